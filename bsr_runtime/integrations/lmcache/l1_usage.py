"""LMCache's L1 usage, measured: the L1 a restore or a store through the tier takes besides BSR's staging.

A measurement's peak is the peak of LMCache's own L1 usage (`StorageManager.get_l1_usage()`, i.e.
the L1 memory allocator's used bytes) above its value when the measurement started
(`LMCacheTier.l1_tracker.start()` / `stop()`). It is sampled by an L1ManagerListener right after
every L1 allocation (`on_l1_keys_reserved_write`, called by the L1 manager with the new objects
allocated) and when asked, so no allocation peak is missed.
"""

from __future__ import annotations

import threading

from lmcache.v1.distributed.internal_api import L1ManagerListener
from lmcache.v1.distributed.storage_manager import StorageManager


class L1Measure:
    """One measurement: L1 used at its start (baseline), its peak, how many samples it saw."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.peak = baseline
        self.samples = 1


class L1UsageTracker(L1ManagerListener):
    """Peak of StorageManager.get_l1_usage() during each active measurement, sampled right after
    every L1 allocation and whenever the owner asks.

    L1 managers call listeners with their lock held: the callbacks only read the allocator's
    usage (not under that lock) and never block."""

    def __init__(self, sm: StorageManager) -> None:
        self._sm = sm
        self._lock = threading.Lock()
        self._active: list[L1Measure] = []
        self.listening = False
        managers = getattr(sm, "_l1_managers_by_id", None)  # StorageManager has no public accessor
        if managers:
            for m in managers.values():
                m.register_listener(self)
            self.listening = True

    def used(self) -> int:
        return int(self._sm.get_l1_usage()[0])

    def sample(self) -> int:
        used = self.used()
        with self._lock:
            for m in self._active:
                m.peak = max(m.peak, used)
                m.samples += 1
        return used

    def start(self) -> L1Measure:
        m = L1Measure(self.used())
        with self._lock:
            self._active.append(m)
        return m

    def stop(self, m: L1Measure) -> L1Measure:
        self.sample()
        with self._lock:
            self._active.remove(m)
        return m

    # listener callbacks
    def on_l1_keys_reserved_write(self, keys) -> None:
        if self._active:
            self.sample()

    def on_l1_keys_finish_write_and_reserve_read(self, keys) -> None:
        if self._active:
            self.sample()

    def on_l1_keys_reserved_read(self, keys) -> None:
        pass

    def on_l1_keys_read_finished(self, keys) -> None:
        pass

    def on_l1_keys_write_finished(self, keys) -> None:
        pass

    def on_l1_keys_deleted_by_manager(self, keys) -> None:
        pass

    def on_l1_keys_accessed(self, keys) -> None:
        pass
