"""A config as a tree of values, without loading or checking it: dotted keys (free-form dict fields kept whole),
the schema's keys and type names for error messages, and the dict, YAML and MLflow-params forms of a typed config.
`dinov3_core.config` builds and checks configs on top of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested mapping: `{"a": {"b": 1}}` → `{"a.b": 1}` (lists and scalars are leaves)."""
    if isinstance(node, Mapping) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def is_section(node: Any) -> bool:
    """A dataclass-backed sub-config (its keys are fixed), as opposed to a free-form `dict[str, X]` field."""
    if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
        return False
    return dataclasses.is_dataclass(node._metadata.object_type)


def flatten_against(schema: DictConfig, update: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of `update`, descending only into dataclass sections of `schema`.

    Values of free-form dict fields stay whole, so their own keys may contain dots (`a.svs: 0.25`).
    """
    out: dict[str, Any] = {}
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        node = schema._get_node(str(key)) if str(key) in schema.keys() else None  # noqa: SIM118
        if isinstance(value, Mapping) and value and is_section(node):
            out.update(flatten_against(node, value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def schema_keys(schema: DictConfig) -> list[str]:
    keys: list[str] = []
    for key in schema.keys():  # noqa: SIM118 (OmegaConf: `in` is False for MISSING values)
        value = schema._get_node(key)
        if is_section(value):
            keys.extend(f"{key}.{sub}" for sub in schema_keys(value))
            keys.append(str(key))
        else:
            keys.append(str(key))
    return keys


def type_name(node: Any) -> str:
    try:
        ref = node._metadata.ref_type
        name = getattr(ref, "__name__", None) or str(ref).replace("typing.", "")
        return f"{name} or null" if node._metadata.optional and name != "Any" else name
    except AttributeError:
        return "a valid value"


def node_of(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node._get_node(part)
    return node


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(container, dict)
    return container


def flat_params(cfg: Any) -> dict[str, Any]:
    """Dotted key → value, for logging as MLflow params."""
    return flatten(to_dict(cfg))


__all__ = [
    "flat_params",
    "flatten",
    "flatten_against",
    "is_section",
    "node_of",
    "schema_keys",
    "to_dict",
    "to_yaml",
    "type_name",
]
