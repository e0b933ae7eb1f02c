"""Loading a function from a learner's file: ``ring.py:ring_allreduce`` names ``ring_allreduce`` in ``ring.py``.

How a course exercise, or any algorithm of your own, reaches dtrain: ``dtrain exercises check`` loads the function to
grade it, and ``dtrain train --paradigm ddp --allreduce ex/ring.py:ring_allreduce`` trains with it. Whatever is wrong
with the file is one :class:`UserError` that names the file and says what to fix (a missing file, a syntax error and
its line, an exception while the file runs, no such function, the wrong parameters), never a traceback from here.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from pathlib import Path

from dtrain.errors import UserError

SEPARATOR = ":"


def is_spec(text) -> bool:
    """``text`` names a function in a file (``FILE.py:NAME``), not a built-in choice."""
    return isinstance(text, str) and SEPARATOR in text and text.partition(SEPARATOR)[0].endswith(".py")


def split_spec(spec: str) -> tuple[Path, str]:
    """``"dir/ring.py:ring_allreduce"`` -> (Path("dir/ring.py"), "ring_allreduce")."""
    path, _, name = spec.rpartition(SEPARATOR)
    if not path.endswith(".py") or not name.isidentifier():
        raise UserError(f"{spec!r}: expected FILE.py:FUNCTION, e.g. ex/ring.py:ring_allreduce")
    return Path(path), name


def load_function(path, name: str, parameters: tuple[str, ...] | None = None, who: str = ""):
    """The function ``name`` defined in the Python file ``path``, which is run as a module of its own.

    ``parameters``: the names its required parameters must have, in order (the exercise's documented signature).
    ``who`` starts every error message (e.g. "exercise 2.1: ").
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"{who}{path} {what}")
    source = path.read_text()
    try:
        compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise UserError(f"{who}{path} line {exc.lineno}: {exc.msg} (a syntax error: fix it and try again)") from None
    module_name = f"_dtrain_yours_{path.stem}_{abs(hash(str(path.resolve()))):x}"
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # the file may import its neighbours (a hierarchical all-reduce, your own ring)
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # (dataclasses and pickling look their module up here)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        said = f"{type(exc).__name__}: {exc}{where(exc, path)}"
        raise UserError(f"{who}{path} raised {said} while it was loaded") from None
    function = getattr(module, name, None)
    if function is None:
        defined = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name]
        raise UserError(f"{who}{path} defines no {name}() (it defines: {', '.join(defined) or 'no functions'})")
    if not callable(function):
        raise UserError(f"{who}{path}: {name} is a {type(function).__name__}, not a function")
    if parameters is not None:
        check_parameters(function, parameters, f"{who}{path}: ")
    return function


def check_parameters(function, parameters: tuple[str, ...], who: str = "") -> None:
    """``function`` can be called with ``parameters`` positionally, and asks for nothing else."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a built-in: nothing to compare
    required = [p.name for p in signature.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    try:
        signature.bind(*parameters)
    except TypeError:
        ok = False
    else:
        ok = len(required) <= len(parameters)
    if not ok:
        raise UserError(
            f"{who}{function.__name__}({', '.join(signature.parameters)}) has the wrong parameters: the exercise "
            f"calls {function.__name__}({', '.join(parameters)})"
        )


def where(exc: BaseException, path) -> str:
    """ " (ring.py line 12, in ring_allreduce: `comm.Send(...)`)": the deepest frame of ``exc`` in the file ``path``,
    or "" if none is."""
    path = str(Path(path).resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(Path(f.filename).resolve()) == path]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": `{frame.line}`" if frame.line else ""
    return f" ({Path(path).name} line {frame.lineno}, in {frame.name}{code})"
