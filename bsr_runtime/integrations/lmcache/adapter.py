"""LMCacheAdapter: BSR's windowed retrieve, probe-only lookup and store path inside LMCache 0.5.6's
multiprocess storage stack (`lmcache.v1.distributed`: StorageManager, L1 manager, L2 adapters).

One TP rank's view of a StorageManager, composed of the package's modules: config.py (config,
StorageManager and L2 plugin configs), objects.py (object layout and keys), probe.py (probe and
lookup results, L2 lookups), retrieve.py (the windowed retrieve on the window loop, fail-closed
reports), store.py (the store path on the window loop), l1_usage.py (LMCache's L1 usage as RWS).
W = 0 keeps LMCache's own whole-plan behaviour (lookup and prefetch) as the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.storage_manager import StorageManager

from bsr_kernels import Registration
from bsr_runtime.admission import ByteBudget, SerialAdmission
from bsr_runtime.keys import KeySpace
from bsr_runtime.restore import RestoreRequest
from bsr_runtime.store import StoreReport

from . import retrieve as _retrieve
from . import store as _store
from .config import align_up, build_storage_manager, load_adapter_config
from .l1_usage import L1UsageTracker
from .objects import LMCacheKeys, _owners, chunk_layout, synchronize_device
from .probe import PROBE_BATCH_CHUNKS, L2Lookups, LMCacheLookup, LMCacheProbeResult, probe
from .retrieve import LatePrefetches, LMCacheRestoreReport, fold_window_lines


class LMCacheAdapter:
    """BSR on top of an LMCache StorageManager (one TP rank's view)."""

    def __init__(self, reg: Registration, storage_manager: StorageManager, config=None, *,
                 admission: SerialAdmission | ByteBudget | None = None, stream: torch.cuda.Stream | None = None,
                 owns_storage_manager: bool = False, l2_lookup_timeout_s: float = 10.0, markers=None,
                 l2_loads_are_temporary: bool = False) -> None:
        self.reg = reg
        self.sm = storage_manager
        self.config = config if config is not None else load_adapter_config()
        self.config.validate()
        self.admission = admission or SerialAdmission()
        self.stream = stream
        self.layout = chunk_layout(reg)
        self.l2_lookup_timeout_s = l2_lookup_timeout_s
        self.force_local: set[str] = set()  # request ids that failed closed (see clear_force_local)
        self.markers = markers  # optional shared force-local table: anything with set(request_id, reason)
        self._owns = owns_storage_manager
        # True when the prefetch policy is known to keep nothing it loads from L2 (LMCache's default
        # policy: finish_read frees those objects), so a window need not delete them from L1 itself
        self.l2_loads_are_temporary = l2_loads_are_temporary
        self.tracker = L1UsageTracker(storage_manager)
        self.l2 = L2Lookups(storage_manager, self.layout, l2_lookup_timeout_s)
        self.late = LatePrefetches(storage_manager, lambda: self.config.prefetch_timeout_s)
        fold_window_lines()  # one log line per retrieve, not one per window (retrieve.py)
        align = storage_manager.l1_memory_desc.align_bytes
        if align % 16:
            raise ValueError(f"L1 align_bytes {align} is not a multiple of 16: staged objects must be 16-byte aligned")
        self.l1_object_bytes = align_up(reg.chunk_bytes, align)

    @classmethod
    def create(cls, reg: Registration, l1_bytes: int, l2: Sequence[L2AdapterConfigBase] = (), config=None, *,
               align_bytes: int = 4096, store_policy: str = "skip_l1", prefetch_policy: str = "default",
               **kw) -> LMCacheAdapter:
        """An adapter owning a new StorageManager (build_storage_manager), closed with the adapter."""
        sm = build_storage_manager(l1_bytes, l2, align_bytes=align_bytes, store_policy=store_policy,
                                   prefetch_policy=prefetch_policy)
        try:
            return cls(reg, sm, config, owns_storage_manager=True,
                       l2_loads_are_temporary=prefetch_policy == "default", **kw)
        except BaseException:
            sm.close()
            raise

    # -- misc ------------------------------------------------------------------------------
    def l1_usage(self) -> tuple[int, int]:
        return self.sm.get_l1_usage()

    def keys(self, keyspace: KeySpace, tokens: Sequence[int]) -> LMCacheKeys:
        if keyspace.fingerprint != self.reg.fingerprint:
            raise ValueError("keyspace was built for another registration "
                             f"({keyspace.fingerprint} != {self.reg.fingerprint})")
        return LMCacheKeys(keyspace, tokens, self.reg.chunk_tokens)

    def l2_adapters(self):
        return self.sm.l2_adapters()

    def tier_name(self) -> str:
        names = [type(a).__name__ for _, a in self.sm.l2_adapters()]
        return f"lmcache[{'+'.join(names) or 'L1'}]"

    def synchronize(self, kv: Sequence[torch.Tensor]) -> None:
        """Wait for the installs / gathers launched on the destinations (the adapter's stream)."""
        synchronize_device(kv, self.stream)

    def clear_force_local(self, request_id: str) -> None:
        """Drop the force-local marker (the request was admitted RUNNING or torn down). A shared
        `markers` table is cleared by its owner."""
        self.force_local.discard(request_id)

    def close(self) -> None:
        self.late.join()
        self.l2.unlock_orphans(wait_s=1.0)
        if self._owns:
            self.sm.close()

    def __enter__(self) -> LMCacheAdapter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- probe / lookup -----------------------------------------------------------------------
    def probe(self, keyspace: KeySpace, tokens: Sequence[int], num_chunks: int | None = None,
              batch_chunks: int = PROBE_BATCH_CHUNKS) -> LMCacheProbeResult:
        """Hit bitmap and prefix through LMCache's L1 and L2 adapters; holds nothing afterwards
        (no L1 allocation, every L1 read lock and L2 lookup lock released)."""
        keys = self.keys(keyspace, tokens)
        total = keys.num_chunks if num_chunks is None else min(num_chunks, keys.num_chunks)
        return probe(self.sm, self.layout, self.l2, keys, total, batch_chunks)

    def lookup(self, keyspace: KeySpace, tokens: Sequence[int], num_chunks: int | None = None,
               request_id: str = "lookup") -> LMCacheLookup:
        """probe_only: `probe()`. Otherwise LMCache's own lookup: a whole-plan prefetch that makes the
        hit prefix resident and read-locked in L1 until `release_lookup()`."""
        if self.config.probe_only:
            p = self.probe(keyspace, tokens, num_chunks)
            return LMCacheLookup(request_id, p.prefix_chunks, False, probe=p)
        keys = self.keys(keyspace, tokens)
        total = keys.num_chunks if num_chunks is None else min(num_chunks, keys.num_chunks)
        if total == 0:
            return LMCacheLookup(request_id, 0, True)
        batch = keys.window(0, total)
        handle = self.sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(batch, 0, self.layout)]),
                                              external_request_id=request_id)
        result = self.late.wait(handle, batch, self.config.prefetch_timeout_s)
        if result is None:
            return LMCacheLookup(request_id, 0, True)
        hit = result.hit_cells[0].get_indices_list()
        held = [batch[i] for i in hit]
        loaded = [batch[i] for i in result.l2_hit_cells[0].get_indices_list()]
        return LMCacheLookup(request_id, len(hit), True, held_keys=held, l1_owners=_owners(result, held) or {},
                             l2_loaded_keys=loaded)

    def release_lookup(self, lookup: LMCacheLookup) -> None:
        """LMCache's free_lookup_locks for a legacy lookup (no-op for a probe)."""
        if lookup.held_keys:
            self.sm.finish_read_prefetched(lookup.held_keys, read_locks=1, l1_owners=lookup.l1_owners or None)
            lookup.held_keys = []

    # -- retrieve / store -----------------------------------------------------------------------
    def retrieve(self, req: RestoreRequest, num_chunks: int, *, window_chunks: int | None = None,
                 admission_timeout_s: float | None = None) -> LMCacheRestoreReport:
        """Restore chunks 0..num_chunks-1 of `req` from LMCache into its destination blocks.

        W = `window_chunks` or config.window_chunks; W = 0 is LMCache's whole-plan prefetch.
        Bad arguments raise ValueError before anything is submitted; every other failure returns a
        fail-closed report (ok=False). See retrieve.py."""
        return _retrieve.retrieve(self, req, num_chunks, window_chunks, admission_timeout_s)

    def store(self, keyspace: KeySpace, tokens: Sequence[int], kv: Sequence[torch.Tensor],
              block_tables: Sequence[torch.Tensor], num_chunks: int | None = None, *,
              batch_chunks: int | None = None, flush_l1: bool = True, timeout_s: float = 60.0) -> StoreReport:
        """Write chunks 0..num_chunks-1 into LMCache: reserve_write -> gather_window into the reserved
        L1 objects -> finish_write; LMCache's store controller puts them into the L2 adapters. Batches
        of at most `batch_chunks` (default W, or 32) that also fit the free L1; each batch is waited
        for in L2 (when there is one) and, with flush_l1, deleted from L1 before the next.

        Returns the canonical state hash of what was written (state_hash.py). See store.py."""
        return _store.store(self, keyspace, tokens, kv, block_tables, num_chunks, batch_chunks, flush_l1, timeout_s)
