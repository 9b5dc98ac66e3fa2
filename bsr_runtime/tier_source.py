"""A restore's bytes from a tier, window by window into staging: the window loop's WindowSource over
`Tier.fetch` (window_loop.py). Each window's staging is its reservation's lease (a run of the arena the
admission leases from); the tier's fetch lands the window's objects there. On a failure path the run
goes back only once nothing can still write into it: a read that never settles quarantines the run
until it lands (the arena's owner replaces an arena that quarantine leaves too small).
"""

from __future__ import annotations

import time

import torch

from .admission import WindowReservation
from .keys import PrefixKeys
from .plan import Window
from .tiers.base import FetchHandle, Tier


class TierSource:
    """A restore's bytes from a tier, fetched window by window into staging (the loop's WindowSource).
    Making one starts nothing; `submit` starts one window's fetch."""

    def __init__(self, tier: Tier, keys: PrefixKeys, timeout_s: float) -> None:
        self.tier, self.keys = tier, keys
        self.timeout_s = timeout_s

    def submit(self, window: Window, reservation: WindowReservation) -> TierWindow:
        """Submit the tier's fetch of the window into its reservation's staging."""
        lease = reservation.lease
        handle = self.tier.fetch(self.keys.window(window.first_chunk, window.num_chunks), lease.chunks(),
                                 time.monotonic() + self.timeout_s, headroom=lease.arena.headroom)
        return TierWindow(self, lease, handle)


class TierWindow:
    """One window being fetched from a tier into its staging lease (the loop's SubmittedWindow)."""

    def __init__(self, source: TierSource, lease, handle: FetchHandle) -> None:
        self.source, self.lease, self.handle = source, lease, handle

    def fetched(self) -> list[tuple[int, int, torch.Tensor]]:
        self.handle.wait()
        return [(0, self.lease.num_chunks, self.lease.view)]

    def synchronize(self, stream) -> None:
        self.lease.record(stream)
        self.lease.synchronize()

    def release(self) -> None:
        self.lease.release()  # idempotent: the reservation releases it too

    def abandon(self, stream) -> None:
        """Give the staging back once nothing can still write into it; a fetch that does not settle
        within another timeout keeps writing: its run is quarantined until the read lands."""
        if self.lease.released:
            return
        self.synchronize(stream)  # an install may have been launched on the staging
        if not self.handle.quiesce(self.source.timeout_s):
            self.lease.quarantine(self.handle.quiesce)
            return
        self.release()
