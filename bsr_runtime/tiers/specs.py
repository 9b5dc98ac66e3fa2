"""The tier specs of the one tier factory (factory.py): one schema per tier type.

    {"type": "filesystem", "root": "/mnt/ssd/bsr", "load_concurrency": 4, "fsync": false, "checksum": "auto"}
    {"type": "mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata",
     ...MooncakeTierOptions fields}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from ..config_schema import ConfigError, Count, HostPort, Name, Schema, parse, short_repr
from .mooncake_options import MooncakeTierOptions


class FilesystemTierSpec(Schema):
    type: Literal["filesystem"] = "filesystem"
    root: Name  # an existing writable directory
    load_concurrency: Count | None = None  # None: $LMCACHE_FS_LOAD_CONCURRENCY or 1
    fsync: bool = False
    checksum: Literal["auto", "crc32", "crc32c"] = "auto"


class MooncakeTierSpec(MooncakeTierOptions):
    type: Literal["mooncake"] = "mooncake"
    master_address: HostPort
    metadata_server: Name

    def options(self) -> MooncakeTierOptions:
        return MooncakeTierOptions(**{k: getattr(self, k) for k in MooncakeTierOptions.model_fields})


TIER_SPECS: dict[str, type[Schema]] = {"filesystem": FilesystemTierSpec, "mooncake": MooncakeTierSpec}
TIER_TYPES = tuple(TIER_SPECS)


def spec_schema(spec: object) -> type[Schema]:
    """The schema of `spec`'s type; a one-line ConfigError for a spec that is no mapping or of no known type."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a tier spec must be a mapping with a 'type', got {type(spec).__name__}")
    kind = spec.get("type")
    if kind not in TIER_SPECS:
        raise ConfigError(f"unknown tier type {short_repr(kind)}; choose one of {', '.join(TIER_TYPES)}")
    return TIER_SPECS[kind]


def parse_tier_spec(spec: object) -> FilesystemTierSpec | MooncakeTierSpec:
    """A checked tier spec; one ConfigError naming every bad key otherwise."""
    schema = spec_schema(spec)
    return parse(schema, spec, f"{spec['type']} tier spec")
