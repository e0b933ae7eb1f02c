"""``--device gpu``: CuPy arrays end to end, checked against the CPU, the simulator and a count of device copies.

Every test here needs CuPy and an NVIDIA GPU; without them each is skipped and says why (``pytest -rs``), so CPU CI
stays green. On a GPU machine: ``pytest -m gpu -rs``.

The oracles:

* **the CPU**: the same run with ``--device cpu``. In float64 the two differ only by the order in which cuBLAS and
  OpenBLAS sum a matrix product's terms: about sqrt(K) x 1.1e-16 relative per product (K <= 784 terms), far below
  the 1e-9 the float64 tests allow. In float32 the same rounding is 2^-24 = 6e-8 per operation, about 2e-6 per
  product for K = 784; SGD carries such differences along without growing them much over a few hundred steps of a
  converging run, so the losses agree to 1e-4 relative (the float32 bound; the runs print what they measured).
* **the two paths of a message**: staged through pinned host memory or handed to a CUDA-aware transport, a message
  arrives with the same bytes and every reduction runs the same kernels on the same data, so the weights must be
  bit-identical (equal SHA-256 digests). The simulator plays the CUDA-aware MPI (``SimWorld(cuda_aware=True)``:
  its ranks copy GPU arrays GPU to GPU) when the machine's MPI is not one.
* **counted copies**: the driver reads GPU losses 16 steps at a time, and nothing else in a step should copy from
  the device. A run of 48 steps must make exactly two more device-to-host copies than a run of 16 (the two extra
  reads of 16 losses); PyTorch's profiler counts the copies (CUPTI sees every CUDA copy in the process, CuPy's
  too), so that test needs torch and is skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dtrain import backend
from dtrain.comm import sim
from dtrain.config import TrainConfig
from dtrain.train import LOSSES_READ_TOGETHER, train

MISSING = backend.gpu_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=f"needs a GPU: {MISSING}")]

FLOAT32_BOUND, FLOAT64_BOUND = 1e-4, 1e-9
COMMON = ["--dataset", "synthetic", "--samples", "1536", "--features", "48", "--classes", "6", "--hidden", "64,64",
          "--batch-size", "96", "--epochs", "2", "--lr", "0.05", "--seed", "3"]  # fmt: skip
# (name, ranks, flags): the paradigms the issue names, each on the smallest world that exercises its communication
PARADIGMS = [
    ("single", 1, ["--paradigm", "single"]),
    ("ddp-ring", 2, ["--paradigm", "ddp", "--allreduce", "ring"]),
    ("ddp-mpi", 2, ["--paradigm", "ddp", "--allreduce", "mpi"]),
    ("ps-sync", 3, ["--paradigm", "ps-sync", "--servers", "1"]),
    ("tp", 2, ["--paradigm", "tp"]),
    ("pp-1f1b", 2, ["--paradigm", "pp", "--schedule", "1f1b", "--microbatches", "4"]),
    ("zero-3", 2, ["--paradigm", "zero", "--zero-stage", "3"]),
]


def run_cli(folder, ranks: int, *flags, env=None) -> dict:
    """``dtrain train FLAGS`` on one process or under ``dtrain launch -n RANKS``: its metrics.json."""
    launch = ["-m", "dtrain", "launch", "-n", str(ranks)] if ranks > 1 else []
    command = [sys.executable, *launch, "-m", "dtrain", "train", *flags, "--quiet", "--out", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "metrics.json").read_text())


def largest_difference(gpu: dict, cpu: dict) -> float:
    """The largest relative difference between two runs' per-epoch train and test losses."""
    epochs = zip(gpu["epochs"], cpu["epochs"], strict=True)
    pairs = [(g[k], c[k]) for g, c in epochs for k in ("train_loss", "test_loss")]
    return max(abs(g - c) / abs(c) for g, c in pairs)


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "ranks", "flags"), PARADIGMS, ids=[p[0] for p in PARADIGMS])
def test_gpu_training_follows_the_cpu(tmp_path, name, ranks, flags):
    """float32: every epoch's losses within 1e-4 of the CPU run's; and the run really was on the GPU, staged."""
    cpu = run_cli(tmp_path / "cpu", ranks, *COMMON, *flags, "--device", "cpu")
    gpu = run_cli(tmp_path / "gpu", ranks, *COMMON, *flags, "--device", "gpu")
    difference = largest_difference(gpu, cpu)
    print(f"{name}: float32 GPU vs CPU, largest relative loss difference {difference:.2e} (bound {FLOAT32_BOUND})")
    assert difference < FLOAT32_BOUND
    assert gpu["gpu"]["name"] and gpu["gpu"]["local_rank"] == 0
    if ranks > 1:  # the mpich wheel is not CUDA-aware: every message went through pinned host memory
        staging = gpu["gpu"]["staging"]
        assert len(staging) == ranks
        if not staging[0]["cuda_aware"]:
            sent = [r["totals"]["bytes_sent"] for r in gpu["communication"]["per_rank"]]
            assert all(s["bytes_to_host"] >= b > 0 for s, b in zip(staging, sent)), (staging, sent)


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "ranks", "flags"), [PARADIGMS[0], PARADIGMS[1], PARADIGMS[6]],
                         ids=["single", "ddp-ring", "zero-3"])  # fmt: skip
