"""The windowed retrieve: restore a confirmed prefix window by window with bounded staging.

Per window: lease a run of staging, fetch the window's objects straight into it (each chunk has
FETCH_HEADROOM bytes of scratch before it, where a tier lands the object's header, so an object
arrives whole in one transfer; that room, W * FETCH_HEADROOM bytes, is auxiliary state beside
the W * c of staging and is reported as header_room_bytes), wait for
complete presence (a missing key or timeout fails the restore), install into the window's
destination blocks with one kernel launch, record the run's event, and release the run
only after that install completed (synchronize-then-release). W = 0 keeps the legacy
whole-plan path (the whole plan staged at once) as the baseline. A tier that offers its own
WindowSource (`Tier.window_source`: LMCache's L1) is restored from it instead: its windows are
installed from where the tier holds them (leasing no staging of the restorer's own; from a shared
arena each window still reserves its run of B), and the report's staging figures are what that source
pinned.

Staging is a StagingArena, leased window by window (admission.py): the restorer's own of W chunks (one
restore at a time over the `serial` lock, process-wide by default), or one of B bytes that concurrent
restores (an engine's background loader) share, so all their live staging stays within B.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from bsr_kernels import Registration, WindowInstaller
from bsr_kernels.backends import backend_names
from bsr_kernels.staging_arena import StagingArena, work_stream

from .admission import SERIAL, Admission
from .causes import FailureCause, cause_of
from .keys import KeySpace, PrefixKeys
from .plan import count_windows, plan_windows, window_sizes
from .tier_source import TierSource
from .tiers.base import FETCH_HEADROOM, Tier
from .validation import check_int, check_optional_int, check_timeout
from .window_loop import LOOP_PHASES, LoopStats, WindowFailed, WindowLoop

MAX_WINDOW_CHUNKS = 1 << 16  # an absurd W is a configuration error, not a huge allocation


@dataclass(frozen=True)
class RestoreConfig:
    window_chunks: int = 32  # W; 0 = legacy whole-plan path
    pipeline_depth: int = 1  # 2: fetch window j+1 while window j installs
    fetch_timeout_s: float = 30.0  # per window
    backend: str = "auto"
    admission_timeout_s: float | None = None
    # Staging capacity (bytes). W > 0 needs W*c of it; the whole-plan path (W = 0) needs N*c
    # and, like LMCache's all-or-nothing L1 reservation, restores nothing when N*c exceeds it.
    max_staging_bytes: int | None = None

    def __post_init__(self) -> None:
        w = self.window_chunks
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"window_chunks (W) must be an integer >= 0, got {w!r}")
        if w > MAX_WINDOW_CHUNKS:
            raise ValueError(f"window_chunks (W) = {w} is absurd (max {MAX_WINDOW_CHUNKS})")
        check_int("pipeline_depth", self.pipeline_depth, lo=1, hi=2)
        window_sizes(max(w, 1), self.pipeline_depth)  # validates depth
        # every timeout ends up in Event.wait / Lock.acquire: finite and <= threading.TIMEOUT_MAX
        check_timeout("fetch_timeout_s", self.fetch_timeout_s)
        check_timeout("admission_timeout_s", self.admission_timeout_s, allow_none=True)
        check_optional_int("max_staging_bytes", self.max_staging_bytes, lo=1)
        if self.backend not in ("auto", *backend_names()):  # a typo is an error here, not a failed install per window
            raise ValueError(f"backend must be one of auto, {', '.join(backend_names())}, got {self.backend!r}")


@dataclass
class RestoreRequest:
    """One request's restore on one TP rank: its prefix tokens, keys and destination blocks."""

    request_id: str
    tokens: Sequence[int]
    keyspace: KeySpace
    kv: Sequence[torch.Tensor]
    block_tables: Sequence[torch.Tensor]  # one per group, block ids from token 0 (-1: not written)
    # asked at every window boundary: True stops the restore there (it then fails, as cancelled)
    should_stop: Callable[[], bool] | None = None
    # tokens the engine holds already (a local prefix-cache hit, other requests may share its blocks):
    # its whole chunks are not fetched, and no block of it is written (their ids may read -1)
    local_tokens: int = 0
    # where the prefix ends when not at the end of its last chunk: blocks past it are not written (-1)
    end_tokens: int | None = None
    # the last chunk is the prompt's partial chunk (PrefixKeys' partial chunk) of this many tokens
    partial_tokens: int = 0

    def prefix_keys(self, chunk_tokens: int) -> PrefixKeys:
        return PrefixKeys(self.keyspace, self.tokens, chunk_tokens, self.partial_tokens)


# a restore's timed phases, in order: the destinations prepared, then the window loop's (<phase>_s each)
RESTORE_PHASES = ("prepare", *LOOP_PHASES)


