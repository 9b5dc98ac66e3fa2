"""Hit discovery that holds nothing: the tier's probe, through LMCache's L1 and L2 adapters.

LMCache's own lookup is a whole-plan prefetch: it read-locks every L1 hit, loads every L2 hit into
L1 and keeps them locked until the retrieve (probing makes the hit set resident), and its L1
reservation is all-or-nothing per request. BSR's probe is a decision, not residency:

- L1: a `submit_prefetch_task(..., skip_l2=True)` (served on the calling thread: `reserve_read` of
  the resident keys, no allocation), whose retained read locks are returned at once with
  `finish_read_prefetched(hit keys, read_locks=1, l1_owners)`.
- L2: every adapter's `submit_lookup_and_lock_task`, polled with `query_lookup_and_lock_result`,
  then `submit_unlock` of the keys it found (FS takes no lock; the Mooncake plugin keeps a
  client-side refcount). A lookup that does not answer in time is remembered and unlocked when it
  does (`L2Lookups`, also used by the put path to see its objects arrive in L2).
"""

from __future__ import annotations

import threading
import time

from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.storage_manager import StorageManager

from .objects import _owners, _poll


class L2Lookups:
    """Which keys every L2 adapter holds, with every lookup lock returned (see the module docstring)."""

    def __init__(self, sm: StorageManager, layout: MemoryLayoutDesc | None, timeout_s: float) -> None:
        self.sm, self.layout, self.timeout_s = sm, layout, timeout_s
        self._orphans: list[tuple[object, int, list[ObjectKey]]] = []  # (adapter, task id, keys) to unlock
        self._lock = threading.Lock()

    def lookup(self, keys: list[ObjectKey], layouts: dict[int, MemoryLayoutDesc] | None = None,
               ) -> tuple[dict[str, list[bool]], list[str]]:
        """Per adapter ("<index>:<type>") a hit per key, and errors; an adapter that fails or does
        not answer in time counts as a miss (and is unlocked when it answers). `layouts`: the
        object groups' layouts (the adapters' hint); default: the tier's one layout as group 0."""
        self.unlock_orphans()
        layouts = layouts if layouts is not None else {0: self.layout}
        out: dict[str, list[bool]] = {}
        errors: list[str] = []
        pending = []
        for desc, adapter in self.sm.l2_adapters():
            name = f"{desc.index}:{desc.type_name}"
            try:
                task = adapter.submit_lookup_and_lock_task(keys, layouts)
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


def probe_l1(sm: StorageManager, layout: MemoryLayoutDesc, batch: list[ObjectKey]) -> list[int]:
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
