"""The communication layer: the world of ranks and the small mpi4py subset algorithms are written against.

Algorithms above this package call only ``Get_rank``, ``Get_size``, ``Send``, ``Recv``, ``Sendrecv``,
``Isend``/``Irecv`` (and :func:`waitall` on the requests), ``Barrier`` and ``Split`` on a communicator. Three kinds of
communicator provide them:

* a real ``mpi4py.MPI.Comm`` under ``mpiexec`` (:mod:`dtrain.comm.mpi`);
* :mod:`dtrain.comm.sim`, N simulated ranks as threads in one process (notebooks, fast tests);
* either of those wrapped by :mod:`dtrain.comm.trace`, which counts bytes, messages and time.
"""

from __future__ import annotations


def waitall(requests) -> None:
    """Wait for every request in ``requests``, whichever kind of communicator made them.

    mpi4py's ``MPI.Request.Waitall`` is a class method that only accepts real MPI requests, so algorithms call this
    instead: real requests go to MPI in one call (which lets MPI progress them together); simulated or traced
    requests are waited one by one through their own ``Wait``.
    """
    requests = list(requests)
    if not requests:
        return
    try:
        from mpi4py import MPI
    except ImportError:  # the simulator works without mpi4py
        MPI = None
    if MPI is not None and all(isinstance(r, MPI.Request) for r in requests):
        MPI.Request.Waitall(requests)
        return
    for request in requests:
        request.Wait()
