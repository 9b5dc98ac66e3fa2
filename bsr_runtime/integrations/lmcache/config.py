"""The adapter's configuration and the LMCache storage stack it runs on.

Config, the LMCache way: a config class made by LMCache's `create_config_class`, loaded with
`load_config_with_overrides`: the file named by LMCACHE_BSR_CONFIG_FILE, then LMCACHE_* variables,
then explicit overrides. LMCACHE_PREFETCH_WINDOW_CHUNKS (W, default 0 = LMCache's whole-plan
behaviour), LMCACHE_PROBE_ONLY, LMCACHE_FS_LOAD_CONCURRENCY (read by the FS L2 plugin, fs_l2.py),
LMCACHE_PREFETCH_TIMEOUT_S, LMCACHE_INSTALL_BACKEND, LMCACHE_EVICT_RETAINED.

`build_storage_manager` makes LMCache 0.5.6's multiprocess StorageManager (one DRAM L1, the given
L2 adapters); `fs_l2_config` and `mooncake_l2_config` are the L2 plugin configs of fs_l2.py and mooncake_l2.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache.v1.config_base import create_config_class, load_config_with_overrides
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, L2AdaptersConfig
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.distributed.storage_manager import StorageManager

from bsr_runtime.restore import MAX_WINDOW_CHUNKS


def _to_bool(v) -> bool:
    if isinstance(v, bool):
        return v
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def _validate(self) -> None:
    w = self.prefetch_window_chunks
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WINDOW_CHUNKS:
        raise ValueError(f"prefetch_window_chunks (W) must be an integer in [0, {MAX_WINDOW_CHUNKS}], got {w!r}")
    n = self.fs_load_concurrency
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fs_load_concurrency must be an integer >= 1, got {n!r}")
    if not (isinstance(self.prefetch_timeout_s, (int, float)) and self.prefetch_timeout_s > 0):
        raise ValueError(f"prefetch_timeout_s must be positive, got {self.prefetch_timeout_s!r}")


_CONFIG_DEFINITIONS = {
    "prefetch_window_chunks": {"type": int, "default": 0, "env_converter": int,
                               "description": "W: chunks per prefetch window; 0 = LMCache's whole-plan prefetch"},
    "probe_only": {"type": bool, "default": False, "env_converter": _to_bool,
                   "description": "lookup() reports hits without making them resident or keeping locks"},
    "fs_load_concurrency": {"type": int, "default": 1, "env_converter": int,
                            "description": "concurrent file reads per FS L2 load task (fs_l2 plugin)"},
    "prefetch_timeout_s": {"type": float, "default": 30.0, "env_converter": float,
                           "description": "per window: a prefetch not complete by then fails the retrieve"},
    "install_backend": {"type": str, "default": "auto", "env_converter": str,
                        "description": "bsr_kernels install backend: auto, torch, cpu, triton, cuda"},
    "evict_retained": {"type": bool, "default": True, "env_converter": _to_bool,
                       "description": "W > 0: delete L2-loaded keys a retaining prefetch policy kept in L1"},
}

BSRLMCacheConfig = create_config_class(
    "BSRLMCacheConfig", _CONFIG_DEFINITIONS, namespace_extras={"validate": _validate}, env_prefix="LMCACHE_"
)
CONFIG_FILE_ENV = "LMCACHE_BSR_CONFIG_FILE"


def load_adapter_config(config_file: str | None = None, **overrides):
    """The adapter config, loaded like LMCache's own: file (`config_file` or $LMCACHE_BSR_CONFIG_FILE),
    then LMCACHE_* environment variables, then `overrides`; validated."""
    return load_config_with_overrides(BSRLMCacheConfig, CONFIG_FILE_ENV, config_file, overrides or None)


def fs_l2_config(base_path: str, load_concurrency: int | None = None, **kw) -> PluginL2AdapterConfig:
    """LMCache's FS L2 adapter with concurrent loads (fs_l2.ConcurrentFSL2Adapter), as a plugin.
    `load_concurrency` None: $LMCACHE_FS_LOAD_CONCURRENCY (default 1 = LMCache's one-at-a-time loads)."""
    params = {"base_path": str(base_path), **kw}
    if load_concurrency is not None:
        params["load_concurrency"] = int(load_concurrency)
    return PluginL2AdapterConfig.from_dict({
        "module_path": "bsr_runtime.integrations.lmcache.fs_l2", "class_name": "ConcurrentFSL2Adapter",
        "adapter_params": params,
    })


def mooncake_l2_config(master_address: str, metadata_server: str, **kw) -> PluginL2AdapterConfig:
    """The Mooncake L2 adapter of mooncake_l2.py (pip wheels only), as a plugin."""
    params = {"master_address": master_address, "metadata_server": metadata_server, **kw}
    return PluginL2AdapterConfig.from_dict({
        "module_path": "bsr_runtime.integrations.lmcache.mooncake_l2", "class_name": "BSRMooncakeL2Adapter",
        "adapter_params": params,
    })


def build_storage_manager(l1_bytes: int, l2: Sequence[L2AdapterConfigBase] = (), *, align_bytes: int = 4096,
                          store_policy: str = "skip_l1", prefetch_policy: str = "default",
                          eviction_policy: str = "LRU") -> StorageManager:
    """A StorageManager with one DRAM L1 of `l1_bytes` (eager, no SHM) and the given L2 adapters.

    store_policy "skip_l1" (LMCache's BufferOnlyStorePolicy) drops objects from L1 once every L2
    adapter stored them; "default" keeps them. prefetch_policy "default" loads L2 objects as
    temporary L1 objects (freed by the last finish_read), "retain" keeps them."""
    mem = L1MemoryManagerConfig(size_in_bytes=int(l1_bytes), use_lazy=False, shm_name="", align_bytes=align_bytes)
    cfg = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=mem),
        eviction_config=EvictionConfig(eviction_policy=eviction_policy),
        l2_adapter_config=L2AdaptersConfig(list(l2)),
        store_policy=store_policy,
        prefetch_policy=prefetch_policy,
    )
    return StorageManager(cfg)


def align_up(n: int, a: int) -> int:
    """`n` rounded up to a multiple of `a` (LMCache's physical object size: align_up(c, align_bytes))."""
    return -(-n // a) * a if a > 1 else n
