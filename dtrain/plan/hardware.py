"""What a step costs on some hardware: the compute of an MLP's step, and the links its messages take.

The planner (:mod:`dtrain.plan`) asks each paradigm how long a step would take on a :class:`Hardware`; the paradigm
says which layers a rank computes on how many rows, and which collectives over which ranks it makes, and this module
prices them. Three rates and two links describe a machine::

    one rank's step   = slowdown x ( M x sum over its Linear layers of         each of M micro-batches of rows/M rows:
                                           (6 (rows/M) a b / flops             its matrix products,
                                            + layer_s                          a layer's fixed cost (Python, launches)
                                            + 4 a b itemsize / memory_bandwidth)   4 passes over the layer's weights
                                     + step_s                                  the loss, the step's own Python
                                     + (3 + 2k) parameters x itemsize / memory_bandwidth )    the optimizer's update
    slowdown          = ranks on the machine / cores, when ranks outnumber cores (they share them), else 1
    a collective      = the alpha-beta-gamma formula of its algorithm (dtrain.collectives.costmodel) on the link it
                        crosses: ``intra`` when every rank of the group is on one node, ``inter`` when it spans nodes

(A Linear layer of a x b weights costs 2 rows a b floating-point operations forward and 4 rows a b backward; k is the
optimizer's buffers per parameter, and its update reads the weights, the gradient and the buffers and writes the
weights and the buffers.) Ranks fill nodes in order: rank r is on node r // ranks_per_node.

``Hardware.this()`` is the machine you are on, as ``python scripts/calibrate.py`` measured it into
dtrain/collectives/calibration.json: the links with all the node's ranks busy, as an all-reduce keeps them (beta and
gamma from raw transfers; alpha from dtrain's own all-reduce of a tiny buffer, so that the Python layers every dtrain
message passes, the tracer's and the watchdog's, are in it), the slowdown of a rank's compute when every rank
computes at once, and the compute rates (``"compute"``), fitted by :func:`measure_compute` to dtrain's own steps on
one thread. The other presets, in
hardware.json, are real clusters from their vendors' published figures, each number with its source, and the
assumptions that turn a peak figure into a sustained one stated beside it.

A dtrain cluster (``dtrain cluster up``; ``dtrain plan --hostfile FILE``, :mod:`dtrain.plan.hostfile`) is this
machine cut into nodes that are network namespaces, joined by links shaped to a rate: :attr:`Hardware.cluster`
names it. Its ranks all share this machine's cores, whatever their node (the slowdown and the loaded links of the
whole world's ranks), and each node has one link, not one a rank as a DGX's GPUs have: an all-reduce step in which
k ranks of a node cross at once shares it k ways (:meth:`Hardware.allreduce`: the ring and the hierarchical
all-reduces send one flow a node; hierarchical_rs, doubling and Rabenseifner k at their crossing steps).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np

from dtrain.collectives import costmodel, shm
from dtrain.collectives.costmodel import Machine
from dtrain.comm import usable_cores
from dtrain.errors import ConfigError

PRESETS = Path(__file__).with_name("hardware.json")
# A micro-batch reads a layer's weights in forward and again in backward, and reads and writes its gradient (which it
# accumulates into): four passes over a weight-sized array, however few its rows
WEIGHT_PASSES = 4
THIS = "this"
GIB = 1 << 30
# the all-reduces some of whose steps stay inside a node and some cross between nodes (the ring's every step crosses)
STEPS_INSIDE_AND_ACROSS = ("doubling", "rabenseifner", "tree", "mpi")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A machine (or a cluster of identical nodes) as the planner prices it; see the module docstring."""

    name: str
    flops: float  # sustained floating-point operations per second of one rank's matrix products
    layer_s: float  # seconds per Linear layer per step besides its arithmetic (interpreter, kernel launches)
    step_s: float  # seconds per step besides the layers (the loss, the step's own Python)
    memory_bandwidth: float  # bytes per second one rank streams through memory (the optimizer's update)
    memory: float  # bytes of memory per rank
    intra: Machine  # the link between two ranks of one node
    inter: Machine  # the link between nodes
    ranks_per_node: int | None = None  # None: every rank on one node
    cores: int | None = None  # per node, when ranks share them (CPUs); None: a rank has its own device
    # the part of an all-reduce started during backward that backward hides: a GPU computes and moves data at once
    # (NCCL on its own stream); a CPU rank moves its intra-node data with the cores that compute, and MPI progresses
    # only when the rank calls it, so on this machine --overlap measured slower, not faster (docs/benchmarks.md, 4)
    hidden: float = 1.0
    # a GPU: the CPU queues each layer's kernels and goes on while the GPU runs them, so a micro-batch takes the
    # longer of the two (the layers' fixed costs on the host, their arithmetic and memory traffic on the device)
    # instead of their sum; ``cores`` is then the node's GPUs, which ranks beyond them share
    asynchronous: bool = False
    loaded: dict = dataclasses.field(default_factory=dict, compare=False)  # this machine: p -> Machine measured busy
    slowdowns: dict = dataclasses.field(default_factory=dict, compare=False)  # this machine: p -> measured slowdown
    about: str = ""
    # the dtrain cluster (dtrain cluster up) whose nodes these are: network namespaces of this one machine, so every
    # rank of the world shares its cores and memory bus whichever node it is on (the slowdown and the loaded links of
    # all the world's ranks), and a group that spans nodes crosses the cluster's shaped link, ``inter``
    cluster: str | None = None

    @property
    def device(self) -> str:
        """What its ranks compute on: "gpu" (an :attr:`asynchronous` device) or "cpu"."""
        return "gpu" if self.asynchronous else "cpu"

    # --- where ranks are -------------------------------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def ranks_on_node(self, world: int) -> int:
        return world if self.ranks_per_node is None else min(world, self.ranks_per_node)

    def ranks_sharing(self, world: int) -> int:
        """The ranks that share a machine's cores, memory and memory bus: the node's, or every rank of the world on
        a :attr:`cluster` of this machine's namespaces."""
        return world if self.cluster else self.ranks_on_node(world)

    def slowdown(self, world: int) -> float:
        """How much slower a rank computes because ranks share the machine's cores and memory bus: measured on this
        machine (the nearest rank count), else ranks / cores where they outnumber them, else 1."""
        busy = self.ranks_sharing(world)
        if busy > 1 and self.slowdowns:
            return max(1.0, self.slowdowns[min(self.slowdowns, key=lambda p: (abs(p - busy), p))])
        return max(1.0, busy / self.cores) if self.cores else 1.0

    def link(self, ranks, world: int) -> Machine:
        """The alpha-beta-gamma of a group of ``ranks`` (of ``world``): the node's link if they share a node. On a
        :attr:`cluster`, a group that spans nodes takes its link's latency and bandwidth, and this machine's rate of
        reducing (the sums are made by its cores, busy with every rank)."""
        spans = len({self.node_of(r) for r in ranks}) > 1
        if self.loaded:  # this machine, measured with p ranks at once (they share its cores and its memory bus): the
            busy = self.ranks_sharing(world)  # nearest p; emulated nodes on it share its one link too (but a cluster's)
            here = self.loaded[min(self.loaded, key=lambda p: (abs(p - busy), p))]
            return dataclasses.replace(here, alpha=self.inter.alpha, beta=self.inter.beta) if spans and self.cluster \
                else here  # fmt: skip
        return self.inter if spans else self.intra

    # --- compute ----------------------------------------------------------------------------------------------------
    def layers_time(self, layers, rows: int, itemsize: int) -> float:
        """Seconds of one micro-batch's forward and backward through ``layers`` ((a, b) weight shapes) on ``rows``
        rows, on a core of its own (the caller multiplies by :meth:`slowdown`): the arithmetic, the fixed cost of
        each layer, and :data:`WEIGHT_PASSES` passes over its weights, which every micro-batch pays again. On an
        :attr:`asynchronous` device the fixed costs (the host's) and the rest (the device's) overlap: the longer."""
        if self.asynchronous:
            device = sum(6 * rows * a * b / self.flops + WEIGHT_PASSES * a * b * itemsize / self.memory_bandwidth
                         for a, b in layers)  # fmt: skip
            return max(len(layers) * self.layer_s, device)
        return sum(6 * rows * a * b / self.flops + self.layer_s + WEIGHT_PASSES * a * b * itemsize /
                   self.memory_bandwidth for a, b in layers)  # fmt: skip

    def update_time(self, parameters: float, itemsize: int, buffers: int) -> float:
        """Seconds of the rest of a step on a core of its own: the optimizer's update of ``parameters`` with
        ``buffers`` buffers each, and the step's own overhead."""
        return self.step_s + (3 + 2 * buffers) * parameters * itemsize / self.memory_bandwidth

    # --- communication ----------------------------------------------------------------------------------------------
    def allreduce(self, algorithm: str, nbytes: float, ranks, world: int, ranks_per_node=None) -> float:
        """Seconds of an all-reduce of ``nbytes`` over ``ranks``; hierarchical ones cross nodes of
        ``ranks_per_node`` (emulated nodes on one machine are priced on its one link)."""
        ranks = list(ranks)
        p, machine = len(ranks), self.link(ranks, world)
        if algorithm in ("hierarchical", "hierarchical_rs", "hierarchical_shm"):
            machine = self.link(ranks[:1], world)  # (inside a node)
            k = ranks_per_node or self.ranks_per_node
            inter = self.link([0, k], world) if k and k < p else machine  # (ranks 0 and k: on different nodes)
            if self.cluster and algorithm == "hierarchical_rs" and k and k < p:  # its k rings, one per local rank,
                inter = dataclasses.replace(inter, beta=k * inter.beta)  # cross the node's one link at once
            return costmodel.predict_time(algorithm, nbytes, p, machine, k, inter)
        if algorithm == "auto":
            algorithm = costmodel.choose(nbytes, p, machine)
        if self.cluster and algorithm in STEPS_INSIDE_AND_ACROSS and self._one_link_a_node(p, world):
            return self._across_one_link(algorithm, nbytes, p, world)
        return costmodel.predict_time(algorithm, nbytes, p, machine)

    def _one_link_a_node(self, p: int, world: int) -> bool:
        """Whether an all-reduce over ranks 0 .. p-1 spans a cluster's nodes evenly, both p and its ranks a node
        powers of two (where :meth:`_across_one_link` can say which steps cross)."""
        k = self.ranks_per_node
        return p == world and bool(k) and 1 < k < p and p % k == 0 and not (p & (p - 1)) and not (k & (k - 1))

    def _across_one_link(self, algorithm: str, nbytes: float, p: int, world: int) -> float:
        """Recursive doubling and Rabenseifner on a :attr:`cluster`, whose nodes have one link each (not one a
        rank, as a DGX's GPUs have): their steps at distances under the k ranks a node stay inside it; at distance
        k and beyond every rank of a node crosses at once, k flows sharing the node's link (each at 1/k of its rate).
        Doubling: log2 k steps inside, then doubling over the nodes with k flows. Rabenseifner: its halving's first
        log2(p/k) steps (n/2, n/4 ... n k/p bytes) and the gathering's last cross, as Rabenseifner over the nodes on
        n does; the rest is Rabenseifner inside a node on n k/p. The binomial tree: its steps at distance k and
        beyond are between the nodes' first ranks (one flow a node), the others inside. "mpi": the best of those, the
        ring (one flow a node) and the hierarchical one (MPICH's collectives know the nodes: its all-reduce reduces
        inside each node first)."""
        k = self.ranks_per_node
        nodes, inside = p // k, self.link([0], world)
        crossing = dataclasses.replace(self.link([0, k], world), beta=k * self.link([0, k], world).beta)
        if algorithm == "doubling":
            return (costmodel.predict_time("doubling", nbytes, k, inside)
                    + costmodel.predict_time("doubling", nbytes, nodes, crossing))  # fmt: skip
        if algorithm == "rabenseifner":
            return (costmodel.predict_time("rabenseifner", nbytes * k / p, k, inside)
                    + costmodel.predict_time("rabenseifner", nbytes, nodes, crossing))  # fmt: skip
        if algorithm == "tree":
            return (costmodel.predict_time("tree", nbytes, k, inside)
                    + costmodel.predict_time("tree", nbytes, nodes, self.link([0, k], world)))  # fmt: skip
        candidates = ("doubling", "rabenseifner", "ring", "hierarchical")
        return min(self.allreduce(a, nbytes, range(p), world) for a in candidates)

    def collective(self, collective: str, algorithm: str, nbytes: float, ranks, world: int) -> float:
        """Seconds of a reduce-scatter, all-gather, reduce or broadcast of an ``nbytes`` buffer over ``ranks``: the
        all-reduce's formulas halved (a ring all-reduce is a reduce-scatter then an all-gather; a tree all-reduce a
        reduce then a broadcast), the reduction priced only where there is one."""
        ranks = list(ranks)
        p, m = len(ranks), self.link(ranks, world)
        if p == 1 or nbytes == 0:
            return 0.0
        reduces = collective in ("reduce_scatter", "reduce")
        if algorithm in ("ring", "rabenseifner", "doubling"):  # (p-1) or log p steps of 1/p of the buffer
            steps = p - 1 if algorithm == "ring" else math.ceil(math.log2(p))
            share = (p - 1) / p * nbytes
        elif algorithm == "tree":
            steps, share = math.ceil(math.log2(p)), math.ceil(math.log2(p)) * nbytes
        elif algorithm == "naive":
            steps, share = p - 1, (p - 1) * nbytes
        elif algorithm == "shm":  # no message: two fences and the copies (shm.py's price; these buffers copy in)
            return shm.predict_time(collective, nbytes, p, m, copy_in=True)
        else:
            raise ValueError(f"no time model for {collective} with {algorithm!r}")
        return steps * m.alpha + share * m.beta + (share * m.gamma if reduces else 0.0)

    def message(self, nbytes: float, source: int, dest: int, world: int) -> float:
        """Seconds of one message of ``nbytes`` from rank ``source`` to rank ``dest``."""
        m = self.link([source, dest], world)
        return m.alpha + nbytes * m.beta

    # --- presets ------------------------------------------------------------------------------------------------------
    @classmethod
    def this(cls, calibration=costmodel.CALIBRATION) -> Hardware:
        """This machine: calibration.json's links and compute rates, its cores and its memory."""
        data = json.loads(Path(calibration).read_text()) if Path(calibration).exists() else {}
        idle = Machine.load(calibration)
        loaded, slowdowns = {}, {}
        for p, measured in data.get("by_ranks", {}).items():  # dtrain's own messages' latency where it was measured
            link = Machine.load(calibration, p=int(p))
            loaded[int(p)] = dataclasses.replace(link, alpha=measured.get("alpha_dtrain", link.alpha))
            if "slowdown" in measured:
                slowdowns[int(p)] = measured["slowdown"]
        compute = data.get("compute") or DEFAULT_COMPUTE
        cores = usable_cores()
        return cls(name=THIS, flops=compute["flops"], layer_s=compute["layer_s"], step_s=compute["step_s"],
                   memory_bandwidth=compute["memory_bandwidth"], memory=_memory_bytes(), intra=idle, inter=idle,
                   cores=cores, hidden=0.0, loaded=loaded, slowdowns=slowdowns,
                   about=f"this machine: {cores} cores, {_memory_bytes() / GIB:.0f} GiB, links and compute rates "
                   f"from {Path(calibration).name}" + (f" of {compute['date']}" if compute.get("date") else "")
                   + ("" if data.get("compute") else " (compute: defaults; run scripts/calibrate.py --compute)"),
                   )  # fmt: skip

    def per_rank_memory(self, world: int) -> float:
        """Bytes each rank may use: the node's memory shared by its ranks where they share it (CPUs)."""
        return self.memory / self.ranks_sharing(world) if self.cores else self.memory


