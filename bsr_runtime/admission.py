"""Admission: how concurrent restores share staging.

- SerialAdmission (default, as the paper's prototype): one restore at a time process-wide.
- ByteBudget(B): concurrent restores; every window reserves its bytes from B before it is
  fetched and returns them after its install completed. FIFO: a blocking reservation waits
  its turn. Deadlock-free because a restore only blocks while holding nothing: a second
  (pipelined) window is taken with `try_reserve`, never waited for.
- ArenaAdmission(arena): the budget B is a StagingArena of B bytes shared by concurrent
  restores; a window's reservation is its lease of staging (`WindowReservation.lease`), so the
  bytes reserved and the bytes staged are one and the same. Same FIFO and no-deadlock rules.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bsr_kernels.staging_arena import StagingArenaRetired
from bsr_kernels.staging_pool import StagingWaitTimeout

from .validation import check_int, check_timeout


class WindowReservation:
    """The bytes one window holds from an admission; `release()` is idempotent, so every path
    out of the window loop can call it. `lease`: the window's staging when the admission hands
    staging out itself (ArenaAdmission), else None (the stage leases its own)."""

    def __init__(self, admission: Admission, nbytes: int, lease=None) -> None:
        self._admission = admission
        self.nbytes = nbytes
        self.lease = lease
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            if self.lease is not None:
                self.lease.release()
            else:
                self._admission.release(self.nbytes)


class Admission:
    """What the window loop needs of an admission: reservations per window, and `admitted(...)`
    around a whole restore or store."""

    @contextmanager
    def admitted(self, timeout: float | None = None) -> Iterator[Admission]:
        """Held for a whole restore (or store); SerialAdmission admits one at a time here, the
        budgets admit per window only."""
        yield self

    def reserve(self, nbytes: int, timeout: float | None = None) -> None:
        raise NotImplementedError

    def try_reserve(self, nbytes: int) -> bool:
        raise NotImplementedError

    def release(self, nbytes: int) -> None:
        raise NotImplementedError

    def window(self, nbytes: int, timeout: float | None = None) -> WindowReservation:
        """Reserve a window's bytes, waiting up to `timeout`."""
        self.reserve(nbytes, timeout)
        return WindowReservation(self, nbytes)

    def try_window(self, nbytes: int) -> WindowReservation | None:
        """Reserve a window's bytes only if that needs no waiting."""
        return WindowReservation(self, nbytes) if self.try_reserve(nbytes) else None


class SerialAdmission(Admission):
    """One bounded restore at a time in this process."""

    _process_lock = threading.Lock()

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self._lock = lock or SerialAdmission._process_lock
        self.max_wait_s = 0.0

    @contextmanager
    def admitted(self, timeout: float | None = None) -> Iterator[Admission]:
        timeout = check_timeout("admission timeout", timeout, allow_none=True)
        t0 = time.monotonic()
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise StagingWaitTimeout(f"restore admission not granted within {timeout}s")
        self.max_wait_s = max(self.max_wait_s, time.monotonic() - t0)
        try:
            yield self
        finally:
            self._lock.release()

    # with a serial lock, windows need no reservation of their own
    def reserve(self, nbytes: int, timeout: float | None = None) -> None:
        _check_nbytes(nbytes)
        check_timeout("reservation timeout", timeout, allow_none=True)

    def try_reserve(self, nbytes: int) -> bool:
        _check_nbytes(nbytes)
        return True

    def release(self, nbytes: int) -> None:
        _check_nbytes(nbytes)


class ByteBudget(Admission):
    """A global byte budget B shared by concurrent restores (FIFO, no deadlock)."""

    def __init__(self, budget_bytes: int) -> None:
        # an int: NaN or inf would disable the bound (every comparison with NaN is False)
        self.budget_bytes = check_int("byte budget", budget_bytes, lo=1)
        self._used = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._tickets = itertools.count()
        self.max_wait_s = 0.0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def _take(self, nbytes: int) -> None:
        self._used += nbytes
        self._peak = max(self._peak, self._used)

    def reserve(self, nbytes: int, timeout: float | None = None) -> None:
        nbytes = _check_nbytes(nbytes)
        timeout = check_timeout("reservation timeout", timeout, allow_none=True)
        if nbytes > self.budget_bytes:
            raise ValueError(f"a window of {nbytes:,} B exceeds the byte budget B = {self.budget_bytes:,} B")
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                while self._queue[0] != ticket or self._used + nbytes > self.budget_bytes:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise StagingWaitTimeout(f"{nbytes:,} B not granted from the budget within {timeout}s")
                    self._cond.wait(remaining)
                self._take(nbytes)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
        self.max_wait_s = max(self.max_wait_s, time.monotonic() - t0)

    def try_reserve(self, nbytes: int) -> bool:
        nbytes = _check_nbytes(nbytes)
        with self._cond:
            if self._queue or self._used + nbytes > self.budget_bytes:
                return False
            self._take(nbytes)
            return True

    def release(self, nbytes: int) -> None:
        nbytes = _check_nbytes(nbytes)
        with self._cond:
            if nbytes > self._used:
                raise RuntimeError(f"budget release of {nbytes} B exceeds the {self._used} B reserved")
            self._used -= nbytes
            self._cond.notify_all()


def _check_nbytes(nbytes: object) -> int:
    return check_int("reservation size (bytes)", nbytes, lo=0)


class ArenaAdmission(Admission):
    """Windows lease their staging from one StagingArena (the byte budget B of concurrent restores).
    A reservation carries the lease; releasing it (after the install synchronized) frees the run.

    `current` (default: `arena` for good) names the arena to lease from now: its owner may retire an
    arena (runs quarantined behind reads that never land) and put a replacement in its place; a wait
    on the retired one then goes on, within the same bound, on the replacement."""

    def __init__(self, arena, should_stop: Callable[[], bool] | None = None,
                 current: Callable[[], object] | None = None) -> None:
        self._current = current or (lambda: arena)
        self.budget_bytes = arena.capacity_bytes
        self.should_stop = should_stop  # one restore's: its wait for staging ends when it is cancelled

    @property
    def arena(self):
        return self._current()

    def _chunks(self, arena, nbytes: int) -> int:
        nbytes = _check_nbytes(nbytes)
        n, rest = divmod(nbytes, arena.chunk_bytes)
        if rest or n == 0:
            raise ValueError(f"a window of {nbytes:,} B is not a whole number of {arena.chunk_bytes:,} B chunks")
        return n

    def window(self, nbytes: int, timeout: float | None = None) -> WindowReservation:
        timeout = check_timeout("reservation timeout", timeout, allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            arena = self.arena
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return WindowReservation(self, nbytes, arena.acquire(self._chunks(arena, nbytes), remaining,
                                                                     self.should_stop))
            except StagingArenaRetired:
                if self.arena is arena:  # retired with no replacement: nothing to wait on
                    raise

    def try_window(self, nbytes: int) -> WindowReservation | None:
        arena = self.arena
        lease = arena.try_acquire(self._chunks(arena, nbytes))
        return None if lease is None else WindowReservation(self, nbytes, lease)

    def reserve(self, nbytes: int, timeout: float | None = None) -> None:
        raise TypeError("ArenaAdmission hands out staging with each window: use window() / try_window()")

    def try_reserve(self, nbytes: int) -> bool:
        raise TypeError("ArenaAdmission hands out staging with each window: use window() / try_window()")

    def release(self, nbytes: int) -> None:
        raise TypeError("an ArenaAdmission reservation is released through its lease")
