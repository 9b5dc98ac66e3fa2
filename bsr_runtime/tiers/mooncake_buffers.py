"""Which host memory a Mooncake client has registered for zero-copy transfers.

Staging buffers are registered once for the tier's lifetime (`add` / `remove`). A view outside
every registered buffer is registered for one transfer only (`take` / `give_back`), refcounted
per start address, so concurrent transfers over the same memory share one registration.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import numpy as np

from .base import TierError


class StoreRegistrations:
    def __init__(self, store: Callable[[], object | None], error: Callable[[int, int], TierError],
                 stats: dict[str, int]) -> None:
        self._store = store  # the live client, or None once closed
        self._error = error  # (size, rc) -> the TierError of a failed register_buffer
        self._stats = stats
        self._lock = threading.Lock()
        self.regions: list[tuple[int, int]] = []  # registered for the tier's lifetime: [start, end)
        self.temp: dict[int, tuple[int, int]] = {}  # per transfer: start -> (size, refcount)

    def covered(self, ptr: int, size: int) -> bool:
        return any(s <= ptr and ptr + size <= e for s, e in self.regions)

    def add(self, ptr: int, size: int) -> None:
        if self.covered(ptr, size):
            return
        rc = self._store().register_buffer(ptr, size)
        if rc != 0:
            raise self._error(size, rc)
        self.regions.append((ptr, ptr + size))

    def remove(self, ptr: int) -> None:
        store = self._store()
        for region in [r for r in self.regions if r[0] == ptr]:
            self.regions.remove(region)
            if store is not None:
                store.unregister_buffer(ptr)

    def take(self, ptrs: Sequence[int], size: int | Sequence[int]) -> list[int]:
        """Register the ranges at `ptrs` (of `size` bytes, one size or one each) that no
        registration covers; returns what to hand to give_back()."""
        ranges: list[list[int]] = []
        lo = np.asarray(ptrs, dtype=np.int64)
        hi = lo + np.asarray(size, dtype=np.int64)
        inside = np.zeros(len(lo), dtype=bool)
        for s, e in self.regions:  # one vectorized test per registration, not one Python call per view
            inside |= (lo >= s) & (hi <= e)
        for p, q in sorted(set(zip(lo[~inside].tolist(), hi[~inside].tolist(), strict=True))):
            if ranges and p <= ranges[-1][1]:
                ranges[-1][1] = max(ranges[-1][1], q)
            else:
                ranges.append([p, q])
        taken: list[int] = []
        with self._lock:
            try:
                for start, end in ranges:
                    self._take_one(start, end - start)
                    taken.append(start)
            except BaseException:
                self._give_back_locked(taken)
                raise
        return taken

    def _take_one(self, start: int, size: int) -> None:
        held, n = self.temp.get(start, (size, 0))
        if n == 0:
            rc = self._store().register_buffer(start, size)
            if rc != 0:
                raise self._error(size, rc)
            self._stats["temp_registrations"] += 1
            held = size
        elif held < size:
            raise TierError("overlapping temporary registrations of different sizes")
        self.temp[start] = (held, n + 1)

    def give_back(self, taken: list[int]) -> None:
        if taken:
            with self._lock:
                self._give_back_locked(taken)

    def _give_back_locked(self, taken: list[int]) -> None:
        store = self._store()
        for start in taken:
            size, n = self.temp[start]
            if n <= 1:
                del self.temp[start]
                if store is not None:
                    store.unregister_buffer(start)
            else:
                self.temp[start] = (size, n - 1)

    def clear(self, store) -> None:
        """Unregister everything from `store` (closing: the tier no longer hands it out)."""
        with self._lock:
            for start in [*self.temp, *(s for s, _ in self.regions)]:
                with contextlib.suppress(Exception):
                    store.unregister_buffer(start)
            self.temp.clear()
            self.regions.clear()
