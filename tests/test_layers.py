"""The layers of the package (docs/architecture.md, "The rule"), counted over every import.

A module's imports are read from its source, all of them: at the top, inside functions, under
``TYPE_CHECKING``. A lazy import is for start-up time, never to hide a cycle, so it counts as
much as any other. The same rule is the import-linter contract in pyproject.toml, run by
``make lint`` (.ci/lint_layers.py); the last tests show that contract catches an upward import.
"""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"otel_gpu": ROOT / "otel_gpu", "otel_gpu.exporters": ROOT / "exporters"}
"""Where each package's modules live (pyproject's package-dir: exporters/ is otel_gpu.exporters)."""

KNOWN_UPWARD_IMPORTS: set[tuple[str, str]] = set()
"""Folder pairs (importer, imported) that import against the layers. None is left: the calls
layer reaches the running pipeline through the core's sink, and the top of the package
(``otel_gpu.runtime``) applies ``OTEL_GPU_INSTRUMENT``. No pair may join it."""


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            if "_bootstrap" in path.parts:  # a sitecustomize run by Python, not a module of ours
                continue
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports_of(
    module: str, source: str, known: set[str] | dict[str, Path], is_package: bool = False
) -> Iterator[str]:
    """The modules of ``known`` that ``module``'s source imports, wherever the import statement
    is (top level, functions, classes, ``if TYPE_CHECKING``), relative imports resolved."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parent = parts[: len(parts) - node.level + (1 if is_package else 0)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


def folder(module: str) -> str:
    """A module's folder below ``otel_gpu`` (``calls``), a top-level module's own name
    (``config``), or ``otel_gpu`` for the package's ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {folder(m): set() for m in modules}
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        for imported in imports_of(module, source, modules, path.name == "__init__.py"):
            if folder(imported) != folder(module):
                graph[folder(module)].add(folder(imported))
    return graph


