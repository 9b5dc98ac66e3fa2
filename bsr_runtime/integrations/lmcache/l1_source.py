"""LMCacheTier's WindowSource: a restore's windows installed straight from LMCache's L1 (one copy per byte).

Per window: `submit_prefetch_task` of its keys (L2 -> L1 by LMCache's prefetch controller) when the loop
fetches it; `fetched` waits (deadline), requires every key to hit, enters
`read_prefetched_results` and returns views of the L1 memory objects (one run per stretch of objects
that lie one object size apart in the L1 arena): the loop installs from them. `release` leaves the
read, `finish_read_prefetched` (LMCache's default policy frees what it loaded from L2) and deletes
the L2-loaded objects a retaining policy would keep. The objects are pinned (read-locked) only
between fetched and release; `abandon` returns everything on every failure path.

Integrity: the BSR L2 plugins (fs_l2.py, mooncake_l2.py) check each object's header (key, tenant,
model) and checksum as it lands in L1 and clear the key's bit when a check fails, so a damaged or
foreign object is a miss here; an L1 object that is absent or shorter than a chunk fails the window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchHandle,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.storage_manager import StorageManager

from ...keys import PrefixKeys
from ...plan import Window
from ...tiers.base import CorruptObjectError, FetchTimeoutError, MissingObjectError
from .objects import _owners, object_keys
from .prefetch import WINDOW_TAG, LatePrefetches, evict_l2_loaded, release_result

_PREFETCHING, _LOCKED, _READING, _DONE = range(4)


@dataclass(frozen=True)
class L1Reads:
    """What reading windows from LMCache's L1 needs of the tier (LMCacheTier.window_source)."""

    sm: StorageManager
    late: LatePrefetches  # where a prefetch that missed its deadline is settled
    layout: MemoryLayoutDesc  # one BSR object
    model: str  # the objects' LMCache model name
    chunk_bytes: int
    object_bytes: int  # what LMCache allocates per object: align_up(c, L1 align_bytes)
    evict_l2_loads: bool  # delete the L2-loaded objects after the read (a retaining prefetch policy keeps them)


class L1Source:
    """A restore's bytes from LMCache's L1, prefetched window by window (the loop's WindowSource).
    Making one starts nothing; `fetch` submits one window's prefetch.

    Staging accounting (`peak_bytes`, the restore report's peak_staging_bytes): the chunk bytes of the
    L1 objects this restore made LMCache allocate (loaded from L2 for a window) while a window pins
    them; objects already resident in L1 before the fetch are LMCache's cache, only read-locked, and
    not counted. `peak_room_bytes` is their alignment padding (LMCache allocates align_up(c, align)):
    auxiliary state, like a staging arena's header room. A window's loads are known once its prefetch
    result is taken, but may sit in L1 from its submission on: at depth 2 window j+1's loads land while
    window j installs, so they count together with those of every window still open at its submission."""

    def __init__(self, l1: L1Reads, keys: PrefixKeys, timeout_s: float) -> None:
        self.l1, self.keys, self.timeout_s = l1, keys, timeout_s
        self.live_objects = 0
        self.peak_objects = 0
        self._open: list[L1Window] = []  # submitted, not yet released or abandoned

    @property
    def peak_bytes(self) -> int:
        return self.peak_objects * self.l1.chunk_bytes

    @property
    def peak_room_bytes(self) -> int:
        return self.peak_objects * (self.l1.object_bytes - self.l1.chunk_bytes)

    def submit(self, window: Window, reservation=None) -> L1Window:
        """Submit the window's prefetch (the reservation, if any, is the loop's to return)."""
        l1 = self.l1
        keys = self.keys.window(window.first_chunk, window.num_chunks)
        okeys = object_keys(keys, l1.model)
        deadline = time.monotonic() + self.timeout_s
        spec = PrefetchTaskSpec([GroupedObjectKeys(okeys, 0, l1.layout)], num_kv_readers=1, fetching_policy="prefix")
        handle = l1.sm.submit_prefetch_task(spec, external_request_id=WINDOW_TAG)
        window = L1Window(self, keys, okeys, handle, deadline, overlaps=list(self._open))
        self._open.append(window)
        return window

    def _hold(self, window: L1Window, objects: int) -> None:
        """`window`'s L2 loads, now known: held until it is released, and in L1 beside the loads of the
        windows open when it was submitted."""
        window.loaded = objects
        self.live_objects += objects
        beside = objects + sum(w.loaded for w in window.overlaps)
        self.peak_objects = max(self.peak_objects, self.live_objects, beside)

    def _close(self, window: L1Window) -> None:
        if window in self._open:
            self._open.remove(window)
        window.overlaps = []  # its count stays; the windows before it need not (no chain over the restore)


