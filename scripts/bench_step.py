"""How much does dtrain's autograd cost? Time one training step against a hand-written NumPy step and PyTorch.

One step = forward + backward + plain SGD update of a 784-512-512-10 ReLU MLP on a batch of 256, float32, ONE
thread. Three implementations of exactly the same arithmetic:

* ``numpy``:  the network's forward and backward written out by hand (no graph, no objects): the floor for NumPy;
* ``dtrain``: ``model(Tensor(x))``, ``softmax_cross_entropy``, ``backward()``, ``SGD.step()``;
* ``torch``:  PyTorch eager on the CPU (only if torch is installed; it is never a dependency of dtrain).

All three start from the same weights (dtrain's initialisation), and the script checks that they compute the same
first loss before timing anything.

The machines are noisy, so the three are measured *interleaved* (one step of each, repeated) and compared by their
medians; each one's speed is against the hand-written NumPy step measured in the same run ("1.05x slower").

    python scripts/bench_step.py                 # 200 interleaved rounds
    python scripts/bench_step.py --json out.json
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_name] = "1"  # before NumPy loads BLAS: one thread, for every contender

import argparse
import itertools
import platform
import statistics
import time

import numpy as np
from bench_util import faster, forward_by_hand, run_meta, say, write_json

from dtrain import terminal
from dtrain.autograd import Tensor, softmax_cross_entropy
from dtrain.nn import MLP
from dtrain.optim import SGD

SIZES = [784, 512, 512, 10]
BATCH, LR = 256, 0.01


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], BATCH)
    return x, y


class DtrainStep:
    name = "dtrain"

    def __init__(self, x, y):
        self.model = MLP(SIZES, seed=0)
        self.opt = SGD(self.model, lr=LR)
        self.x, self.y = x, y

    def __call__(self):
        self.model.zero_grad()
        loss = softmax_cross_entropy(self.model(Tensor(self.x)), self.y)
        loss.backward()
        self.opt.step()
        return float(loss.data)


class NumpyStep:
    """The same network, forward and backward by hand, parameters as separate arrays."""

    name = "numpy"

    def __init__(self, x, y):
        model = MLP(SIZES, seed=0)  # same initial weights as dtrain's
        self.params = [p.data.copy() for p in model.parameters()]  # W1 b1 W2 b2 W3 b3
        self.x, self.y = x, y

    def __call__(self):
        _, _, W2, _, W3, _ = self.params
        x = self.x
        loss, dz3, (z1, h1, z2, h2) = forward_by_hand(self.params, x, self.y)  # (shared with bench_ddp's floor)
        dW3, db3 = h2.T @ dz3, dz3.sum(axis=0)
        dz2 = (dz3 @ W3.T) * (z2 > 0)
        dW2, db2 = h1.T @ dz2, dz2.sum(axis=0)
        dz1 = (dz2 @ W2.T) * (z1 > 0)
        dW1, db1 = x.T @ dz1, dz1.sum(axis=0)
        for p, g in zip(self.params, (dW1, db1, dW2, db2, dW3, db3)):
            p -= LR * g
        return loss


class TorchStep:
    name = "torch"

    def __init__(self, x, y):
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        layers = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(SIZES)):
            layers.append(torch.nn.Linear(n_in, n_out))
            if i < len(SIZES) - 2:
                layers.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*layers)
        with torch.no_grad():  # same initial weights as dtrain's (torch keeps W as (out, in): transposed)
            for linear, ours in zip(layers[::2], MLP(SIZES, seed=0).layers[::2]):
                linear.weight.copy_(torch.from_numpy(ours.weight.data.T.copy()))
                linear.bias.copy_(torch.from_numpy(ours.bias.data))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return loss.item()


def table(results: dict, width="auto") -> str:
    """The implementations' steps (``results`` of the JSON) as a table fitted to ``width`` (:mod:`dtrain.terminal`):
    each one's speed against the hand-written NumPy step's."""
    cells = [[name, f"{1e3 * r['median_s']:.2f}", f"{r['samples_per_s']:,.0f}",
              "-" if name == "numpy" else faster(1 / r["time_ratio_vs_numpy"])]
             for name, r in results.items() if name != "dtrain_over_torch_samples_per_s"]  # fmt: skip
    return terminal.table(["impl", "ms per step", "samples/s", "vs numpy"], cells, width=width)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="interleaved timed rounds (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()

    x, y = make_batch()
    contenders = [NumpyStep(x, y), DtrainStep(x, y)]
    if not args.no_torch:
        try:
            contenders.append(TorchStep(x, y))
        except ImportError:
            print("(torch not installed: skipping the PyTorch comparison)")

    # The same arithmetic must give the same first loss (a cheap check that we time equal work).
    first = {c.name: c() for c in contenders}
    ref = first["numpy"]
    for name, loss in first.items():
        if abs(loss - ref) > 1e-4 * abs(ref):
            raise SystemExit(f"{name} computes a different loss ({loss}) from the hand-written step ({ref})")

    for _ in range(args.warmup):
        for c in contenders:
            c()
    times = {c.name: [] for c in contenders}
    for _ in range(args.rounds):
        for c in contenders:
            t0 = time.perf_counter()
            c()
            times[c.name].append(time.perf_counter() - t0)

    base = statistics.median(times["numpy"])
    results = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        results[name] = {"median_s": med, "samples_per_s": BATCH / med, "time_ratio_vs_numpy": med / base}
    say(f"one step of MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, float32, 1 thread, {args.rounds} interleaved "
        "rounds (median)", hanging="  ")  # fmt: skip
    print(table(results))
    if "torch" in results:
        speed = results["dtrain"]["samples_per_s"] / results["torch"]["samples_per_s"]
        print(f"dtrain: {faster(speed, 'torch')} (samples/s)")
        results["dtrain_over_torch_samples_per_s"] = speed
    if args.json:
        meta = run_meta(sizes=SIZES, batch=BATCH, rounds=args.rounds, numpy=np.__version__,
                        processor=platform.processor())  # fmt: skip
        write_json(args.json, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
