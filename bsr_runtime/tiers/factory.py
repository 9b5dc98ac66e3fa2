"""The built-in tier types' opener: a FilesystemTier or MooncakeTier from a plain config mapping.

Reached through the tier registry (registry.py: every tier type by name, integrations' too) and used
directly by the harness (the CLI and the benchmarks, which first start what a tier needs). Starting
services is not a tier's business: a Mooncake tier here connects to a master that is already running.
The specs and their schemas are in specs.py: a bad spec is one ValueError naming every bad key, before
anything opens.
"""

from __future__ import annotations

from collections.abc import Mapping

from bsr_kernels import Registration

from ..config_schema import Schema
from .base import Tier
from .registry import parse_tier_spec
from .specs import FilesystemTierSpec, MooncakeTierSpec

__all__ = ["make_tier"]


def make_tier(reg: Registration, spec: Mapping) -> Tier:
    """A ready tier of a built-in type for `reg` from `spec` (specs.py), checked first; another registered
    type is opened by registry.open_tier."""
    return open_spec(reg, parse_tier_spec(spec))


def open_spec(reg: Registration, s: Schema) -> Tier:
    """The registry's opener of the built-in types: the tier of a checked spec (a Tier is its own context
    manager)."""
    if isinstance(s, FilesystemTierSpec):
        from .filesystem import FilesystemTier

        return FilesystemTier(s.root, reg.chunk_bytes, reg.fingerprint, load_concurrency=s.load_concurrency,
                              fsync=s.fsync, checksum=s.checksum)
    if isinstance(s, MooncakeTierSpec):
        from .mooncake import MooncakeTier

        return MooncakeTier(reg.chunk_bytes, reg.fingerprint, s.master_address, s.metadata_server, s.options())
    raise ValueError(f"make_tier opens the built-in tier types; open {s.type!r} with "
                     f"bsr_runtime.tiers.registry.open_tier")
