"""Hit discovery that holds nothing (`probe_only`), and the lookup results.

LMCache's own lookup is a whole-plan prefetch: it read-locks every L1 hit, loads every L2 hit into
L1 and keeps them locked until the retrieve (probing makes the hit set resident). Its L1
reservation for the loads is all-or-nothing per request: one chunk more than free L1 and the whole
request reports zero hits. The adapter keeps that path (`LMCacheAdapter.lookup` without probe_only)
and adds this probe, through the same L1 and L2 adapters:

- L1: a `submit_prefetch_task(..., skip_l2=True)` (served on the calling thread: `reserve_read` of
  the resident keys, no allocation), whose retained read locks are returned at once with
  `finish_read_prefetched(hit keys, read_locks=1, l1_owners)`.
- L2: every adapter's `submit_lookup_and_lock_task`, polled with `query_lookup_and_lock_result`,
  then `submit_unlock` of the keys it found (FS takes no lock; the Mooncake plugin keeps a
  client-side refcount). A lookup that does not answer in time is remembered and unlocked when it
  does (`L2Lookups`, also used by the store path to see its objects arrive in L2).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.storage_manager import StorageManager

from .objects import LMCacheKeys, _owners, _poll

PROBE_BATCH_CHUNKS = 256


@dataclass(frozen=True)
class LMCacheProbeResult:
    bitmap: bytes  # one byte per candidate chunk: 1 = present in L1 or an L2 adapter
    prefix_chunks: int  # longest fully present prefix
    l1_bitmap: bytes
    l2_bitmaps: dict[str, bytes]  # per adapter ("<index>:<type>")
    errors: tuple[str, ...] = ()
    resident: bool = False  # True only for the legacy (whole-plan) lookup

    @property
    def hits(self) -> int:
        return sum(self.bitmap)


@dataclass
class LMCacheLookup:
    """Result of `lookup()`. probe_only: nothing is held. Legacy: the hit prefix is resident in L1 and
    read-locked (as after LMCache's LookupModule.lookup) until `release_lookup()`."""

    request_id: str
    prefix_chunks: int
    resident: bool
    probe: LMCacheProbeResult | None = None
    held_keys: list[ObjectKey] = field(default_factory=list)
    l1_owners: dict = field(default_factory=dict)
    l2_loaded_keys: list[ObjectKey] = field(default_factory=list)


class L2Lookups:
    """Which keys every L2 adapter holds, with every lookup lock returned (see the module docstring)."""

    def __init__(self, sm: StorageManager, layout: MemoryLayoutDesc, timeout_s: float) -> None:
        self.sm, self.layout, self.timeout_s = sm, layout, timeout_s
        self._orphans: list[tuple[object, int, list[ObjectKey]]] = []  # (adapter, task id, keys) to unlock
        self._lock = threading.Lock()

    def lookup(self, keys: list[ObjectKey]) -> tuple[dict[str, list[bool]], list[str]]:
        """Per adapter ("<index>:<type>") a hit per key, and errors; an adapter that fails or does
        not answer in time counts as a miss (and is unlocked when it answers)."""
        self.unlock_orphans()
        out: dict[str, list[bool]] = {}
        errors: list[str] = []
        pending = []
        for desc, adapter in self.sm.l2_adapters():
            name = f"{desc.index}:{desc.type_name}"
            try:
                task = adapter.submit_lookup_and_lock_task(keys, {0: self.layout})
            except Exception as e:  # noqa: BLE001 - an adapter that fails is a miss, reported
                errors.append(f"{name}: lookup failed: {type(e).__name__}: {e}")
                out[name] = [False] * len(keys)
                continue
            pending.append((name, adapter, task))
        deadline = time.monotonic() + self.timeout_s
        for name, adapter, task in pending:
            result = _poll(lambda a=adapter, t=task: a.query_lookup_and_lock_result(t), deadline)
            if result is None:
                errors.append(f"{name}: lookup did not answer within {self.timeout_s}s")
                out[name] = [False] * len(keys)
                with self._lock:
                    self._orphans.append((adapter, task, keys))
                continue
            found = result.get_indices_list()
            if found:
                adapter.submit_unlock([keys[i] for i in found])
            hit = [False] * len(keys)
            for i in found:
                hit[i] = True
            out[name] = hit
        return out, errors

    def unlock_orphans(self, wait_s: float = 0.0) -> None:
        """Unlock what late lookups found (waiting up to `wait_s` for them to answer)."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        deadline = time.monotonic() + wait_s
        left = []
        for adapter, task, keys in orphans:
            try:
                result = _poll(lambda a=adapter, t=task: a.query_lookup_and_lock_result(t), deadline)
            except Exception:  # noqa: BLE001 - a closed adapter holds nothing
                continue
            if result is None:
                left.append((adapter, task, keys))
                continue
            found = result.get_indices_list()
            if found:
                adapter.submit_unlock([keys[i] for i in found])
        with self._lock:
            self._orphans.extend(left)


def _probe_l1(sm: StorageManager, layout: MemoryLayoutDesc, batch: list[ObjectKey]) -> list[int]:
    """Indices of `batch` resident in L1: LMCache's prefetch served from L1 only (no allocation),
    its read locks returned at once."""
    spec = PrefetchTaskSpec([GroupedObjectKeys(batch, 0, layout)], fetching_policy="full")
    handle = sm.submit_prefetch_task(spec, external_request_id="bsr-probe", skip_l2=True)
    result = sm.query_prefetch_status(handle)
    if result is None or not result.hit_cells:
        return []
    hit = result.hit_cells[0].get_indices_list()
    if hit:
        hit_keys = [batch[i] for i in hit]
        sm.finish_read_prefetched(hit_keys, read_locks=1, l1_owners=_owners(result, hit_keys))
    return hit


def probe(sm: StorageManager, layout: MemoryLayoutDesc, l2: L2Lookups, keys: LMCacheKeys, total: int,
          batch_chunks: int = PROBE_BATCH_CHUNKS) -> LMCacheProbeResult:
    """Hit bitmap and prefix of chunks 0..total-1 through LMCache's L1 and L2 adapters, in batches;
    holds nothing afterwards (no L1 allocation, every L1 read lock and L2 lookup lock released)."""
    l1 = bytearray(total)
    l2_rows: dict[str, bytearray] = {}
    errors: list[str] = []
    for first in range(0, total, batch_chunks):
        n = min(batch_chunks, total - first)
        batch = keys.window(first, n)
        for i in _probe_l1(sm, layout, batch):
            l1[first + i] = 1
        found, errs = l2.lookup(batch)
        errors.extend(errs)
        for name, hits in found.items():
            row = l2_rows.setdefault(name, bytearray(total))
            for i, h in enumerate(hits):
                if h:
                    row[first + i] = 1
    bitmap = bytearray(l1)
    for row in l2_rows.values():
        for i, h in enumerate(row):
            if h:
                bitmap[i] = 1
    p = bitmap.find(0)
    return LMCacheProbeResult(bytes(bitmap), total if p < 0 else p, bytes(l1),
                              {k: bytes(v) for k, v in l2_rows.items()}, tuple(errors))
