"""StagingArena: staging shared by concurrent restores (or saves) under one byte budget B.

One buffer of `capacity_chunks` chunks, allocated once; a window leases a contiguous run of chunks
from it and gives the run back after the work that read it completed (synchronize-then-release,
as StagingPool's slots). Live staging can therefore never exceed the buffer: the budget B is the
buffer itself, not a counter beside it.

Leases are granted first come, first served: a waiter is never overtaken by a later request, so
the windows of a short restore interleave with those of a long one instead of queueing behind
all of them. `try_acquire` never waits and never jumps the queue (a restore holding a staged window
uses it for its next window: waiting there could deadlock two restores on each other's windows).

`headroom` > 0 leaves that many bytes of scratch before each chunk, as in StagingPool (a tier lands
an object with its header there in one transfer).

Every wait has a way out: `acquire` waits at most `timeout` and, given `should_stop`, ends as soon as
it answers True (a cancelled request must not wait for staging it no longer needs). A run quarantined
because a late writer may still land there (`quarantine(lease, settled)`) comes back once `settled`
says the writer stopped: one watcher thread per quarantined run (at most one per chunk), so a read that
lands late costs its staging only until it lands, not for the life of the worker.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .staging_pool import CompletionEvent, LeasedChunks, StagingBuffer

log = logging.getLogger(__name__)

STOP_POLL_S = 0.02  # how often a waiter given `should_stop` asks it (the cancel latency of a staging wait)
SETTLE_POLL_S = 0.5  # how often a quarantine watcher checks whether the arena closed


class StagingWaitCancelled(RuntimeError):
    """`acquire` ended because its `should_stop` answered True (the request was cancelled)."""


@dataclass
class ArenaLease(LeasedChunks):
    """A run of `num_chunks` chunks of an arena; a SlotLease's interface (LeasedChunks, release), so
    the window loop's sources and sinks take either."""

    pool: StagingArena
    first: int  # first chunk of the run in the arena
    num_chunks: int
    view: torch.Tensor = field(repr=False)
    event: CompletionEvent = field(repr=False)
    recorded: bool = False
    synchronized: bool = False
    released: bool = False

    def release(self) -> None:
        """Give the run back (idempotent). Recorded work must have been synchronized first."""
        self.pool.release(self)

    def quarantine(self, settled: Callable[[float], bool] | None = None) -> None:
        """A writer that never settled may still land in this run: not handed out again until
        `settled(timeout)` returns True (the writer stopped); without `settled`, never."""
        self.pool.quarantine(self, settled)


