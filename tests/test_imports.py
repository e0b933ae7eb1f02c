"""The house has floors: no two modules of ``dtrain/`` import each other, however indirectly (shared/DESIGN.md).

The graph is built from the source (``ast``), not by importing anything, so a cycle that Python happens to survive
(an import inside a function, under ``TYPE_CHECKING``) is found too. The rules:

* every ``import`` and ``from ... import`` anywhere in a module counts: at module level, inside functions and
  classes, under ``if TYPE_CHECKING``;
* a package's ``__init__.py`` is a module of its own (``dtrain.parallel``);
* ``from pkg import name`` is an edge to ``pkg/__init__`` unless ``name`` is a submodule of ``pkg`` (then the edge
  goes to that submodule, and ``pkg/__init__`` runs first, but that is Python's business, not a dependency);
* importing ``pkg.sub`` depends on ``pkg.sub`` (Python runs ``pkg/__init__`` first, but it is not a dependency);
* ``importlib`` calls are the registry's business and not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def resolve(module: str, level: int, here: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in module ``here``."""
    if level == 0:
        return module
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``dtrain`` that module ``name`` imports, anywhere in its source."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node.module or "", node.level, name, is_package)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    return {target for target in found if target in known and target != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: edges(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_dtrain_imports_itself_through_others():
    found = cycles(graph())
    described = ["; ".join(f"{a} -> {', '.join(sorted(graph()[a] & set(c)))}" for a in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


@pytest.mark.parametrize(
    ("sources", "expected"),
    [({"a": "from dtrain import b\n", "b": "def f():\n    import dtrain.a\n"}, [["dtrain.a", "dtrain.b"]]),
     ({"a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtrain.b import x\n",
       "b": "from dtrain.a import y\n"}, [["dtrain.a", "dtrain.b"]]),
     ({"a": "from dtrain.b import x\n", "b": "import importlib\nimportlib.import_module('dtrain.a')\n"}, [])],
    ids=["inside-a-function", "type-checking", "importlib-is-no-edge"],
)  # fmt: skip
def test_the_graph_sees_every_kind_of_import(tmp_path, monkeypatch, sources, expected):
    """The checker itself can fail: a cycle through a function's import or TYPE_CHECKING is found."""
    package = tmp_path / "dtrain"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in sources.items():
        (package / f"{name}.py").write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", package)
    assert cycles(graph()) == expected


def test_a_package_init_is_a_module_of_its_own(tmp_path, monkeypatch):
    """``from pkg import name`` (not a submodule) depends on pkg/__init__; ``from pkg import sub`` on pkg.sub."""
    package = tmp_path / "dtrain"
    (package / "pkg").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pkg" / "__init__.py").write_text("from dtrain.pkg.sub import thing\n")
    (package / "pkg" / "sub.py").write_text("from dtrain.pkg import other\n")  # other: a name of pkg/__init__
    (package / "pkg" / "leaf.py").write_text("from dtrain.pkg import sub\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", package)
    g = graph()
    assert g["dtrain.pkg.leaf"] == {"dtrain.pkg.sub"} and g["dtrain.pkg.sub"] == {"dtrain.pkg"}
    assert cycles(g) == [["dtrain.pkg", "dtrain.pkg.sub"]]
