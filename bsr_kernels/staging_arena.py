"""StagingArena: the one staging of BSR, for restores and stores alike.

One buffer of `capacity_chunks` chunks, allocated once; a window leases a contiguous run of chunks
from it and gives the run back after the work that read it completed (synchronize-then-release).
Live staging can therefore never exceed the buffer: the bound is the buffer itself, not a counter
beside it. A restorer's own staging is an arena of W chunks (at pipeline depth 2 its windows of
ceil(W/2) and floor(W/2) chunks are two runs of it), concurrent restores share one of B bytes (the
byte budget), a whole plan's is one of N chunks, and a saver's (the engine's saves, the harness's stores)
its own.

Leases are granted first come, first served: a waiter is never overtaken by a later request, so
the windows of a short restore interleave with those of a long one instead of queueing behind
all of them. `try_acquire` never waits and never jumps the queue (a restore holding a staged window
uses it for its next window: waiting there could deadlock two restores on each other's windows).

`headroom` > 0 leaves that many bytes of scratch before each chunk: chunk i of a run starts at
headroom + i * chunk_stride (chunk_stride = headroom + chunk_bytes), and a lease's `view` is then a 2-D
(num_chunks, chunk_bytes) view with row stride chunk_stride, which every install backend takes. A tier
whose objects carry a header lands each object whole there, header in the scratch, by one transfer
(tiers/mooncake.py). The meters count chunk bytes (the paper's W*c); the room, `room_bytes` = capacity *
headroom, is auxiliary state (the A of RWS <= W*c + A, docs/design.md).

Every wait has a way out: `acquire` waits at most `timeout` and, given `should_stop`, ends as soon as
it answers True (a cancelled request must not wait for staging it no longer needs). A run quarantined
because a late writer may still land there (`quarantine(lease, settled)`) comes back once `settled`
says the writer stopped: one watcher thread per quarantined run (at most one per chunk), so a read that
lands late costs its staging only until it lands, not for the life of the worker.

A read that never lands keeps its run for good; once quarantined runs leave no room for a window
(`can_hold`), the owner (bsr_runtime/loader.py) retires the arena (`retire`: waiters raise
StagingArenaRetired and wait again on the replacement, nothing new is leased here) and allocates a
replacement. A retired arena is `drained` once its leases came back and its quarantined runs settled;
only then may its buffer be unregistered from the tiers. `stuck_reason`, once set, ends a wait for a
run the quarantine leaves no room for at once (StagingExhausted), instead of at the wait's bound.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

STOP_POLL_S = 0.02  # how often a waiter given `should_stop` asks it (the cancel latency of a staging wait)
SETTLE_POLL_S = 0.5  # how often a quarantine watcher checks whether the arena closed
_FREE, _LIVE, _QUARANTINED = 1, 0, 2  # a chunk's state (`_state`)


class StagingWaitTimeout(TimeoutError):
    """No staging for a window within the wait's bound."""


def work_stream(tensors, stream=None):
    """The stream work on `tensors` runs on: `stream`, else their CUDA device's current stream, else None (on
    CPU the kernels are synchronous). What a run's completion is recorded on: a kernel launched on the current
    stream that reads or writes host staging has not completed when the launch returns."""
    if stream is not None:
        return stream
    first = next(iter(tensors), None)
    if isinstance(first, torch.Tensor) and first.device.type == "cuda":
        return torch.cuda.current_stream(first.device)
    return None


