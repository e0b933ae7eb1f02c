"""The registry of paradigms: which ``--paradigm`` names exist, their classes, their flags.

A paradigm registers itself (``@register`` on its class) when its module is imported; the registry imports every
module of :mod:`dtrain.parallel`, and those named by ``$DTRAIN_PARADIGMS``, the first time it is asked, so the
registry is the list of files and adding a paradigm is one new file.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil

from dtrain.errors import ConfigError
from dtrain.parallel.flags import Flag

PACKAGE = "dtrain.parallel"
_REGISTRY: dict[str, type] = {}
# Modules outside this package that register paradigms too (a course exercise, an experiment): their import names,
# separated by commas, as PYTHONPATH finds them.
MODULES_VAR = "DTRAIN_PARADIGMS"


def register(cls: type) -> type:
    """Class decorator: make ``cls`` available as ``--paradigm cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    """The registered paradigms, in their own order (each class's ``order``: the course's)."""
    return tuple(_registry())


def get(name: str) -> type:
    """The paradigm class registered as ``name``, or a :class:`ConfigError` listing the choices."""
    registry = _registry()
    if name not in registry:
        raise ConfigError(f"--paradigm {name!r} is not one of: {', '.join(registry)}")
    return registry[name]


def all_flags() -> dict[str, Flag]:
    """Every registered paradigm's flags, by name (a flag several paradigms read is there once)."""
    return _flags_of(tuple(_registry().values()))


@functools.cache
def _flags_of(kinds: tuple) -> dict[str, Flag]:
    return {flag.name: flag for kind in kinds for flag in kind.flags}


def readers(flag: str) -> list[str]:
    """The paradigms that read ``flag`` (a name), in their order."""
    return [name for name, kind in _registry().items() if any(f.name == flag for f in kind.flags)]


def _registry() -> dict[str, type]:
    """Import every module of this package once, and those named by ``$DTRAIN_PARADIGMS``, so each paradigm
    registers itself: the registry is the list of files. Sorted by each paradigm's own ``order`` (added ones, with
    the base class's infinite order, last)."""
    return _imported(os.environ.get(MODULES_VAR, ""), tuple(_REGISTRY.items()))


@functools.lru_cache(maxsize=16)
def _imported(modules_var: str, registered: tuple) -> dict[str, type]:
    """:func:`_registry` for one value of ``$DTRAIN_PARADIGMS`` and of what is registered (it is asked for on every
    flag a config reads: the imports are looked at again only when either changed)."""
    added = [name.strip() for name in modules_var.split(",") if name.strip()]
    for module in _package_modules() + added:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if module not in added or exc.name != module:
                raise
            raise ConfigError(f"{MODULES_VAR} names {module!r}, which Python cannot find (is its folder on "
                              "PYTHONPATH?)") from None  # fmt: skip
    return _sorted(tuple(_REGISTRY.items()))


@functools.cache
def _package_modules() -> list[str]:
    package = importlib.import_module(PACKAGE)
    return [f"{PACKAGE}.{module.name}" for module in pkgutil.iter_modules(package.__path__)]


@functools.cache
def _sorted(registered: tuple) -> dict[str, type]:
    order = [name for name, _kind in registered]
    return dict(sorted(registered, key=lambda item: (item[1].order, order.index(item[0]))))
