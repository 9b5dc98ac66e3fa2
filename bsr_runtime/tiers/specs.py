"""The specs of the built-in tier types (registered in registry.py, opened by factory.py): one schema each.

    {"type": "filesystem", "root": "/mnt/ssd/bsr", "load_concurrency": 4, "fsync": false, "checksum": "auto"}
    {"type": "mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata",
     ...MooncakeTierOptions fields}
"""

from __future__ import annotations

from typing import Literal

from ..config_schema import Count, HostPort, Name, Schema
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
