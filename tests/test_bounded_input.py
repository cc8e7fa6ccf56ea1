"""Bounded parsing of user input: YAML configs without aliases or tags, capped in size (dinov3_core/config.py).

Each config goes through the real `wsidino` command in a subprocess (`python -m dinov3_core.cli`), so the exit code,
the one line on stderr and the time are what a user sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dinov3_core.config import MAX_CONFIG_BYTES, ConfigError, load_config, parse_overrides
from dinov3_core.tiling.config import TileConfig

ROOT = Path(__file__).resolve().parents[1]


def wsidino(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dinov3_core.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    return done, time.perf_counter() - start


def alias_bomb(levels: int = 9, indent: str = "") -> str:
    """The "billion laughs": each level an anchored list of nine aliases of the one before (9⁹ leaves)."""
    lines = [f"{indent}l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def one_error_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith(f"wsidino {command}:")]
    return line


@pytest.mark.parametrize("under", ["top", "pretrain.overrides"])
def test_alias_bomb_in_a_pipeline_config_stops_at_once(tmp_path: Path, under: str) -> None:
    config = tmp_path / "bomb.yaml"
    if under == "top":
        config.write_text("workdir: w\n" + alias_bomb())
        first_alias_line = 3  # line 2 anchors l0, line 3 holds the first *l0
    else:  # a valid key whose value is a free-form mapping, so no schema check can stop it first
        config.write_text("workdir: w\npretrain:\n  config: cpu\n  overrides:\n" + alias_bomb(indent="    "))
        first_alias_line = 6
    done, seconds = wsidino("pipeline", "--config", str(config), "--slides", "s", cwd=tmp_path)
    line = one_error_line(done, "pipeline")
    assert f"{config} line {first_alias_line}: YAML aliases (*l0) are not allowed" in line, line
    assert "write the values out" in line
    assert seconds < 5, seconds  # < 1 s alone; the margin is for a loaded box (Python + imports)
    print(f"alias bomb under {under}: exit 2 in {seconds:.2f} s")


def test_alias_bomb_as_a_stage_config_and_as_an_override(tmp_path: Path) -> None:
    config = tmp_path / "tile.yaml"
    config.write_text("input: slides\noutput: out\nmpp_by_slide:\n" + alias_bomb(indent="  "))
    tile_config_refused(config, rf"config file {config} line 5: YAML aliases \(\*l0\)")
    bomb = "[" + ",".join(["&a [x,x,x,x,x,x,x,x,x]"] + ["*a"] * 8) + "]"
    with pytest.raises(ConfigError, match=r"override mpp_by_slide=…: YAML aliases \(\*name\) are not allowed"):
        parse_overrides([f"mpp_by_slide={bomb}"])


def test_python_tags_are_refused_in_one_line_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(f'workdir: w\nslides: !!python/object/apply:os.system ["touch {marker}"]\n')
    done, _ = wsidino("pipeline", "--config", str(config), cwd=tmp_path)
    line = one_error_line(done, "pipeline")
    assert f"{config} line 2:" in line and "python/object/apply:os.system" in line and "remove the tag" in line
    assert not marker.exists()
    # any tag YAML's safe schema does not know, in a stage config
    other = tmp_path / "tagged.yaml"
    other.write_text("input: s\noutput: !custom o\n")
    tile_config_refused(other, rf"{other} line 2: could not determine a constructor for the tag '!custom'")


def tile_config_refused(path: Path, match: str) -> None:
    """Loading `path` as a tile config fails with a `ConfigError` that matches `match`."""
    with pytest.raises(ConfigError, match=match):
        load_config(TileConfig, path, {}, stage="tile")


def test_oversized_non_utf8_and_broken_yaml_name_the_file(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("input: s\noutput: o\n" + "# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    start = time.perf_counter()
    tile_config_refused(big, rf"config file {big} is larger than 1 MB")
    assert time.perf_counter() - start < 1  # refused before parsing
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("input: caf\xe9\n".encode("latin-1"))
    tile_config_refused(latin, rf"config file {latin} is not UTF-8 text")
    broken = tmp_path / "broken.yaml"
    broken.write_text("input: s\noutput: [o\nworkers: 2\n")
    tile_config_refused(broken, rf"config file {broken} line 3, column 8 is not valid YAML")


def test_plain_configs_still_load(tmp_path: Path) -> None:
    """Every shipped config, and a hand-written one, loads through the bounded loader (anchors alone are fine)."""
    config = tmp_path / "plain.yaml"
    config.write_text("input: s\noutput: &out o\nmpp_by_slide: {a.svs: 0.25}\n")
    cfg = load_config(TileConfig, config, {}, stage="tile")
    assert (cfg.output, cfg.mpp_by_slide) == ("o", {"a.svs": 0.25})