class CompletionEvent:
    """Completion of the work that reads or writes a leased run.

    On a GPU a CUDA event recorded on the stream the work ran on (`work_stream`), for staging on the
    device and in (pinned) host memory alike. On CPU the kernels are synchronous, so recording marks
    completion, unless the work ran on a host stream: any object with a `synchronize()` that returns
    once the work submitted to it is done (a CPU worker thread).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = torch.cuda.Event() if device.type == "cuda" else None
        self._host_stream = None
        self._recorded = False

    def record(self, stream=None) -> None:
        if self._cuda is None and isinstance(stream, torch.cuda.Stream):
            self._cuda = torch.cuda.Event()  # host staging, GPU work: wait for that work, not the whole stream
        if self._cuda is not None:
            self._cuda.record(stream if stream is not None else torch.cuda.current_stream())
        else:
            self._host_stream = stream if hasattr(stream, "synchronize") else None
        self._recorded = True

    def synchronize(self) -> None:
        if self._cuda is not None and self._recorded:
            self._cuda.synchronize()
        elif self._host_stream is not None:
            self._host_stream.synchronize()
            self._host_stream = None


def _check_count(name: str, value: object, *, multiple: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value % multiple:
        raise ValueError(f"{name} must be an integer >= {least}, a multiple of {multiple}, got {value!r}")


class StagingWaitCancelled(RuntimeError):
    """`acquire` ended because its `should_stop` answered True (the request was cancelled)."""


class StagingArenaRetired(RuntimeError):
    """The arena was retired (`retire`) while the caller waited: wait on its replacement."""


class StagingExhausted(RuntimeError):
    """Runs quarantined behind reads that never landed leave no room for the window, and the owner will
    not replace the arena again (`stuck_reason`)."""


@dataclass
class ArenaLease:
    """A run of `num_chunks` chunks of an arena: its chunks' views, and the completion of the work on
    them (`record(stream)` after launching the install or gather that uses them, `synchronize()` before
    anything else reads or reuses them, then `release()`)."""

    arena: StagingArena
    first: int  # first chunk of the run in the arena
    num_chunks: int
    view: torch.Tensor = field(repr=False)
    event: CompletionEvent = field(repr=False)
    recorded: bool = False
    synchronized: bool = False
    released: bool = False

    def chunk(self, i: int) -> torch.Tensor:
        return self.chunks()[i]

    def chunks(self) -> list[torch.Tensor]:
        return self.arena.chunk_views(self.first, self.num_chunks)

    def record(self, stream=None) -> None:
        """Record the completion of the work just launched on this lease's bytes."""
        self.event.record(stream)
        self.recorded, self.synchronized = True, False

    def synchronize(self) -> None:
        """Wait until the recorded work completed."""
        self.event.synchronize()
        self.synchronized = True

    def release(self) -> None:
        """Give the run back (idempotent). Recorded work must have been synchronized first."""
        self.arena.release(self)

    def quarantine(self, settled: Callable[[float], bool] | None = None) -> None:
        """A writer that never settled may still land in this run: not handed out again until
        `settled(timeout)` returns True (the writer stopped); without `settled`, never."""
        self.arena.quarantine(self, settled)


