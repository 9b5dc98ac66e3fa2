"""The one tier factory: a Tier from a plain config mapping.

Used by the engine integrations (a connector's tier list) and by the harness (the CLI and the
benchmarks, which first start what a tier needs). Starting services is not a tier's business:
a Mooncake tier here connects to a master that is already running. The specs and their schemas
are in specs.py: a bad spec is one ValueError naming every bad key, before anything opens.
"""

from __future__ import annotations

from collections.abc import Mapping

from bsr_kernels import Registration

from .base import Tier
from .specs import TIER_TYPES, FilesystemTierSpec, parse_tier_spec

__all__ = ["TIER_TYPES", "make_tier"]


def make_tier(reg: Registration, spec: Mapping) -> Tier:
    """A ready tier for `reg` from `spec` (specs.py)."""
    s = parse_tier_spec(spec)
    if isinstance(s, FilesystemTierSpec):
        from .filesystem import FilesystemTier

        return FilesystemTier(s.root, reg.chunk_bytes, reg.fingerprint, load_concurrency=s.load_concurrency,
                              fsync=s.fsync, checksum=s.checksum)
    from .mooncake import MooncakeTier

    return MooncakeTier(reg.chunk_bytes, reg.fingerprint, s.master_address, s.metadata_server, s.options())
