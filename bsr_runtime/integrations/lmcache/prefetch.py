"""LMCache prefetches of the tier's windows: their results released on every path, late ones too.

A window's fetch is one `submit_prefetch_task` (L2 -> L1 loads by LMCache's prefetch controller),
waited for until the fetch's deadline. A result holds a read lock on every hit; `release_result`
returns them and deletes what the prefetch loaded from L2 where a retaining policy would keep it. A
prefetch that misses its deadline is still running inside LMCache: its result is collected when it
lands (within 1 s on the calling thread, later on a reaper thread: `LatePrefetches`) and released
the same way, so nothing stays resident.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

from lmcache.v1.distributed.api import ObjectKey, PrefetchHandle
from lmcache.v1.distributed.storage_manager import StorageManager

from .objects import _owners

# A window's prefetch is tagged WINDOW_TAG. LMCache logs one INFO line per completed prefetch; a
# windowed restore would log N/W of them (2,047 at W = 1 for a 512K-token prefix). Below DEBUG they
# are dropped (the restore has its report).
WINDOW_TAG = "bsr-w"
_WINDOW_ID = re.compile(r"(^|/)bsr-w\d*$")


class _WindowPrefetchLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(a, str) and _WINDOW_ID.search(a) for a in args)


def fold_window_lines() -> None:
    """Install the filter on LMCache's StorageManager logger, once per process (LMCacheTier does)."""
    sm_logger = logging.getLogger(StorageManager.__module__)
    if not any(isinstance(f, _WindowPrefetchLines) for f in sm_logger.filters):
        sm_logger.addFilter(_WindowPrefetchLines())


def release_result(sm: StorageManager, result, keys: list[ObjectKey], evict_loaded: bool) -> None:
    """Return a prefetch result's read locks (nothing was read) and, with `evict_loaded`, delete the
    keys it loaded from L2 (objects a retaining policy kept; temporary ones are gone already)."""
    hit_keys = [keys[i] for i in result.hit_cells[0].get_indices_list()]
    if hit_keys:
        sm.finish_read_prefetched(hit_keys, read_locks=1, l1_owners=_owners(result, hit_keys))
    if evict_loaded:
        evict_l2_loaded(sm, result, keys)


def evict_l2_loaded(sm: StorageManager, result, keys: list[ObjectKey]) -> None:
    loaded = [keys[i] for i in result.l2_hit_cells[0].get_indices_list()]
    if loaded:
        sm.delete_l1_keys(loaded)


class LatePrefetches:
    """Prefetches whose result did not come in time: collected when it lands (within 1 s on the
    calling thread, later on a reaper thread) and released, so nothing stays resident."""

    def __init__(self, sm: StorageManager, timeout_s: Callable[[], float]) -> None:
        self.sm, self._timeout_s = sm, timeout_s  # the configured prefetch timeout, read when needed
        self._reapers: list[threading.Thread] = []

    def wait(self, handle: PrefetchHandle, keys: list[ObjectKey], timeout_s: float):
        """The prefetch's result, or None after `timeout_s` (then settled late)."""
        if self.sm.wait_prefetch_status(handle, timeout_s):
            result = self.sm.query_prefetch_status(handle)
            if result is not None:
                return result
        self.settle(handle, keys)
        return None

    def settle(self, handle: PrefetchHandle, keys: list[ObjectKey]) -> None:
        def settle(wait_s: float) -> bool:
            if not self.sm.wait_prefetch_status(handle, wait_s):
                return False
            result = self.sm.query_prefetch_status(handle)
            if result is not None:
                release_result(self.sm, result, keys, evict_loaded=True)
            return True

        timeout_s = self._timeout_s()
        if settle(min(1.0, timeout_s)):
            return
        t = threading.Thread(target=settle, args=(max(60.0, 4 * timeout_s),),
                             name="bsr-lmcache-late-prefetch", daemon=True)
        t.start()
        self._reapers = [r for r in self._reapers if r.is_alive()] + [t]

    def join(self) -> None:
        for t in self._reapers:
            t.join(timeout=self._timeout_s())
