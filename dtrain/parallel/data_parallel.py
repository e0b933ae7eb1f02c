"""Synchronous data parallelism (PyTorch's DistributedDataParallel, TensorFlow's MirroredStrategy).

Every rank holds the whole model. Each step, every rank takes its own slice of the global batch, computes the
gradient of its slice's mean loss, and the ranks *average* those gradients with an all-reduce; every rank then takes
the same optimizer step from the same weights, so the replicas never drift apart::

      global batch of B samples, N ranks: rank r gets samples [r B/N, (r+1) B/N)

      rank 0: forward/backward on slice 0 --> g0 --+                       +--> step --> w'   (identical on
      rank 1: forward/backward on slice 1 --> g1 --+-- all-reduce (avg) ---+--> step --> w'    every rank)
      rank 2: forward/backward on slice 2 --> g2 --+   g = (g0+g1+g2)/N    +--> step --> w'

**Why the average is the big batch's gradient.** The loss of the global batch is the mean of its B per-sample
losses; with equal slices that is the mean over ranks of each slice's mean, and the gradient of a mean is the mean of
the gradients. So N ranks with global batch B follow, up to floating-point rounding, the trajectory of one process
with batch B (tests/test_data_parallel.py holds them to ~1e-12 in float64).

**Buckets, and overlapping them with backward.** Backward produces gradients last layer first. Instead of one
all-reduce of the whole flat gradient after backward, the flat buffer is cut into *buckets* (``--bucket-mb``; slices
of ``model.flat_grads`` in reverse layer order, never splitting a parameter). A bucket's all-reduce starts the moment
the gradient-ready hooks (:mod:`dtrain.autograd`) say its last parameter is complete, while backward goes on with the
earlier layers::

    backward:  [ layer 3 ][ layer 2 ][ layer 1 ][ layer 0 ] | wait
    bucket 0:             [===== ring =====]                |           (layers 3-2)
    bucket 1:                                  [==== ring ===]==]       (layers 1-0)

*How an all-reduce runs "in the background" here* (buckets.py, PyTorch's "reducer"): without a second thread per
rank, which would fight backward for a small machine's cores and break the simulator's one thread per rank. A
bucket's ring is a *non-blocking* collective, a small state machine that posts one step's ``Isend``/``Irecv`` and
returns; every hook call (between layers) advances every bucket in flight as far as its messages have arrived, and
``average_gradients`` finishes them, as ``MPI_Iallreduce`` progresses in an MPI library without a progress thread.
Buckets start in bucket order on every rank, on a communicator duplicated for gradients alone, each with its own tag,
so messages of different buckets never match each other. Other ``--allreduce`` algorithms run blocking: with
overlap, each bucket as soon as it is ready; without, all after backward.

*Why ``--overlap`` is off by default.* On a CPU it is slower (docs/benchmarks.md has the measurements): MPI
moves a large message only while the ranks are inside MPI calls, so a bucket in flight mostly waits for the next hook;
the ring it needs costs 2(p-1) latencies per bucket; and the bytes are copied by the same cores that compute backward.
Overlap pays where something else moves the bytes (a GPU's copy engines and NCCL, a NIC with RDMA). Without it,
the default is one bucket: one all-reduce of the whole gradient after backward, the fewest latencies.

**Parameters the loss does not use** never fire their hook, so their bucket would never start (PyTorch's
``find_unused_parameters`` problem). Here ``average_gradients`` starts every bucket not yet started, in order: their
gradients are zero on the ranks that did not use them, and the average is what it should be.

**Gradient accumulation** (``--accumulate k``, DDP's ``no_sync``): the first k-1 micro-batches only accumulate
gradients; the hooks start buckets on the last one alone, so communication is paid once per step.

**Sending fewer bytes** (``--compress fp16|bf16|topk|powersgd``): instead of the buckets' all-reduce, a compressor
(:mod:`dtrain.parallel.compression`) exchanges a smaller form of the whole gradient after backward, and every rank
ends with the same approximate average: half precision, the k largest entries, or low-rank factors, the last two
with error feedback. Its bytes and the state it keeps are in :meth:`DataParallel.costs`.

**Replicas stay identical** because they start identical (rank 0's weights are broadcast before the first step) and
take identical steps. This is checked, not assumed: at the end of training every rank's weights digest is compared
(with ``DTRAIN_DEBUG=1`` also every ``CHECK_EVERY`` steps); a difference is an error naming the ranks.

**Cost per step** (n bytes of gradients in buckets n_1 + ... + n_m, p ranks, ring): each rank sends
``sum_i 2 (p-1)/p n_i ~= 2 (p-1)/p n`` bytes in ``2 (p-1) m`` messages, whatever the bucket size: buckets buy overlap
with m times the latency. Exact bytes per rank: :meth:`DataParallel.costs` (from ``costmodel.bytes_sent``). Memory
per rank: the whole model, its gradients and the optimizer state, like ``single``; nothing is saved by adding ranks
(that is what ZeRO changes).
"""

from __future__ import annotations

