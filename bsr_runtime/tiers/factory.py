"""The one tier factory: a Tier from a plain config mapping.

Used by the engine integrations (a connector's tier list) and by the harness (the CLI and the
benchmarks, which first start what a tier needs). Starting services is not a tier's business:
a Mooncake tier here connects to a master that is already running.

    {"type": "filesystem", "root": "/mnt/ssd/bsr", ...FilesystemTier options}
    {"type": "mooncake", "master_address": "127.0.0.1:50051",
     "metadata_server": "http://127.0.0.1:8080/metadata", ...MooncakeTier options}
"""

from __future__ import annotations

from collections.abc import Mapping

from bsr_kernels import Registration

from .base import Tier

TIER_TYPES = ("filesystem", "mooncake")
_REQUIRED = {"filesystem": ("root",), "mooncake": ("master_address", "metadata_server")}


def make_tier(reg: Registration, spec: Mapping) -> Tier:
    """A ready tier for `reg` from `spec`; a bad spec is a one-line ValueError before anything opens."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"a tier spec must be a mapping with a 'type', got {type(spec).__name__}")
    options = dict(spec)
    kind = options.pop("type", None)
    if kind not in TIER_TYPES:
        raise ValueError(f"unknown tier type {kind!r}; choose one of {', '.join(TIER_TYPES)}")
    missing = [k for k in _REQUIRED[kind] if not options.get(k)]
    if missing:
        raise ValueError(f"{kind} tier spec needs {', '.join(missing)}")
    try:
        if kind == "filesystem":
            from .filesystem import FilesystemTier

            return FilesystemTier(options.pop("root"), reg.chunk_bytes, reg.fingerprint, **options)
        from .mooncake import MooncakeTier

        return MooncakeTier(reg.chunk_bytes, reg.fingerprint, options.pop("master_address"),
                            options.pop("metadata_server"), **options)
    except TypeError as e:  # an unknown option
        raise ValueError(f"{kind} tier spec: {e}") from None
