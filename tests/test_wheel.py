"""The built wheel is complete: installed into a fresh venv, away from the checkout, its stages run and find their
named configs (package data, `configs/`) and the sample slides.

The wheel is built offline from a copy of the sources (`pip wheel --no-deps --no-build-isolation --no-index`, with
the setuptools of this venv) and installed with `--no-deps` into a new venv that has no pip and no access to the
checkout. Its dependencies come from this venv's site-packages through a `.pth` line: a plain path entry, so the
`.pth` files in there (this venv's editable install of the checkout) are not run and `import dinov3_core` finds the
wheel's copy. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject's packages and the files it names); the rest of the checkout stays out.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "configs", "dinov3_core", "flows", "tasks", "wsidino_dev")
# Variables that would point the installed code back at the checkout or at a running server.
CLEARED_ENV = ("PYTHONPATH", "PYTHONHOME", "WSIDINO_CONFIG_DIR", "MLFLOW_TRACKING_URI", "PREFECT_API_URL")

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"{' '.join(done.args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def build_wheel(out: Path, tmp: Path) -> Path:
    """The wheel of a copy of the sources (no build/ or *.egg-info left in the checkout), built offline."""
    have = version("setuptools")
    if int(have.split(".")[0]) < 77:  # the dev extra asks for it; `pip wheel` would fail on pyproject's license
        pytest.fail(f"setuptools {have} in this venv is older than [build-system] needs (77): pip install -e '.[dev]'")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=skip)
        else:
            shutil.copy2(path, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    ok(run([*cmd, "-w", str(out), str(src)], cwd=tmp, env=clean_env()))
    (wheel,) = out.glob("wsidino-*.whl")
    return wheel


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def install(wheel: Path, root: Path) -> Path:
    """A venv at `root` holding the wheel; its other packages are this venv's. Returns its bin directory."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    # pip of this venv, run by the new interpreter (which sees only its own, empty site-packages yet).
    ok(
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                str(wheel),
            ],
            cwd=root,
            env=clean_env(),
        )
    )
    purelib = Path(
        ok(
            run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root, clean_env())
        ).strip()
    )
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (purelib / "zz-wsidino-test-deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return root / "bin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(bin directory of the venv with the wheel installed, an empty working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp / "dist", tmp)
    bin_dir = install(wheel, tmp / "venv")
    work = tmp / "work"
    work.mkdir()
    return bin_dir, work


def test_the_installed_wheel_runs_stages_with_its_packaged_configs(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    env = clean_env()
    venv_root = bin_dir.parent.resolve()
    probe = (
        "import json, dinov3_core, dinov3_core.config as c, flows, tasks, wsidino_dev.sample_slides as s, torch; "
        "print(json.dumps({'core': dinov3_core.__file__, 'flows': flows.__file__, 'tasks': tasks.__file__, "
        "'samples': s.__file__, 'configs': str(c.config_dir())}))"
    )
    where = json.loads(ok(run([str(bin_dir / "python"), "-c", probe], work, env)))
    for name, path in where.items():  # the wheel's copy, not the checkout's (its editable install is not active)
        assert Path(path).resolve().is_relative_to(venv_root), f"{name} from {path}, not from the installed wheel"
    assert sorted(p.stem for p in (Path(where["configs"]) / "pretrain").glob("*.yaml")), "no packaged configs"

    # Sample slides (the wheel's wsidino_dev/sample_slides/data) → the tile stage with a named config.
    ok(run([str(bin_dir / "wsidino-dev"), "samples", "slides", "--preset", "test", "--no-negatives"], work, env))
    slide = work / "slides" / "tissue_20x.svs"
    assert slide.is_file()
    tile = [
        str(bin_dir / "wsidino"),
        "tile",
        "--config",
        "default",
        "--input",
        str(slide),
        "--output",
        "tiles.zarr",
        "tile_size=64",
        "mpp=2.0",
        "progress=false",
        "tracking.enabled=false",
    ]
    out = ok(run(tile, work, env))
    assert "config default" in out, out
    complete = "from dinov3_core.tiling.store import complete_slide_ids as c; print(c('tiles.zarr'))"
    assert ok(run([str(bin_dir / "python"), "-c", complete], work, env)).strip() == "['tissue_20x']"

    # Named configs of the training stages and the chains resolve from the package.
    pretrain = [
        str(bin_dir / "wsidino"),
        "pretrain",
        "--config",
        "tiny",
        "--store",
        "tiles.zarr",
        "--output-dir",
        "pretrain",
        "--print-config",
    ]
    assert "arch: vit_test" in ok(run(pretrain, work, env))  # configs/pretrain/tiny.yaml, not the schema default
    pipeline = [
        str(bin_dir / "wsidino"),
        "pipeline",
        "--config",
        "cpu",
        "--slides",
        "slides",
        "--workdir",
        "run",
        "--print-config",
    ]
    assert "  pretrain:\n    config: cpu\n" in ok(run(pipeline, work, env))  # configs/pipeline/cpu.yaml


def test_serve_from_a_wheel_says_it_needs_a_checkout(installed: tuple[Path, Path]) -> None:
    """`make serve` registers deploy/prefect.yaml, whose entrypoints are paths in a checkout: not package data."""
    bin_dir, work = installed
    done = run([str(bin_dir / "wsidino-dev"), "serve", "--serve-dir", str(work / "serve")], work, clean_env(), 120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "serve runs from a checkout" in done.stderr
