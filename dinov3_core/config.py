"""Typed stage configuration: dataclass schema ← named or given YAML ← `key=value` overrides.

Every stage takes one dataclass. Unknown keys fail with the closest valid key, wrong types fail with the key and
the expected type, and the resolved config is saved beside each stage output so a run can be reproduced.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.resources
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from dinov3_core.config_tree import (
    flat_params,
    flatten,
    flatten_against,
    is_section,
    node_of,
    schema_keys,
    to_yaml,
    type_name,
)
from dinov3_core.errors import WsidinoError
from dinov3_core.files import write_text_atomic

T = TypeVar("T")

CONFIG_DIR_ENV = "WSIDINO_CONFIG_DIR"
# A config is a few kB (a long mpp_by_slide table some 100 kB). The cap bounds the time of the pure-Python loader
# below (it is slow on a dense file) and stops a wrong file passed as --config before it is parsed.
MAX_CONFIG_BYTES = 1 << 20


class ConfigError(WsidinoError, ValueError):
    """A configuration problem, phrased for the person who wrote the config.

    With `key` (a field of the dataclass that raised it, from its `__post_init__`), the message reads
    "<key>: <message>"; `load_config` prefixes the key with the section's path (`crops.mask_ratio: …`).
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.detail = message


def require(ok: bool, key: str, message: str) -> None:
    """A dataclass field check for `__post_init__`: raise `ConfigError(message, key=key)` unless `ok`."""
    if not ok:
        raise ConfigError(message, key=key)


def packaged_config_dir() -> Path:
    """The named configs that ship with wsidino. Their home is the repository's top-level `configs/` (a checkout,
    an editable install); a wheel carries them as package data, `dinov3_core/configs/` (setup.py copies them in),
    found through `importlib.resources`."""
    packaged = Path(str(importlib.resources.files("dinov3_core") / "configs"))  # an unzipped install: a directory
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "configs"


def config_dir() -> Path:
    """The directory of named configs (`<dir>/<stage>/<name>.yaml`): `$WSIDINO_CONFIG_DIR` (a lab's own recipes),
    else the packaged `configs/` (`packaged_config_dir`). Every lookup of a named config goes through
    here."""
    env = os.environ.get(CONFIG_DIR_ENV)
    return Path(env) if env else packaged_config_dir()


def resolve_config_path(stage: str, name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """A config given as a file path, or as a name: `<config_dir()>/<stage>/<name>.yaml`."""
    if name_or_path is None or str(name_or_path) == "":
        return None
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        return path
    if not stage:
        raise ConfigError(
            f"config {str(name_or_path)!r} is a name, and a named config needs its stage "
            "(load_config(..., stage='extract')) or a path to a .yaml file"
        )
    named = config_dir() / stage / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    available = sorted(p.stem for p in (config_dir() / stage).glob("*.yaml"))
    raise ConfigError(
        f"no config named {str(name_or_path)!r} for stage {stage!r}; "
        f"available: {', '.join(available) or 'none'} (or pass a path to a .yaml file)"
    )


def _check_key(schema: DictConfig, key: str, source: str) -> None:
    node: Any = schema
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig) or part not in node.keys():  # noqa: SIM118 (MISSING values)
            moved = getattr(schema._metadata.object_type, "MOVED_KEYS", {}).get(key)
            if moved:
                raise ConfigError(f"config key {key!r} in {source} is now {moved!r}: set that instead")
            valid = schema_keys(schema)
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parent = ".".join(parts[:depth]) or "<root>"
            raise ConfigError(f"unknown config key {key!r} in {source} (no {part!r} under {parent}){hint}")
        node = node._get_node(part)
        if isinstance(node, DictConfig) and not is_section(node):
            return  # a free-form dict, or an unset optional sub-config: its own keys are validated on merge


