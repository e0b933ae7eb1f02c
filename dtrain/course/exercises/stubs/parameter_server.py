"""Exercises 4.1 and 4.2 (lesson 4, parameter servers): a worker's push and pull, and a server's stale-synchronous
gate.

Check them: dtrain exercises check 4.1 --path ex
            dtrain exercises check 4.2 --path ex
Run them from the folder that holds ex/ (the folder `dtrain exercises init ex` copied these files into).
"""

from dtrain.comm import waitall  # noqa: F401  (waitall(requests) waits for a list of requests, on any communicator)
from dtrain.parallel.ps_server import PUSH, WEIGHTS  # noqa: F401  (the protocol's tags)


def push_and_pull(comm, params, grads, servers):
    """A parameter-server worker's step after its backward: push the gradient, pull the new weights.

    Signature: ``push_and_pull(comm, params, grads, servers) -> None``. ``comm`` has mpi4py's buffer methods
    (``Isend``, ``Irecv``, ...). ``params`` and ``grads`` are this worker's whole flat buffers (1-D float64 NumPy
    arrays of n elements). ``servers`` lists the servers as ``(server rank, (start, stop))``: server s owns the
    shard ``[start, stop)`` of the flat buffer (the shards are contiguous and cover it).

    Before: ``grads`` holds this worker's gradient; ``params`` the weights it computed it with.
    After:  every server has received exactly its slice of the gradient, ``grads[start:stop]``, tagged ``PUSH``;
            ``params[start:stop]`` holds what that server sent back, tagged ``WEIGHTS``, for every server.
            ``grads`` is unchanged. One message sent to each server, one received from each.

    Every message must be in flight together: post all the receives (``comm.Irecv(params[a:b], server, WEIGHTS)``,
    straight into ``params``) and all the sends (``comm.Isend(grads[a:b], server, PUSH)``), then wait for all of the
    requests. A server may hold its reply back until other messages have arrived (a stale-synchronous server waits
    for slow workers; the checker's servers reply only once *every* server has its push), so a worker that waits for
    one server's reply before pushing to the next waits forever.

    Hint: a slice of a NumPy array is a view: receiving into ``params[a:b]`` fills ``params``. Keep the requests in a
    list and pass it to ``waitall``.
    """
    raise NotImplementedError("exercise 4.1: a worker's push and pull — see lessons/04_parameter_server.py")


def stale_synchronous_ready(waiting, clock, running, bound):
    """The workers a stale-synchronous parameter server may answer now.

    Signature: ``stale_synchronous_ready(waiting, clock, running, bound) -> list[int]``. A worker is a number
    0 .. W-1.

    * ``waiting``: the workers whose push the server has applied but whose reply (the new weights) it holds back;
    * ``clock``: ``clock[w]`` is the number of steps (pushes) worker w has made so far, for every worker;
    * ``running``: the workers still taking steps (not finished): only they can hold the others back;
    * ``bound``: the staleness bound K (``--staleness K``), an int >= 0, or None.

    Return the workers of ``waiting``, in ``waiting``'s order, that are at most ``bound`` steps ahead of the slowest
    running worker (the smallest ``clock`` among ``running``). ``bound`` 0 is lockstep: nobody gets ahead of the
    slowest. ``bound`` None is asynchronous: everyone waiting is answered. With no worker running, count the slowest
    as at step 0. Leave the three lists as they are.

    Example: ``clock = [5, 4, 3]``, all running, bound 1: worker 1 (one step ahead of worker 2) may go on, worker 0
    (two steps ahead) waits: ``stale_synchronous_ready([0, 1], [5, 4, 3], [0, 1, 2], 1) == [1]``.

    Hint: ``min(..., default=0)``; the server calls this after every push and every finished worker
    (dtrain/parallel/ps_server.py, ``ServerLoop.release``).
    """
    raise NotImplementedError("exercise 4.2: the stale-synchronous gate — see lessons/04_parameter_server.py")
