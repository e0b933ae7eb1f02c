"""One process trains the whole model on the whole batch: the reference every other paradigm is compared with.

Nothing to communicate, so nothing to add to :class:`~dtrain.parallel.Paradigm`: forward, backward and an optimizer
step on the full global batch (TensorFlow calls this ``OneDeviceStrategy``). It refuses to run on more than one
rank, where each rank would silently train its own copy.

**Cost**: 0 bytes sent; each rank holds the parameters, the gradients and the optimizer state (momentum: one more
copy of the parameters, Adam: two).
"""

from __future__ import annotations

from dtrain.errors import ConfigError
from dtrain.parallel import Paradigm, register


@register
class Single(Paradigm):
    name = "single"
    summary = "one process"
    order = 1  # where it comes in listings (--help, the planner): the course teaches it then

    @classmethod
    def check(cls, config, world: int) -> None:
        if world != 1:
            raise ConfigError(
                f"--paradigm single trains on one rank, but {world} were launched; "
                f"run without mpiexec or choose a distributed paradigm (ddp)"
            )
        super().check(config, world)

    # === the price: what a step sends and holds (costs, held against the tracer), and what the planner asks ===
    @classmethod
    def configurations(cls, world: int, config, hardware) -> list[tuple[str, dict, int]]:
        return [("single (1 rank)", {}, 1)]  # one rank, however many there are: "should we distribute at all?"
