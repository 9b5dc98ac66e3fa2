"""The LMCache integration's tier types (registry.py): entry points of the group "bsr.tier_types"
(pyproject.toml). Loading one imports this package, and with it LMCache: only when such a tier is used."""

from __future__ import annotations

from bsr_runtime.tiers.registry import TierType

LMCACHE_FILESYSTEM = TierType("lmcache-filesystem", "bsr_runtime.integrations.lmcache.specs:LMCacheFSTierSpec",
                              "bsr_runtime.integrations.lmcache.tier:open_lmcache_spec", directory_option="root")
# an engine mounts no segment by default, as with the mooncake type: objects live on the store hosts
LMCACHE_MOONCAKE = TierType("lmcache-mooncake", "bsr_runtime.integrations.lmcache.specs:LMCacheMooncakeTierSpec",
                            "bsr_runtime.integrations.lmcache.tier:open_lmcache_spec",
                            engine_defaults={"global_segment_size": 0})