# Rough rates for one CPU core driven from Python, used when calibration.json has no "compute" entry.
DEFAULT_COMPUTE = {"flops": 2e10, "layer_s": 5e-5, "step_s": 1e-4, "memory_bandwidth": 5e9}


def _memory_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16.0 * GIB


def presets() -> dict[str, dict]:
    """hardware.json's presets (and ``this``), by name."""
    return {THIS: {"about": "this machine, as calibrated"}, **json.loads(PRESETS.read_text())["presets"]}


def load(name: str, dtype: str = "float32") -> Hardware:
    """The preset ``name`` for ``dtype`` arithmetic, or a :class:`ConfigError` listing the presets."""
    if name == THIS:
        return Hardware.this()
    known = presets()
    if name not in known:
        raise ConfigError(f"--machine {name!r} is not a preset: choose one of {', '.join(known)}")
    p = known[name]
    flops = p["flops"].get(dtype)
    if flops is None:
        raise ConfigError(f"--machine {name} gives no {dtype} rate: use --dtype {' or '.join(p['flops'])}")
    link = {key: Machine(p[key]["alpha"], 1.0 / p[key]["bandwidth"], p[key]["gamma"]) for key in ("intra", "inter")}
    return Hardware(name=name, flops=flops * p["efficiency"], layer_s=p["layer_s"], step_s=p["step_s"],
                    memory_bandwidth=p["memory_bandwidth"], memory=p["memory"], ranks_per_node=p["ranks_per_node"],
                    cores=p.get("devices_per_node"), asynchronous=p.get("asynchronous", False),
                    hidden=p.get("hidden", 1.0), about=p["about"], **link)  # fmt: skip