class StagingArena(StagingBuffer):
    """`capacity_chunks` chunks of `chunk_bytes` (plus `headroom` before each), leased as runs."""

    def __init__(self, chunk_bytes: int, capacity_chunks: int, *, headroom: int = 0,
                 device: str | torch.device = "cpu", pin_memory: bool | None = None) -> None:
        super().__init__("staging arena", chunk_bytes, capacity_chunks, headroom, device, pin_memory)
        self.prefault()  # shared by every restore of a worker for its lifetime
        self._free = bytearray(b"\x01") * capacity_chunks  # 1: chunk free
        self._quarantined = 0
        self._live = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._tickets = itertools.count()
        self._closed = False
        self.max_wait_s = 0.0

    # -- meters ----------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        with self._cond:
            return self._live * self.chunk_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak * self.chunk_bytes

    @property
    def quarantined_chunks(self) -> int:
        return self._quarantined

    @property
    def waiters(self) -> int:
        with self._cond:
            return len(self._queue)

    def reset_peak(self) -> None:
        with self._cond:
            self._peak = self._live

    # -- leasing ---------------------------------------------------------------------------
    def acquire(self, num_chunks: int, timeout: float | None = None,
                should_stop: Callable[[], bool] | None = None) -> ArenaLease:
        """Lease a run of `num_chunks` chunks, first come first served, waiting up to `timeout`
        (TimeoutError) or until `should_stop()` answers True (StagingWaitCancelled, asked every
        STOP_POLL_S). ValueError if the arena can never hold that many."""
        self._check(num_chunks)
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                while True:
                    if self._closed:
                        raise RuntimeError("staging arena closed")
                    if should_stop is not None and should_stop():
                        raise StagingWaitCancelled(f"cancelled while waiting for staging for {num_chunks} chunks")
                    first = self._find(num_chunks) if self._queue[0] == ticket else None
                    if first is not None:
                        lease = self._take(first, num_chunks)
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no staging for {num_chunks} chunks within {timeout}s "
                                           f"({self._live}/{self.capacity_chunks} chunks live)")
                    if should_stop is not None:  # nothing notifies a cancel: ask again soon
                        remaining = STOP_POLL_S if remaining is None else min(remaining, STOP_POLL_S)
                    self._cond.wait(remaining)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
        self.max_wait_s = max(self.max_wait_s, time.monotonic() - t0)
        return lease

    def try_acquire(self, num_chunks: int) -> ArenaLease | None:
        """A run at once, or None (also when others are waiting: nobody is overtaken)."""
        self._check(num_chunks)
        with self._cond:
            if self._closed or self._queue:
                return None
            first = self._find(num_chunks)
            return None if first is None else self._take(first, num_chunks)

    def release(self, lease: ArenaLease) -> None:
        with self._cond:
            if lease.released:
                return
            if lease.recorded and not lease.synchronized:
                raise RuntimeError("staging released before the work recorded on it was synchronized")
            lease.released = True
            self._free[lease.first : lease.first + lease.num_chunks] = b"\x01" * lease.num_chunks
            self._live -= lease.num_chunks
            self._cond.notify_all()

    def quarantine(self, lease: ArenaLease, settled: Callable[[float], bool] | None = None) -> None:
        """Retire a run while a late write may still land there; its bytes stop counting as live. With
        `settled` (e.g. the fetch handle's quiesce), a watcher thread gives the run back once
        `settled(timeout)` returns True; without it, the run is retired for good."""
        with self._cond:
            if lease.released:
                return
            lease.released = True
            self._live -= lease.num_chunks
            self._quarantined += lease.num_chunks
            self._cond.notify_all()
        if settled is not None:
            threading.Thread(target=self._watch, args=(lease, settled), name="bsr-quarantine", daemon=True).start()

    def _watch(self, lease: ArenaLease, settled: Callable[[float], bool]) -> None:
        """Give a quarantined run back once its writer settled; give up when the arena closes."""
        try:
            while not settled(SETTLE_POLL_S):
                if self._closed:
                    return
        except Exception:  # noqa: BLE001 - a writer we cannot ask about stays quarantined
            log.exception("staging arena: a quarantined run's writer could not be asked; the run stays retired")
            return
        with self._cond:
            self._free[lease.first : lease.first + lease.num_chunks] = b"\x01" * lease.num_chunks
            self._quarantined -= lease.num_chunks
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with an error; leases already out stay valid until released."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- internals -------------------------------------------------------------------------
    def _check(self, num_chunks: int) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks <= 0:
            raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
        if num_chunks > self.capacity_chunks:
            raise ValueError(f"{num_chunks} chunks exceed the staging budget of {self.capacity_chunks} chunks "
                             f"({self.capacity_bytes:,} B)")

    def _find(self, n: int) -> int | None:
        run = b"\x01" * n
        i = self._free.find(run)
        return None if i < 0 else i

    def _take(self, first: int, n: int) -> ArenaLease:
        self._free[first : first + n] = b"\x00" * n
        self._live += n
        self._peak = max(self._peak, self._live)
        start = first * self.chunk_stride
        if self.headroom:
            rows = self.buffer[start : start + n * self.chunk_stride].view(n, -1)
            view = rows[:, self.headroom :]
        else:
            view = self.buffer[start : start + n * self.chunk_bytes]
        return ArenaLease(self, first, n, view, CompletionEvent(self.device))
