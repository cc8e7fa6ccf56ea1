"""Imports point one way: flows → tasks → dinov3_core, and nothing in them imports the development tools.

Read from the source (every import statement, also inside functions), so a lazy import cannot slip through.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package → top-level packages it must never import
FORBIDDEN = {
    "dinov3_core": {"prefect", "flows", "tasks", "wsidino_dev"},
    "tasks": {"flows", "wsidino_dev"},
    "flows": {"wsidino_dev"},
}
ALLOWED: set[Path] = set()


def imported_packages(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / package).rglob("*.py"))
        if path not in ALLOWED
        for line, name in imported_packages(path)
        if name in FORBIDDEN[package]
    ]
    assert offenders == []


def test_the_checker_sees_a_lazy_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from prefect import flow\n    import tasks.stage_task\n")
    assert imported_packages(module) == [(2, "prefect"), (3, "tasks")]


@pytest.mark.parametrize(
    ("modules", "heavy"),
    [
        # Every command imports the stage list (the CLI builds its parser from it): no torch, zarr, OpenSlide, MLflow.
        ("dinov3_core.cli, dinov3_core.stages, dinov3_core.chain", ("torch", "zarr", "openslide", "mlflow", "prefect")),
        # The torchrun launcher runs in thin CLI and Prefect-worker processes: it must not pay for torch or Prefect.
        ("dinov3_core.launch, dinov3_core.launch.training, dinov3_core.events", ("torch", "prefect")),
    ],
    ids=["stage_list_and_cli", "launcher"],
)
def test_light_modules_stay_light(modules: str, heavy: tuple[str, ...]) -> None:
    """Importing `modules` in a fresh interpreter loads none of the `heavy` packages."""
    code = f"import sys, {modules}\nsys.exit(sorted(m for m in {heavy!r} if m in sys.modules) or 0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------------------------- inside dinov3_core

CORE = REPO / "dinov3_core"
# Edges left out of the cycle check, each with the reason it is still there (none today).
CYCLE_ALLOWED: set[tuple[str, str]] = set()
STAGES = {
    "dinov3_core.convert",
    "dinov3_core.export",
    "dinov3_core.extract",
    "dinov3_core.evaluate",
    "dinov3_core.pipeline",
    "dinov3_core.retrain",
}
# The stage list and what runs it sit above every stage's own code.
CHAINS = {
    "dinov3_core.stages",
    "dinov3_core.runner",
    "dinov3_core.chain",
    "dinov3_core.pipeline",
    "dinov3_core.retrain",
}
# package → packages it must never import (its modules, at any depth)
CORE_FORBIDDEN: dict[str, set[str]] = {}
for rules in (
    {"dinov3_core.evaluate": {"dinov3_core.export"}},
    {f"dinov3_core.{stage}": {"dinov3_core.evaluate"} for stage in ("convert", "export", "extract")},
    {"dinov3_core.inference": STAGES},
    {f"dinov3_core.{low}": STAGES for low in ("models", "losses", "data", "train")},
    # A stage's own code never reaches up to the stage list or the chains; the launcher neither.
    {f"dinov3_core.{p}": CHAINS for p in ("tiling", "train", "gram", "convert", "export", "evaluate", "extract")},
    {"dinov3_core.launch": CHAINS, "dinov3_core.stage": CHAINS},  # stage: what a stage is, below every stage
    {"dinov3_core.train": {"dinov3_core.inference"}},  # the training probes use scoring code below both
):
    for package, forbidden in rules.items():
        CORE_FORBIDDEN[package] = CORE_FORBIDDEN.get(package, set()) | forbidden
# What a stage's manifest keeps (`<package>/summary.py`) is the typed record other packages read across the stage
# boundary: importing it is not importing that stage.
SUMMARIES = {f"{p}.summary" for p in STAGES | {"dinov3_core.tiling", "dinov3_core.train"}}
LAYER_ALLOWED: set[tuple[str, str]] = set()  # none today


def _module_names(root: Path, package: str) -> dict[str, Path]:
    names = {}
    for path in (root / package.replace(".", "/")).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def import_graph(root: Path, package: str, *, type_checking: bool = False) -> dict[str, set[str]]:
    """module → the modules of `package` it imports, from every import statement (module level and inside
    functions). `from p import name` counts as an import of `p.name` when that is a module, else of `p`. Imports
    under `if TYPE_CHECKING:` never run, so they cannot close an import cycle: left out unless `type_checking`."""
    modules = _module_names(root, package)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
        while todo:
            node = todo.pop()
            if not type_checking and _type_checking_only(node):
                todo.extend(node.orelse)  # type: ignore[attr-defined]
                continue
            todo.extend(ast.iter_child_nodes(node))
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            graph[module] |= {t for t in map(resolve, targets) if t and t != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_dinov3_core_has_no_import_cycle() -> None:
    graph = import_graph(REPO, "dinov3_core")
    assert graph["dinov3_core.extract.extract"], "the graph is empty: the checker is broken"
    for a, b in CYCLE_ALLOWED:
        graph[a].discard(b)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (move the shared piece into the lower module): " + "; ".join(
        " ↔ ".join(c) for c in cycles
    )


def _offenders(graph: dict[str, set[str]], rules: dict[str, set[str]], allowed: set[tuple[str, str]]) -> list[str]:
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        for package, forbidden in rules.items()
        if within(module, package)
        and any(within(target, f) for f in forbidden)
        and target not in SUMMARIES
        and (module, target) not in allowed
    ]


def test_dinov3_core_layers() -> None:
    """evaluate and export never import each other, the inference layer below them neither, the model, loss,
    data and training code no stage-level package, and no stage's own code (nor the launcher) the stage list or a
    chain (TYPE_CHECKING imports count: they are dependencies too)."""
    graph = import_graph(REPO, "dinov3_core", type_checking=True)
    assert all(package in graph for package in CORE_FORBIDDEN)
    assert _offenders(graph, CORE_FORBIDDEN, LAYER_ALLOWED) == []


def test_the_cycle_finder_sees_a_lazy_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "d.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n    from .. import c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
        "def g():\n    from pkg.a import f\n"
    )
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert find_cycles(import_graph(tmp_path, "pkg", type_checking=True)) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]
    graph["pkg.c"].clear()
    assert find_cycles(graph) == []


def test_the_layer_rules_see_a_forbidden_import() -> None:
    graph = {
        "dinov3_core.evaluate.x": {"dinov3_core.export.y", "dinov3_core.export.summary"},
        "dinov3_core.train.z": {"dinov3_core.retrain", "dinov3_core.inference.label_free"},
        "dinov3_core.export.y": {"dinov3_core.inference.w"},
        "dinov3_core.launch.training": {"dinov3_core.stages"},
    }
    assert _offenders(graph, CORE_FORBIDDEN, set()) == [
        "dinov3_core.evaluate.x imports dinov3_core.export.y",
        "dinov3_core.launch.training imports dinov3_core.stages",
        "dinov3_core.train.z imports dinov3_core.inference.label_free",
        "dinov3_core.train.z imports dinov3_core.retrain",
    ]
    allowed = {
        ("dinov3_core.evaluate.x", "dinov3_core.export.y"),
        ("dinov3_core.launch.training", "dinov3_core.stages"),
    }
    assert _offenders(graph, CORE_FORBIDDEN, allowed) == [
        "dinov3_core.train.z imports dinov3_core.inference.label_free",
        "dinov3_core.train.z imports dinov3_core.retrain",
    ]