# The preset of a GPU machine measured by dtrain itself (scripts/calibrate.py --gpu): what --device gpu plans on when
# no --machine is named, and what the tour's GPU runs are predicted on.
GPU_MEASURED = "lent-h100"


def for_device(device: str, dtype: str = "float32") -> Hardware:
    """The machine a plan for ``device`` uses when none is named: this one (its CPU calibration) for "cpu", the
    measured GPU preset (:data:`GPU_MEASURED`) for "gpu"."""
    return load(THIS if device == "cpu" else GPU_MEASURED, dtype)


# --- measuring this machine's compute ------------------------------------------------------------------------------
# (sizes, rows, micro-batches): small and wide, shallow and deep, few rows and many, one micro-batch and several, so
# that the fit can tell the four rates apart
SHAPES = [((64, 64, 10), 8, 1), ((64, 64, 64, 64, 64, 64, 64, 10), 8, 1), ((64, 64, 64, 64, 10), 96, 1),
          ((64, 64, 64, 64, 10), 96, 4), ((784, 512, 512, 10), 16, 1), ((784, 512, 512, 10), 256, 1),
          ((784, 512, 512, 10), 256, 8), ((784, 2048, 2048, 10), 8, 1), ((784, 1024, 1024, 1024, 10), 128, 1),
          ((784, 1024, 1024, 1024, 10), 128, 8), ((2048, 2048, 10), 512, 1)]  # fmt: skip
