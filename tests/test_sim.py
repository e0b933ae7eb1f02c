"""The simulated world: MPI's matching rules, errors MPI would raise, collectives, deadlock detection, failures.

Every result is checked against something computed without the simulator: NumPy on the same inputs, a list of
expected (source, tag) pairs, or the same program run under a real ``mpiexec``.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI
from mpi_util import run_mpi_code

from dtrain.comm import names, new_status, sim, waitall


def _rank_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sim-rank-") and t.is_alive()]


def _cause(excinfo):
    """The exception a rank raised, from the SimRankError that ``run`` raised."""
    assert isinstance(excinfo.value, sim.SimRankError)
    return excinfo.value.__cause__


# --- basics and matching -------------------------------------------------------------------------------------


def test_rank_and_size():
    results = sim.run(5, lambda comm: (comm.Get_rank(), comm.Get_size(), comm.rank, comm.size))
    assert results == [(r, 5, r, 5) for r in range(5)]


def test_constants_are_mpi4pys():
    assert (names.ANY_SOURCE, names.ANY_TAG, names.PROC_NULL) == (MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.PROC_NULL)
    assert names.IN_PLACE is MPI.IN_PLACE and names.SUM is MPI.SUM and names.MAX is MPI.MAX


def test_messages_with_one_tag_do_not_overtake_and_tags_select():
    def program(comm):
        if comm.rank == 0:
            for i in range(5):
                comm.Send(np.array([i], dtype=np.int64), dest=1, tag=7)
                comm.Send(np.array([100 + i], dtype=np.int64), dest=1, tag=8)
            return None
        buf = np.empty(1, dtype=np.int64)
        tag8 = []
        for _ in range(5):  # drain tag 8 first: tag 7's messages must wait, in order
            comm.Recv(buf, source=0, tag=8)
            tag8.append(int(buf[0]))
        tag7 = []
        for _ in range(5):
            comm.Recv(buf, source=0, tag=7)
            tag7.append(int(buf[0]))
        return tag7, tag8

    assert sim.run(2, program)[1] == ([0, 1, 2, 3, 4], [100, 101, 102, 103, 104])


def test_wildcards_and_status():
    def program(comm):
        if comm.rank != 0:
            comm.Send(np.full(comm.rank, comm.rank, dtype=np.int32), dest=0, tag=10 + comm.rank)
            return None
        buf = np.zeros(8, dtype=np.int32)
        status = sim.SimStatus()
        comm.Recv(buf, source=names.ANY_SOURCE, tag=12, status=status)  # only rank 2 uses tag 12
        first = (status.Get_source(), status.Get_tag(), status.Get_count(), buf[:3].tolist())
        comm.Recv(buf, source=names.ANY_SOURCE, tag=names.ANY_TAG, status=status)  # what is left: rank 1's
        return first, (status.Get_source(), status.Get_tag(), status.Get_count(np.int32), buf[:2].tolist())

    first, second = sim.run(3, program)[0]
    assert first == (2, 12, 8, [2, 2, 0])
    assert second == (1, 11, 1, [1, 2])


def test_any_source_takes_every_sender_once():
    def program(comm):
        if comm.rank != 0:
            comm.Send(np.array([comm.rank * 1.5]), dest=0, tag=comm.rank)
            return None
        got = []
        status = sim.SimStatus()
        buf = np.empty(1)
        for _ in range(comm.size - 1):
            comm.Recv(buf, source=names.ANY_SOURCE, tag=names.ANY_TAG, status=status)
            got.append((status.Get_source(), status.Get_tag(), float(buf[0])))
        return sorted(got)

    assert sim.run(4, program)[0] == [(1, 1, 1.5), (2, 2, 3.0), (3, 3, 4.5)]


def test_source_selects_the_sender():
    def program(comm):
        if comm.rank != 0:
            comm.Send(np.array([comm.rank]), dest=0, tag=0)
        comm.Barrier()  # now every message has arrived: a receive ignoring its source would take any of them
        if comm.rank != 0:
            return None
        got = []
        for source in (3, 1, 2):
            buf = np.empty(1, dtype=np.int64)
            comm.Recv(buf, source=source, tag=0)
            got.append(int(buf[0]))
        return got

    assert sim.run(4, program)[0] == [3, 1, 2]


def test_send_snapshots_the_buffer():
    def program(comm):
        buf = np.arange(4.0)
        if comm.rank == 0:
            comm.Send(buf, dest=1)
            buf[:] = -1  # the message already left: the receiver must not see this
            comm.Barrier()
            return None
        comm.Barrier()
        comm.Recv(buf, source=0)
        return buf.tolist()

    assert sim.run(2, program)[1] == [0.0, 1.0, 2.0, 3.0]


def test_buffer_specs_and_larger_receive_buffer():
    def program(comm):
        data = np.arange(10, dtype=np.float32)
        if comm.rank == 0:
            comm.Send([data, 4, MPI.FLOAT], dest=1, tag=1)  # the first four elements only
            comm.Send([data, MPI.FLOAT], dest=1, tag=2)
            return None
        small, big = np.zeros(6, dtype=np.float32), np.zeros(20, dtype=np.float32)
        status = sim.SimStatus()
        comm.Recv(small, source=0, tag=1, status=status)
        first = (small.tolist(), status.Get_count())
        comm.Recv([big, MPI.FLOAT], source=0, tag=2, status=status)
        return first, big[:11].tolist(), status.Get_count()

    first, big, count = sim.run(2, program)[1]
    assert first == ([0, 1, 2, 3, 0, 0], 16)
    assert big == [*range(10), 0] and count == 40


def test_mpi_status_is_filled_too():
    def program(comm):
        if comm.rank == 1:
            comm.Send(np.zeros(3), dest=0, tag=4)
            return None
        status = MPI.Status()
        comm.Recv(np.empty(3), source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
        return status.Get_source(), status.Get_tag(), status.Get_count(MPI.DOUBLE)

    assert sim.run(2, program)[0] == (1, 4, 3)


def test_truncation_is_an_error():
    def program(comm):
        if comm.rank == 0:
            comm.Send(np.zeros(10), dest=1)
        else:
            comm.Recv(np.zeros(5), source=0)

    with pytest.raises(sim.SimRankError, match="rank 1") as excinfo:
        sim.run(2, program)
    assert isinstance(_cause(excinfo), sim.SimCommError)
    assert "truncated" in str(_cause(excinfo)) and "10 elements" in str(_cause(excinfo))


def test_dtype_mismatch_is_an_error():
    def program(comm):
        if comm.rank == 0:
            comm.Send(np.zeros(4, dtype=np.float64), dest=1)
        else:
            comm.Recv(np.zeros(4, dtype=np.float32), source=0)

    with pytest.raises(sim.SimRankError) as excinfo:
        sim.run(2, program)
    assert "dtype mismatch" in str(_cause(excinfo))
    assert "float64" in str(_cause(excinfo)) and "float32" in str(_cause(excinfo))


def test_strided_buffer_and_bad_rank_are_errors():
    with pytest.raises(sim.SimRankError) as excinfo:
        sim.run(2, lambda comm: comm.Send(np.zeros(10)[::2], dest=1 - comm.rank))
    assert isinstance(_cause(excinfo), BufferError)
    with pytest.raises(sim.SimRankError) as excinfo:
        sim.run(2, lambda comm: comm.Send(np.zeros(1), dest=2))
    assert "dest=2 is not a rank" in str(_cause(excinfo))


def test_proc_null_is_a_no_op():
    def program(comm):
        r, p = comm.rank, comm.size
        # A non-periodic shift: the ends talk to PROC_NULL, as in MPI_Cart_shift.
        right = r + 1 if r + 1 < p else MPI.PROC_NULL
        left = r - 1 if r > 0 else MPI.PROC_NULL
        got = np.full(2, -1.0)
        status = sim.SimStatus()
        comm.Sendrecv(np.full(2, float(r)), dest=right, recvbuf=got, source=left, status=status)
        comm.Send(np.zeros(10**6), dest=MPI.PROC_NULL)  # big, but no rendezvous with nobody
        untouched = np.full(1, 7.0)
        comm.Recv(untouched, source=MPI.PROC_NULL)
        return got.tolist(), status.Get_source(), untouched[0]

    results = sim.run(3, program)
    assert results[0] == ([-1.0, -1.0], MPI.PROC_NULL, 7.0)
    assert results[1] == ([0.0, 0.0], 0, 7.0)
    assert results[2] == ([1.0, 1.0], 1, 7.0)


def test_isend_irecv_with_waitall_and_test():
    def program(comm):
        p, r = comm.size, comm.rank
        outs = [np.full(3, 10 * r + d, dtype=np.int64) for d in range(p)]
        ins = [np.empty(3, dtype=np.int64) for _ in range(p)]
        requests = [comm.Irecv(ins[s], source=s, tag=5) for s in range(p)]
        requests += [comm.Isend(outs[d], dest=d, tag=5) for d in range(p)]
        waitall(requests)
        assert all(req.Test() for req in requests)  # completed requests stay complete
        return [int(b[0]) for b in ins]

    results = sim.run(4, program)
    for r, got in enumerate(results):
        assert got == [10 * s + r for s in range(4)]


def test_test_polls_until_the_message_arrives():
    def program(comm):
        if comm.rank == 0:
            time.sleep(0.05)
            comm.Send(np.array([42]), dest=1)
            return None
        buf = np.zeros(1, dtype=np.int64)
        request = comm.Irecv(buf, source=0)
        polls = 0
        while not request.Test():
            polls += 1
            time.sleep(0.001)
        return int(buf[0]), polls

    value, polls = sim.run(2, program)[1]
    assert value == 42 and polls > 0


# --- communicators -------------------------------------------------------------------------------------------


def test_split_groups_order_and_isolation():
    def program(comm):
        r = comm.rank
        sub = comm.Split(color=r % 2, key=-r)  # reversed order inside each colour
        # The same tag on both communicators: a world receive must never take the sub-communicator's message.
        comm.Send(np.array([1000 + r]), dest=(r + 2) % comm.size, tag=3)
        sub.Send(np.array([r]), dest=(sub.rank + 1) % sub.size, tag=3)
        from_sub, from_world = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        sub.Recv(from_sub, source=(sub.rank - 1) % sub.size, tag=3)
        comm.Recv(from_world, source=(r - 2) % comm.size, tag=3)
        return sub.rank, sub.size, int(from_sub[0]), int(from_world[0])

    results = sim.run(6, program)
    # colour 0: world ranks 0, 2, 4 become sub ranks 2, 1, 0 (key = -rank); colour 1: 1, 3, 5 -> 2, 1, 0.
    members = {0: [4, 2, 0], 1: [5, 3, 1]}
    for r, (sub_rank, sub_size, from_sub, from_world) in enumerate(results):
        group = members[r % 2]
        assert (sub_rank, sub_size) == (group.index(r), 3)
        assert from_sub == group[(sub_rank - 1) % 3]
        assert from_world == 1000 + (r - 2) % 6


def test_split_undefined_dup_and_split_type():
    def program(comm):
        none = comm.Split(MPI.UNDEFINED if comm.rank == 0 else 1)
        dup = comm.Dup()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        # A message on the duplicate is invisible to a receive on the original with the same source and tag.
        if comm.rank == 0:
            dup.Send(np.array([1.0]), dest=1, tag=0)
            comm.Send(np.array([2.0]), dest=1, tag=0)
        elif comm.rank == 1:
            first = np.zeros(1)
            comm.Recv(first, source=0, tag=0)
            dup.Recv(np.zeros(1), source=0, tag=0)
            return first[0], node.rank, node.size
        return (none is None) if comm.rank == 0 else (none.rank, none.size)

    results = sim.run(3, program)
    assert results[0] is True
    assert results[1] == (2.0, 1, 3)
    assert results[2] == (1, 2)


def test_barrier_waits_for_everyone():
    log = []

    def program(comm):
        if comm.rank == 0:
            time.sleep(0.05)  # without a real barrier the others would log "after" first
        log.append(("before", comm.rank))
        comm.Barrier()
        log.append(("after", comm.rank))

    sim.run(4, program)
    assert [kind for kind, _ in log[:4]] == ["before"] * 4
    assert sorted(r for _, r in log[4:]) == [0, 1, 2, 3]


def test_collective_mismatch_is_an_error():
    def program(comm):
        if comm.rank == 0:
            comm.Barrier()
        else:
            comm.Bcast(np.zeros(2), root=0)

    with pytest.raises(sim.SimRankError) as excinfo:
        sim.run(2, program)
    assert "collective mismatch" in str(_cause(excinfo))


# --- MPI's own collectives, against NumPy --------------------------------------------------------------------


def _inputs(p, n=37):
    return [np.random.default_rng(r).standard_normal(n) for r in range(p)]


def test_allreduce_bcast_reduce_match_numpy():
    p = 5
    inputs = _inputs(p)

    def program(comm):
        mine = inputs[comm.rank]
        total, biggest, inplace = np.empty_like(mine), np.empty_like(mine), mine.copy()
        comm.Allreduce(mine, total, op=MPI.SUM)
        comm.Allreduce(mine, biggest, op=MPI.MAX)
        comm.Allreduce(MPI.IN_PLACE, inplace)
        bcast = mine.copy()
        comm.Bcast(bcast, root=2)
        reduced = np.zeros_like(mine) if comm.rank == 1 else None
        comm.Reduce(mine, reduced, op=MPI.SUM, root=1)
        return total, biggest, inplace, bcast, reduced

    expected_sum = np.sum(inputs, axis=0)
    for r, (total, biggest, inplace, bcast, reduced) in enumerate(sim.run(p, program)):
        np.testing.assert_allclose(total, expected_sum, rtol=1e-12)
        np.testing.assert_array_equal(biggest, np.max(inputs, axis=0))
        np.testing.assert_array_equal(inplace, total)  # same values, same order of summation
        np.testing.assert_array_equal(bcast, inputs[2])
        if r == 1:
            np.testing.assert_allclose(reduced, expected_sum, rtol=1e-12)
        else:
            assert reduced is None


def test_object_collectives():
    def program(comm):
        r = comm.rank
        return (
            comm.bcast({"from": r} if r == 1 else None, root=1),
            comm.gather(r * r, root=0),
            comm.allgather(f"r{r}"),
            comm.allreduce(r + 1),
            comm.allreduce(r, op=MPI.MAX),
        )

    results = sim.run(4, program)
    for r, (bcast, gathered, allgathered, total, biggest) in enumerate(results):
        assert bcast == {"from": 1}
        assert gathered == ([0, 1, 4, 9] if r == 0 else None)
        assert allgathered == ["r0", "r1", "r2", "r3"]
        assert (total, biggest) == (10, 3)


# --- a ring all-reduce written here, on the contract subset --------------------------------------------------


def ring_allreduce(comm, buf):
    """Reduce-scatter then all-gather around the ring, with Sendrecv; ``buf`` is summed in place."""
    p, r = comm.Get_size(), comm.Get_rank()
    edges = np.linspace(0, buf.size, p + 1).astype(int)
    chunk = [buf[edges[i] : edges[i + 1]] for i in range(p)]
    incoming = np.empty(max(c.size for c in chunk), dtype=buf.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send, recv = chunk[(r - s) % p], chunk[(r - s - 1) % p]
        comm.Sendrecv(send, dest=right, recvbuf=incoming[: recv.size], source=left)
        recv += incoming[: recv.size]
    for s in range(p - 1):
        send, recv = chunk[(r - s + 1) % p], chunk[(r - s) % p]
        comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)
    return buf


@pytest.mark.parametrize("p", [2, 3, 8])
def test_ring_allreduce_gives_numpys_sum(p):
    inputs = [np.random.default_rng(r).integers(-1000, 1000, size=101).astype(np.float64) for r in range(p)]
    results = sim.run(p, lambda comm: ring_allreduce(comm, inputs[comm.rank].copy()))
    for result in results:
        np.testing.assert_array_equal(result, np.sum(inputs, axis=0))  # integers: exact in any order


def test_ring_allreduce_of_a_million_floats_on_8_ranks_is_fast():
    n, p = 1_000_000, 8
    inputs = [np.full(n, r + 1, dtype=np.float32) for r in range(p)]
    start = time.perf_counter()
    results = sim.run(p, lambda comm: ring_allreduce(comm, inputs[comm.rank].copy()))
    elapsed = time.perf_counter() - start
    assert all((res == p * (p + 1) / 2).all() for res in results)
    assert elapsed < 3.0, f"{elapsed:.2f} s: the simulator should take well under a second here"


# --- deadlock detection --------------------------------------------------------------------------------------


def test_two_ranks_receiving_from_each_other_deadlock():
    def program(comm):
        comm.Recv(np.zeros(1), source=1 - comm.rank, tag=0)

    with pytest.raises(sim.SimDeadlock) as excinfo:
        sim.run(2, program)
    message = str(excinfo.value)
    assert "rank 0: Recv(source=1, tag=0)" in message
    assert "rank 1: Recv(source=0, tag=0)" in message
    assert not _rank_threads_alive()


def test_big_sends_first_deadlock_like_mpi():
    def program(comm):
        buf = np.zeros(2**19)  # 4 MiB, far above the eager limit
        comm.Send(buf, dest=1 - comm.rank, tag=0)
        comm.Recv(buf, source=1 - comm.rank, tag=0)

    with pytest.raises(sim.SimDeadlock) as excinfo:
        sim.run(2, program)
    message = str(excinfo.value)
    for r in (0, 1):
        assert f"rank {r}: Send(dest={1 - r}, tag=0, 4194304 bytes, rendezvous" in message


def test_small_sends_first_are_eager_and_do_not_deadlock():
    def program(comm):
        out, got = np.full(100, float(comm.rank)), np.zeros(100)
        comm.Send(out, dest=1 - comm.rank, tag=0)
        comm.Recv(got, source=1 - comm.rank, tag=0)
        return got[0]

    assert sim.run(2, program) == [1.0, 0.0]


def test_eager_limit_is_the_boundary():
    def program(comm, n):
        buf = np.zeros(n, dtype=np.uint8)
        comm.Send(buf, dest=1 - comm.rank)
        comm.Recv(buf, source=1 - comm.rank)

    sim.SimWorld(2, eager_limit=1000).run(program, 1000)
    with pytest.raises(sim.SimDeadlock):
        sim.SimWorld(2, eager_limit=1000).run(program, 1001)


def test_sendrecv_and_isend_avoid_the_big_send_deadlock():
    def with_sendrecv(comm):
        out, got = np.full(2**19, float(comm.rank)), np.zeros(2**19)
        comm.Sendrecv(out, dest=1 - comm.rank, recvbuf=got, source=1 - comm.rank)
        return got[0]

    def with_isend(comm):
        out, got = np.full(2**19, float(comm.rank)), np.zeros(2**19)
        request = comm.Isend(out, dest=1 - comm.rank)
        comm.Recv(got, source=1 - comm.rank)
        request.Wait()
        return got[0]

    assert sim.run(2, with_sendrecv) == [1.0, 0.0]
    assert sim.run(2, with_isend) == [1.0, 0.0]


def test_waiting_for_a_rank_that_finished_is_a_deadlock():
    def program(comm):
        if comm.rank == 0:
            comm.Recv(np.zeros(1), source=1, tag=9)

    with pytest.raises(sim.SimDeadlock) as excinfo:
        sim.run(3, program)
    message = str(excinfo.value)
    assert "rank 0: Recv(source=1, tag=9)" in message
    assert "rank 1: finished" in message and "rank 2: finished" in message


def test_wrong_tag_deadlock_lists_the_unreceived_message():
    def program(comm):
        if comm.rank == 0:
            comm.Send(np.zeros(2), dest=1, tag=5)
            comm.Barrier()
        else:
            comm.Recv(np.zeros(2), source=0, tag=6)
            comm.Barrier()

    with pytest.raises(sim.SimDeadlock) as excinfo:
        sim.run(2, program)
    message = str(excinfo.value)
    assert "rank 0: Barrier(): waiting for rank(s) [1] to call it" in message
    assert "rank 1: Recv(source=0, tag=6)" in message
    assert "rank 0 -> rank 1: tag=5, 16 bytes" in message


def test_deadlock_on_a_subcommunicator_names_it():
    def program(comm):
        sub = comm.Split(comm.rank // 2)
        if comm.rank < 2:
            sub.Recv(np.zeros(1), source=1 - sub.rank)

    with pytest.raises(sim.SimDeadlock, match=r"rank 1: Recv\(source=0, tag=ANY_TAG\) on world.split\(0\)"):
        sim.run(4, program)


def test_timeout_reports_a_rank_that_never_blocks():
    def program(comm):
        if comm.rank == 0:
            request = comm.Irecv(np.zeros(1), source=1)
            while not request.Test():  # polling is not blocking: only the timeout can catch it
                time.sleep(0.001)

    with pytest.raises(sim.SimTimeout) as excinfo:
        sim.SimWorld(2, timeout=0.3).run(program)
    message = str(excinfo.value)
    assert "rank 0: running" in message and "rank 1: finished" in message
    time.sleep(0.05)
    assert not _rank_threads_alive()


# --- failures ------------------------------------------------------------------------------------------------


def test_exception_on_one_rank_is_raised_and_ends_the_others():
    def program(comm):
        if comm.rank == 2:
            time.sleep(0.05)  # let the others block first
            raise ValueError("bad shard")
        if comm.rank == 0:
            comm.Recv(np.zeros(1), source=2)  # rank 2 will never send
        else:
            comm.Barrier()

    start = time.perf_counter()
    with pytest.raises(sim.SimRankError, match="rank 2 raised ValueError: bad shard") as excinfo:
        sim.SimWorld(4, timeout=30).run(program)
    assert time.perf_counter() - start < 5
    assert excinfo.value.rank == 2 and isinstance(excinfo.value.__cause__, ValueError)
    assert not _rank_threads_alive()


def test_abort_ends_the_run():
    def program(comm):
        if comm.rank == 1:
            comm.Abort(3)
        comm.Barrier()

    with pytest.raises(sim.SimAbort, match=r"rank 1 called Abort\(errorcode=3\)"):
        sim.run(3, program)
    assert not _rank_threads_alive()


def test_a_world_can_run_again_after_a_failure():
    world = sim.SimWorld(2)
    with pytest.raises(sim.SimDeadlock):
        world.run(lambda comm: comm.Recv(np.zeros(1), source=1 - comm.rank))
    assert world.run(lambda comm: comm.allreduce(comm.rank + 1)) == [3, 3]


# --- the event log -------------------------------------------------------------------------------------------


def test_record_logs_who_sent_what_to_whom():
    world = sim.SimWorld(3, record=True)

    def shift(comm):
        r, p = comm.rank, comm.size
        comm.Sendrecv(np.zeros(r + 1), dest=(r + 1) % p, sendtag=r, recvbuf=np.zeros(3), source=(r - 1) % p)

    world.run(shift)
    events = world.events
    assert [e.seq for e in events] == list(range(6))
    sends = {(e.rank, e.peer, e.tag, e.nbytes) for e in events if e.kind == "send"}
    recvs = {(e.rank, e.peer, e.tag, e.nbytes) for e in events if e.kind == "recv"}
    assert sends == {(r, (r + 1) % 3, r, 8 * (r + 1)) for r in range(3)}
    assert recvs == {((r + 1) % 3, r, r, 8 * (r + 1)) for r in range(3)}
    for recv in (e for e in events if e.kind == "recv"):  # a message is received after it is sent
        send = next(e for e in events if e.kind == "send" and e.rank == recv.peer and e.peer == recv.rank)
        assert send.seq < recv.seq
    assert all(e.comm == "world" for e in events)
    assert str(events[0]).startswith("#0 send rank")


def test_verbose_prints_each_event(capsys):
    sim.SimWorld(2, verbose=True).run(lambda comm: comm.Sendrecv(np.zeros(1), 1 - comm.rank, recvbuf=np.zeros(1)))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and sum("send" in line for line in lines) == 2


# --- the same program on the simulator and under mpiexec -----------------------------------------------------

PROGRAM = """
import numpy as np
from dtrain.comm import waitall

