"""How the pydantic parameter models render as forms: Prefect's UI draws each flow's form from their JSON schema.

    gpu_slots: str | None = Field(None, title="GPU slot limit", json_schema_extra=ui(6))

Every field of a form model takes `json_schema_extra=ui(position)` (or `ui()`; `required_field` and
`optional_field` declare the two common kinds of input with it). For an optional field (`X | None`)
`ui` makes the schema the plain `X` with no default, so the form shows an empty input (no "null" branch to pick, no
"Property is type None") while an empty or `null` value still means None to pydantic.

Why not `X | SkipJsonSchema[None]`: pydantic then no longer puts the field's constraints on `X`'s schema (a
`pattern` is dropped, `gt`/`le` come out as keys no JSON-schema validator knows), so the server would stop
checking them. Why the default goes too: Prefect validates a run's parameters against the stored schema after
adding a null branch back to every optional property *without* a default
(`prefect.utilities.schema_tools.validation.preprocess_schema`); with `"default": null` an explicit `null` (every
complete payload in deploy/prefect.yaml has some) would be refused. Here, not in `tasks/`, because the launch
settings of `dinov3_core.launch.training` are a form section too (this module does not import Prefect).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field


def ui(position: int | None = None) -> Callable[[dict[str, Any]], None]:
    """A field's `json_schema_extra`: its place in the form (inside a model the UI otherwise orders fields
    defaults-first, alphabetically) and, for an optional field, the value's own schema in place of
    `anyOf: [value, null]`, without `"default": null` (see the module docstring)."""

    def extra(schema: dict[str, Any]) -> None:
        if position is not None:
            schema["position"] = position
        branches = schema.get("anyOf", [])
        values = [branch for branch in branches if branch != {"type": "null"}]
        if len(values) == 1 and len(branches) == 2:  # X | None: X's schema, keeping the field's title etc.
            del schema["anyOf"]
            schema.update({key: value for key, value in values[0].items() if key not in schema})
        if "default" in schema and schema["default"] is None:
            del schema["default"]

    return extra


def required_field(position: int | None, title: str, description: str | None = None, **constraints: Any) -> Any:
    """A required input (a path, or a list of them): the form refuses it empty, before anything runs."""
    return Field(min_length=1, title=title, description=description, json_schema_extra=ui(position), **constraints)


def optional_field(position: int | None, title: str, description: str | None = None, **constraints: Any) -> Any:
    """An optional input (`X | None`): drawn as a plain input, empty meaning None (see `ui`)."""
    return Field(None, title=title, description=description, json_schema_extra=ui(position), **constraints)


__all__ = ["optional_field", "required_field", "ui"]