def test_imports_inside_functions_and_type_checking_count():
    """The walk finds an import however it is hidden: in a function, under TYPE_CHECKING, or
    relative; so a lazy import cannot hide a cycle from the tests below."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from otel_gpu.export.pipeline import Pipeline\n"
        "def f():\n    from otel_gpu.journal import writer\n"
        "    import otel_gpu.cli\n"
        "from . import metadata\n"
    )
    known = {
        "otel_gpu.export.pipeline",
        "otel_gpu.journal.writer",
        "otel_gpu.cli",
        "otel_gpu.calls.metadata",
        "otel_gpu.calls.x",
    }
    found = set(imports_of("otel_gpu.calls.x", source, known))
    assert found == known - {"otel_gpu.calls.x"}


def test_no_cycle_between_folders():
    """Without the known upward imports, the folders form no cycle: every new import between
    folders either follows the layers or fails here, naming the cycle."""
    graph = folder_graph()
    kept = {a: {b for b in bs if (a, b) not in KNOWN_UPWARD_IMPORTS} for a, bs in graph.items()}
    try:
        tuple(graphlib.TopologicalSorter(kept).static_order())
    except graphlib.CycleError as exc:
        cycle = " -> ".join(exc.args[1])
        pytest.fail(f"a cycle between folders (counting imports inside functions): {cycle}")


def test_known_upward_imports_still_exist():
    """Each known upward import is still there: when one goes, it leaves KNOWN_UPWARD_IMPORTS
    (and the matching ignore of pyproject's import-linter contract), so the list stays true."""
    graph = folder_graph()
    gone = sorted((a, b) for a, b in KNOWN_UPWARD_IMPORTS if b not in graph.get(a, set()))
    assert not gone, f"no longer imported: remove {gone} from KNOWN_UPWARD_IMPORTS"


def _lint_layers() -> object:
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (make install-test installs it)")
    spec = importlib.util.spec_from_file_location("lint_layers", ROOT / ".ci" / "lint_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lint_layers", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_import_linter_contract_holds():
    """``lint-imports`` keeps every contract on this tree (what ``make lint`` runs)."""
    lint = _lint_layers()
    result = lint.check()  # type: ignore[attr-defined]
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_the_contract_fails_on_a_planted_upward_import():
    """An upward import planted inside a function of a bottom-layer module (the settings
    importing the command line) breaks the contract, and the report names it."""
    lint = _lint_layers()
    planted = "\n\ndef _planted() -> None:\n    from otel_gpu.cli import main  # noqa: F401\n"
    result = lint.check(plant={"otel_gpu/_text.py": planted})  # type: ignore[attr-defined]
    assert result.returncode != 0
    assert "otel_gpu._text is not allowed to import otel_gpu.cli" in result.stdout


EXPLAINED_MODULE_CYCLES = {
    frozenset({"otel_gpu.devices.cuda_fault", "otel_gpu.devices.device_time"}): (
        "the resolver feeds the fault finder; the finder names the event pair type only for "
        "type checkers"
    ),
    frozenset({"otel_gpu.instrumentation.targets", "otel_gpu.instrumentation.torch_distributed"}): (
        "targets routes the torch.distributed target to its own wrapper, which decorates "
        "through targets.decorate"
    ),
    frozenset({"otel_gpu.traces.diff", "otel_gpu.traces.dump_calls"}): (
        "diff loads dump folders on demand; the dump reader raises diff's own error"
    ),
    frozenset({"otel_gpu.traces.workload_files", "otel_gpu.traces.workloads"}): (
        "--emit writes files on demand; the writer names the workload type only for type checkers"
    ),
    frozenset({"otel_gpu.journal.recover", "otel_gpu.journal.writer"}): (
        "recovery reuses the writer's file handling; the writer runs recovery when it starts"
    ),
    frozenset({"otel_gpu.metrics.provider", "otel_gpu.metrics.summary"}): (
        "each names the other's type only for type checkers; the summary is built on demand"
    ),
    frozenset({"otel_gpu.recorder.call_manifest", "otel_gpu.recorder.ring"}): (
        "the ring writes manifests when it dumps; the manifest names the ring's entry type only "
        "for type checkers"
    ),
    frozenset({"otel_gpu.recorder.graph_snapshots", "otel_gpu.recorder.recorder"}): (
        "the recorder dumps graph replays; the snapshots name the recorder type only for type "
        "checkers"
    ),
    frozenset({"otel_gpu.replay", "otel_gpu.replay.cli"}): (
        "the package gives the command its parser on demand; the command runs the package"
    ),
    frozenset({"otel_gpu.bench", "otel_gpu.bench.report"}): (
        "the bench renders its report on demand; the report reads the bench's rows"
    ),
    frozenset({"otel_gpu.bench.collectives", "otel_gpu.bench.worker"}): (
        "a bench worker process runs the collectives job class the parent defines"
    ),
}
"""The cycles between modules that are left, each a pair in one folder, with the reason. A
cycle of more modules, across folders, or not listed fails the test below."""


def module_cycles() -> list[set[str]]:
    """The strongly connected groups of more than one module (imports inside functions and
    under TYPE_CHECKING count)."""
    modules = _modules()
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        graph[module].update(imports_of(module, source, modules, path.name == "__init__.py"))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.add(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(group)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_cycle_between_modules_but_the_explained_pairs():
    """Counting imports inside functions, the only cycles between modules are same-folder pairs
    listed with their reason in EXPLAINED_MODULE_CYCLES; a listed pair that is no longer a cycle
    leaves the list."""
    cycles = [frozenset(group) for group in module_cycles()]
    unexplained = [sorted(group) for group in cycles if group not in EXPLAINED_MODULE_CYCLES]
    assert not unexplained, f"cycles between modules with no explained reason: {unexplained}"
    gone = [sorted(pair) for pair in EXPLAINED_MODULE_CYCLES if pair not in cycles]
    assert not gone, f"no longer a cycle: remove {gone} from EXPLAINED_MODULE_CYCLES"
    for pair in EXPLAINED_MODULE_CYCLES:
        assert len({folder(m) for m in pair}) == 1, f"{sorted(pair)} crosses folders"


def private_names_across_folders() -> list[str]:
    """Each use of an underscore name of another folder's module: ``from m import _x`` and
    ``m._x`` where ``m`` was imported as a module (top-level modules count as folders of their
    own, as in the layers)."""
    modules = _modules()
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("otel_gpu"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    elif _private(alias.name) and folder(node.module or "") != folder(module):
                        found.append(f"{module} imports {full}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and folder(aliases[node.value.id]) != folder(module)
            ):
                found.append(f"{module} uses {aliases[node.value.id]}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_underscore_name_crosses_a_folder():
    """What another folder needs is public in its module: no module reads an underscore name of
    a module in another folder (imports inside functions count)."""
    assert private_names_across_folders() == []


def test_the_private_name_walk_finds_both_forms(tmp_path, monkeypatch):
    """The walk sees ``from otel_gpu.x.y import _z`` and ``y._z`` through a module alias, and
    leaves a same-folder use alone: the test above cannot pass by missing them."""
    planted = {
        "otel_gpu.calls.planted": "from otel_gpu.export.pipeline import _lock\n"
        "from otel_gpu.export import pipeline\n"
        "from otel_gpu.calls import metadata\n"
        "x = pipeline._WAKE_AT\ny = metadata._private_same_folder\n",
    }
    path = tmp_path / "planted.py"
    path.write_text(planted["otel_gpu.calls.planted"], encoding="utf-8")
    real = _modules()
    monkeypatch.setitem(globals(), "_modules", lambda: {**real, "otel_gpu.calls.planted": path})
    found = private_names_across_folders()
    assert found == [
        "otel_gpu.calls.planted imports otel_gpu.export.pipeline._lock",
        "otel_gpu.calls.planted uses otel_gpu.export.pipeline._WAKE_AT",
    ]
