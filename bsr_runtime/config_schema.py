"""Configuration validated where it enters: one schema per config, one error naming every bad key.

A schema is a pydantic model (`Schema`): strict types (the string "256" is not an integer, 1 is
not a bool, 2.0 is not a count), ranges, and unknown keys refused, so a typo is an error, never a
silent fallback to a default. `parse` turns a mapping into the schema's object or raises one
`ConfigError` (a ValueError) whose single line lists every bad key with what is wrong and what was
given. Adding a key to a config is one line: a field with its type, range and default.

The error is one line whatever the input: a key that is not a plain name and every value are shown
by `short_repr`, which cuts a value before formatting it (a value built from YAML aliases can be
exponentially larger than its file; a 10**5000 integer cannot even be printed), and `raise_problems`
escapes any line break left. `load_yaml` bounds what a YAML file's aliases expand to.

The field types shared by BSR's configs are defined here (`Count`, `Seconds`, `Text`, `HostBytes`, ...).
"""

from __future__ import annotations

import os
import re
import reprlib
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

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


def _backend(value: str) -> str:
    from bsr_kernels.backends import backend_names  # the install backends' registry

    names = ("auto", *backend_names())
    if value not in names:
        raise ValueError(f"expected one of {', '.join(names)}")
    return value


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


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _fits_in_memory(value: int) -> int:
    # refused where it enters: a larger size passes every later check, then fails in an allocator or
    # (fitting the address space, not RAM) is prefaulted at start-up until the OOM killer ends it
    total = physical_memory_bytes()
    if total is not None and value > total:
        raise ValueError(f"more than this machine's physical memory ({total} bytes = {total / 2**30:.1f} GiB)")
    return value


Text = Annotated[str, AfterValidator(_utf8)]  # any text (may be empty)
Name = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]  # a non-empty name or path
HostPort = Annotated[str, AfterValidator(_host_port)]
OutputFile = Annotated[str, Field(min_length=1), AfterValidator(_existing_parent)]  # a file BSR writes
Count = Annotated[int, Field(ge=1)]  # threads, workers, window sizes that cannot be 0
Size = Annotated[int, Field(ge=0)]  # bytes, where 0 means none
Seconds = Annotated[float, Field(gt=0, le=TIMEOUT_MAX_S, allow_inf_nan=False)]  # any timeout
HostBytes = Annotated[int, Field(ge=0), AfterValidator(_fits_in_memory)]  # bytes allocated in this host's memory
Backend = Annotated[str, AfterValidator(_backend)]  # "auto" or a registered install backend (bsr_kernels/backends.py)


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
    raise ConfigError(one_line(f"{what}: {many}{'; '.join(bad)}"))


# every character str.splitlines() breaks a line at, escaped as repr() writes it
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: str) -> str:
    """`text` with its line breaks escaped: an error is one line whatever a caller put in it (a path,
    an OS message)."""
    return text.translate(_LINE_BREAKS)


def describe(e: ValidationError, schema: type[Schema], prefix: str = "") -> list[str]:
    out = []
    for err in e.errors(include_url=False):
        loc = ".".join(key_text(p) for p in err["loc"])
        key = f"{prefix}.{loc}" if prefix and loc else prefix or loc or "the config"
        kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            out.append(f"{key}: unknown key (known: {', '.join(_fields_at(schema, err['loc'][:-1]))})")
        elif kind == "missing":
            out.append(f"{key}: missing (required)")
        elif kind == "string_unicode":
            out.append(f"{key}: not valid Unicode text (got {short_repr(err.get('input'))})")
        elif kind in ("model_type", "dict_type", "model_attributes_type"):
            out.append(f"{key}: expected a mapping of keys (got {short_repr(err.get('input'))})")
        else:
            out.append(f"{key}: {msg[:1].lower()}{msg[1:]} (got {short_repr(err.get('input'))})")
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


SHOWN_CHARS = 60  # what an error shows of one value or key
_PLAIN_KEY = re.compile(rf"[A-Za-z0-9_-]{{1,{SHOWN_CHARS}}}\Z")


def key_text(key: object) -> str:
    """A key as an error names it: a plain name as it is, anything else (a newline, a colon, a
    megabyte of text, a number) quoted and cut by short_repr."""
    if isinstance(key, int) and not isinstance(key, bool) and key.bit_length() <= 64:
        return str(key)
    return key if isinstance(key, str) and _PLAIN_KEY.match(key) else short_repr(key)


class _BoundedRepr(reprlib.Repr):
    """reprlib's cut repr, also for what reprlib formats whole first: bytes, and integers (Python
    refuses to print one over 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 4
        self.maxset = self.maxfrozenset = self.maxdeque = 4
        self.maxstring = self.maxlong = self.maxother = SHOWN_CHARS

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * SHOWN_CHARS:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[:SHOWN_CHARS]) + ("..." if len(x) > SHOWN_CHARS else "")

    repr_bytearray = repr_bytes


_REPR = _BoundedRepr()


def short_repr(value: object, limit: int = SHOWN_CHARS) -> str:
    """repr(value) in about `limit` characters, on one line, at a cost bounded by what it shows:
    strings and bytes cut before they are formatted, containers to 3 levels and 4 items."""
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:limit]) + ("..." if len(value) > limit else "")
    else:
        try:
            text = _REPR.repr(value)
        except Exception:  # noqa: BLE001 - an object whose repr fails is still named
            text = f"<{type(value).__name__}>"
        text = text if len(text) <= limit else text[: limit - 3] + "..."
    return one_line(text)


MAX_YAML_NODES = 1 << 22  # more than any config BSR reads (a registration of 65536 tensors: ~1.2M)


def load_yaml(text: str | bytes, max_nodes: int = MAX_YAML_NODES) -> Any:
    """The YAML document `text` (safe types only); a one-line ValueError for a syntax error, or when
    its aliases expand it beyond `max_nodes` nodes: a few hundred bytes of nested aliases stand for
    billions of nodes, which every later walk (a check, an error message) would pay for."""
    import yaml

    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, max_nodes)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ValueError(_yaml_problem(e)) from None


def _yaml_problem(e: Exception) -> str:
    """PyYAML's error in one line: what is wrong and where (its own text spans several, with the
    offending line and a caret)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(e)


def _check_expansion(root: Any, max_nodes: int) -> None:
    """Counts the document's nodes as its aliases expand it (a shared node once per use), memoized
    per node: one visit per node of the file, whatever the expansion."""
    size: dict[int, int] = {}  # id(node) -> expanded size; -1 while its children are counted
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        if counted:
            size[id(node)] = 1 + sum(size[id(k)] for k in _children(node))
            if size[id(node)] > max_nodes:
                raise ValueError(f"its aliases expand it to more than {max_nodes} values")
        elif size.get(id(node), -2) == -1:
            raise ValueError("an alias refers to a value that contains it (a recursive document)")
        elif id(node) not in size:
            size[id(node)] = -1
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node) if size.get(id(k), -1) < 0)


def _children(node: Any) -> list[Any]:
    value = getattr(node, "value", None)
    if not isinstance(value, list):
        return []
    return [n for pair in value for n in pair] if value and isinstance(value[0], tuple) else list(value)
