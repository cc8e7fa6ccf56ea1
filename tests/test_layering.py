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


def test_launcher_imports_neither_torch_nor_prefect() -> None:
    """The torchrun launcher runs in thin CLI and Prefect-worker processes: it must not pay for torch or Prefect."""
    code = (
        "import sys, dinov3_core.launch, dinov3_core.launch.training, dinov3_core.events\n"
        "sys.exit(sorted(m for m in ('torch', 'prefect') if m in sys.modules) or 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