def _merge_checked(base: DictConfig, update: Mapping[str, Any], source: str) -> DictConfig:
    for key, value in flatten_against(base, update).items():
        _check_key(base, key, source)
        try:
            OmegaConf.update(base, key, value, merge=True)
        except ValidationError as err:
            node = OmegaConf.select(base, key, throw_on_missing=False)
            expected = type_name(base._get_node(key.split(".")[0]) if node is None else node_of(base, key))
            raise ConfigError(
                f"invalid value for config key {key!r} in {source}: {value!r} is not {expected} "
                f"({err.msg.splitlines()[0]})"
            ) from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"invalid config key {key!r} in {source}: {err.msg}") from None
    return base


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings → nested dict; values are parsed as YAML (numbers, booleans, null, lists)."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = yaml.load(raw, Loader=_BoundedLoader) if raw.strip() else ""  # a SafeLoader
        except _AliasRefused:
            raise ConfigError(
                f"override {key}=…: YAML aliases (*name) are not allowed in wsidino configs; write the values out"
            ) from None
        except yaml.YAMLError:
            value = raw
        out[key] = value
    return out


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing aliases (`*name`).

    An alias shares a node; 9 levels of `[*a, *a, …]` share 10⁹ leaves that OmegaConf copies one by one (the "billion
    laughs": a hang with no output). Composing refuses the first alias event, so parsing stays linear in the file.
    Unknown tags (`!!python/object`, …) are refused by SafeLoader's constructor and reported by `load_yaml` with the
    line.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(event.anchor, event.start_mark)
        return super().compose_node(parent, index)


class _AliasRefused(yaml.YAMLError):
    def __init__(self, anchor: str, mark: yaml.Mark) -> None:
        super().__init__(anchor)
        self.anchor, self.mark = anchor, mark


def parse_yaml(text: str, source: str) -> Any:
    """`text` parsed as YAML without aliases or unknown tags; a `ConfigError` naming `source` and the line."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass
    except _AliasRefused as err:
        raise ConfigError(
            f"{source} line {err.mark.line + 1}: YAML aliases (*{err.anchor}) are not allowed in wsidino configs; "
            "write the values out"
        ) from None
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark or err.context_mark
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{source}{where}: {err.problem} (wsidino configs hold plain values: mappings, lists, strings, numbers; "
            "remove the tag)"
        ) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where} is not valid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML: {err}") from None


def load_yaml(path: str | os.PathLike[str], *, what: str = "config file") -> Any:
    """A user's YAML file, bounded: at most MAX_CONFIG_BYTES, UTF-8, no aliases, no tags beyond plain values. Every
    problem is a one-line `ConfigError` naming the file (and the line)."""
    path = Path(path)
    source = f"{what} {path}"
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"cannot read {source}: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source} is larger than {MAX_CONFIG_BYTES >> 20} MB, far beyond any config; check the path "
            "(a config holds settings, not data)"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    return parse_yaml(text, source)


BASE_KEY = "base"  # a config file may start from another named config of its stage: `base: vitb16-continued`


def _yaml_chain(stage: str, path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """The file and the configs it builds on (`base:`), the most basic first."""
    if path.resolve() in seen:
        raise ConfigError(f"config file {path}: `base:` goes round in a circle ({' → '.join(map(str, seen))})")
    loaded = load_yaml(path) or {}
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(loaded).__name__}")
    loaded = dict(loaded)
    parent = loaded.pop(BASE_KEY, None)
    if parent is None:
        return [(path, loaded)]
    return [*_yaml_chain(stage, resolve_config_path(stage, parent), (*seen, path.resolve())), (path, loaded)]  # type: ignore[arg-type]


def named_config_keys(stage: str, config: str | os.PathLike[str] | None) -> set[str]:
    """The dotted keys a named config (or YAML file) sets, its `base:` configs included."""
    path = resolve_config_path(stage, config) if config else None
    if path is None:
        return set()
    return {key for _, doc in _yaml_chain(stage, path) for key in flatten(doc)}


def load_config(
    schema: type[T],
    config: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    *,
    stage: str | None = None,
) -> T:
    """Build a typed config: schema defaults ← YAML (a path, or a name under `configs/<stage>/`:
    `resolve_config_path`) ← overrides."""
    base = OmegaConf.structured(schema)
    path = resolve_config_path(stage or "", config) if config is not None else None
    if path is not None:
        for source, loaded in _yaml_chain(stage or "", path):
            _merge_checked(base, loaded, f"config file {source}")
    named = flatten(OmegaConf.to_container(base, resolve=False))  # the named config, before the overrides
    if isinstance(overrides, Mapping):
        update = {k: v for k, v in overrides.items()}
        _merge_checked(base, update, "overrides")
    else:
        _merge_checked(base, parse_overrides(overrides), "overrides")
    missing = sorted(OmegaConf.missing_keys(base))
    if missing:
        raise ConfigError(f"required config key(s) not set: {', '.join(missing)} (set them as key=value)")
    cfg = _instantiate(base)
    with contextlib.suppress(AttributeError, TypeError):  # remembered for `config_changes` (not a config field)
        object.__setattr__(cfg, _NAMED_ATTR, (str(config) if config is not None else None, named))
    return cfg


_NAMED_ATTR = "_wsidino_named_config"


def config_changes(cfg: Any, skip: tuple[str, ...] = ("tracking.",)) -> tuple[str | None, dict[str, tuple[Any, Any]]]:
    """What the overrides changed on top of the named config `cfg` was loaded from: (config name or None,
    {key: (the named config's value, "???" when it had none, the value now)})."""
    name, named = getattr(cfg, _NAMED_ATTR, (None, None))
    if named is None:
        return None, {}
    now = flat_params(cfg)
    changed = {k: (named.get(k), v) for k, v in now.items() if named.get(k) != v and not k.startswith(skip)}
    return name, changed


def describe_changes(stage: str, cfg: Any, limit: int = 20) -> str:
    """One line: the named config and every key set on top of it, e.g. `tile: config default + workers=1 (was 2),
    input=/data/slides`."""
    name, changed = config_changes(cfg)
    base = f"config {name}" if name else "built-in defaults"
    if not changed:
        return f"{stage}: {base}, unchanged"
    items = [f"{k}={v}" + ("" if old in (None, "???") else f" (was {old})") for k, (old, v) in changed.items()]
    more = f", … {len(items) - limit} more (--print-config shows all)" if len(items) > limit else ""
    return f"{stage}: {base} + {', '.join(items[:limit])}{more}"


def _instantiate(cfg: DictConfig) -> Any:
    """`OmegaConf.to_object`, which runs every section's `__post_init__` checks; their errors name the key."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config: {err}") from None
    except ValueError as err:
        prefix = _failing_section(cfg)
        if isinstance(err, ConfigError) and err.key:
            raise ConfigError(err.detail, key=f"{prefix}{err.key}") from None
        raise ConfigError(f"invalid {prefix[:-1] or 'config'}: {err}") from None


def _failing_section(node: DictConfig, prefix: str = "") -> str:
    """Dotted path (with a trailing dot) of the innermost section whose checks (`__post_init__`) fail."""
    for key in node.keys():  # noqa: SIM118 (OmegaConf: `in` is False for MISSING values)
        child = node._get_node(key)
        if is_section(child):
            try:
                OmegaConf.to_object(child)
            except ValueError:
                return _failing_section(child, f"{prefix}{key}.")  # type: ignore[arg-type]
    return prefix


def save_config(cfg: Any, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config atomically (temporary name, then rename)."""
    return write_text_atomic(path, to_yaml(cfg))


def config_hash(cfg: Any, exclude: Iterable[str] = ()) -> str:
    """Stable hash of the config's values (minus `exclude`d dotted keys): used to decide whether a rerun may skip."""
    flat = {k: v for k, v in flat_params(cfg).items() if k not in set(exclude)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


__all__ = [
    "ConfigError",
    "config_dir",
    "config_hash",
    "load_config",
    "load_yaml",
    "packaged_config_dir",
    "parse_overrides",
    "require",
    "resolve_config_path",
    "save_config",
]
