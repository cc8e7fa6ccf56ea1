"""Typed configs: defaults ← YAML ← overrides, with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from dinov3_core.config import ConfigError, load_config, require, resolve_config_path, save_config
from dinov3_core.config_tree import to_dict
from dinov3_core.tiling.config import TileConfig

REQUIRED = {"input": "slides/", "output": "t.zarr"}


def test_layers_apply_in_order(tmp_path: Path) -> None:
    cfg_file = tmp_path / "mine.yaml"
    cfg_file.write_text("tile_size: 256\ntissue:\n  min_tissue_fraction: 0.3\ncompressor: jpeg\n")
    cfg = load_config(TileConfig, cfg_file, ["input=s", "output=o", "tile_size=512"])
    assert isinstance(cfg, TileConfig)
    assert (cfg.tile_size, cfg.tissue.min_tissue_fraction, cfg.compressor, cfg.mpp) == (512, 0.3, "jpeg", 0.5)


def test_named_configs_resolve_and_all_load() -> None:
    assert resolve_config_path("tile", "default").name == "default.yaml"
    for path in sorted(Path(resolve_config_path("tile", "default")).parent.glob("*.yaml")):
        load_config(TileConfig, path, REQUIRED)  # every shipped config is valid
    with pytest.raises(ConfigError, match=r"no config named 'nope' for stage 'tile'; available: .*default"):
        resolve_config_path("tile", "nope")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tile_sise=3"], r"unknown config key 'tile_sise' .*did you mean 'tile_size'"),
        (["tissue.min_tisue_fraction=0.3"], r"did you mean 'tissue\.min_tissue_fraction'"),
        (["tile_size=abc"], r"'tile_size'.*'abc' is not int"),
        (["stride=x"], r"'stride'.*is not int or null"),
        (["compressor=lzma"], r"'compressor'.*expected one of \['zstd', 'jpeg', 'none'\]"),
        (["tile_size"], r"not of the form key=value"),
        # the sections' own checks run at load and name the key
        (["workers=0"], r"^workers: must be >= 1, got 0$"),
        (["tile_size=8"], r"^tile_size: must be >= 16, got 8$"),
        (["tissue.min_tissue_fraction=1.5"], r"^tissue\.min_tissue_fraction: must be in \[0, 1\], got 1\.5$"),
        (["mpp_by_slide={a.svs: -1}"], r"^mpp_by_slide: values must be positive"),
    ],
)
def test_bad_overrides_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TileConfig, None, ["input=s", "output=o", *overrides])


@dataclass
class _Inner:
    n: int = 1

    def __post_init__(self) -> None:
        require(self.n >= 1, "n", f"must be >= 1, got {self.n}")


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    other: _Inner = field(default_factory=_Inner)
    MOVED_KEYS: ClassVar[dict[str, str]] = {"old_n": "inner.n"}


def test_nested_section_errors_and_moved_keys() -> None:
    with pytest.raises(ConfigError, match=r"^other\.n: must be >= 1, got 0$"):
        load_config(_Outer, None, ["other.n=0"])
    with pytest.raises(ConfigError, match=r"^n: must be >= 1, got 0$"):
        _Inner(n=0)  # the same check outside load_config names the bare field
    with pytest.raises(ConfigError, match=r"config key 'old_n' in overrides is now 'inner\.n'"):
        load_config(_Outer, None, ["old_n=3"])


def test_missing_required_keys_are_listed() -> None:
    with pytest.raises(ConfigError, match=r"required config key\(s\) not set: output"):
        load_config(TileConfig, None, ["input=s"])


def test_yaml_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tissue:\n  thumbnail_mp: 4\n")
    with pytest.raises(ConfigError, match=rf"config file {bad}.*did you mean 'tissue\.thumbnail_mpp'"):
        load_config(TileConfig, bad, REQUIRED)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(TileConfig, listy, REQUIRED)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(TileConfig, tmp_path / "absent.yaml", REQUIRED)


def test_free_form_dict_keys_may_contain_dots() -> None:
    cfg = load_config(TileConfig, None, {**REQUIRED, "mpp_by_slide": {"case 1.svs": 0.25}})
    assert cfg.mpp_by_slide == {"case 1.svs": 0.25}
    cfg = load_config(TileConfig, None, ["input=s", "output=o", "mpp_by_slide={a.svs: 0.5}"])
    assert cfg.mpp_by_slide == {"a.svs": 0.5}


def test_saved_config_reloads_identically(tmp_path: Path) -> None:
    cfg = load_config(TileConfig, None, {**REQUIRED, "tile_size": 160, "filters": {"pen_filter": True}})
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert yaml.safe_load(path.read_text())["tile_size"] == 160
    assert to_dict(load_config(TileConfig, path)) == to_dict(cfg)


def test_a_run_says_what_it_sets_on_top_of_its_named_config() -> None:
    from dinov3_core.config import config_changes, describe_changes
    from dinov3_core.train.config import PretrainConfig

    values = {
        "data.stores": ["t.zarr"],
        "output_dir": "run",
        "train.stop_at": 7,
        "optim.epochs": 3,
        "tracking.experiment": "x",
    }
    cfg = load_config(PretrainConfig, "tiny", values, stage="pretrain")
    name, changed = config_changes(cfg)
    assert name == "tiny" and set(changed) == {"data.stores", "output_dir", "train.stop_at", "optim.epochs"}
    line = describe_changes("pretrain", cfg)
    named_epochs = load_config(PretrainConfig, "tiny", REQUIRED_PRETRAIN, stage="pretrain").optim.epochs
    assert line.startswith("pretrain: config tiny + ") and f"optim.epochs=3 (was {named_epochs})" in line
    assert "tracking" not in line  # where it logs is not a change of the run
    tile = load_config(TileConfig, "default", REQUIRED, stage="tile")
    assert describe_changes("tile", tile) == "tile: config default + input=slides/, output=t.zarr"
    assert describe_changes("tile", load_config(TileConfig, None, REQUIRED)).startswith("tile: built-in defaults")


REQUIRED_PRETRAIN = {"data.stores": ["t.zarr"], "output_dir": "run"}


def test_named_configs_are_package_data_unless_the_environment_names_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped configs live at the repository's top level in a checkout (a wheel carries them as package data,
    tests/test_wheel.py); $WSIDINO_CONFIG_DIR replaces them with a lab's own directory of `<stage>/<name>.yaml`."""
    import dinov3_core
    from dinov3_core.config import CONFIG_DIR_ENV, config_dir, packaged_config_dir, resolve_config_path

    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    assert config_dir() == packaged_config_dir() == Path(dinov3_core.__file__).resolve().parents[1] / "configs"
    assert resolve_config_path("pretrain", "tiny") == packaged_config_dir() / "pretrain" / "tiny.yaml"
    (tmp_path / "tile").mkdir()
    (tmp_path / "tile" / "lab.yaml").write_text("tile_size: 256\n")
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    assert config_dir() == tmp_path
    assert resolve_config_path("tile", "lab") == tmp_path / "tile" / "lab.yaml"
    with pytest.raises(ConfigError, match="no config named 'default' for stage 'tile'; available: lab"):
        resolve_config_path("tile", "default")
