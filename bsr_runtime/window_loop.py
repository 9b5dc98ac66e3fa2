"""The one window loop of the restore (ARCHITECTURE.md, "The window loop"), in the paper's verbs:

    "each window is fetched, required to be complete, mapped onto the corresponding destination
     block slice, transferred, synchronized, and then released"

    per window G_j:  admit (reserve its staging) -> submit the fetch -> fetched (required complete)
                     -> map onto the destination block slice -> transfer (install) -> synchronize
                     -> release -> advance

(Saves go the other way through saver.Saver, the engine's and the harness's one store path.)

Where the bytes come from is plugged in as an object the loop calls: a `WindowSource` whose
`submit(window, reservation)` submits one window's fetch and whose `SubmittedWindow.fetched()` waits until
it is complete (a tier into staging: tier_source.TierSource; or
a tier's own source installed from where it holds the bytes, `Tier.window_source`: LMCache's L1,
integrations/lmcache/l1_source.py). Making a source starts nothing.

The loop owns the order of the steps and the clean-up: on every path out (an exception of any type
included) each fetched window is abandoned (writers stopped, launched work synchronized, staging
released) and each reservation returned. A failure becomes `WindowFailed` with the window's index;
a BaseException that is not an Exception (KeyboardInterrupt, SystemExit) is re-raised as itself
after the clean-up. `should_stop` (a cancelled request, an engine shutting down) is asked before
each new window: the loop then stops at that window boundary, after the windows already fetched
were transferred or abandoned, and raises `RestoreCancelled` (a failure like any other).

The time of each phase is added to `LoopStats` by `with stats.time(phase):`; the phase names are
the report fields and metric labels (`<phase>_s`), each timing the call it is named after: admit
(waiting for the admission), submit (`source.submit`: keys, staging, the tier call), fetch
(`fetched()`: until the fetch is complete), install (the transfers), sync (synchronize + release).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from .admission import Admission, WindowReservation
from .plan import Window

# (offset of the run's first chunk inside the window, chunks in the run, their staged bytes)
StagedRun = tuple[int, int, torch.Tensor]


class BlockSlice(NamedTuple):
    """Staged bytes mapped onto their slice of the destination: `num_chunks` chunks from request
    chunk `first_chunk` (the kernel resolves them to destination blocks through the block tables)."""

    staged: torch.Tensor
    first_chunk: int
    num_chunks: int


# install / gather one block slice: (staged bytes, first request chunk, chunks) -> backend name
TransferFn = Callable[[torch.Tensor, int, int], "str | None"]


class SubmittedWindow(Protocol):
    """One restore window whose fetch was submitted."""

    def fetched(self) -> Sequence[StagedRun]:
        """Block until every object of the window is present in staging (the paper's "required to be
        complete") and give its staged runs; raise otherwise."""

    def synchronize(self, stream) -> None:
        """Record the transfers just launched on `stream` from the staged bytes and wait for them."""

    def release(self) -> None:
        """Give staging (and any locks) back; only after synchronize()."""

    def abandon(self, stream) -> None:
        """Failure path: stop writers, synchronize anything launched, release everything."""


class WindowSource(Protocol):
    """Where a restore's bytes come from."""

    def submit(self, window: Window, reservation: WindowReservation) -> SubmittedWindow:
        """Submit the fetch of the window's objects (into `reservation.lease`, its staging); on failure
        nothing of the window is held."""


class InPlaceSource(WindowSource, Protocol):
    """A tier's own source (Tier.window_source): its windows are installed from where the tier holds
    the bytes (LMCache's L1), not from BSR's staging; it measures what it pins for the restore."""

    @property
    def peak_bytes(self) -> int:
        """The most chunk bytes the restore's windows pinned at once (the report's peak staging)."""

    @property
    def peak_room_bytes(self) -> int:
        """Auxiliary bytes beside them (alignment padding; the report's header room)."""


class _NoStaging:
    """The reservation of a window that leases no staging (WindowLoop.admission None)."""

    lease = None
    nbytes = 0

    def release(self) -> None:
        pass


NO_STAGING = _NoStaging()


class RestoreCancelled(Exception):
    """The restore was asked to stop (request aborted, engine shutting down)."""


class WindowFailed(Exception):
    """A window failed; `cause` is what failed it. Nothing of the window is exposed."""

    def __init__(self, window: int, cause: BaseException) -> None:
        super().__init__(f"window {window}: {type(cause).__name__}: {cause}")
        self.window = window
        self.cause = cause


# the loop's timed phases, in order: LoopStats' `<phase>_s` fields, and with the restore's "prepare" before them
# (restore.RESTORE_PHASES) the fields of every restore and load record and the connector's metric labels
LOOP_PHASES = ("admit", "submit", "fetch", "install", "sync")


@dataclass
class LoopStats:
    """What the loop measured; restore reports copy these fields."""

    admit_s: float = 0.0  # waiting for the admission (the byte budget B)
    submit_s: float = 0.0  # issuing a window's fetch: its keys, its staging, the tier call
    fetch_s: float = 0.0  # until the fetch is complete
    install_s: float = 0.0  # install launches (the transfers)
    sync_s: float = 0.0  # synchronize + release
    windows_done: int = 0
    chunks_done: int = 0
    backend: str | None = None
    failed_window: int | None = None
    launches: int = 0
    live_bytes: int = 0  # this loop's windows reserved now
    peak_bytes: int = 0  # the most this loop held at once

    def time(self, phase: str) -> _PhaseTimer:
        """Add the time spent in the block to `<phase>_s`."""
        return _PhaseTimer(self, f"{phase}_s")

    def hold(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def drop(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


class _PhaseTimer:
    """LoopStats.time's block: a plain object, not a generator context manager (a window enters five of
    these and two `_Failing` blocks; generator-based ones cost microseconds each, per window)."""

    __slots__ = ("_stats", "_field", "_t")

    def __init__(self, stats: LoopStats, field_name: str) -> None:
        self._stats, self._field = stats, field_name

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        setattr(self._stats, self._field, getattr(self._stats, self._field) + time.perf_counter() - self._t)


def map_onto_destination(window: Window, runs: Sequence[StagedRun]) -> Iterator[BlockSlice]:
    """Each staged run of `window`, mapped onto the destination block slice it belongs to."""
    for offset, count, staged in runs:
        yield BlockSlice(staged, window.first_chunk + offset, count)


@dataclass
class WindowLoop:
    """The loop's fixed parts: admission, the stream transfers run on, the pipeline depth."""

    # None: the windows lease no staging of the loop's (a source that pins what it installs from and bounds
    # that itself: LMCache's L1 in its server, integrations/lmcache/server_retrieve.py)
    admission: Admission | None
    stream: object = None
    depth: int = 1  # 2: window j+1 is fetched while window j is transferred
    admission_timeout_s: float | None = None
    stats: LoopStats = field(default_factory=LoopStats)
    should_stop: Callable[[], bool] | None = None

    # -- restore ----------------------------------------------------------------------------
    def restore(self, windows: Iterable[Window], source: WindowSource, install: TransferFn) -> None:
        """Every window fetched from `source`, completed, installed, synchronized and released."""
        in_flight: deque[_Held] = deque()
        try:
            for window in windows:
                self._stop_at_boundary(window, in_flight, install)
                reservation = self._admit(window, in_flight, install)
                in_flight.append(self._submit(window, source, reservation))
                while len(in_flight) >= self.depth:
                    self._restore_window(in_flight.popleft(), install)
            while in_flight:
                self._restore_window(in_flight.popleft(), install)
        except BaseException:
            for held in in_flight:
                held.abandon(self.stream)
            raise

    def _submit(self, window: Window, source: WindowSource, reservation: WindowReservation) -> _Held:
        with self._failing(window, reservation), self.stats.time("submit"):
            submitted = source.submit(window, reservation)
        return _Held(window, submitted, reservation, self.stats)

    def _restore_window(self, held: _Held, install: TransferFn) -> None:
        """The paper's sentence for one fetched window."""
        window, submitted = held.window, held.staged
        with self._failing(window, held):
            with self.stats.time("fetch"):
                runs = submitted.fetched()
            with self.stats.time("install"):
                for block_slice in map_onto_destination(window, runs):
                    self.stats.backend = install(*block_slice) or self.stats.backend
                    self.stats.launches += 1
            with self.stats.time("sync"):
                submitted.synchronize(self.stream)
                held.release()
        self._advance(window)

    def _stop_at_boundary(self, window: Window, in_flight: deque[_Held], install: TransferFn) -> None:
        """A stop request installs what was fetched, then ends the loop before `window`."""
        if self.should_stop is None or not self.should_stop():
            return
        while in_flight:
            self._restore_window(in_flight.popleft(), install)
        self._fail(window, RestoreCancelled(f"stopped before window {window.index}"))

    # -- shared -----------------------------------------------------------------------------
    def _admit(self, window: Window, in_flight: deque[_Held], transfer: TransferFn) -> WindowReservation:
        """The window's staging. Never block on the admission while holding a fetched window
        (a shared arena would deadlock): finish the held windows first."""
        if self.admission is None:
            return NO_STAGING
        while in_flight:
            reservation = self.admission.try_window(window.num_chunks)
            if reservation is not None:
                return reservation
            self._restore_window(in_flight.popleft(), transfer)
        with self._failing(window), self.stats.time("admit"):
            return self.admission.window(window.num_chunks, self.admission_timeout_s)

    def _advance(self, window: Window) -> None:
        self.stats.windows_done += 1
        self.stats.chunks_done += window.num_chunks

    def _failing(self, window: Window, held: _Held | WindowReservation | None = None) -> _Failing:
        """Any exception in the block abandons what the window holds and fails the window."""
        return _Failing(self, window, held)

    def _fail(self, window: Window, e: BaseException):
        self.stats.failed_window = window.index
        if isinstance(e, WindowFailed) or not isinstance(e, Exception):
            raise e
        raise WindowFailed(window.index, e) from e


class _Failing:
    """WindowLoop._failing's block: an exception of any type abandons (a fetched window) or releases (a
    reservation) what the window holds, then fails the window (WindowLoop._fail raises)."""

    __slots__ = ("_loop", "_window", "_held")

    def __init__(self, loop: WindowLoop, window: Window, held: _Held | WindowReservation | None) -> None:
        self._loop, self._window, self._held = loop, window, held

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if e is None:
            return False
        held = self._held
        if isinstance(held, _Held):
            held.abandon(self._loop.stream)
        elif held is not None:
            held.release()
        self._loop._fail(self._window, e)
        return False  # not reached: _fail raises


@dataclass
class _Held:
    """A window between its fetch (or staging) and its release: the staged bytes and the reservation."""

    window: Window
    staged: SubmittedWindow
    reservation: WindowReservation
    stats: LoopStats
    _counted: bool = False

    def __post_init__(self) -> None:
        self.stats.hold(self.reservation.nbytes)
        self._counted = True

    def release(self) -> None:
        self.staged.release()
        self._return_bytes()

    def abandon(self, stream) -> None:
        try:
            self.staged.abandon(stream)
        finally:
            self._return_bytes()

    def _return_bytes(self) -> None:
        self.reservation.release()
        if self._counted:
            self._counted = False
            self.stats.drop(self.reservation.nbytes)
