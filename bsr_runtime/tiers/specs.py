"""The specs of the built-in tier types (registered in registry.py, opened by factory.py): one schema each.

    {"type": "filesystem", "root": "/mnt/ssd/bsr", "load_concurrency": 4, "fsync": false, "checksum": "auto"}
    {"type": "mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata",
     ...MooncakeConnection fields, "tuning": {...MooncakeTuning fields}}
"""

from __future__ import annotations

from typing import Literal

from ..config_schema import Count, HostPort, Name, Schema
from .mooncake_options import MooncakeConnection, MooncakeTierOptions, MooncakeTuning


class FilesystemTierSpec(Schema):
    type: Literal["filesystem"] = "filesystem"
    root: Name  # an existing writable directory
    load_concurrency: Count | None = None  # None: $LMCACHE_FS_LOAD_CONCURRENCY or 1
    fsync: bool = False
    checksum: Literal["auto", "crc32", "crc32c"] = "auto"


class MooncakeTierSpec(MooncakeConnection):
    type: Literal["mooncake"] = "mooncake"
    master_address: HostPort
    metadata_server: Name
    tuning: MooncakeTuning = MooncakeTuning()  # working defaults (how reads are batched, checked, landed)

    def options(self) -> MooncakeTierOptions:
        """The tier's keyword options: the connection's and the tuning's, flat."""
        connection = {k: getattr(self, k) for k in MooncakeConnection.model_fields}
        tuning = {k: getattr(self.tuning, k) for k in MooncakeTuning.model_fields}
        return MooncakeTierOptions(**connection, **tuning)
