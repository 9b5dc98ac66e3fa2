"""Schemas of the LMCache integration's configurations: the two L2 plugins' `adapter_params` and
the LMCache tier specs a connector lists (bsr_runtime/config_schema.py: strict types, ranges,
unknown keys refused, one error naming every bad key).

    {"type": "lmcache-filesystem", "root": "/ssd/lmcache", "load_concurrency": 4, "l1_bytes": 268435456,
     "config_file": null, ...FSL2Options}
    {"type": "lmcache-mooncake", "master_address": "H:50051", "metadata_server": "http://H:8080/metadata",
     "l1_bytes": 268435456, "config_file": null, ...MooncakeL2Params}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from bsr_runtime.config_schema import Count, HostBytes, HostPort, Name, Schema, Seconds, Size, Text
from bsr_runtime.tiers.mooncake_options import DEFAULT_SEGMENT_BYTES, MooncakeProtocol

DEFAULT_L1_BYTES = 256 << 20


class FSL2Options(Schema):
    """The FS L2 plugin's options (fs_l2.py), LMCache's FSL2Adapter's plus `load_concurrency`."""

    relative_tmp_dir: Name | None = None  # temp files in this subdirectory of base_path (default: beside the objects)
    read_ahead_size: Count | None = None  # read this many payload bytes first (filesystem readahead)
    use_odirect: bool = False  # ignored with a warning (the object header breaks O_DIRECT alignment)
    load_concurrency: Count | None = None  # None: $LMCACHE_FS_LOAD_CONCURRENCY, default 1


class FSL2Params(FSL2Options):
    """`adapter_params` of the FS L2 plugin."""

    base_path: Name


class MooncakeL2Params(Schema):
    """`adapter_params` of the Mooncake L2 plugin (mooncake_l2.py); see MooncakeTierOptions for their meaning."""

    master_address: HostPort
    metadata_server: Name
    protocol: MooncakeProtocol = "tcp"
    local_hostname: Name = "127.0.0.1"
    global_segment_size: HostBytes = DEFAULT_SEGMENT_BYTES
    local_buffer_size: HostBytes = 16 << 20
    device_name: Text = ""
    connect_timeout_s: Seconds = 10.0
    rpc_timeout_s: Seconds = 5.0
    tenant_id: Name = "default"
    num_workers: Count = 2
    key_prefix: Name = Field("lmcache", pattern="^[^@]*$")  # "@" separates the fields of a store key
    register_l1: bool = True
    max_capacity_bytes: Size = 0  # > 0: LMCache's L2 eviction controller may evict
    fingerprint: Name = "lmcache-l2"
    verify_batch_bytes: Count = 8 << 20
    put_batch_bytes: Count = 64 << 20
    eviction: dict[str, Any] | None = None  # LMCache's L2 eviction config, parsed by LMCache


class LMCacheTierOptions(Schema):
    """What every LMCache tier spec has: the L1 and the adapter config (config.py)."""

    l1_bytes: Annotated[HostBytes, Field(ge=1)] = DEFAULT_L1_BYTES
    config_file: Name | None = None  # default $LMCACHE_BSR_CONFIG_FILE, then LMCACHE_* variables


class LMCacheFSTierSpec(LMCacheTierOptions, FSL2Options):
    type: Literal["lmcache-filesystem"] = "lmcache-filesystem"
    root: Name


class LMCacheMooncakeTierSpec(LMCacheTierOptions, MooncakeL2Params):
    type: Literal["lmcache-mooncake"] = "lmcache-mooncake"


LMCACHE_TIER_SPECS: dict[str, type[Schema]] = {"lmcache-filesystem": LMCacheFSTierSpec,
                                               "lmcache-mooncake": LMCacheMooncakeTierSpec}
