"""Turn pydantic validation errors into one-line-per-problem messages.

A message names the file, the field path, the bad value and what is allowed, e.g.::

    topology.yaml: leaf_switches[2].ports[5].speed_gbps: -1 is not allowed (must be > 0)

Cross-reference checks (a cable naming a port that does not exist) report through
:func:`issue` with the same layout, so every complaint about a topology reads alike.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

Loc = Sequence[str | int]

_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def format_loc(loc: Loc) -> str:
    """``("leaf_switches", 2, "ports", 5, "speed_gbps")`` -> ``leaf_switches[2].ports[5].speed_gbps``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def show_value(value: Any) -> str:
    """A short, YAML-like rendering of a bad value (strings quoted, long values cut)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def issue(source: str, loc: Loc, message: str) -> str:
    return f"{source}: {format_loc(loc)}: {message}"


def _allowed_fields(root: type[BaseModel], loc: Loc) -> list[str] | None:
    """Field names of the model found by walking ``loc`` from ``root`` (None if unknown)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return None


def _unwrap(annotation: Any) -> Any:
    """Peel ``Optional``/``list``/``dict`` off an annotation to reach the model inside."""
    while True:
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if origin in (list, tuple, set, frozenset) and args:
            annotation = args[0]
        elif origin is dict and len(args) == 2:
            annotation = args[1]
        elif origin in (typing.Union, types.UnionType) and len(args) == 1:
            annotation = args[0]
        elif origin is typing.Annotated:
            annotation = args[0]
        else:
            return annotation


def _explain(error: dict[str, Any], root: type[BaseModel]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    for key, word in _BOUND_WORDS.items():
        if key in ctx and kind.startswith(("greater_than", "less_than")):
            bound = ctx[key]
            shown = f"{bound:g}" if isinstance(bound, float) else str(bound)
            return f"{show_value(value)} is not allowed (must be {word} {shown})"
    if kind == "missing":
        return "is required but missing"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(root, error["loc"][:-1])
        hint = f"; allowed fields: {', '.join(allowed)}" if allowed else ""
        return f"unknown field{hint}"
    if kind == "literal_error":
        return f"{show_value(value)} is not allowed (must be one of {ctx.get('expected')})"
    if kind == "string_pattern_mismatch":
        return f"{show_value(value)} is not allowed (must match the pattern {ctx.get('pattern')})"
    if kind in ("too_short", "too_long"):
        return f"{error['msg'][0].lower()}{error['msg'][1:]}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"{show_value(value)} is not allowed (must be an integer)"
    if kind in ("float_parsing", "float_type"):
        return f"{show_value(value)} is not allowed (must be a number)"
    if kind in ("string_type", "bool_type", "bool_parsing", "list_type", "dict_type", "model_type"):
        expected = {"string": "a string", "bool": "true or false", "list": "a list",
                    "dict": "a mapping", "model": "a mapping"}[kind.split("_")[0]]
        return f"{show_value(value)} is not allowed (must be {expected})"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{show_value(value)} is not allowed ({error['msg'][0].lower()}{error['msg'][1:]})"


def format_validation_error(source: str, exc: ValidationError, root: type[BaseModel]) -> str:
    """All problems of one pydantic error, one line each, prefixed by ``source``."""
    return "\n".join(issue(source, e["loc"], _explain(e, root)) for e in exc.errors())