@dataclass
class RestoreReport:
    request_id: str
    tier: str
    ok: bool
    num_chunks: int
    committed_tokens: int
    window_chunks: int
    pipeline_depth: int
    windows: int
    windows_installed: int
    chunk_bytes: int
    bytes_moved: int
    peak_staging_bytes: int
    header_room_bytes: int = 0  # FETCH_HEADROOM before each staging chunk (auxiliary state, not W*c)
    prepare_s: float = 0.0  # destinations and block tables validated, the installer prepared
    admit_s: float = 0.0  # waiting for staging from the byte budget
    submit_s: float = 0.0  # keys and fetch submission
    fetch_s: float = 0.0
    install_s: float = 0.0
    sync_s: float = 0.0
    total_s: float = 0.0
    error: str | None = None
    cause: FailureCause | None = None  # why it failed (None: it did not); set with `error`
    failed_window: int | None = None
    backend: str | None = None
    tiers_tried: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class BoundedRestorer:
    """Restores confirmed prefixes with staging bounded by W chunks (or the whole plan at W = 0).

    Its staging is its own arena of W chunks (allocated once for W > 0), taken one restore at a time
    over the `serial` lock (default: process-wide, as the paper's prototype), or a shared `arena` (a
    StagingArena of B bytes, the byte budget): then any number of threads may restore through it at once,
    each window leasing its staging from the arena first come first served; the caller registers the
    arena's buffer with the tiers (register_staging) and owns it. With its own arena a restorer is not
    thread-safe, by choice: a second concurrent `restore()` on it raises RuntimeError at once instead of
    competing for the first one's staging.
    """

    def __init__(self, reg: Registration, config: RestoreConfig | None = None, *,
                 stream: torch.cuda.Stream | None = None, staging_device: str = "cpu",
                 make_installer: Callable[..., WindowInstaller] = WindowInstaller,
                 arena: StagingArena | None = None, serial: threading.Lock | None = SERIAL) -> None:
        self.reg = reg
        # how installers are made (WindowInstaller's signature); the fault harness wraps it
        self.make_installer = make_installer
        self.config = config or RestoreConfig()
        self.arena = arena
        self.serial = None if arena is not None else serial
        self.stream = stream
        self.staging_device = staging_device
        w = self.config.window_chunks
        cap = self.config.max_staging_bytes
        if cap is not None and w * reg.chunk_bytes > cap:
            raise ValueError(f"W = {w} chunks of {reg.chunk_bytes:,} B exceeds the staging capacity {cap:,} B")
        self._window_chunks = max(window_sizes(max(w, 1), self.config.pipeline_depth))  # the largest window
        if arena is not None:
            if arena.chunk_bytes != reg.chunk_bytes:
                raise ValueError(f"staging arena of {arena.chunk_bytes:,} B chunks for a registration of "
                                 f"{reg.chunk_bytes:,} B chunks")
            if w <= 0:
                raise ValueError("a restorer over a shared staging arena needs W > 0")
            if self._window_chunks > arena.capacity_chunks:
                raise ValueError(f"a window of {self._window_chunks} chunks "
                                 f"({self._window_chunks * reg.chunk_bytes:,} B) exceeds the staging "
                                 f"budget B = {arena.capacity_bytes:,} B")
        self.staging: StagingArena | None = None  # the restorer's own arena (None: a shared one)
        if arena is None and w > 0:
            self.staging = self._new_arena(w)
        elif arena is None and cap is not None and cap >= reg.chunk_bytes:
            # the whole plan as a real system runs it: staging for the largest prefix it accepts, allocated
            # once (LMCache's L1 at start-up), not per restore; each restore leases the run it needs
            self.staging = self._new_arena(cap // reg.chunk_bytes)
        self._registered: dict[tuple[int, int], tuple[Tier, torch.Tensor]] = {}
        self._busy = threading.Lock()  # taken without blocking by restore(): one restore at a time

    def _new_arena(self, chunks: int, prefault: bool = True) -> StagingArena:
        """An arena of the restorer's own (touched now unless it is for one restore only); one whose quarantined
        runs leave no room for a window is replaced (`_on_quarantine`)."""
        arena = StagingArena(self.reg.chunk_bytes, chunks, device=self.staging_device, headroom=FETCH_HEADROOM,
                             prefault=prefault)
        arena.on_quarantine = self._on_quarantine
        return arena

    def _on_quarantine(self, arena: StagingArena) -> None:
        """A late read may still land in a run of `arena`: if what is left cannot hold a window, replace it."""
        if arena is self.staging and not arena.can_hold(min(self._window_chunks, arena.capacity_chunks)):
            arena.retire()
            self.staging = self._new_arena(arena.capacity_chunks)

    @property
    def staging_capacity_bytes(self) -> int:
        return self.staging.capacity_bytes if self.staging else 0

    def close(self) -> None:
        """Unregister the restorer's own staging from every tier it was registered with."""
        for tier, buffer in list(self._registered.values()):
            self._unregister(tier, buffer)
        self.staging = None

    def __enter__(self) -> BoundedRestorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public ----------------------------------------------------------------------------
    def restore(self, req: RestoreRequest, tier: Tier, num_chunks: int) -> RestoreReport:
        """Restore chunks 0..num_chunks-1 (the confirmed prefix) of `req` from `tier`.

        Bad arguments raise ValueError before any byte moves. A tier or install failure
        returns a report with ok=False (committed_tokens = 0) after every window's staging is released;
        the caller fails the request closed.

        Raises RuntimeError when another thread is in restore() on this restorer with its own staging (not
        thread-safe: one restorer per thread, or restorers sharing an arena)."""
        num_chunks = check_int("num_chunks", num_chunks, lo=0)
        with self._exclusive():
            keys = req.prefix_keys(self.reg.chunk_tokens)  # the ids packed and checked once per restore
            self._check(req, tier, num_chunks, keys)
            installer, report = self._prepare(req, tier, num_chunks)
            if report.ok or report.error:  # nothing to fetch, or a whole plan past the staging capacity
                return report
            return self._run(req, tier, num_chunks, keys, installer, report)

    def _prepare(self, req: RestoreRequest, tier: Tier, num_chunks: int) -> tuple[WindowInstaller, RestoreReport]:
        """The restore's installer (its destinations checked and prepared) and its report, ok already when
        there is nothing to fetch, failed when a whole plan exceeds the staging capacity."""
        reg, cfg = self.reg, self.config
        t0 = time.perf_counter()
        # at depth 2 every install but the last runs while the next window's fetch uses the host: the
        # native cpu backend then keeps to one thread (depth 1: a second one from its size threshold up)
        local = {"local_tokens": req.local_tokens} if req.local_tokens else {}
        if req.end_tokens is not None:
            local["end_tokens"] = req.end_tokens
        installer = self.make_installer(reg, req.kv, req.block_tables, num_chunks, backend=cfg.backend,
                                        stream=self.stream, fingerprint=reg.fingerprint,
                                        cpu_threads=1 if cfg.pipeline_depth == 2 else 0, **local)
        prepare_s = time.perf_counter() - t0
        first = req.local_tokens // reg.chunk_tokens  # the first chunk fetched
        w = cfg.window_chunks
        report = RestoreReport(
            request_id=req.request_id, tier=tier.name, ok=False, num_chunks=num_chunks, committed_tokens=0,
            window_chunks=w, pipeline_depth=cfg.pipeline_depth,
            windows=count_windows(num_chunks - first, w, cfg.pipeline_depth), windows_installed=0,
            chunk_bytes=reg.chunk_bytes, bytes_moved=0, peak_staging_bytes=0, tiers_tried=[tier.name],
            prepare_s=prepare_s,
        )
        cap = cfg.max_staging_bytes
        whole = (num_chunks - first) * reg.chunk_bytes
        if num_chunks == first:
            report.ok = True
        elif w == 0 and cap is not None and whole > cap:
            report.error = (f"StagingCapacityError: whole plan of {whole:,} B exceeds "
                            f"the staging capacity {cap:,} B")
            report.failed_window = 0
        return installer, report

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Held around a restore through the restorer's own staging (one at a time, by choice: see the class
        docstring); windows from a shared arena lease from it, any number at once."""
        if self.arena is not None:
            yield
            return
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("BoundedRestorer is not thread-safe: one restore at a time per restorer; "
                               "make one per thread, sharing a StagingArena")
        try:
            yield
        finally:
            self._busy.release()

    def _check(self, req: RestoreRequest, tier: Tier, num_chunks: int, keys: PrefixKeys) -> None:
        reg = self.reg
        if num_chunks < 0 or num_chunks > keys.num_chunks:
            raise ValueError(f"confirmed prefix of {num_chunks} chunks exceeds the request's "
                             f"{len(req.tokens)} tokens")
        if req.end_tokens is not None:
            check_int("end_tokens", req.end_tokens, lo=max(0, num_chunks - 1) * reg.chunk_tokens + 1,
                      hi=num_chunks * reg.chunk_tokens)
        check_int("local_tokens", req.local_tokens, lo=0, hi=num_chunks * reg.chunk_tokens)
        if req.keyspace.fingerprint != reg.fingerprint:
            raise ValueError("request keyspace was built for another registration "
                             f"({req.keyspace.fingerprint} != {reg.fingerprint})")
        if tier.chunk_bytes != reg.chunk_bytes:
            raise ValueError(f"tier {tier.name} holds objects of {tier.chunk_bytes:,} B, registration {reg.name} "
                             f"stages chunks of {reg.chunk_bytes:,} B")
        if tier.fingerprint != reg.fingerprint:
            raise ValueError(f"tier {tier.name} was opened for registration {tier.fingerprint}, the engine's is "
                             f"{reg.name} ({reg.fingerprint})")

    def _run(self, req: RestoreRequest, tier: Tier, num_chunks: int, keys: PrefixKeys, installer: WindowInstaller,
             report: RestoreReport) -> RestoreReport:
        """The one restore driver: the windows through the loop, each leasing its run of staging (the shared
        arena, the restorer's own, or for a whole plan without one an arena of the plan's size), fetched from
        the tier into it, or from the tier's own source (Tier.window_source: installed from where the tier
        holds them; a run is reserved only from a shared arena). Every failure becomes a fail-closed report."""
        reg, cfg = self.reg, self.config
        t0 = time.perf_counter()
        first = req.local_tokens // reg.chunk_tokens
        source = tier.window_source(keys, cfg.fetch_timeout_s)
        in_place = source is not None
        if not in_place:
            source = TierSource(tier, keys, cfg.fetch_timeout_s)
        arena = self.arena or self.staging
        if arena is None and not in_place:
            arena = self._new_arena(num_chunks - first, prefault=False)  # a whole plan's, for this restore
        # a shared arena is the restorer's at each window (its owner may have replaced a retired one); an own
        # arena retired during a restore fails that restore (a read of it never settled: it was failing)
        current = (lambda: self.arena) if self.arena is not None else arena
        admission = Admission(current, serial=self.serial, should_stop=req.should_stop)
        # a tier's own source pins what it installs from and bounds that itself: its windows lease no staging
        # of ours, except from a shared arena, where they reserve their runs of the budget B all restores share.
        # Each window's staging goes back once the install that read it completed, on the stream it ran on.
        loop = WindowLoop(None if in_place and self.arena is None else admission, work_stream(req.kv, self.stream),
                          depth=cfg.pipeline_depth, admission_timeout_s=cfg.admission_timeout_s,
                          should_stop=req.should_stop)
        try:
            with admission.admitted(cfg.admission_timeout_s):
                try:
                    if self.arena is None and not in_place:  # own staging: registered here (a shared arena
                        self._register(tier, arena)  # is its owner's to register)
                    loop.restore(plan_windows(num_chunks, cfg.window_chunks, cfg.pipeline_depth, first), source,
                                 installer.install)
                    report.ok = True
                    report.committed_tokens = req.end_tokens or num_chunks * reg.chunk_tokens
                except Exception as e:  # noqa: BLE001 - any failure fails the restore closed
                    _failed(report, e, loop.stats)
                finally:
                    if arena is not None and arena is not self.staging and arena is not self.arena:
                        self._unregister(tier, arena.buffer)  # a whole plan's, for this restore only
        finally:
            _copy_stats(report, loop.stats, reg.chunk_bytes)
            if in_place:  # what the tier's source pinned for this restore
                report.peak_staging_bytes, report.header_room_bytes = source.peak_bytes, source.peak_room_bytes
            else:  # the room: all of an own arena's (allocated for it), of a shared one what its windows held
                report.peak_staging_bytes = loop.stats.peak_bytes
                report.header_room_bytes = arena.room_bytes if arena is not self.arena else \
                    (loop.stats.peak_bytes // reg.chunk_bytes) * arena.headroom
            report.total_s = time.perf_counter() - t0
        return report

    # -- tier buffer registration (Mooncake registers staging for zero-copy gets) -----------
    def _register(self, tier: Tier, arena: StagingArena) -> None:
        key = (id(tier), arena.buffer.data_ptr())
        if key not in self._registered:
            tier.register_staging(arena.buffer)
            self._registered[key] = (tier, arena.buffer)

    def _unregister(self, tier: Tier, buffer: torch.Tensor) -> None:
        if self._registered.pop((id(tier), buffer.data_ptr()), None) is not None:
            tier.unregister_staging(buffer)


def _failed(report: RestoreReport, error: Exception, stats: LoopStats) -> None:
    """Fail the report closed with what failed it: its text, its cause, its window."""
    failure = error.cause if isinstance(error, WindowFailed) else error
    report.error = f"{type(failure).__name__}: {failure}"
    report.cause = cause_of(failure)
    report.failed_window = stats.failed_window


def _copy_stats(report: RestoreReport, stats: LoopStats, chunk_bytes: int) -> None:
    for phase in LOOP_PHASES:
        setattr(report, f"{phase}_s", getattr(stats, f"{phase}_s"))
    report.windows_installed = stats.windows_done
    report.bytes_moved = stats.chunks_done * chunk_bytes
    report.backend = stats.backend or report.backend
