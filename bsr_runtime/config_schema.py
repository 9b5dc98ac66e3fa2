"""Configuration validated where it enters: one schema per config, one error naming every bad key.

A schema is a pydantic model (`Schema`): strict types (the string "256" is not an integer, 1 is
not a bool, 2.0 is not a count), ranges, and unknown keys refused, so a typo is an error, never a
silent fallback to a default. `parse` turns a mapping into the schema's object or raises one
`ConfigError` (a ValueError) whose single line lists every bad key with what is wrong and what was
given. Adding a key to a config is one line: a field with its type, range and default.

The field types shared by BSR's configs are defined here (`Count`, `Seconds`, `Text`, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from .validation import TIMEOUT_MAX_S, check_text


class ConfigError(ValueError):
    """A configuration with bad keys; the message names every one of them, on one line."""


class Schema(BaseModel):
    """A configuration's schema: strict types, unknown keys refused, immutable once parsed."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


S = TypeVar("S", bound=Schema)


def _utf8(value: str) -> str:
    return check_text("text", value)


def _host_port(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT")
    return value


def _existing_parent(value: str) -> str:
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise ValueError(f"its directory {parent} does not exist")
    if os.path.isdir(value):
        raise ValueError("it is a directory")
    return value


Text = Annotated[str, AfterValidator(_utf8)]  # any text (may be empty)
Name = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]  # a non-empty name or path
HostPort = Annotated[str, AfterValidator(_host_port)]
OutputFile = Annotated[str, Field(min_length=1), AfterValidator(_existing_parent)]  # a file BSR writes
Count = Annotated[int, Field(ge=1)]  # threads, workers, window sizes that cannot be 0
Size = Annotated[int, Field(ge=0)]  # bytes, where 0 means none
Seconds = Annotated[float, Field(gt=0, le=TIMEOUT_MAX_S, allow_inf_nan=False)]  # any timeout
Backend = Literal["auto", "torch", "cpu", "triton", "cuda"]  # bsr_kernels install backends


def problems(schema: type[Schema], data: Any, prefix: str = "") -> list[str]:
    """Every bad key of `data` for `schema`, one "key: what is wrong (got value)" each (none: it parses)."""
    if not isinstance(data, Mapping):
        return [f"{prefix or 'the config'}: expected a mapping of keys, got {type(data).__name__}"]
    try:
        schema.model_validate(dict(data))
    except ValidationError as e:
        return describe(e, schema, prefix)
    return []


def parse(schema: type[S], data: Any, what: str) -> S:
    """`data` as a `schema` object; ConfigError("what: key: problem; key: problem") otherwise."""
    bad = problems(schema, data)
    if bad:
        raise_problems(what, bad)
    return schema.model_validate(dict(data))


def raise_problems(what: str, bad: list[str]) -> None:
    """One ConfigError for `what` listing every problem."""
    many = f"{len(bad)} bad keys: " if len(bad) > 1 else ""
    raise ConfigError(f"{what}: {many}{'; '.join(bad)}")


def describe(e: ValidationError, schema: type[Schema], prefix: str = "") -> list[str]:
    out = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}.{loc}" if prefix and loc else prefix or loc or "the config"
        kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            out.append(f"{key}: unknown key (known: {', '.join(_fields_at(schema, err['loc'][:-1]))})")
        elif kind == "missing":
            out.append(f"{key}: missing (required)")
        elif kind == "string_unicode":
            out.append(f"{key}: not valid Unicode text (got {_short(err.get('input'))})")
        elif kind in ("model_type", "dict_type", "model_attributes_type"):
            out.append(f"{key}: expected a mapping of keys (got {_short(err.get('input'))})")
        else:
            out.append(f"{key}: {msg[:1].lower()}{msg[1:]} (got {_short(err.get('input'))})")
    return out


def _fields_at(schema: type[Schema], loc: tuple) -> list[str]:
    """The keys a nested schema at `loc` knows (list indices skipped)."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = schema.model_fields.get(part)
        nested = _schema_in(field.annotation) if field is not None else None
        if nested is None:
            return []
        schema = nested
    return list(schema.model_fields)


def _schema_in(annotation: object) -> type[Schema] | None:
    if isinstance(annotation, type) and issubclass(annotation, Schema):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _schema_in(arg)
        if found is not None:
            return found
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
