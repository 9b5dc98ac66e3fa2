"""A restore's bytes from a tier, window by window into staging: the window loop's WindowSource over
`Tier.fetch` (window_loop.py). Each window leases its staging (a StagingPool slot or a StagingArena
run) unless its reservation holds one, submits the tier's fetch into it, and on a failure path gives
the staging back only once nothing can still write into it (a read that never settles quarantines its
run of a shared arena, or has the owner retire its own pool).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bsr_kernels import StagingPool
from bsr_kernels.staging_arena import StagingArena

from .admission import WindowReservation
from .keys import PrefixKeys
from .plan import Window
from .tiers.base import FetchHandle, Tier


class TierSource:
    """A restore's bytes from a tier, fetched window by window into staging (the loop's WindowSource).
    Making one starts nothing; `submit` starts one window's fetch."""

    def __init__(self, tier: Tier, keys: PrefixKeys, staging: StagingPool | StagingArena, timeout_s: float,
                 on_unsettled: Callable[[], None] | None = None) -> None:
        self.tier, self.keys, self.staging = tier, keys, staging
        self.timeout_s = timeout_s
        self.on_unsettled = on_unsettled  # a fetch that never settled: the owner retires its pool

    def submit(self, window: Window, reservation: WindowReservation) -> TierWindow:
        """Lease the window's staging (or take the reservation's) and submit the tier's fetch into it."""
        leased_here = reservation.lease is None  # else the reservation owns (and returns) its lease
        lease = self.staging.acquire(window.num_chunks, timeout=self.timeout_s) if leased_here else reservation.lease
        try:
            handle = self.tier.fetch(self.keys.window(window.first_chunk, window.num_chunks), lease.chunks(),
                                     time.monotonic() + self.timeout_s, headroom=self.staging.headroom)
        except BaseException:
            if leased_here:
                lease.release()
            raise
        return TierWindow(self, lease, handle)


class TierWindow:
    """One window being fetched from a tier into its staging lease (the loop's SubmittedWindow)."""

    def __init__(self, source: TierSource, lease, handle: FetchHandle) -> None:
        self.source, self.lease, self.handle = source, lease, handle
        self._released = False

    def fetched(self) -> list[tuple[int, int, torch.Tensor]]:
        self.handle.wait()
        return [(0, self.lease.num_chunks, self.lease.view)]

    def synchronize(self, stream) -> None:
        self.lease.record(stream)
        self.lease.synchronize()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.lease.release()

    def abandon(self, stream) -> None:
        """Release the staging once nothing can still write into it. A fetch that does not settle
        within another timeout keeps writing: the owner retires the pool (`on_unsettled`)."""
        if self._released:
            return
        if not self.handle.quiesce(self.source.timeout_s):
            if isinstance(self.lease.pool, StagingArena):  # shared: retire just this run, until the read lands
                self.synchronize(stream)
                self._released = True
                self.lease.quarantine(self.handle.quiesce)
                return
            if self.source.on_unsettled is not None:
                self.source.on_unsettled()
        self.synchronize(stream)  # an install may have been launched on the staging
        self.release()
