"""The one window loop of the design (ARCHITECTURE.md, "The window loop"), for both directions.

    restore, per window G_j:  reserve bytes -> stage (lease staging, submit the fetch)
                              -> wait for complete presence -> install -> record -> synchronize
                              -> release staging and bytes
    store, per window G_j:    reserve bytes -> stage (lease staging) -> gather -> record
                              -> synchronize -> commit (put) -> release staging and bytes

What varies is where a window is staged, plugged in as a `RestoreStage` / `StoreStage` made
by a factory: a tier fetching into a StagingPool slot (restore.py, store.py) or LMCache's L1
(integrations/lmcache). The loop owns the order of the steps and the clean-up: on every path
out (an exception of any type included) each staged window is abandoned (writers stopped,
recorded work synchronized, staging released) and each reservation returned. A failure
becomes `WindowFailed` with the window's index; a BaseException that is not an Exception
(KeyboardInterrupt, SystemExit) is re-raised as itself after the clean-up.

A stage factory is called with the window and its reservation (`reservation.lease` is the window's
staging when the admission hands staging out: a StagingArena shared by concurrent restores).
`should_stop` (a cancelled request, an engine shutting down) is asked before each new window: the
loop then stops at that window boundary, after the windows already staged were installed or
abandoned, and raises `RestoreCancelled` (a failure like any other: nothing is exposed).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .admission import Admission, WindowReservation
from .plan import Window

# (offset of the run's first chunk inside the window, chunks in the run, their staged bytes)
StagedRun = tuple[int, int, torch.Tensor]
# install / gather: (staged bytes, request chunk of the first staged chunk, chunks) -> backend name
MoveFn = Callable[[torch.Tensor, int, int], "str | None"]
# (window, its reservation) -> the window staged (a RestoreStage or StoreStage)
StageFactory = Callable[[Window, WindowReservation], "RestoreStage | StoreStage"]


class RestoreStage(Protocol):
    """One window staged for a restore."""

    def wait(self) -> Sequence[StagedRun]:
        """Block until every object of the window is present in staging; raise otherwise."""

    def record(self, stream) -> None:
        """Record the completion of the install just launched on the staged bytes."""

    def synchronize(self) -> None:
        """Wait until the recorded install completed."""

    def release(self) -> None:
        """Give staging (and any locks) back; only after synchronize()."""

    def abandon(self, stream) -> None:
        """Failure path: stop writers, synchronize anything launched, release everything."""


class StoreStage(Protocol):
    """One window staged for a store."""

    def runs(self) -> Sequence[StagedRun]:
        """Where the window's chunks are gathered to."""

    def record(self, stream) -> None: ...

    def synchronize(self) -> None: ...

    def commit(self) -> None:
        """Hand the gathered (synchronized) bytes to the tier."""

    def release(self) -> None: ...

    def abandon(self, stream) -> None: ...


class RestoreCancelled(Exception):
    """The restore was asked to stop (request aborted, engine shutting down)."""


class WindowFailed(Exception):
    """A window failed; `cause` is what failed it. Nothing of the window is exposed."""

    def __init__(self, window: int, cause: BaseException) -> None:
        super().__init__(f"window {window}: {type(cause).__name__}: {cause}")
        self.window = window
        self.cause = cause