class StagingArena:
    """`capacity_chunks` chunks of `chunk_bytes` (plus `headroom` before each), leased as runs; host
    memory is pinned on a CUDA machine so the install can read it directly."""

    def __init__(self, chunk_bytes: int, capacity_chunks: int, *, headroom: int = 0,
                 device: str | torch.device = "cpu", pin_memory: bool | None = None, prefault: bool = True) -> None:
        _check_count("chunk_bytes", chunk_bytes, multiple=16, least=16)
        if isinstance(capacity_chunks, bool) or not isinstance(capacity_chunks, int) or capacity_chunks < 1:
            raise ValueError(f"a staging arena needs at least one chunk, got {capacity_chunks!r}")
        _check_count("headroom", headroom, multiple=16, least=0)
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.headroom = headroom
        self.chunk_stride = headroom + chunk_bytes
        self.capacity_chunks = capacity_chunks
        if pin_memory is None:
            pin_memory = self.device.type == "cpu" and torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        self.buffer = torch.empty(capacity_chunks * self.chunk_stride, dtype=torch.uint8, device=self.device,
                                  pin_memory=self.pinned)
        if prefault:  # a long-lived arena: touched before any restore that uses it is timed
            self.prefault()
        # every chunk's view, made once: a window's lease and its views are then a list slice and one tensor
        # slice of these, not a torch view made per chunk for every window of every restore
        self._rows = self.buffer.view(capacity_chunks, self.chunk_stride)[:, headroom:]
        self._chunk_views = list(self._rows)
        self._state = bytearray([_FREE]) * capacity_chunks
        self._quarantined = 0
        self._live = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._tickets = itertools.count()
        self._closed = False
        self._retired = False
        self.max_wait_s = 0.0
        # called (with this arena, on the thread that quarantined, outside the lock) after a run was quarantined
        self.on_quarantine: Callable[[StagingArena], None] | None = None
        self.stuck_reason: str | None = None  # set by the owner: why no replacement comes (StagingExhausted)

    def chunk_views(self, first: int, n: int) -> list[torch.Tensor]:
        """The views of chunks first..first+n-1 (one contiguous chunk_bytes view each)."""
        return self._chunk_views[first : first + n]

    def prefault(self) -> None:
        """Touch host memory now: else the first restore that uses it pays a page fault per page. Pinned and
        device memory are resident already."""
        if self.device.type == "cpu" and not self.pinned:
            self.buffer.zero_()

    # -- meters ----------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.capacity_chunks * self.chunk_bytes

    @property
    def room_bytes(self) -> int:
        """The header room before the chunks (allocated with them, never counted as staged bytes)."""
        return self.capacity_chunks * self.headroom

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

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def drained(self) -> bool:
        """No lease out and no quarantined run: nothing can still write into the buffer."""
        with self._cond:
            return self._live == 0 and self._quarantined == 0

    def can_hold(self, num_chunks: int) -> bool:
        """Whether a run of `num_chunks` chunks could still be leased once every live lease came back
        (quarantined runs may never come back)."""
        with self._cond:
            return self._can_hold(num_chunks)

    def reset_peak(self) -> None:
        with self._cond:
            self._peak = self._live

    # -- leasing ---------------------------------------------------------------------------
    def acquire(self, num_chunks: int, timeout: float | None = None,
                should_stop: Callable[[], bool] | None = None) -> ArenaLease:
        """Lease a run of `num_chunks` chunks, first come first served, waiting up to `timeout`
        (StagingWaitTimeout) or until `should_stop()` answers True (StagingWaitCancelled, asked every
        STOP_POLL_S). ValueError if the arena can never hold that many; StagingArenaRetired once it is
        retired; StagingExhausted when quarantined runs leave no room and `stuck_reason` is set."""
        self._check(num_chunks)
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                while True:
                    self._check_open(num_chunks, should_stop)
                    first = self._find(num_chunks) if self._queue[0] == ticket else None
                    if first is not None:
                        lease = self._take(first, num_chunks)
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise StagingWaitTimeout(f"no staging for {num_chunks} chunks within {timeout}s ("
                                                 f"{self._live}/{self.capacity_chunks} chunks live, "
                                                 f"{self._quarantined} quarantined behind reads not landed)")
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
            if self._closed or self._retired or self._queue:
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
            self._mark(lease, _FREE)
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
            self._mark(lease, _QUARANTINED)
            self._live -= lease.num_chunks
            self._quarantined += lease.num_chunks
            self._cond.notify_all()
        if settled is not None:
            threading.Thread(target=self._watch, args=(lease, settled), name="bsr-quarantine", daemon=True).start()
        if self.on_quarantine is not None:
            self.on_quarantine(self)

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
            self._mark(lease, _FREE)
            self._quarantined -= lease.num_chunks
            self._cond.notify_all()

    def retire(self) -> None:
        """Lease nothing more: every waiter raises StagingArenaRetired (to wait on the replacement). Leases
        out stay valid until released, quarantined runs are still watched (`drained`)."""
        with self._cond:
            self._retired = True
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

    def _check_open(self, num_chunks: int, should_stop: Callable[[], bool] | None) -> None:
        """Raise if a wait for `num_chunks` chunks must end now (under the lock)."""
        if self._closed:
            raise RuntimeError("staging arena closed")
        if self._retired:
            raise StagingArenaRetired("staging arena retired: wait on its replacement")
        if should_stop is not None and should_stop():
            raise StagingWaitCancelled(f"cancelled while waiting for staging for {num_chunks} chunks")
        if self.stuck_reason is not None and not self._can_hold(num_chunks):
            raise StagingExhausted(f"no staging for {num_chunks} chunks: {self._quarantined} of "
                                   f"{self.capacity_chunks} chunks quarantined behind reads that never landed; "
                                   f"{self.stuck_reason}")

    def _can_hold(self, n: int) -> bool:
        return re.search(b"[^\\x%02x]{%d}" % (_QUARANTINED, n), self._state) is not None

    def _mark(self, lease: ArenaLease, state: int) -> None:
        self._state[lease.first : lease.first + lease.num_chunks] = bytes([state]) * lease.num_chunks

    def _find(self, n: int) -> int | None:
        i = self._state.find(bytes([_FREE]) * n)
        return None if i < 0 else i

    def _take(self, first: int, n: int) -> ArenaLease:
        self._state[first : first + n] = bytes([_LIVE]) * n
        self._live += n
        self._peak = max(self._peak, self._live)
        if self.headroom:
            view = self._rows[first : first + n]
        else:
            view = self.buffer[first * self.chunk_bytes : (first + n) * self.chunk_bytes]
        return ArenaLease(self, first, n, view, CompletionEvent(self.device))