def program(comm):
    r, p = comm.Get_rank(), comm.Get_size()
    right, left = (r + 1) % p, (r - 1) % p
    shifted = np.empty(4)
    comm.Sendrecv(np.arange(4.0) + 10 * r, dest=right, sendtag=1, recvbuf=shifted, source=left, recvtag=1)
    outs = [np.array([r, 100 * d + r], dtype=np.int64) for d in range(p)]
    ins = [np.empty(2, dtype=np.int64) for _ in range(p)]
    requests = [comm.Irecv(ins[s], source=s, tag=2) for s in range(p)]
    requests += [comm.Isend(outs[d], dest=d, tag=2) for d in range(p)]
    waitall(requests)
    sub = comm.Split(r % 2, key=-r)
    if sub.Get_rank() == 0:
        total = np.array([r], dtype=np.int64)
        part = np.empty(1, dtype=np.int64)
        for source in range(1, sub.Get_size()):
            sub.Recv(part, source=source, tag=3)
            total += part
        total = int(total[0])
    else:
        sub.Send(np.array([r], dtype=np.int64), dest=0, tag=3)
        total = None
    comm.Barrier()
    return {"shifted": shifted.tolist(), "all_to_all": [b.tolist() for b in ins],
            "sub": [sub.Get_rank(), sub.Get_size()], "sub_total": total}
