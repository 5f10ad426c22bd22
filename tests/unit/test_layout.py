"""The package's layout: subpackages by role, imports flowing one way, modules of a readable size
(docs/how-it-works.md, Layout). Every import counts: at module level, inside functions and under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "unbroken"
BASE = {"unbroken.errors", "unbroken.store_keys", "unbroken.open_files", "unbroken.parent_death", "unbroken.version"}
"""Top-level modules every package may import (never ``unbroken`` itself: it names every package)."""
MAY_IMPORT = {
    "observe": set(),
    "data": {"observe"},
    "replica_groups": {"observe", "data"},
    "storage": {"observe", "data", "replica_groups"},
    "coordinator": {"observe"},
    "worker": {"observe", "data", "replica_groups", "storage", "coordinator"},
    "launch": {"observe", "data", "replica_groups", "storage", "coordinator", "worker"},
    "integrations": {"observe", "data", "replica_groups", "storage", "coordinator", "worker"},
}
LONGEST = 400
TOO_LONG_FOR_NOW: set[str] = set()
"""Modules still above ``LONGEST`` lines, to be split; the list may only shrink."""


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> set[str]:
    """The ``unbroken...`` modules (or names) a file imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "unbroken"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "unbroken":
            found |= {f"{node.module}.{a.name}" for a in node.names} if node.module == "unbroken" else {node.module}
    return found


def _package(name: str) -> str | None:
    """The subpackage a dotted name is in, or None for the top level."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_one_way(path):
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) == 1:
        return  # the top level: the command line and the public names reach everything
    own = relative.parts[0]
    allowed = MAY_IMPORT[own] | {own}
    base = BASE | ({"unbroken"} if own in ("launch", "integrations") else set())  # the demo: a script on the public names
    wrong = sorted(n for n in _imports(path) if n not in base and _package(n) not in allowed and _package(n) is not None)
    wrong += sorted(n for n in _imports(path) if _package(n) is None and n not in base)
    assert not wrong, f"{relative} ({own}) may import {sorted(allowed)} and the top level's base, not {wrong}"


def test_each_package_says_what_it_owns_and_what_it_may_import():
    for own in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((PACKAGE / own / "__init__.py").read_text())) or ""
        assert "import" in doc.lower() and len(doc) > 80, f"unbroken/{own}/__init__.py: say what it owns and may import"


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE)) for p in _modules() if len(p.read_text().splitlines()) > LONGEST}
    assert long <= TOO_LONG_FOR_NOW, f"above {LONGEST} lines: {sorted(long - TOO_LONG_FOR_NOW)}; split them"
    assert TOO_LONG_FOR_NOW <= long, f"now short enough, take them off the list: {sorted(TOO_LONG_FOR_NOW - long)}"


def test_the_former_module_paths_import_the_same_modules_with_a_warning():
    import subprocess
    import sys

    code = (
        "import warnings, importlib\n"
        "from unbroken._moved import MOVED\n"
        "for old, new in MOVED.items():\n"
        "    if old == 'demo_train': continue  # a script: importing it trains\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module('unbroken.' + old)\n"
        "    assert module is importlib.import_module('unbroken.' + new), old\n"
        "    assert module.__name__ == module.__spec__.name == 'unbroken.' + new, old\n"
        "    assert any(w.category is DeprecationWarning and 'unbroken.' + new in str(w.message) for w in seen), old\n"
        "from unbroken.coordinator import Coordinator, CoordinatorSettings\n"
        "from unbroken.replica_groups import sum_gradients, process_micro_batches\n"
        "from unbroken.devices import local_device\n"
        "print(len(MOVED))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 40


def _module_graph() -> dict[str, set[str]]:
    names = {}
    for path in _modules():
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in names}
    for name, path in names.items():
        for target in _imports(path):
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    """Not even under ``TYPE_CHECKING``: the Job's helpers name what they use of it
    (:mod:`unbroken.worker.job_parts`), not the Job."""
    cycles = _cycles(_module_graph())
    assert not cycles, [sorted(c) for c in cycles]


def test_the_public_names_are_exactly_the_ones_exported():
    import unbroken

    assert sorted(unbroken.__all__) == sorted([*unbroken._PUBLIC, "__version__"])
    for name in unbroken._PUBLIC:
        assert getattr(unbroken, name).__name__ == name


def test_the_layout_in_the_docs_names_every_module():
    page = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    named = {m for m in _modules() if f"`{m.relative_to(PACKAGE.parent)}`" in page}
    missing = [str(m.relative_to(PACKAGE.parent)) for m in _modules() if m.name != "__init__.py" and m not in named
               and f"`{m.parent.relative_to(PACKAGE.parent)}/`" not in page]
    assert not missing, f"docs/how-it-works.md's layout does not name {missing}"
