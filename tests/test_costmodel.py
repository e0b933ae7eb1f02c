"""The cost model: textbook byte counts, exactness on awkward sizes, predicted times, and what ``auto`` picks.

(That the per-rank counts match what the algorithms really send is checked message by message against the tracer in
tests/mpi_scripts/check_collectives.py, under mpiexec and on the simulator.)
"""

from __future__ import annotations

import json
import math

import pytest

from dtrain.collectives import costmodel
from dtrain.collectives.costmodel import Machine, bytes_sent, choose, messages_sent, predict_time

F32 = 4


def per_rank(algorithm, count, p, k=None, **kwargs):
    return [bytes_sent(algorithm, count, F32, p, r, k, **kwargs) for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_sends_2_p_minus_1_over_p_of_the_buffer(p):
    n = 840 * p  # divisible: every rank sends exactly 2 (p-1)/p n
    assert per_rank("ring", n, p) == [2 * (p - 1) * n // p * F32] * p
    odd = per_rank("ring", 1009, p)  # uneven chunks: within one element per step of the formula, total exact
    assert sum(odd) == 2 * (p - 1) * 1009 * F32
    assert all(abs(b - 2 * (p - 1) / p * 1009 * F32) <= 2 * F32 for b in odd)
    assert [messages_sent("ring", 1009, F32, p, r) for r in range(p)] == [2 * (p - 1)] * p


def test_ring_counts_the_chunks_each_rank_really_sends():
    # n = 10, p = 4: chunks 3 3 2 2. Rank r skips chunk r in the reduce-scatter and chunk r+1 in the all-gather.
    expected = [(10 - 3) + (10 - 3), (10 - 3) + (10 - 2), (10 - 2) + (10 - 2), (10 - 2) + (10 - 3)]
    assert per_rank("ring", 10, 4) == [e * F32 for e in expected]


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8])
def test_naive_root_sends_p_minus_1_buffers_and_leaves_one(p):
    n = 1000
    assert per_rank("naive", n, p) == [(p - 1) * n * F32] + [n * F32] * (p - 1)
    assert messages_sent("naive", n, F32, p, 0) == p - 1
    assert per_rank("naive", n, p, collective="broadcast", root=p - 1)[-1] == (p - 1) * n * F32
    assert per_rank("naive", n, p, collective="reduce", root=p - 1) == [n * F32] * (p - 1) + [0]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 16])
def test_tree_every_rank_sends_once_up_and_once_per_child_down(p):
    n = 100
    up = per_rank("tree", n, p, collective="reduce")
    down = per_rank("tree", n, p, collective="broadcast")
    assert up == [0] + [n * F32] * (p - 1)
    assert sum(down) == (p - 1) * n * F32  # everyone but the root receives exactly once
    assert down[0] == math.ceil(math.log2(p)) * n * F32  # the root has ceil(log2 p) children
    assert messages_sent("tree", n, F32, p, 0) == math.ceil(math.log2(p))


def test_tree_children_for_p_6():  # 0 -> 4, 2, 1;  2 -> 3;  4 -> 5
    assert [messages_sent("tree", 10, F32, 6, r, collective="broadcast") for r in range(6)] == [3, 0, 1, 0, 1, 0]
    # root 2: numbers relative to the root, v = (rank - 2) % 6, so rank 0 is v = 4 and its child v = 5 is rank 1
    assert [messages_sent("tree", 10, F32, 6, r, collective="broadcast", root=2) for r in range(6)] == [
        1,
        0,
        3,
        0,
        1,
        0,
    ]


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_doubling_sends_log2_p_whole_buffers(p):
    assert per_rank("doubling", 1000, p) == [int(math.log2(p)) * 1000 * F32] * p


