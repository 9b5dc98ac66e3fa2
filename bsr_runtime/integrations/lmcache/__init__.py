"""BSR inside LMCache 0.5.6's multiprocess storage stack: the only importer of lmcache.

One road in: `LMCacheTier` (tier.py), a BSR Tier over LMCache's StorageManager, opened from a tier
spec by `open_lmcache_tier` (what the vLLM connector and the `bsr` sweeps do) or made directly with
`LMCacheTier.create`. It restores and stores like every tier, through the runtime's window loop.
The other modules are its parts (see each docstring) and the two L2 plugins (fs_l2.py, mooncake_l2.py).
"""

from .config import (
    CONFIG_FILE_ENV,
    BSRLMCacheConfig,
    align_up,
    build_storage_manager,
    fs_l2_config,
    load_adapter_config,
    mooncake_l2_config,
)
from .objects import chunk_layout, model_name, object_keys
from .tier import LMCacheTier, open_lmcache_tier

__all__ = [
    "CONFIG_FILE_ENV", "BSRLMCacheConfig", "LMCacheTier", "align_up", "build_storage_manager", "chunk_layout",
    "fs_l2_config", "load_adapter_config", "model_name", "mooncake_l2_config", "object_keys", "open_lmcache_tier",
]
