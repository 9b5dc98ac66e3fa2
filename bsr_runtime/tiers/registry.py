"""Tier types by name: the one place a tier type is registered, where the tier factory's users (an
engine's connector, the contract tests) look it up.

A tier type is its name, the schema of its spec (strict: one error naming every bad key, as in
specs.py) and an opener (a context manager yielding the ready Tier and closing it on exit), plus what
an engine's connector needs to know of it: the option naming a directory the connector creates where
missing, and options an engine defaults differently from a library user. Schemas and openers may be
given as "module:attribute" strings, loaded on first use, so that listing the types imports no tier
library. Built in: filesystem and mooncake. An integration registers its types as entry points of the
group "bsr.tier_types" (pyproject.toml: the LMCache integration's two; the entry point names a
TierType), or in code with `register_tier_type`:

    register_tier_type(TierType("mytier", MyTierSpec, open_my_tier))
    ConnectorConfig.from_extra({"tiers": [{"type": "mytier", ...}]})   # checked by MyTierSpec
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from bsr_kernels import Registration

from ..config_schema import ConfigError, Schema, parse, short_repr
from .base import Tier

ENTRY_POINT_GROUP = "bsr.tier_types"

# (registration, the spec checked by the type's schema) -> a context manager yielding the Tier
Opener = Callable[[Registration, Schema], AbstractContextManager[Tier]]


@dataclass(frozen=True)
class TierType:
    """One tier type. `schema` and `opener` may be "module:attribute" strings (loaded on first use)."""

    name: str
    schema: type[Schema] | str
    opener: Opener | str
    directory_option: str | None = None  # an option naming a directory a connector creates where missing
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)  # options an engine sets unless given

    def load_schema(self) -> type[Schema]:
        return _resolve(self.schema)

    def parse(self, options: Mapping[str, Any]) -> Schema:
        """The checked spec of `options` (without "type"); one ConfigError naming every bad key otherwise."""
        return parse(self.load_schema(), {"type": self.name, **options}, f"{self.name} tier spec")

    def open(self, reg: Registration, options: Mapping[str, Any]) -> AbstractContextManager[Tier]:
        """The tier of `options`, checked first (once: the opener gets the checked spec); the context manager
        closes it."""
        return _resolve(self.opener)(reg, self.parse(options))


def _resolve(obj):
    if not isinstance(obj, str):
        return obj
    module, _, attr = obj.partition(":")
    return getattr(importlib.import_module(module), attr)


_lock = threading.Lock()
_types: dict[str, TierType] = {}
_plugins: dict[str, object] | None = None  # entry point name -> entry point, not loaded yet


def register_tier_type(tier_type: TierType) -> TierType:
    """Make `tier_type` known by its name (again: the same object is a no-op; another one is refused)."""
    with _lock:
        known = _types.get(tier_type.name)
        if known is not None and known != tier_type:
            raise ValueError(f"tier type {tier_type.name!r} is registered already")
        _types[tier_type.name] = tier_type
    return tier_type


def unregister_tier_type(name: str) -> None:
    """Forget a tier type registered in code (tests)."""
    with _lock:
        _types.pop(name, None)


def _entry_points() -> dict[str, object]:
    global _plugins
    if _plugins is None:
        _plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _plugins


def tier_type_names() -> tuple[str, ...]:
    """Every known tier type: the built-in ones and those registered in code, then the entry points' in their
    declared order, loaded or not (the order never depends on which were used first)."""
    plugins = _entry_points()
    with _lock:
        names = [n for n in _types if n not in plugins]
    return (*names, *plugins)


def tier_type(name: object) -> TierType:
    """The tier type called `name` (an entry point's is loaded now); a one-line ConfigError otherwise."""
    with _lock:
        found = _types.get(name) if isinstance(name, str) else None
    if found is not None:
        return found
    ep = _entry_points().get(name) if isinstance(name, str) else None
    if ep is None:
        raise ConfigError(f"unknown tier type {short_repr(name)}; choose one of {', '.join(tier_type_names())}")
    loaded = ep.load()
    if not isinstance(loaded, TierType) or loaded.name != name:
        raise ConfigError(f"entry point {name!r} of {ENTRY_POINT_GROUP} is not a TierType named {name!r}")
    return register_tier_type(loaded)


def _split(spec: object) -> tuple[TierType, dict[str, Any]]:
    """(the type `spec` names, its options without "type"); a one-line ConfigError for a spec of no known type."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a tier spec must be a mapping with a 'type', got {type(spec).__name__}")
    return tier_type(spec.get("type")), {k: v for k, v in spec.items() if k != "type"}


def parse_tier_spec(spec: object) -> Schema:
    """The checked spec ({"type": name, ...options}) of any registered type; one ConfigError naming every bad key."""
    t, options = _split(spec)
    return t.parse(options)


def open_tier(reg: Registration, spec: Mapping[str, Any]) -> AbstractContextManager[Tier]:
    """The tier of `spec` ({"type": name, ...options}), checked first; the context manager closes it."""
    t, options = _split(spec)
    return t.open(reg, options)


_BUILTIN_OPENER = "bsr_runtime.tiers.factory:open_spec"  # a string: this module imports no tier
register_tier_type(TierType("filesystem", "bsr_runtime.tiers.specs:FilesystemTierSpec", _BUILTIN_OPENER,
                            directory_option="root"))
# an engine mounts no segment by default: its objects live on the store hosts and outlive the engine
register_tier_type(TierType("mooncake", "bsr_runtime.tiers.specs:MooncakeTierSpec", _BUILTIN_OPENER,
                            engine_defaults={"global_segment_size": 0}))