def test_doubling_fix_up_for_six_ranks():
    # p = 6: p' = 4, r = 2. Ranks 1 and 3 fold into 0 and 2 (n each); 0 and 2 also return the result (n each).
    n = 1000
    assert per_rank("doubling", n, 6) == [3 * n * F32, n * F32, 3 * n * F32, n * F32, 2 * n * F32, 2 * n * F32]
    assert [messages_sent("doubling", n, F32, 6, r) for r in range(6)] == [3, 1, 3, 1, 2, 2]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_rabenseifner_is_bandwidth_optimal_for_powers_of_two(p):
    n = 64 * p
    assert per_rank("rabenseifner", n, p) == [2 * (p - 1) * n // p * F32] * p
    assert messages_sent("rabenseifner", n, F32, p, 0) == 2 * int(math.log2(p))


def test_rabenseifner_uneven_chunks_and_fix_up():
    # p = 5: rank 1 folds into 0; participants 0, 2, 3, 4 (v = 0..3) split 13 elements into chunks 4 3 3 3.
    # v sends: the half it gives away at distance 2 and 1, then the range it owns at distance 1 and 2.
    v0, v1, v2, v3 = 6 + 3 + 4 + 7, 6 + 4 + 3 + 7, 7 + 3 + 3 + 6, 7 + 3 + 3 + 6
    assert per_rank("rabenseifner", 13, 5) == [(v0 + 13) * F32, 13 * F32, v1 * F32, v2 * F32, v3 * F32]
    assert sum(per_rank("rabenseifner", 13, 4)) == 2 * 3 * 13 * F32


def test_hierarchical_leaders_ring_and_node_trees():
    n, p, k = 1200, 6, 2  # 3 nodes of 2: leaders 0, 2, 4 run a ring of 3 on the whole buffer
    ring_of_3 = 2 * 2 * n // 3
    assert per_rank("hierarchical", n, p, k) == [(n + ring_of_3) * F32, n * F32] * 3
    unequal = per_rank("hierarchical", n, 5, 2)  # nodes {0,1} {2,3} {4}: rank 4 is a leader alone
    assert unequal[4] == 2 * 2 * n // 3 * F32 and unequal[1] == n * F32


def test_hierarchical_rs_moves_n_over_k_between_nodes():
    n, p, k = 1200, 8, 4  # 2 nodes of 4: intra ring 2 (k-1)/k n, then inter ring of 2 on n/k
    assert per_rank("hierarchical_rs", n, p, k) == [(2 * 3 * n // 4 + 2 * 1 * (n // 4) // 2) * F32] * p


def test_mpi_counts_the_logical_volume_and_empty_buffers_send_nothing():
    assert per_rank("mpi", 100, 3) == [400] * 3
    assert per_rank("mpi", 100, 3, collective="broadcast", root=1) == [0, 400, 0]
    for algorithm in costmodel.ALLREDUCE_ALGORITHMS:
        assert per_rank(algorithm, 0, 4, 2) == [0] * 4
    with pytest.raises(ValueError, match="no traffic model"):
        bytes_sent("doubling", 10, F32, 4, 0, collective="broadcast")


# --- predicted time and the choice of algorithm ------------------------------------------------------------------

M = Machine(alpha=1e-5, beta=1e-10, gamma=1e-10)


def test_predicted_times_follow_the_formulas():
    n, p = 1 << 20, 8
    assert predict_time("ring", n, p, M) == pytest.approx(14 * M.alpha + 14 / 8 * n * M.beta + 7 / 8 * n * M.gamma)
    assert predict_time("doubling", n, p, M) == pytest.approx(3 * (M.alpha + n * M.beta + n * M.gamma))
    assert predict_time("tree", n, 5, M) == pytest.approx(6 * M.alpha + 6 * n * M.beta + 3 * n * M.gamma)
    assert predict_time("naive", n, p, M) == pytest.approx(14 * M.alpha + 14 * n * M.beta + 7 * n * M.gamma)
    assert predict_time("ring", n, 1, M) == 0.0
    with pytest.raises(ValueError, match="unknown algorithm"):
        predict_time("butterfly", n, p, M)


def test_ring_bandwidth_term_does_not_grow_with_p_but_naive_does():
    n = 1 << 30
    no_latency = Machine(alpha=0.0, beta=1e-10, gamma=0.0)
    ring = [predict_time("ring", n, p, no_latency) for p in (2, 8, 64)]
    naive = [predict_time("naive", n, p, no_latency) for p in (2, 8, 64)]
    assert max(ring) < 2 * n * no_latency.beta
    assert naive[2] / naive[0] == pytest.approx(63)


def test_slow_links_between_nodes_favour_hierarchical_rs():
    n, p, k = 64 << 20, 16, 4
    network = Machine(alpha=5e-5, beta=1e-9, gamma=M.gamma)  # 10x slower between nodes
    rs = predict_time("hierarchical_rs", n, p, M, ranks_per_node=k, inter=network)
    leaders = predict_time("hierarchical", n, p, M, ranks_per_node=k, inter=network)
    assert rs < leaders


@pytest.mark.parametrize("p", [2, 4, 6, 8, 64])
def test_choose_is_latency_optimal_for_tiny_and_bandwidth_optimal_for_large_messages(p):
    assert choose(8, p, M) == "doubling"
    assert choose(256 << 20, p, M) in ("ring", "rabenseifner")
    if p & (p - 1):  # Rabenseifner pays the fix-up's two full-buffer messages: the ring wins
        assert choose(256 << 20, p, M) == "ring"


def test_choose_switches_where_the_predictions_cross():
    p = 8
    sizes = [1 << s for s in range(3, 30)]
    picks = [choose(n, p, M) for n in sizes]
    first_large = picks.index("rabenseifner")
    assert set(picks[:first_large]) == {"doubling"} and set(picks[first_large:]) == {"rabenseifner"}
    n = sizes[first_large]
    assert predict_time("rabenseifner", n, p, M) <= predict_time("doubling", n, p, M)


def test_machine_loads_a_calibration_file_or_falls_back(tmp_path):
    path = tmp_path / "calibration.json"
    assert Machine.load(path) == Machine()
    path.write_text(json.dumps({"alpha": 2e-6, "beta": 3e-10, "gamma": 4e-10, "host": "ignored"}))
    assert Machine.load(path) == Machine(2e-6, 3e-10, 4e-10)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"alpha": 1e-3}))
    assert Machine.load(partial) == Machine(alpha=1e-3)


