"""Data parallelism against its oracle: one process training on the whole batch.

N ranks with global batch B must hold, after k steps, the parameters one process holds after k steps with batch B:
to ~1e-12 relative in float64 (the only difference is the order in which the N slice gradients are summed) and within
a bound derived below in float32, for every all-reduce algorithm, with and without buckets and overlap, with
accumulation, for N = 1..4. The same configuration twice gives bit-identical weights; traced bytes per step equal
:meth:`DataParallel.costs`; a parameter the loss never uses neither hangs the hooks nor changes the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from dtrain import checkpoint, faults, parallel
from dtrain.collectives import ALGORITHMS
from dtrain.comm import sim
from dtrain.comm.prepare import prepare
from dtrain.config import TrainConfig
from dtrain.data import load_digits
from dtrain.nn import MLP, Linear, ReLU, Sequential
from dtrain.optim import make_optimizer
from dtrain.parallel.buckets import allreduce_algorithm, plan_buckets
from dtrain.parallel.data_parallel import DataParallel

SIZES = [64, 32, 16, 10]
BATCH, STEPS = 24, 3  # 24 divides among 1, 2, 3 and 4 ranks, and each slice again into 2 micro-batches


def batches(dtype=np.float64):
    x, y = load_digits()
    x = (x / 16.0).astype(dtype)
    rng = np.random.default_rng(7)
    return [(x[i], y[i]) for i in (rng.choice(len(y), BATCH, replace=False) for _ in range(STEPS))]


def config(**overrides) -> TrainConfig:
    base = dict(paradigm="ddp", dtype="float64", lr=0.1, momentum=0.9, batch_size=BATCH, timeout=0, bucket_mb=0.002)
    if overrides.get("paradigm", "ddp") != "ddp":
        del base["bucket_mb"]  # a ddp flag: other paradigms refuse it
    return TrainConfig(**{**base, **overrides})


def for_model(paradigm: str, sizes, **overrides) -> TrainConfig:
    """A config of ``paradigm`` for the model ``sizes`` (its hidden widths, as the driver takes them)."""
    return config(paradigm=paradigm, quiet=True, hidden=tuple(sizes[1:-1]), **overrides)


def model_of(sizes):
    """The model ``sizes`` in float64, from the seed every training test uses."""
    return lambda: MLP(sizes, seed=3, dtype=np.float64)


def make_model(cfg, sizes=SIZES):
    return lambda: MLP(sizes, seed=3, dtype=np.dtype(cfg.dtype))


def run(comm, cfg, data, model=None):
    """Train ``cfg`` on ``data`` (one epoch) as the driver does, on this rank's slices or serving; return params,
    traffic, figures."""
    prepared = prepare(comm, timeout=0)
    kind = parallel.get(cfg.paradigm)
    kind.check(cfg, comm.Get_size())
    paradigm = kind(prepared, cfg)
    paradigm.build(
        model or make_model(cfg), lambda m: make_optimizer(cfg.optimizer, m, cfg.lr, cfg.momentum, cfg.weight_decay)
    )
    index, count = paradigm.batch_slice
    local = BATCH // count
    mine = [(x[index * local : (index + 1) * local], y[index * local : (index + 1) * local]) for x, y in data]
    paradigm.run(OneEpoch(paradigm, mine))
    figures = paradigm.finish()
    return paradigm.full_parameters().copy(), prepared.tracer.summary(), figures


class OneEpoch:
    """The driver's epochs (dtrain.train.Epochs), cut down to one pass over ``batches`` and nothing else (an
    asynchronous worker does not go round them again: each worker pushes once per batch)."""

    def __init__(self, paradigm, batches):
        self.paradigm, self.batches, self.steps_per_epoch = paradigm, batches, len(batches)
        self.resumed_steps = 0
        self.position, self.injector = checkpoint.Position(), faults.Injector(None, paradigm.rank)

    def run(self) -> None:
        for _loss in self.paradigm.epoch(iter(self.batches)):
            pass


def reference(data, cfg):
    """One process, the whole batch, no accumulation: the trajectory every data-parallel run must follow."""
    single = config(paradigm="single", dtype=cfg.dtype, lr=cfg.lr, momentum=cfg.momentum)
    return sim.run(1, run, single, data)[0][0]


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


MODES = {
    "buckets+overlap": dict(bucket_mb=0.002, overlap=True),
    "buckets, after backward": dict(bucket_mb=0.002, overlap=False),
    "one bucket": dict(bucket_mb=0.0, overlap=False),
    "accumulate 2": dict(bucket_mb=0.002, overlap=True, accumulate=2),
}


def _needs(algorithm, p):
    """The extra flags an algorithm needs, or None when it cannot run on p ranks."""
    if algorithm.startswith("hierarchical"):
        if algorithm == "hierarchical_rs" and p % 2:
            return None  # nodes of 2 ranks: equal sizes only for even p
        return {"ranks_per_node": 2}
    return {}


@pytest.fixture(scope="module")
def expected64(data64):
    return reference(data64, config())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_n_ranks_follow_one_process_with_the_same_global_batch(p, algorithm, mode, data64, expected64):
    extra = _needs(algorithm, p)
    if extra is None:
        pytest.skip(f"{algorithm} needs nodes of equal size")
    cfg = config(allreduce=algorithm, **MODES[mode], **extra)
    results = sim.SimWorld(p, eager_limit=1024).run(run, cfg, data64)
    for params, _, _ in results:
        assert relative(params, expected64) < 1e-12
    assert all(np.array_equal(params, results[0][0]) for params, _, _ in results)  # replicas bit-identical


def test_float32_within_the_rounding_bound():
    # Per step the averaged gradient differs from one process's by the rounding of a different summation order:
    # at most about (p + log2 B) eps32 |g| per element; over 3 SGD steps with lr 0.1 and momentum that moves the
    # parameters by far less than 1e-5 of their size. A bug (a missing 1/p, a lost bucket) moves them by ~1e-2.
    data = batches(np.float32)
    expected = reference(data, config(dtype="float32"))
    for p in (2, 3, 4):
        for params, _, _ in sim.run(p, run, config(dtype="float32", allreduce="ring"), data):
            assert relative(params, expected) < 1e-5


def test_the_same_configuration_twice_is_bit_identical(data64):
    first = sim.run(3, run, config(allreduce="ring"), data64)
    second = sim.run(3, run, config(allreduce="ring"), data64)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, second))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "rabenseifner", "naive"])
@pytest.mark.parametrize("overlap", [True, False])
def test_traced_bytes_per_step_equal_the_cost_function(p, algorithm, overlap, data64):
    cfg = config(allreduce=algorithm, overlap=overlap)
    results = sim.run(p, run, cfg, data64)
    predicted = DataParallel.costs(SIZES, p, cfg)["sent_per_step"]
    used = allreduce_algorithm(cfg, p, 0)
    for rank, (_, summary, figures) in enumerate(results):
        traced = summary["operations"][f"allreduce/{used}"]
        assert traced["bytes_sent"] == STEPS * predicted[rank], (rank, traced)
        assert traced["calls"] == STEPS * len(figures["bucket_bytes"])


def test_buckets_are_contiguous_reverse_order_slices_that_cover_the_buffer():
    layout = [(0, 2048, 8), (2048, 32, 8), (2080, 512, 8), (2592, 16, 8), (2608, 160, 8), (2768, 10, 8)]
    plan = plan_buckets(layout, 4096)
    assert [(start, stop) for start, stop, _ in plan] == [(2080, 2778), (0, 2080)]
    assert [members for _, _, members in plan] == [[5, 4, 3, 2], [1, 0]]
    assert plan_buckets(layout, 0) == [(0, 2778, [5, 4, 3, 2, 1, 0])]


class WithUnusedLayer(Sequential):
    """The MLP plus a layer whose parameters the loss never touches (it sits between two used layers in memory)."""

    def __init__(self, dtype):
        rng = np.random.default_rng(3)
        first, second = Linear(64, 32, rng), Linear(32, 10, rng)
        super().__init__([first, ReLU(), second])
        self.spare = Linear(32, 32, rng)  # never called
        self.flatten_(dtype=dtype)

    def named_parameters(self, prefix=""):  # spare between the two used layers: a bucket in the middle waits on it
        first, second = self.layers[0], self.layers[2]
        yield from first.named_parameters("0.")
        yield from self.spare.named_parameters("spare.")
        yield from second.named_parameters("2.")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_parameter_the_loss_never_uses_neither_hangs_nor_changes_the_result(overlap, data64):
    cfg = config(allreduce="ring", overlap=overlap, bucket_mb=0.001)

    def model():
        return WithUnusedLayer(np.float64)

    single = config(paradigm="single")
    expected = sim.run(1, run, single, data64, model)[0][0]
    results = sim.SimWorld(3, timeout=60).run(run, cfg, data64, model)
    assert len(results[0][2]["bucket_bytes"]) >= 3
    for params, _, _ in results:
        assert relative(params, expected) < 1e-12
    spare = slice(64 * 32 + 32, 64 * 32 + 32 + 32 * 32 + 32)
    assert np.array_equal(results[0][0][spare], WithUnusedLayer(np.float64).flat_params[spare])  # untouched


def test_overlap_starts_buckets_during_backward(data64):
    """With the ring and several buckets, the first bucket is in flight before backward has finished."""
    cfg = config(allreduce="ring", overlap=True, bucket_mb=0.001)
    for _, _, figures in sim.run(2, run, cfg, data64):
        assert figures["overlap"] and figures["hidden_s"] > 0 and 0 < figures["overlap_fraction"] <= 1


def test_replicas_that_differ_are_an_error_naming_the_ranks(data64):
    def fn(comm):
        prepared = prepare(comm, timeout=0)
        paradigm = DataParallel(prepared, config())
        paradigm.build(make_model(config()), lambda m: make_optimizer("sgd", m, 0.1))
        if comm.Get_rank() == 2:
            paradigm.model.flat_params[0] += 1e-9
        paradigm.check_replicas("in the test")

    with pytest.raises(sim.SimRankError) as info:
        sim.run(3, fn)
    assert "replicas differ in the test" in str(info.value) and "[2]" in str(info.value)


def test_replicas_start_from_rank_0s_weights_whatever_their_seeds(data64, expected64):
    def fn(comm):
        seed_of_this_rank = comm.Get_rank() * 11 + 3  # rank 0 has the reference's seed, 3
        return run(comm, config(allreduce="ring"), data64, lambda: MLP(SIZES, seed=seed_of_this_rank, dtype=np.float64))

    for params, _, _ in sim.run(3, fn):
        assert relative(params, expected64) < 1e-12


@pytest.mark.parametrize(("optimizer", "momentum"), [("sgd", 0.9), ("sgd", 0.0), ("adam", 0.9)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_state_bytes_equal_what_a_rank_really_holds(optimizer, momentum, dtype):
    cfg = config(optimizer=optimizer, momentum=momentum, dtype=dtype)

    def fn(comm):
        paradigm = DataParallel(prepare(comm, timeout=0), cfg)
        paradigm.build(make_model(cfg), lambda m: make_optimizer(optimizer, m, 0.1, momentum))
        state = paradigm.optimizer_state()
        held = sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray))
        return paradigm.model.flat_params.nbytes, paradigm.model.flat_grads.nbytes, held

    predicted = DataParallel.costs(SIZES, 2, cfg)
    for params, grads, held in sim.run(2, fn):
        assert (predicted["parameters"], predicted["gradients"], predicted["optimizer"]) == (params, grads, held)


@pytest.mark.parametrize(("paradigm", "p"), [("ddp", 3), ("single", 1)])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_held_bytes_in_the_figures_equal_the_cost_function(paradigm, p, optimizer, data64):
    """What every paradigm reports (``finish()["held_bytes"]``, one entry by rank, read off the arrays) is what its
    ``costs()`` predicts: for ddp and single, the whole model, its gradients and the optimizer state on every rank."""
    cfg = config(paradigm=paradigm, optimizer=optimizer)
    predicted = parallel.get(paradigm).costs(SIZES, p, cfg)
    for _, _, figures in sim.run(p, run, cfg, data64[:1]):
        assert figures["held_bytes"] == [{k: predicted[k] for k in ("parameters", "gradients", "optimizer")}] * p


# --- --allreduce shm: the gradients in a shared window, summed in place -----------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_ddp_shm_copies_what_its_cost_function_says_and_sends_nothing(p, overlap, data64):
    """Zero copy: each bucket's loads and stores, 2 (p-1) c_r per rank, counted by the tracer as copies (a bucket
    copied in would add 2 n - 2 c_r more: the equality says the gradients were summed where they lay)."""
    cfg = config(allreduce="shm", overlap=overlap)
    results = sim.run(p, run, cfg, data64)
    costs = DataParallel.costs(SIZES, p, cfg)
    for rank, (_, summary, figures) in enumerate(results):
        traced = summary["operations"]["allreduce/shm"]
        assert traced["bytes_sent"] == 0 == costs["sent_per_step"][rank]
        assert traced["bytes_copied"] == STEPS * costs["copied_per_step"][rank], (rank, traced)
        assert traced["calls"] == STEPS * len(figures["bucket_bytes"])


def test_ddp_shm_follows_the_ring_within_the_reduction_order_bound_and_repeats_its_bits(data64):
    """shm sums each chunk in another order than the ring (its own chunk first, then rank order): the same bits on
    every run, and the ring's weights to float64 rounding (3 steps: ~1e-15 relative, asserted at 1e-12)."""
    ring = sim.run(4, run, config(allreduce="ring"), data64)[0][0]
    first, again = (sim.run(4, run, config(allreduce="shm"), data64)[0][0] for _ in range(2))
    assert np.array_equal(first, again)
    assert relative(first, ring) < 1e-12


def test_shm_with_a_gpu_is_refused_in_one_line_before_any_message():
    from dtrain.errors import ConfigError

    for name in ("shm", "hierarchical_shm"):
        with pytest.raises(ConfigError, match="host memory") as error:
            DataParallel.check(config(allreduce=name, device="gpu"), 2)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("p", [3, 4])
def test_ddp_hierarchical_shm_copies_and_sends_what_its_cost_function_says(p, data64):
    """Nodes of 2 (the last one smaller at p = 3): each node's ranks copy, only the leaders send (their ring)."""
    cfg = config(allreduce="hierarchical_shm", ranks_per_node=2)
    costs = DataParallel.costs(SIZES, p, cfg)
    for rank, (_, summary, _) in enumerate(sim.run(p, run, cfg, data64)):
        traced = summary["operations"]["allreduce/hierarchical_shm"]
        assert traced["bytes_copied"] == STEPS * costs["copied_per_step"][rank], (rank, traced)
        assert traced["bytes_sent"] == STEPS * costs["sent_per_step"][rank], (rank, traced)