from dtrain import collectives
from dtrain.backend import itemsize
from dtrain.collectives import costmodel, hierarchical, shm, yours
from dtrain.layout import parameter_shapes
from dtrain.parallel import Paradigm, check_replicas, compression, compression_flags, pricing, register, replicas
from dtrain.parallel.buckets import allreduce_algorithm, gradient_buckets, shared_gradients
from dtrain.parallel.flags import ALLREDUCE_OR_YOURS, RANKS_PER_NODE, Flag

CHECK_EVERY = 50  # steps between replica checks under DTRAIN_DEBUG=1


OVERLAP = Flag("overlap", False, "all-reduce each gradient bucket during backward, as soon as it is complete, as "
               "PyTorch DDP does (off by default: on a CPU it measured slower, see docs/benchmarks.md)")  # fmt: skip
BUCKET_MB = Flag("bucket_mb", None, "gradient bucket size in MiB; 0: one all-reduce of the whole gradient (default: 1 "
                 "with --overlap, else 0)", type=float, metavar="MB", at_least=0,
                 meaning="(0: one bucket)")  # fmt: skip


def shm_copies(algorithm, count, itemsize, world, rank, ranks_per_node) -> int:
    """Bytes ``rank`` copies in one zero-copy all-reduce of ``count`` elements: on all ``world`` ranks ("shm"), or
    inside its node of ``ranks_per_node`` (the last one possibly smaller) for "hierarchical_shm"."""
    if algorithm == "shm":
        return shm.bytes_copied("allreduce", count, itemsize, world, rank)
    k = ranks_per_node or world
    return shm.bytes_copied("hierarchical_shm", count, itemsize, hierarchical.node_sizes(world, k)[rank // k], rank % k)


@register
class DataParallel(Paradigm):
    name = "ddp"
    summary = "data parallel, gradients all-reduced every step"
    order = 3  # where it comes in listings (--help, the planner): the course teaches it then
    flags = (ALLREDUCE_OR_YOURS, RANKS_PER_NODE, OVERLAP, BUCKET_MB, *compression_flags.FLAGS)

    @classmethod
    def check(cls, config, world: int) -> None:
        super().check(config, world)
        if yours.is_spec(config.allreduce):  # your own all-reduce: its file loads, and takes (comm, buf)
            yours.entry(config.allreduce)
        compression_flags.check(config)
        replicas.check_nodes(config, world)

    def __init__(self, comm, config):
        super().__init__(comm, config)
        # Gradient traffic gets a communicator of its own: bucket tags can never meet any other message.
        self.grad_comm = comm.Dup()
        self.topology = replicas.nodes(self.grad_comm, config)  # (the hierarchical all-reduces' nodes, or None)
        self.steps = 0

    # --- the model: identical on every rank, and a hook on every parameter --------------------------------
    def build(self, make_model, make_optimizer) -> None:
        self.model = model = make_model()
        if self.config.compress == "none":  # --allreduce shm: the gradients live in a shared window (buckets.py)
            shared_gradients(self.grad_comm, model, self.config, self.topology)
        self.optimizer = make_optimizer(model)
        replicas.start(self.comm, model.flat_params)  # replicas start from rank 0's weights (checked)
        self.reducer = gradient_buckets(self.grad_comm, model, self.config, self.topology)  # buckets.py
        self.algorithm, self.buckets, self.timing = self.reducer.algorithm, self.reducer.slices, self.reducer.timing
        self.overlap = self.config.overlap and self.world > 1
        params = model.parameters()
        if self.overlap:  # backward's gradient-ready hooks start each bucket once it is complete
            for index, p in enumerate(params):
                p.register_hook(lambda _p, index=index: self.reducer.ready(index))
        compression_flags.check(self.config, [p.grad.shape for p in params])  # (every rank alike: the same model)
        self.compressor = compression.make(self.config, self.grad_comm, [p.grad for p in params])

    # --- one step -----------------------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """Forward and backward (with --overlap, each bucket's all-reduce starts inside backward, once its gradients
        are complete), the average of the gradients finished, then the same optimizer step on every rank."""
        loss = self.gradients(x, y)
        self.average_gradients()
        self.optimizer.step()
        self.steps += 1
        if collectives.debug_enabled() and self.steps % CHECK_EVERY == 0:
            self.check_replicas(f"after step {self.steps}")
        return loss

    def before_backward(self, last: bool) -> None:
        if last:  # accumulation (DDP's no_sync): only the last micro-batch's backward starts communication
            self.reducer.arm()

    def average_gradients(self) -> None:
        """Start every bucket not started yet (no overlap, or parameters the loss did not use), in order, and wait for
        all of them: every rank then holds the average of the ranks' gradients."""
        if self.compressor is not None:  # --compress: the compressed exchange instead of the buckets' all-reduce
            self.compressor.exchange(self.model.flat_grads)
        elif self.world > 1:
            self.reducer.finish()

    # --- end of training ----------------------------------------------------------------------------------
    def check_replicas(self, when: str) -> None:
        check_replicas(self.comm, self.model.flat_params, when)

    def finish(self) -> dict:
        self.check_replicas("at the end of training")
        if self.topology is not None:
            self.topology.free()
        self.grad_comm.Free()
        t = self.timing
        return {
            "allreduce": self.algorithm,
            "bucket_bytes": [int(b.nbytes) for b in self.buckets],
            "overlap": self.overlap,
            "compress": self.config.compress,
            **t,
            # of the time buckets were in flight, the part spent while backward was still computing
            "overlap_fraction": t["hidden_s"] / t["in_flight_s"] if t["in_flight_s"] else 0.0,
            **super().finish(),  # held_bytes
        }

    def held_bytes(self) -> dict:
        held = super().held_bytes()
        if self.compressor is not None:  # top-k's residual, PowerSGD's error and Q
            held["compression"] = self.compressor.state_bytes()
        return held

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def costs(cls, sizes, world: int, config) -> dict:
        """Bytes each rank sends per step: one all-reduce per bucket (exact, from the cost model's counts); with
        --compress, the compressor's exchange (:mod:`dtrain.parallel.compression`) and its state."""
        base = super().costs(sizes, world, config)
        if config.compress != "none":
            shapes = parameter_shapes(sizes)
            return {**base, "sent_per_step": [compression.bytes_sent(config, shapes, world, r) for r in range(world)],
                    "compression": compression.state_bytes(config, shapes)}  # fmt: skip
        b, counts = itemsize(config.dtype), pricing.bucket_counts(sizes, config)
        algorithm = allreduce_algorithm(config, world, max(counts) * b)
        if yours.is_spec(algorithm):  # no formula for a function we have not read: only the tracer can say
            return {**base, "sent_per_step": [None] * world, "sent_by": f"your own all-reduce, {algorithm}"}
        sent = [sum(costmodel.bytes_sent(algorithm, n, b, world, rank, config.ranks_per_node) for n in counts)
                for rank in range(world)]  # fmt: skip
        if algorithm in shm.ALGORITHMS:  # each bucket's loads and stores in the shared windows (zero copy)
            copied = [sum(shm_copies(algorithm, n, b, world, rank, config.ranks_per_node) for n in counts)
                      for rank in range(world)]  # fmt: skip
            return {**base, "sent_per_step": sent, "copied_per_step": copied}
        return {**base, "sent_per_step": sent}

    @classmethod
    def updates_like_single(cls, config) -> bool:
        return config.compress == "none"  # (a compressed gradient approximates the average)

    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        """Each all-reduce algorithm (shared memory where every rank is on one node); the ring overlapped with
        backward; the hierarchical ones over the hardware's nodes (this machine: 2 emulated); each compressor
        (fp16, bf16, top-k 1%, PowerSGD rank 2)."""
        chosen = [(f"ddp {a}", {"allreduce": a}, world) for a in ("ring", "tree", "doubling", "rabenseifner", "mpi")]
        chosen.append(("ddp ring, overlapped", {"allreduce": "ring", "overlap": True}, world))
        chosen += [("ddp fp16", {"compress": "fp16"}, world), ("ddp bf16", {"compress": "bf16"}, world),
                   ("ddp topk 1%", {"compress": "topk", "compress_ratio": 0.01}, world),
                   ("ddp powersgd r=2", {"compress": "powersgd", "powersgd_rank": 2}, world)]  # fmt: skip
        if not hardware.ranks_per_node or hardware.ranks_per_node >= world:  # one node: its shared memory
            chosen.append(("ddp shm", {"allreduce": "shm"}, world))
        k = hardware.ranks_per_node or (world // 2 if world >= 4 else None)
        if k and 1 < k < world:
            chosen += [(f"ddp {a} ({-(-world // k)} nodes)", {"allreduce": a, "ranks_per_node": k}, world)
                       for a in ("hierarchical", "hierarchical_rs", "hierarchical_shm")]  # fmt: skip
        return chosen

    @classmethod
    def step_time(cls, sizes, world: int, config, hardware) -> dict:
        """A replica's step, then an all-reduce per bucket (with --overlap, what backward does not hide of them);
        with --compress, the compressor's exchanges (its own arithmetic is not priced)."""
        compute = pricing.replica_compute(cls, sizes, world, config, hardware)
        if config.compress != "none":
            return {"compute": compute, "communication": compression.exchange_time(config, sizes, world, hardware),
                    "bubble": 0.0}  # fmt: skip
        buckets = [n * itemsize(config.dtype) for n in pricing.bucket_counts(sizes, config)]
        algorithm = allreduce_algorithm(config, world, max(buckets))
        algorithm = "ring" if yours.is_spec(algorithm) else algorithm  # (yours: priced as the ring it should be)
        send = [hardware.allreduce(algorithm, n, range(world), world, config.ranks_per_node) for n in buckets]
        hidden = min(sum(send) - send[-1], hardware.hidden * 2 / 3 * compute)  # (backward: 2/3 of the compute)
        exposed = sum(send) - hidden if config.overlap else sum(send)
        return {"compute": compute, "communication": exposed, "bubble": 0.0}