class L1Window:
    """One window prefetched into LMCache's L1 (the loop's SubmittedWindow).

    States: prefetching (the task is LMCache's) -> locked (its result taken: every hit read-locked)
    -> reading (inside `read_prefetched_results`: the loop installs from the objects) -> done."""

    def __init__(self, source: L1Source, bsr_keys: list[str], keys: list[ObjectKey], handle: PrefetchHandle,
                 deadline: float, overlaps: list[L1Window] | None = None) -> None:
        self.source, self.bsr_keys, self.keys, self.handle, self.deadline = source, bsr_keys, keys, handle, deadline
        self.overlaps = overlaps or []  # the source's windows still open when this one was submitted
        self.loaded = 0  # its L2 loads, once its prefetch result is taken
        self.l1 = source.l1
        self.sm = source.l1.sm
        self.result = self.owners = self._read = None
        self._held = 0
        self._state = _PREFETCHING

    def fetched(self) -> list[tuple[int, int, torch.Tensor]]:
        l1, n = self.l1, len(self.keys)
        result = l1.late.wait(self.handle, self.keys, max(0.001, self.deadline - time.monotonic()))
        if result is None:  # the late result is released by l1.late when it lands
            self._state = _DONE
            raise FetchTimeoutError(f"LMCache prefetch of {n} objects missed its deadline")
        self.result, self._state = result, _LOCKED
        hit = result.hit_cells[0].get_indices_list()
        if len(hit) != n:
            missing = next(i for i in range(n) if i >= len(hit) or hit[i] != i)
            raise MissingObjectError(f"LMCache holds {len(hit)}/{n} objects; {self.bsr_keys[missing]} is missing "
                                     "(not in L1 or L2, damaged, or L1 had no room)")
        self._held = len(result.l2_hit_cells[0].get_indices_list())
        self.source._hold(self, self._held)
        self.owners = _owners(result, self.keys)
        read = self.sm.read_prefetched_results(self.keys, self.owners)
        objs = read.__enter__()  # raising here (before it yields): the read locks are still ours (_LOCKED)
        self._read, self._state = read, _READING
        if objs is None:
            raise CorruptObjectError("LMCache: prefetched objects not readable in L1")
        return list(l1_runs(objs, l1.chunk_bytes, l1.object_bytes))

    def synchronize(self, stream) -> None:
        """The installs read L1 memory: wait for them before the objects are unpinned."""
        if stream is not None and hasattr(stream, "synchronize"):
            stream.synchronize()
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # installs on the current stream (CPU installs are synchronous)

    def release(self) -> None:
        """Installed: leave the read normally, finish it (frees temporary objects), evict what a
        retaining policy kept."""
        if self._state != _READING:
            return
        self._state = _DONE
        try:
            self._read.__exit__(None, None, None)
            self.sm.finish_read_prefetched(self.keys, read_locks=1, l1_owners=self.owners)
            if self.l1.evict_l2_loads:
                evict_l2_loaded(self.sm, self.result, self.keys)
        finally:
            self._unhold()

    def abandon(self, stream) -> None:
        """Failure: synchronize what may read the objects, then release everything the window holds,
        so LMCache's L1 usage returns to its baseline."""
        state, self._state = self._state, _DONE
        try:
            if state == _PREFETCHING:  # still LMCache's: released whenever its result lands
                self.l1.late.settle(self.handle, self.keys)
            elif state == _LOCKED:
                release_result(self.sm, self.result, self.keys, evict_loaded=True)
            elif state == _READING:
                try:
                    self.synchronize(stream)  # an install may have been launched on the L1 objects
                finally:
                    # read_prefetched_results returns the read locks itself when the body raised
                    err = CorruptObjectError("window abandoned")
                    try:
                        self._read.__exit__(CorruptObjectError, err, None)
                    finally:
                        evict_l2_loaded(self.sm, self.result, self.keys)  # a failed window leaves nothing
        finally:
            self._unhold()

    def _unhold(self) -> None:
        self.source.live_objects -= self._held
        self._held = 0
        self.source._close(self)


def l1_runs(objs, chunk_bytes: int, stride: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first index, count, uint8 view) per run of consecutive objects that lie `stride` bytes apart
    (LMCache's object size) in one L1 storage: a (count, chunk_bytes) view with that row stride, or
    1-D when stride == chunk_bytes. The views alias LMCache's L1 memory (no copy). An object that is
    absent or shorter than a chunk fails the window (CorruptObjectError) before any view is returned."""
    raws = []
    for i, obj in enumerate(objs):
        raw = None if obj is None else obj.raw_tensor
        if raw is None or raw.numel() * raw.element_size() < chunk_bytes:
            raise CorruptObjectError(f"LMCache: L1 object {i} of the window is absent or shorter than a chunk")
        raws.append(raw)
    start, n = 0, len(raws)
    while start < n:
        raw = raws[start]
        storage = raw.untyped_storage()
        offset = raw.storage_offset() * raw.element_size()
        end = start + 1
        while (end < n and raws[end].untyped_storage().data_ptr() == storage.data_ptr()
               and raws[end].data_ptr() == raw.data_ptr() + (end - start) * stride
               and offset + (end - start) * stride + chunk_bytes <= storage.nbytes()):
            end += 1
        count = end - start
        view = torch.empty(0, dtype=torch.uint8, device=raw.device)
        if count == 1 or stride == chunk_bytes:
            view.set_(storage, offset, (count * chunk_bytes,))
        else:
            view.set_(storage, offset, (count, chunk_bytes), (stride, 1))
        yield start, count, view
        start = end
