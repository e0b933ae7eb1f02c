"""The wrapper base: every mpi4py call reaches a wrapper as one record, is forwarded unchanged, and sub-communicators
and requests keep their wrappers. The oracle is the same program run on the bare simulator."""

from __future__ import annotations

import numpy as np

from dtrain.comm import names, sim
from dtrain.comm.wrapper import CommWrapper, RequestWrapper, innermost, layers


class Spy(CommWrapper):
    """Records the name of every call it sees; sub-communicators share the log."""

    def __init__(self, comm, log=None):
        super().__init__(comm)
        self.log = [] if log is None else log

    def sibling(self, comm):
        return Spy(comm, self.log)

    def p2p(self, call):
        self.log.append(call.name)
        result = super().p2p(call)
        return CountedRequest(result, self.log) if call.name in ("Isend", "Irecv") else result

    def collective(self, call):
        self.log.append(call.name)
        return super().collective(call)


class CountedRequest(RequestWrapper):
    def __init__(self, request, log):
        super().__init__(request)
        self.log = log

    def completed(self):
        self.log.append("completed")


def program(comm):
    """Every call of the buffer API once; returns what arrived."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    got = np.zeros(3)
    comm.Sendrecv(np.full(3, rank, dtype=np.float64), right, recvbuf=got, source=left)
    if rank == 0:
        comm.Send(np.arange(3.0), dest=1, tag=5)
    elif rank == 1:
        comm.Recv(got, source=0, tag=5)
    requests = [comm.Irecv(np.zeros(2), source=left), comm.Isend(np.ones(2), dest=right)]
    for request in requests:
        request.Wait()
    total = np.full(2, rank + 1.0)
    comm.Allreduce(names.IN_PLACE, total, op=names.SUM)
    root_sum = np.zeros(2)
    comm.Reduce(np.full(2, 2.0), root_sum, op=names.SUM, root=0)
    shared = np.full(2, 9.0) if rank == 0 else np.zeros(2)
    comm.Bcast(shared, root=0)
    comm.Barrier()
    half = comm.Split(rank % 2, rank)
    half_total = np.ones(1)
    half.Allreduce(names.IN_PLACE, half_total)
    return got.tolist(), total.tolist(), root_sum.tolist(), shared.tolist(), half_total.tolist()


def test_a_wrapper_changes_nothing_and_sees_every_call():
    bare = sim.run(4, program)

    def wrapped(comm):
        spy = Spy(comm)
        return program(spy), spy.log

    results = sim.run(4, wrapped)
    assert [r for r, _ in results] == bare
    log = results[1][1]  # rank 1 receives the Send
    assert log == ["Sendrecv", "Recv", "Irecv", "Isend", "completed", "completed",
                   "Allreduce", "Reduce", "Bcast", "Barrier", "Allreduce"]  # fmt: skip
    assert results[0][1][1] == "Send"


def test_sub_communicators_and_requests_keep_their_wrappers():
    def fn(comm):
        spy = Spy(Spy(comm))
        sub = spy.Split(0, comm.Get_rank())
        request = spy.Isend(np.ones(1), dest=comm.Get_rank())
        spy.Recv(np.zeros(1), source=comm.Get_rank())
        request.Wait()
        return (
            [type(layer).__name__ for layer in layers(sub)],
            sub.log is spy.log,
            isinstance(innermost(sub), sim.SimComm),
            isinstance(innermost(request), sim.SimRequest),
            spy.Get_size(),  # forwarded to the simulator
        )

    for names_, shared_log, inner_comm, inner_request, size in sim.run(2, fn):
        assert names_ == ["Spy", "Spy", "SimComm"] and shared_log and inner_comm and inner_request and size == 2


def test_a_null_sub_communicator_stays_null():
    def fn(comm):
        return Spy(comm).Split(names.UNDEFINED if comm.Get_rank() else 0, 0)

    nobody = sim.run(2, fn)[1]
    assert nobody is None


def test_what_was_made_from_a_wrapper_is_freed_once_newest_first():
    """free_made frees every sub-communicator (and theirs) once, through every layer; one freed already is skipped;
    the simulator's own communicators are the oracle (each says whether it was freed)."""

    def program(comm):
        top = Spy(Spy(comm))  # two layers: each remembers what it made
        pair = top.Split(comm.Get_rank() // 2)
        inner = pair.Dup()  # made from a sub-communicator
        freed_early = top.Dup()
        freed_early.Free()
        freed_early.Free()  # a second Free does nothing
        made = [innermost(c) for c in (pair, inner, freed_early)]
        before = [c._freed for c in made]
        top.free_made()
        after = [c._freed for c in made]
        top.free_made()  # nothing left: nothing happens
        return before, after, len(top.made), innermost(top)._freed

    for before, after, left, world_freed in sim.run(4, program):
        assert before == [False, False, True]
        assert after == [True, True, True]
        assert left == 0 and not world_freed