@dataclass
class LoopStats:
    """What the loop measured; restore and store reports copy these fields."""

    admit_s: float = 0.0  # waiting for the admission (the byte budget B)
    submit_s: float = 0.0  # staging a window: its keys, submitting its fetch
    fetch_s: float = 0.0  # waiting for complete presence
    install_s: float = 0.0  # install / gather launches
    sync_s: float = 0.0  # synchronize + release (+ commit for a store)
    windows_done: int = 0
    chunks_done: int = 0
    backend: str | None = None
    failed_window: int | None = None
    launches: int = 0
    live_bytes: int = 0  # this loop's windows reserved now
    peak_bytes: int = 0  # the most this loop held at once

    @contextlib.contextmanager
    def phase(self, name: str):
        """Add the time spent in the block to `<name>_s`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, f"{name}_s", getattr(self, f"{name}_s") + time.perf_counter() - t)

    def hold(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


@dataclass
class WindowLoop:
    """The loop's fixed parts: admission, the stream installs run on, the pipeline depth."""

    admission: Admission
    chunk_bytes: int
    stream: object = None
    depth: int = 1  # 2: window j+1 is staged while window j installs
    admission_timeout_s: float | None = None
    stats: LoopStats = field(default_factory=LoopStats)
    should_stop: Callable[[], bool] | None = None

    # -- restore ----------------------------------------------------------------------------
    def restore(self, windows: Iterable[Window], stage: StageFactory, install: MoveFn) -> None:
        """Run every window through stage -> wait -> install -> record -> synchronize -> release."""
        in_flight: deque[_Flight] = deque()
        try:
            for win in windows:
                self._check_stop(win, in_flight, install)
                reservation = self._admit(win, in_flight, install)
                in_flight.append(self._stage(win, stage, reservation))
                while len(in_flight) >= self.depth:
                    self._install(in_flight.popleft(), install)
            while in_flight:
                self._install(in_flight.popleft(), install)
        except BaseException:
            for f in in_flight:
                f.abandon(self.stream)
            raise

    def _check_stop(self, win: Window, in_flight: deque[_Flight], install: MoveFn) -> None:
        """At a window boundary: a stop request installs what is staged, then ends the loop."""
        if self.should_stop is None or not self.should_stop():
            return
        while in_flight:
            self._install(in_flight.popleft(), install)
        self._fail(win, RestoreCancelled(f"stopped before window {win.index}"))

    def _admit(self, win: Window, in_flight: deque[_Flight], install: MoveFn) -> WindowReservation:
        """The window's bytes. Never block on the admission while holding a staged window
        (a shared budget would deadlock): install the held windows first."""
        nbytes = win.num_chunks * self.chunk_bytes
        while in_flight:
            reservation = self.admission.try_window(nbytes)
            if reservation is not None:
                return reservation
            self._install(in_flight.popleft(), install)
        with self.stats.phase("admit"):
            return self._guard(win, lambda: self.admission.window(nbytes, self.admission_timeout_s))

    def _stage(self, win: Window, stage: StageFactory, reservation: WindowReservation) -> _Flight:
        try:
            with self.stats.phase("submit"):
                staged = self._guard(win, lambda: stage(win, reservation))
        except BaseException:
            reservation.release()
            raise
        self.stats.hold(reservation.nbytes)
        return _Flight(win, staged, reservation, self.stats)

    def _install(self, f: _Flight, install: MoveFn) -> None:
        win, st = f.window, f.stage
        try:
            with self.stats.phase("fetch"):
                runs = st.wait()
            with self.stats.phase("install"):
                self._move(win, runs, install)
                st.record(self.stream)
            with self.stats.phase("sync"):
                st.synchronize()
                st.release()
                f.release()
        except BaseException as e:
            f.abandon(self.stream)
            self._fail(win, e)
        self._done(win)

    # -- store ------------------------------------------------------------------------------
    def store(self, windows: Iterable[Window], stage: StageFactory, gather: MoveFn) -> None:
        """Run every window through stage -> gather -> record -> synchronize -> commit -> release."""
        for win in windows:
            reservation = self._admit(win, deque(), gather)
            f = self._stage(win, stage, reservation)
            st = f.stage
            try:
                with self.stats.phase("install"):
                    self._move(win, st.runs(), gather)
                    st.record(self.stream)
                with self.stats.phase("sync"):
                    st.synchronize()  # an asynchronous gather must land before the bytes are read
                    st.commit()
                    st.release()
                    f.release()
            except BaseException as e:
                f.abandon(self.stream)
                self._fail(win, e)
            self._done(win)

    # -- shared -----------------------------------------------------------------------------
    def _move(self, win: Window, runs: Sequence[StagedRun], move: MoveFn) -> None:
        for offset, count, view in runs:
            self.stats.backend = move(view, win.first_chunk + offset, count) or self.stats.backend
            self.stats.launches += 1

    def _done(self, win: Window) -> None:
        self.stats.windows_done += 1
        self.stats.chunks_done += win.num_chunks

    def _guard(self, win: Window, fn: Callable):
        try:
            return fn()
        except BaseException as e:
            self._fail(win, e)

    def _fail(self, win: Window, e: BaseException):
        self.stats.failed_window = win.index
        if isinstance(e, WindowFailed) or not isinstance(e, Exception):
            raise e
        raise WindowFailed(win.index, e) from e


@dataclass
class _Flight:
    window: Window
    stage: RestoreStage | StoreStage
    reservation: WindowReservation
    stats: LoopStats
    _held: bool = True

    def release(self) -> None:
        self.reservation.release()
        if self._held:
            self._held = False
            self.stats.live_bytes -= self.reservation.nbytes

    def abandon(self, stream) -> None:
        try:
            self.stage.abandon(stream)
        finally:
            self.release()