def test_machine_for_p_ranks_takes_the_nearest_measured_rank_count(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({
        "alpha": 1e-6, "beta": 1e-10, "gamma": 1e-10,
        "by_ranks": {"2": {"alpha": 2e-6, "beta": 2e-10, "gamma": 2e-10},
                     "4": {"alpha": 4e-4, "beta": 4e-10, "gamma": 4e-10, "seconds": [1, 2]}},
    }))  # fmt: skip
    assert Machine.load(path) == Machine(1e-6, 1e-10, 1e-10)  # no p: the idle pair
    assert Machine.load(path, p=2) == Machine(2e-6, 2e-10, 2e-10)
    assert Machine.load(path, p=4) == Machine(4e-4, 4e-10, 4e-10)
    assert Machine.load(path, p=3) == Machine(2e-6, 2e-10, 2e-10)  # equally near: the smaller
    assert Machine.load(path, p=16) == Machine(4e-4, 4e-10, 4e-10)


def test_a_large_latency_makes_auto_prefer_fewer_steps():
    # with ranks waiting ~0.4 ms for a descheduled peer per message, a 1 MiB all-reduce on 4 ranks is latency-bound
    slow = Machine(alpha=4e-4, beta=1e-10, gamma=1.7e-10)
    assert choose(1 << 20, 4, slow) == "doubling"
    assert choose(1 << 20, 4, Machine(alpha=2e-6, beta=1e-10, gamma=2e-11)) != "doubling"