# a GPU needs big products before their arithmetic shows beside the launches' fixed costs; below HOST_BOUND_FLOP a
# step's arithmetic takes a fraction of its kernel launches' time (well under 0.1 ms at tens of TFLOP/s)
HOST_BOUND_FLOP = 2e9
GPU_SHAPES = [*SHAPES, ((784, 4096, 4096, 10), 1024, 1), ((784, 8192, 8192, 10), 512, 1),
              ((784, 4096, 4096, 10), 1024, 4)]  # fmt: skip


def step_seconds(
    sizes, rows: int, optimizer: str = "sgd", steps: int = 20, accumulate: int = 1, device: str = "cpu"
) -> float:
    """Seconds per step of ``dtrain train --paradigm single`` on synthetic data for the MLP ``sizes`` with a batch of
    ``rows``: the driver's whole step (the batch's slicing, forward, backward, the update, the loop's bookkeeping),
    over the second of two epochs of ``steps`` steps (the first warms the caches and the allocator; on a GPU, the
    epoch's time ends when its last losses have been read back, so its kernels have all run)."""
    from dtrain.comm import sim
    from dtrain.config import TrainConfig
    from dtrain.train import train

    config = TrainConfig(paradigm="single", dataset="synthetic", features=sizes[0], classes=sizes[-1],
                         hidden=tuple(sizes[1:-1]), batch_size=rows, samples=-(-rows * steps * 5 // 4), epochs=2,
                         optimizer=optimizer, accumulate=accumulate, device=device, quiet=True, progress=False,
                         timeout=0)  # fmt: skip
    metrics = train(config, sim.solo())
    return metrics["epochs"][-1]["train_time_s"] / steps


def measure_compute(shapes=SHAPES, device: str = "cpu") -> dict:
    """Fit ``flops``, ``layer_s``, ``step_s`` and ``memory_bandwidth`` to dtrain's own steps on this process (run it
    with one BLAS thread, as a rank runs), least squares on relative error; and each shape's measured and fitted
    seconds. ``device="gpu"`` (pass :data:`GPU_SHAPES`): the steps on the GPU, fitted to the asynchronous model
    (:meth:`Hardware.layers_time`, :func:`asynchronous_seconds`): the fixed costs on the shapes whose arithmetic is
    negligible (under :data:`HOST_BOUND_FLOP`), the memory bandwidth from a copy on the device
    (:func:`device_memory_bandwidth`), then the arithmetic rate on the shapes of one micro-batch, by a search over
    a grid (the model is a maximum, not a sum: no linear fit)."""
    from dtrain.layout import parameter_count

    rounds = [[step_seconds(sizes, rows, accumulate=m, device=device) for sizes, rows, m in shapes]  # (a busy
              for _ in range(3)]  # fmt: skip
    seconds = [float(np.median(times)) for times in zip(*rounds)]  # (moment is one round's, not a shape's)
    rows_of = []  # per shape: products, layers, micro-batches, weights, parameters
    for sizes, rows, m in shapes:
        layers = list(itertools.pairwise(sizes))
        products, weights = sum(6 * rows * a * b for a, b in layers), sum(a * b for a, b in layers)
        rows_of.append([products, len(layers), m, weights, parameter_count(sizes)])
    f, t = np.array(rows_of, dtype=float), np.array(seconds)
    products, layers, m, weights, parameters = f.T
    moved = (5 * parameters + WEIGHT_PASSES * m * weights) * 4  # SGD with momentum: k = 1; float32
    if device == "gpu":
        small = products < HOST_BOUND_FLOP
        host = np.stack([layers * m, np.ones_like(t)], axis=1)[small]
        (layer_s, step_s), *_ = np.linalg.lstsq(host / t[small, None], np.ones(small.sum()), rcond=None)
        layer_s, step_s = max(float(layer_s), 0.0), max(float(step_s), 0.0)  # (a cost the data cannot see is none)
        bandwidth = device_memory_bandwidth()  # (measured apart: the fit would lend it costs the model leaves out)
        grid = np.logspace(11, 16, 401)[:, None]  # FLOP/s, 80 points a decade
        whole = m == 1  # (a micro-batch's own fixed costs, its loss's, are not in the model either)
        model = asynchronous_seconds(f[whole], grid, layer_s, step_s, bandwidth)  # (rates, shapes)
        best = float(grid[np.argmin((np.log(model / t[whole]) ** 2).sum(axis=1)), 0])
        coef = [1.0 / best, layer_s, step_s, 1.0 / bandwidth]
        fitted = asynchronous_seconds(f, best, layer_s, step_s, bandwidth)
    else:
        a = np.stack([products, layers * m, np.ones_like(t), moved], axis=1)
        coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
        coef = np.maximum(coef, 1e-13)  # (a rate the data cannot see is fast, not negative)
        fitted = a @ coef
    return {"flops": 1.0 / coef[0], "layer_s": float(coef[1]), "step_s": float(coef[2]),
            "memory_bandwidth": 1.0 / coef[3],
            "shapes": [{"sizes": list(s), "rows": r, "microbatches": m, "seconds": t, "fitted": float(x)}
                       for (s, r, m), t, x in zip(shapes, seconds, fitted)]}  # fmt: skip


def device_memory_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes per second the current GPU reads and writes in a device-to-device copy of ``nbytes`` (both counted), the
    median of ``reps`` copies timed with CUDA events."""
    import cupy

    src, dst = cupy.ones(nbytes // 4, dtype=np.float32), cupy.empty(nbytes // 4, dtype=np.float32)
    dst[...] = src
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        dst[...] = src
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * nbytes / float(np.median(times))


def asynchronous_seconds(shapes, flops, layer_s: float, step_s: float, memory_bandwidth):
    """A step's seconds on an asynchronous device, for :func:`measure_compute`'s ``shapes`` (rows of products,
    layers, micro-batches, weights, parameters; float32, SGD with momentum): each micro-batch the longer of its
    layers' fixed costs and its arithmetic and weight passes, then the step's fixed cost and the update's traffic,
    as :meth:`Hardware.layers_time` and :meth:`Hardware.update_time` price it. ``flops`` and ``memory_bandwidth``
    may be columns, for many rates at once."""
    products, layers, m, weights, parameters = np.asarray(shapes, dtype=float).T
    device = products / m / flops + WEIGHT_PASSES * weights * 4 / memory_bandwidth
    return m * np.maximum(layers * layer_s, device) + step_s + 5 * parameters * 4 / memory_bandwidth
