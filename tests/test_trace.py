"""The tracer: exact byte and message counts for known communication patterns, operations, and the trace file.

The oracle for every count is the pattern itself: a rank that sends k float64 once has sent 8k bytes in one message.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from mpi4py import MPI
from mpi_util import run_mpi_code

from dtrain.comm import sim, waitall
from dtrain.comm.trace import (
    OTHER,
    TracedComm,
    TracedRequest,
    Tracer,
    gather_events,
    gather_summaries,
    message_bytes,
    write_chrome_trace,
)
from dtrain.comm.wrapper import innermost


def traced_run(nranks, body, *args):
    """Run ``body(tcomm, tracer, *args)`` on simulated ranks, each with its own tracer; return each summary."""

    def program(comm):
        tracer = Tracer()
        body(TracedComm(comm, tracer), tracer, *args)
        return tracer.summary()

    return sim.run(nranks, program)


def shift(tcomm, k):
    """Each rank sends k float64 to the next rank and receives k from the previous one."""
    r, p = tcomm.Get_rank(), tcomm.Get_size()
    tcomm.Sendrecv(np.ones(k), dest=(r + 1) % p, recvbuf=np.empty(k), source=(r - 1) % p)


@pytest.mark.parametrize("k", [1, 1000, 100_000])
def test_sendrecv_shift_counts_exactly(k):
    def body(tcomm, tracer):
        with tracer.operation("shift", nbytes=8 * k):
            shift(tcomm, k)

    for rank, summary in enumerate(traced_run(4, body)):
        ops = summary["operations"]
        assert summary["rank"] == rank and list(ops) == ["shift"]
        stats = ops["shift"]
        assert (stats["messages_sent"], stats["bytes_sent"]) == (1, 8 * k)
        assert (stats["messages_received"], stats["bytes_received"]) == (1, 8 * k)
        assert stats["calls"] == 1 and stats["payload_bytes"] == 8 * k
        assert stats["time_s"] >= stats["comm_time_s"] > 0
        assert summary["totals"]["bytes_sent"] == 8 * k


def test_isend_irecv_are_counted_and_their_waits_timed():
    def body(tcomm, tracer):
        p, r = tcomm.Get_size(), tcomm.Get_rank()
        outs = [np.full(10, r, dtype=np.float32) for _ in range(p)]
        ins = [np.empty(10, dtype=np.float32) for _ in range(p)]
        with tracer.operation("alltoall"):
            requests = [tcomm.Irecv(ins[s], source=s, tag=1) for s in range(p) if s != r]
            requests += [tcomm.Isend(outs[d], dest=d, tag=1) for d in range(p) if d != r]
            assert all(isinstance(req, TracedRequest) for req in requests)
            waitall(requests)
        assert [b[0] for i, b in enumerate(ins) if i != r] == [s for s in range(p) if s != r]
        waits = [e for e in tracer.events if e["name"].startswith("Wait(")]
        assert len(waits) == 2 * (p - 1)

    for summary in traced_run(3, body):
        stats = summary["operations"]["alltoall"]
        assert (stats["messages_sent"], stats["bytes_sent"]) == (2, 2 * 40)
        assert (stats["messages_received"], stats["bytes_received"]) == (2, 2 * 40)


def test_send_recv_and_count_buffer_specs():
    def body(tcomm, tracer):
        data = np.arange(10, dtype=np.float64)
        if tcomm.Get_rank() == 0:
            tcomm.Send([data, 3, MPI.DOUBLE], dest=1)  # only 3 elements leave
            tcomm.Send(data, dest=MPI.PROC_NULL)  # nothing leaves
        else:
            tcomm.Recv([data, 3, MPI.DOUBLE], source=0)
            tcomm.Recv(data, source=MPI.PROC_NULL)

    first, second = traced_run(2, body)
    assert first["operations"][OTHER]["bytes_sent"] == 24 and first["operations"][OTHER]["messages_sent"] == 1
    assert second["operations"][OTHER]["bytes_received"] == 24
    assert second["operations"][OTHER]["messages_received"] == 1
    assert first["operations"][OTHER]["calls"] == 2  # outside any operation: each call counts as one


def test_message_bytes():
    data = np.zeros((4, 5), dtype=np.float32)
    assert message_bytes(data) == 80
    assert message_bytes([data, MPI.FLOAT]) == 80
    assert message_bytes([data, 7, MPI.FLOAT]) == 28
    assert message_bytes(MPI.IN_PLACE) == 0 and message_bytes(None) == 0


def test_nested_operations_count_for_the_outermost():
    def body(tcomm, tracer):
        with tracer.operation("allreduce/hierarchical", nbytes=800):
            shift(tcomm, 10)
            with tracer.operation("allreduce/ring"):
                shift(tcomm, 100)
        shift(tcomm, 1)  # outside any operation

        spans = {e["name"]: e for e in tracer.events if e["cat"] == "operation"}
        outer, inner = spans["allreduce/hierarchical"], spans["allreduce/ring"]
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
        assert outer["args"] == {"nbytes": 800}

    for summary in traced_run(2, body):
        ops = summary["operations"]
        assert set(ops) == {"allreduce/hierarchical", OTHER}
        assert ops["allreduce/hierarchical"]["bytes_sent"] == 8 * 110
        assert ops["allreduce/hierarchical"]["messages_sent"] == 2
        assert ops["allreduce/hierarchical"]["calls"] == 1
        assert ops[OTHER]["bytes_sent"] == 8
        assert summary["totals"]["bytes_sent"] == 8 * 111 and summary["totals"]["messages_received"] == 3


def test_subcommunicator_traffic_is_counted():
    def body(tcomm, tracer):
        with tracer.operation("hier"):
            sub = tcomm.Split(tcomm.Get_rank() % 2)
            node = tcomm.Split_type(MPI.COMM_TYPE_SHARED)
            dup = tcomm.Dup()
            assert all(isinstance(c, TracedComm) and c.tracer is tracer for c in (sub, node, dup))
            assert isinstance(innermost(sub), sim.SimComm)
            shift(sub, 5)  # 40 bytes
            shift(node, 2)  # 16 bytes
            shift(dup, 1)  # 8 bytes
        assert tcomm.Split(MPI.UNDEFINED) is None

    for summary in traced_run(4, body):
        assert summary["operations"]["hier"]["bytes_sent"] == 64
        assert summary["operations"]["hier"]["messages_sent"] == 3


def test_mpis_collectives_count_logical_volumes():
    def body(tcomm, tracer):
        buf = np.ones(25)
        with tracer.operation("builtin"):
            tcomm.Allreduce(MPI.IN_PLACE, buf)
            tcomm.Bcast(buf, root=1)
            tcomm.Reduce(buf, np.empty(25) if tcomm.Get_rank() == 0 else None, root=0)
            tcomm.Barrier()
            tcomm.allgather("uncounted")

    summaries = traced_run(3, body)
    for rank, summary in enumerate(summaries):
        stats = summary["operations"]["builtin"]
        assert stats["bytes_sent"] == 200 + (200 if rank == 1 else 0) + 200
        assert stats["bytes_received"] == 200 + (0 if rank == 1 else 200) + (200 if rank == 0 else 0)


def test_summary_json_round_trip_and_reset():
    def program(comm):
        tracer = Tracer()
        with tracer.operation("shift"):
            shift(TracedComm(comm, tracer), 3)
        return tracer  # simulated ranks are threads: the tracer object itself comes back

    tracer = sim.run(2, program)[1]
    summary = tracer.summary()
    assert json.loads(json.dumps(summary)) == summary
    assert set(summary["operations"]["shift"]) == set(summary["totals"])
    tracer.reset()
    assert tracer.events == []
    assert tracer.summary() == {"rank": 1, "operations": {}, "totals": dict.fromkeys(summary["totals"], 0)}


def test_gather_and_chrome_trace(tmp_path):
    path = tmp_path / "not-yet" / "trace.json"  # a folder that does not exist yet: made, as --out's is

    def program(comm):
        tcomm = TracedComm(comm)
        with tcomm.tracer.operation("shift"):
            shift(tcomm, 4)
        summaries = gather_summaries(tcomm.tracer, tcomm)
        events = gather_events(tcomm.tracer, tcomm)
        if comm.Get_rank() == 0:
            write_chrome_trace(path, events)
        return summaries, len(tcomm.tracer.events), tcomm.tracer.summary()["totals"]["messages_sent"]

    results = sim.run(3, program)
    summaries = results[0][0]
    assert [s["rank"] for s in summaries] == [0, 1, 2]
    assert all(r[0] is None for r in results[1:])
    assert all(r[1] == 2 and r[2] == 1 for r in results)  # gathering added neither events nor messages

    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    complete = [e for e in events if e["ph"] == "X"]
    assert sorted({e["pid"] for e in complete}) == [0, 1, 2]
    assert len(complete) == 6 and min(e["ts"] for e in complete) == 0
    assert all(e["dur"] >= 0 for e in complete)
    calls = [e for e in complete if e["name"] == "Sendrecv"]
    assert all(e["args"]["bytes_sent"] == 32 and e["cat"] == "shift" for e in calls)
    assert {(e["pid"], e["args"]["dest"]) for e in calls} == {(0, 1), (1, 2), (2, 0)}


def test_traced_comm_forwards_everything_else():
    def program(comm):
        tcomm = TracedComm(comm)
        return tcomm.rank, tcomm.size, tcomm.Get_name(), tcomm.allreduce(1), tcomm.tracer.rank

    assert sim.run(2, program) == [(0, 2, "world", 2, 0), (1, 2, "world", 2, 1)]


@pytest.mark.mpi
def test_traced_under_mpiexec(tmp_path):
    trace_path = tmp_path / "mpi_trace.json"
    code = f"""
        import json
        import numpy as np
        from mpi4py import MPI
        from dtrain.comm import waitall
        from dtrain.comm.trace import TracedComm, gather_events, gather_summaries, write_chrome_trace

        tcomm = TracedComm(MPI.COMM_WORLD)
        tracer = tcomm.tracer
        r, p = tcomm.Get_rank(), tcomm.Get_size()
        with tracer.operation("shift", nbytes=800):
            got = np.empty(100)
            tcomm.Sendrecv(np.full(100, float(r)), dest=(r + 1) % p, recvbuf=got, source=(r - 1) % p)
            assert got[0] == (r - 1) % p
        with tracer.operation("pairs"):
            sub = tcomm.Split(r // 2)
            out, back = np.full(7, r, dtype=np.int32), np.empty(7, dtype=np.int32)
            requests = [sub.Irecv(back, source=1 - sub.Get_rank()), sub.Isend(out, dest=1 - sub.Get_rank())]
            waitall(requests)
            assert back[0] == r ^ 1
        buf = np.ones(5)
        tcomm.Allreduce(MPI.IN_PLACE, buf)
        assert buf[0] == p
        summaries = gather_summaries(tracer, tcomm)
        events = gather_events(tracer, tcomm)
        if r == 0:
            write_chrome_trace({str(trace_path)!r}, events)
            print("SUMMARIES " + json.dumps(summaries))
    """
    result = run_mpi_code(4, code, tmp_path, timeout=120)
    line = next(x for x in result.stdout.splitlines() if x.startswith("SUMMARIES "))
    summaries = json.loads(line[len("SUMMARIES ") :])
    assert [s["rank"] for s in summaries] == [0, 1, 2, 3]
    for summary in summaries:
        ops = summary["operations"]
        assert (ops["shift"]["bytes_sent"], ops["shift"]["messages_received"]) == (800, 1)
        assert (ops["pairs"]["bytes_sent"], ops["pairs"]["bytes_received"]) == (28, 28)
        assert (ops[OTHER]["bytes_sent"], ops[OTHER]["calls"]) == (40, 1)
    trace = json.loads(trace_path.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2, 3}
