"""LMCache tier helpers for the tests: store and restore through the one road (LMCacheTier under the
runtime's store path and BoundedRestorer), and where the FS L2 plugin keeps a chunk's object."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bsr_kernels import Registration
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreReport, RestoreRequest
from bsr_runtime.store import StoreReport, store_prefix


def store(tier, reg: Registration, space: KeySpace, tokens: Sequence[int], kv: list[torch.Tensor],
          tables: list[torch.Tensor], num_chunks: int | None = None, window_chunks: int = 8) -> StoreReport:
    """Chunks 0..num_chunks-1 into the tier; each put stages `window_chunks` objects in LMCache's L1."""
    return store_prefix(reg, tier, space, tokens, kv, tables, num_chunks, window_chunks=window_chunks)


def restore(tier, req: RestoreRequest, num_chunks: int, window_chunks: int, *, fetch_timeout_s: float = 30.0,
            **config) -> RestoreReport:
    """One restore of chunks 0..num_chunks-1 from the tier at W = window_chunks, at the tier's depth for that W."""
    depth = tier.preferred_pipeline_depth(window_chunks * tier.reg.chunk_bytes)
    cfg = RestoreConfig(window_chunks=window_chunks, pipeline_depth=depth,
                        fetch_timeout_s=fetch_timeout_s, **config)
    with BoundedRestorer(tier.reg, cfg) as restorer:
        return restorer.restore(req, tier, num_chunks)


def chunk_keys(tier, space: KeySpace, tokens: Sequence[int], first: int, count: int) -> list:
    """LMCache ObjectKeys of chunks first..first+count-1 of a prefix."""
    return tier._object_keys(PrefixKeys(space, tokens, tier.reg.chunk_tokens).window(first, count))


def object_path(tier, space: KeySpace, tokens: Sequence[int], chunk: int) -> str:
    """The FS L2 plugin's file of one chunk."""
    plugin = tier.sm.l2_adapters()[0][1]
    return str(plugin._key_to_path(chunk_keys(tier, space, tokens, chunk, 1)[0]))
