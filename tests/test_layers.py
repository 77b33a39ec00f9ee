"""The package's layers (docs/architecture.md, "Layout"): no import circle between modules, and no module imports one of
a higher layer, counting every import (module level, inside functions and under ``TYPE_CHECKING``).

Read from the source with :mod:`ast`, so the test sees the imports a run might never execute.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import spark_credit_shuffle

PACKAGE = "spark_credit_shuffle"
ROOT = Path(spark_credit_shuffle.__file__).parent

#: Bottom to top. A module belongs to the layer of its longest matching prefix (a package's name covers
#: its modules). A module may import modules of its own layer (without a circle) and of lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("config", "errors", "metrics", "diagnosis", "_pyspark", "worker"),
    ("partitioners",),
    ("buffers",),
    ("protocol",),
    ("transport",),
    ("engine",),
    ("planner",),
    ("runtime", "simulation"),
    ("web",),
    ("exchange", "dataframe", "input_checks", "arrow_schema", "registry", "plot", "cli", "__main__", "", "jobs"),
]

#: Two drivers of the task engine side by side: neither imports the other, directly or through another module.
SIBLINGS = ("runtime", "simulation")
#: What the clock-free task engine and the sans-IO core may not import: clocks, sockets, event loops, Spark.
#: (A lock is allowed: Flink's BufferBuilder is written by one thread and read by another; starting a thread
#: is not, checked apart.)
IO_MODULES = ("time", "socket", "select", "selectors", "ssl", "asyncio", "pyspark", "py4j")


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the modules outside the package that a source file imports anywhere."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {PACKAGE}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _in(name: str, package: str) -> bool:
    return name == f"{PACKAGE}.{package}" or name.startswith(f"{PACKAGE}.{package}.")


def _layer(name: str) -> int:
    rel = name[len(PACKAGE) + 1 :] if name != PACKAGE else ""
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = rel == prefix or (prefix and rel.startswith(prefix + "."))
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise AssertionError(
            f"module {name} is in no layer of LAYERS: add it to the table (and to docs/architecture.md)"
        )
    return best


@functools.cache  # the sources do not change during a run: read and parse them once for every test here
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_is_in_a_layer():
    for name in _modules():
        _layer(name)


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in _graph().items()
        for target in sorted(targets)
        if _layer(target) > _layer(name)
    ]
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_the_engine_sits_below_both_runtimes_and_the_simulation():
    """docs/architecture.md, "Layout": the task engine is one layer that the Spark runtime and the simulation
    both drive; the planner, which both read, sits between."""
    assert _layer(f"{PACKAGE}.engine") < _layer(f"{PACKAGE}.planner") < _layer(f"{PACKAGE}.runtime")
    assert _layer(f"{PACKAGE}.simulation") == _layer(f"{PACKAGE}.runtime")


def test_simulation_and_runtime_never_import_each_other():
    graph = _graph()
    for name in graph:
        for mine, other in (SIBLINGS, SIBLINGS[::-1]):
            if _in(name, mine):
                reached = sorted(t for t in _reachable(graph, name) if _in(t, other))
                assert not reached, f"{name} reaches {other}: {reached}"


@pytest.mark.parametrize("package", ["engine", "protocol", "buffers", "partitioners"])
def test_the_engine_and_the_core_read_no_clock_and_open_no_socket(package):
    """The engine and the sans-IO core take time as an argument and bytes as values (a virtual clock drives
    them in the simulation): no clock, socket or Spark module is imported anywhere in them, no thread started."""
    for name, path in _modules().items():
        if _in(name, package):
            assert not _external_imports(path) & set(IO_MODULES), f"{name} imports {_external_imports(path)}"
            assert "Thread(" not in path.read_text(), f"{name} starts a thread"


def test_no_import_circle():
    graph = _graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ..protocol.messages import AddCredit", {"spark_credit_shuffle.protocol.messages"}),
        ("def f():\n    from ..planner import executor_slots", {"spark_credit_shuffle.planner"}),
        ("from .. import errors", {"spark_credit_shuffle.errors"}),
        ("import spark_credit_shuffle.config", {"spark_credit_shuffle.config"}),
        ("from .session import spark_context", {"spark_credit_shuffle.runtime.session"}),
    ],
)
def test_the_graph_sees_every_kind_of_import(tmp_path, source, expected):
    """The checks above are only as good as the import reader: relative, absolute, function-level."""
    module = tmp_path / "probe.py"
    module.write_text(source + "\n")
    modules = _modules()
    assert _imports("spark_credit_shuffle.runtime.probe", module, modules) == expected


def _sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in _modules().items()}


def test_one_murmur3_one_metrics_type_one_channel_rule():
    """One implementation of each: MurmurHash3 (its constant), the blocking storage's metrics data type, and
    the rule of which channels are local (docs/architecture.md, "Layout")."""
    sources = _sources()
    murmur = sorted(n for n, s in sources.items() if re.search(r"0x(cc9e2d51|CC9E2D51)", s))
    assert murmur == [f"{PACKAGE}.partitioners.murmur3"]
    metrics_type = sorted(n for n, s in sources.items() if re.search(r"^METRICS_TYPE\s*=", s, re.M))
    assert metrics_type == [f"{PACKAGE}.runtime.blocking.storage"]
    rule = sorted(n for n, s in sources.items() if re.search(r"local_channels\s*[!=]=|process\s*==", s))
    assert rule == [f"{PACKAGE}.planner.channels"]