def test_gpu_training_follows_the_cpu_in_float64(tmp_path, name, ranks, flags):
    cpu = run_cli(tmp_path / "cpu", ranks, *COMMON, *flags, "--device", "cpu", "--dtype", "float64")
    gpu = run_cli(tmp_path / "gpu", ranks, *COMMON, *flags, "--device", "gpu", "--dtype", "float64")
    difference = largest_difference(gpu, cpu)
    print(f"{name}: float64 GPU vs CPU, largest relative loss difference {difference:.2e} (bound {FLOAT64_BOUND})")
    assert difference < FLOAT64_BOUND


SIM = {"dataset": "synthetic", "samples": 768, "features": 32, "classes": 5, "hidden": (48, 48), "batch_size": 96,
       "epochs": 1, "lr": 0.05, "device": "gpu", "quiet": True, "progress": False, "timeout": 0}  # fmt: skip


@pytest.mark.parametrize(
    ("p", "flags"),
    [(2, {"paradigm": "ddp", "allreduce": "ring"}), (4, {"paradigm": "ddp", "allreduce": "mpi"}),
     (4, {"paradigm": "ddp", "allreduce": "hierarchical_rs"}), (4, {"paradigm": "zero", "zero_stage": 2}),
     (2, {"paradigm": "tp"}), (2, {"paradigm": "pp", "microbatches": 4}), (3, {"paradigm": "ps-sync"})],
    ids=["ddp-ring-2", "ddp-mpi-4", "ddp-hierarchical-4", "zero2-4", "tp-2", "pp-2", "ps-sync-3"],
)  # fmt: skip
def test_staged_and_direct_messages_give_identical_weights(p, flags):
    """The same GPU run on a world whose messages are staged through host memory and on one that takes GPU arrays
    as they are: bit-identical weights; only the first staged any bytes."""
    config = TrainConfig(**{**SIM, **flags})
    staged, direct = (sim.SimWorld(p, timeout=120, cuda_aware=aware).run(lambda comm: train(config, comm))[0]
                      for aware in (False, True))  # fmt: skip
    assert staged["weights_sha256"] == direct["weights_sha256"]
    assert all(not s["cuda_aware"] and s["bytes_to_host"] > 0 for s in staged["gpu"]["staging"])
    assert all(s["cuda_aware"] and s["bytes_to_host"] == 0 for s in direct["gpu"]["staging"])


@pytest.mark.mpi
def test_staged_and_direct_under_mpi_when_it_is_cuda_aware(tmp_path):
    """With a CUDA-aware MPI, DTRAIN_CUDA_AWARE=0 (staged) and =1 (direct) give bit-identical weights."""
    from dtrain.comm.cuda_aware import cuda_aware_mpi, cuda_awareness_reason

    if not cuda_aware_mpi():
        pytest.skip(f"this MPI is not CUDA-aware ({cuda_awareness_reason()}); the simulator test plays one")
    flags = [*COMMON, "--paradigm", "ddp", "--allreduce", "ring", "--device", "gpu"]
    staged = run_cli(tmp_path / "staged", 2, *flags, env={"DTRAIN_CUDA_AWARE": "0"})
    direct = run_cli(tmp_path / "direct", 2, *flags, env={"DTRAIN_CUDA_AWARE": "1"})
    assert staged["weights_sha256"] == direct["weights_sha256"]


def device_to_host_copies(steps: int) -> int:
    """Device-to-host copies (CUPTI's count, through PyTorch's profiler) of a one-epoch GPU run of ``steps`` steps."""
    torch = pytest.importorskip("torch", reason="counting device copies uses PyTorch's profiler (CUPTI)")
    from torch.profiler import ProfilerActivity, profile

    # 1,536 training samples (and the same 384 test samples, so evaluation's copies are the same in both runs)
    config = TrainConfig(**{**SIM, "samples": 1920, "batch_size": 1536 // steps, "paradigm": "single"})
    train(config, sim.solo())  # once untimed: CuPy's kernels compiled, the memory pool filled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train(config, sim.solo())
    names = [e.name for e in prof.events()]
    copies = [n for n in names if "DtoH" in n or "Device -> P" in n]
    print(f"{steps} steps: {len(copies)} device-to-host copies ({sorted(set(copies))}); {len(names)} events")
    return len(copies)


def test_a_step_copies_nothing_back_to_the_host():
    assert LOSSES_READ_TOGETHER == 16
    few, many = device_to_host_copies(16), device_to_host_copies(48)
    assert many - few == 2, (few, many)


def test_the_fused_sum_and_scale_kernel_matches_numpy_to_the_bit():
    """kernels.sum_scale_ on GPU arrays (CuPy's generated ElementwiseKernel) against NumPy's ufuncs on the host."""
    import cupy

    from dtrain import kernels

    rng = np.random.default_rng(0)
    for k in (2, 3, 8, 11):
        for dtype in (np.float32, np.float64):
            host = [rng.standard_normal(100_003).astype(dtype) for _ in range(k)]
            expected = host[0].copy()
            for a in host[1:]:
                expected += a
            expected *= dtype(0.25)
            out = cupy.full(100_003, np.nan, dtype=dtype)  # poisoned: every element must be written
            kernels.sum_scale_(out, [cupy.asarray(a) for a in host], 0.25)
            assert np.array_equal(out.get(), expected), (k, dtype)


def test_ranks_take_gpus_round_robin():
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    for local_rank in range(2 * count + 1):
        assert backend.select_gpu(local_rank)["index"] == local_rank % count
    backend.select_gpu(0)
