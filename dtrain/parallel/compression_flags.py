"""``ddp --compress``'s flags, and the combinations of flags it refuses (:mod:`dtrain.parallel.compression` is the
algorithm: what each compressor sends, keeps and costs).

A compressor exchanges the whole gradient after backward through dtrain's own ring, so it refuses what would change
that (another ``--allreduce``, nodes, ``--overlap``, buckets) before any message, and, once the model exists, a
PowerSGD rank larger than a weight matrix's smaller side.
"""

from __future__ import annotations

from dtrain.errors import ConfigError
from dtrain.parallel.flags import Flag

NAMES = ("none", "fp16", "bf16", "topk", "powersgd")
COMPRESS = Flag("compress", "none", "send a compressed gradient: fp16 or bf16 (half the bytes), topk (the "
                "--compress-ratio largest entries, error feedback), powersgd (rank --powersgd-rank factors, error "
                "feedback); none: the whole gradient", choices=NAMES)  # fmt: skip
RATIO = Flag("compress_ratio", 0.01, "top-k: the fraction of the gradient's entries a rank sends (0 < ratio <= 1)",
             type=float, metavar="K/N")  # fmt: skip
RANK = Flag("powersgd_rank", 2, "PowerSGD: the rank of each weight matrix's factors (<= its smaller side)", type=int,
            metavar="R", at_least=1)  # fmt: skip
FEEDBACK = Flag("compress_feedback", "on", "top-k and PowerSGD: carry what a step did not send into the next (on), "
                "or drop it (off: to see why error feedback is needed)", choices=("on", "off"))  # fmt: skip
FLAGS = (COMPRESS, RATIO, RANK, FEEDBACK)


def check(config, shapes=None) -> None:
    """Refuse what cannot run, before any message; ``shapes`` (the model's parameter shapes, once it exists) for the
    PowerSGD rank against each weight matrix."""
    if config.compress == "none":
        return
    if not 0 < config.compress_ratio <= 1:
        raise ConfigError(f"--compress-ratio must be in (0, 1] (the fraction of entries a rank sends), got "
                          f"{config.compress_ratio}")  # fmt: skip
    if config.compress == "powersgd" and shapes is not None:
        sides = [min(s) for s in shapes if len(s) == 2]
        if sides and config.powersgd_rank > min(sides):
            raise ConfigError(f"--powersgd-rank {config.powersgd_rank} is larger than the smaller side of a weight "
                              f"matrix ({min(sides)}): use --powersgd-rank {min(sides)} or less")  # fmt: skip
    if shapes is None and config.allreduce not in ("auto", "ring"):
        raise ConfigError(f"--compress {config.compress} exchanges through dtrain's ring (its own messages): drop "
                          f"--allreduce {config.allreduce}")  # fmt: skip
    if shapes is None and config.ranks_per_node is not None:
        raise ConfigError(f"--compress {config.compress} uses no nodes (the ring): drop --ranks-per-node")
    if shapes is None and config.overlap:
        raise ConfigError(f"--compress {config.compress} exchanges the whole gradient after backward: drop --overlap")
    if shapes is None and config.bucket_mb:
        raise ConfigError(f"--compress {config.compress} exchanges the whole gradient at once: drop --bucket-mb")
