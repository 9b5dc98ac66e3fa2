"""BSR inside LMCache 0.5.6's multiprocess storage stack: the only importer of lmcache.

The modules of this package and the two L2 plugins (fs_l2.py, mooncake_l2.py) are the only places
that import LMCache; nothing else in bsr_runtime imports them at import time. `LMCacheAdapter`
(adapter.py) is the entry point; see each module's docstring for its part.
"""

from .adapter import LMCacheAdapter
from .config import (
    CONFIG_FILE_ENV,
    BSRLMCacheConfig,
    align_up,
    build_storage_manager,
    fs_l2_config,
    load_adapter_config,
    mooncake_l2_config,
)
from .l1_usage import L1UsageTracker
from .objects import LMCacheKeys, chunk_layout
from .probe import PROBE_BATCH_CHUNKS, LMCacheLookup, LMCacheProbeResult
from .retrieve import L1RestoreStage, L1WindowError, LMCacheRestoreReport
from .store import L1StoreStage

__all__ = [
    "CONFIG_FILE_ENV", "PROBE_BATCH_CHUNKS", "BSRLMCacheConfig", "L1RestoreStage", "L1StoreStage",
    "L1UsageTracker", "L1WindowError", "LMCacheAdapter", "LMCacheKeys", "LMCacheLookup", "LMCacheProbeResult",
    "LMCacheRestoreReport", "align_up", "build_storage_manager", "chunk_layout", "fs_l2_config",
    "load_adapter_config", "mooncake_l2_config",
]