"""


@pytest.mark.mpi
def test_same_program_on_the_simulator_and_under_mpiexec(tmp_path):
    namespace = {}
    exec(textwrap.dedent(PROGRAM), namespace)
    simulated = sim.run(3, namespace["program"])

    script = PROGRAM + textwrap.dedent(
        """
        import json
        from mpi4py import MPI
        results = MPI.COMM_WORLD.gather(program(MPI.COMM_WORLD), root=0)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("RESULTS " + json.dumps(results))
        """
    )
    result = run_mpi_code(3, script, tmp_path, timeout=120)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULTS "))
    assert json.loads(line[len("RESULTS ") :]) == simulated
    assert simulated[1]["shifted"] == [0.0, 1.0, 2.0, 3.0]  # and it is right, not just the same
    assert simulated[0]["sub"] == [1, 2] and simulated[2]["sub_total"] == 2


def test_probe_describes_the_next_message_and_leaves_it_for_the_receive():
    """A server's loop: Probe from any source, then receive that message into a buffer of the size it needs."""

    def program(comm):
        if comm.rank > 0:
            comm.Send(np.full(comm.rank, float(comm.rank)), dest=0, tag=10 + comm.rank)
            return None
        seen, status = [], new_status(comm)
        for _ in range(2):
            comm.Probe(names.ANY_SOURCE, names.ANY_TAG, status)
            source, tag, count = status.Get_source(), status.Get_tag(), status.Get_count() // 8
            buf = np.empty(count)
            comm.Recv(buf, source, tag)
            seen.append((source, tag, buf.tolist()))
        return sorted(seen)

    assert sim.run(3, program)[0] == [(1, 11, [1.0]), (2, 12, [2.0, 2.0])]


def test_probing_for_a_message_nobody_sends_is_a_deadlock():
    def program(comm):
        if comm.rank == 0:
            comm.Probe(1, 5)

    with pytest.raises(sim.SimDeadlock, match=r"rank 0: Probe\(source=1, tag=5\)"):
        sim.run(2, program)
