"""Admission: how restores and stores get their windows' staging, the one way.

Every window's reservation is its lease of a run of chunks of a StagingArena (the one staging,
bsr_kernels/staging_arena.py): the chunks reserved and the chunks staged are one and the same, so
live staging can never exceed the arena. Runs are granted first come, first served; deadlock-free
because a restore only blocks while holding nothing: a second (pipelined) window is taken with
`try_window`, never waited for.

What differs between uses is only the arena and an optional lock:
- a restorer's own arena of W chunks, with the process-wide SERIAL lock held around each whole restore
  (`admitted`): one restore at a time per process, as the paper's prototype (the default);
- one arena of B bytes shared by concurrent restores (the byte budget B), no lock: their windows
  interleave window by window;
- a whole plan's arena of N chunks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bsr_kernels.staging_arena import ArenaLease, StagingArena, StagingArenaRetired, StagingWaitTimeout

from .validation import check_int, check_timeout

SERIAL = threading.Lock()  # one restore at a time in this process: a restorer's default serial lock


class WindowReservation:
    """One window's staging: its lease of a run of the arena. `release()` is idempotent, so every path
    out of the window loop can call it."""

    def __init__(self, lease: ArenaLease) -> None:
        self.lease = lease

    @property
    def nbytes(self) -> int:
        return self.lease.num_chunks * self.lease.arena.chunk_bytes

    def release(self) -> None:
        self.lease.release()


class Admission:
    """Windows lease their staging from an arena (`arena`, or a callable naming the arena to lease from
    now: its owner may retire an arena, runs quarantined behind reads that never land, and put a
    replacement in its place; a wait on the retired one then goes on, within the same bound, on the
    replacement). `serial`: a lock held around each whole restore or store (`admitted`). `should_stop`:
    one restore's, its wait for staging ends when it is cancelled."""

    def __init__(self, arena: StagingArena | Callable[[], StagingArena], *, serial: threading.Lock | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self._current = arena if callable(arena) else (lambda: arena)
        self.serial = serial
        self.should_stop = should_stop

    @property
    def arena(self) -> StagingArena:
        return self._current()

    @contextmanager
    def admitted(self, timeout: float | None = None) -> Iterator[Admission]:
        """Held for a whole restore (or store): the serial lock, if any, within `timeout`."""
        timeout = check_timeout("admission timeout", timeout, allow_none=True)
        if self.serial is None:
            yield self
            return
        if not self.serial.acquire(timeout=-1 if timeout is None else timeout):
            raise StagingWaitTimeout(f"restore admission not granted within {timeout}s")
        try:
            yield self
        finally:
            self.serial.release()

    def window(self, num_chunks: int, timeout: float | None = None) -> WindowReservation:
        """A run of `num_chunks` chunks, waiting up to `timeout`."""
        num_chunks = check_int("window chunks", num_chunks, lo=1)
        timeout = check_timeout("reservation timeout", timeout, allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            arena = self.arena
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return WindowReservation(arena.acquire(num_chunks, remaining, self.should_stop))
            except StagingArenaRetired:
                if self.arena is arena:  # retired with no replacement: nothing to wait on
                    raise

    def try_window(self, num_chunks: int) -> WindowReservation | None:
        """A run at once, or None."""
        lease = self.arena.try_acquire(check_int("window chunks", num_chunks, lo=1))
        return None if lease is None else WindowReservation(lease)
