"""The worker side of a restore: loads run off the engine's step thread, their staging shared under one
byte budget B, and each ends committed or failed closed, reported once.

    loader = Loader(reg, tiers, kv, config, budget_bytes=B, ...)
    loader.submit(spec)          returns at once; the restore runs on a loader thread
    loader.cancel(request_id)    the restore stops at its next window boundary
    loader.take_finished()       results since the last call, each after its last install completed
    loader.run(spec)             the same restore on the calling thread (sync loads)
    loader.close(timeout_s)      cancels what runs, waits a bounded time, returns every staging byte

Staging: one StagingArena of B bytes (the byte budget) shared by every restore of this worker; each
window leases its run of chunks first come first served, so the windows of concurrent restores
interleave and their live staging never exceeds B (each request still stages at most W chunks at
once: ceil(W/depth) per window, `pipeline_depth` windows).

Commit: with TP > 1 the ranks agree on q[r][g] (commit.agree) over a process group the engine does
not use from other threads; agreements run on one thread per rank in submission order (the same
order on every rank: the scheduler ships the loads in one list), so every rank reports the same
outcome for the same request. A result is reported only after its restore returned: every window
it staged was installed and synchronized or abandoned, so no byte lands in its blocks afterwards.

Bounded, and every way out reports (docs/reliability.md, class 7): a window waits for staging at most
`admission_timeout_s` (DEFAULT_STAGING_WAIT_S when the config gives none) and stops waiting when its
request is cancelled; a submit that is refused takes no agreement turn (the agreement thread waits for
every turn handed out); a BaseException out of a restore is reported as a failed load before it is
re-raised; the agreement thread outlives any one load's failure.

A read that never lands: its run stays quarantined (StagingArena). Once quarantined runs leave the arena
no room for one window, the loader retires it and allocates a replacement of B bytes, registered with
the tiers; the retired arena is kept (with its registration) until every late read in it landed, and
only then unregistered and dropped, or forever. Memory: one extra B per such episode, at most
`max_staging_retirements` of them (DEFAULT_STAGING_RETIREMENTS); past that, a load that finds no room
fails at once (StagingExhausted, cause `staging`) until the reads land or the worker restarts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration
from bsr_kernels.staging_arena import StagingArena

from . import commit
from .causes import FailureCause, cause_of
from .keys import KeySpace
from .plan import LoadSpec, window_sizes
from .restore import RESTORE_PHASES, BoundedRestorer, RestoreConfig, RestoreRequest
from .retrieve import LOCAL, AgreeFn, LoadRecord, Retriever, TierSet, request_block_ids
from .tiers.base import FETCH_HEADROOM, Tier
from .validation import check_int

log = logging.getLogger(__name__)

# a window's wait for staging when the config gives no bound (RestoreConfig.admission_timeout_s None):
# staging another restore never gives back (a writer that never lands) must fail this load closed,
# not hold it, and the request waiting on it, forever
DEFAULT_STAGING_WAIT_S = 30.0
# arenas replaced for reads that never landed, at most (each costs B bytes more until its reads land)
DEFAULT_STAGING_RETIREMENTS = 2


@dataclass
class _Job:
    seq: int
    spec: LoadSpec
    submitted: float
    stop: threading.Event = field(default_factory=threading.Event)
    running: threading.Event = field(default_factory=threading.Event)  # its loader thread began it
    started: float | None = None
    record: LoadRecord | None = None
    restored: float | None = None


def default_budget_bytes(reg: Registration, config: RestoreConfig) -> int:
    """B when none is configured: the staging of one restore (W chunks), the paper's bound, so
    concurrent restores interleave within what a single restore uses."""
    return max(1, config.window_chunks) * reg.chunk_bytes


class Loader:
    def __init__(self, reg: Registration, tiers: Sequence[Tier] | TierSet, kv: Sequence[torch.Tensor] | None,
                 config: RestoreConfig, *, budget_bytes: int | None = None, max_restores: int = 8,
                 tp_rank: int = 0, tp_world: int = 1, salt: str = "", model: str = "",
                 agree: AgreeFn | None = None, agree_timeout_s: float = commit.DEFAULT_TIMEOUT_S,
                 unavailable_cooldown_s: float = 30.0, make_installer=None,
                 max_staging_retirements: int = DEFAULT_STAGING_RETIREMENTS) -> None:
        if config.window_chunks <= 0:
            raise ValueError("background loads need W > 0 (the whole-plan path W = 0 has no window to bound)")
        if config.admission_timeout_s is None:
            config = dataclasses.replace(config, admission_timeout_s=DEFAULT_STAGING_WAIT_S)
        self.reg = reg
        self.config = config
        self.keyspace = KeySpace(reg.fingerprint, tp_rank, tp_world, salt, model)
        self.tp_world = tp_world
        if budget_bytes is None:
            budget_bytes = default_budget_bytes(reg, config)
        budget = check_int("budget_bytes", budget_bytes, lo=1)
        budget_chunks = budget // reg.chunk_bytes
        window = max(window_sizes(config.window_chunks, config.pipeline_depth))
        if budget_chunks < window:
            raise ValueError(f"the restore budget B = {budget:,} B holds {budget_chunks} chunks of "
                             f"{reg.chunk_bytes:,} B; one window needs {window} (W = {config.window_chunks}, "
                             f"pipeline depth {config.pipeline_depth}): raise B to at least "
                             f"{window * reg.chunk_bytes:,} B")
        self.max_restores = check_int("max_restores", max_restores, lo=1)
        self.max_staging_retirements = check_int("max_staging_retirements", max_staging_retirements, lo=0)
        self.staging_retirements = 0  # arenas retired so far
        self._window_chunks = window
        self._arena_lock = threading.Lock()
        self._retired: list[StagingArena] = []  # retired arenas whose late reads have not all landed
        self.arena = self._new_arena(budget_chunks)
        kw = {} if make_installer is None else {"make_installer": make_installer}
        restorer = BoundedRestorer(reg, config, arena=self.arena, **kw)
        self.retriever = Retriever(reg, tiers, restorer=restorer, agree=agree, agree_timeout_s=agree_timeout_s,
                                   unavailable_cooldown_s=unavailable_cooldown_s)
        self.kv: list[torch.Tensor] | None = list(kv) if kv is not None else None
        self._registered: list[Tier] = []  # the tiers every arena's buffer is registered with
        for tier in self.retriever.tiers:
            tier.register_staging(self.arena.buffer)
            self._registered.append(tier)
        self._seq = itertools.count()
        self._lock = threading.Condition()
        self._jobs: dict[str, _Job] = {}  # request id -> its running or queued job
        self._finished: deque[LoadRecord] = deque()
        self._closed = False
        self._threads = ThreadPoolExecutor(max_workers=self.max_restores, thread_name_prefix="bsr-restore")
        self._agree_queue: dict[int, _Job] = {}  # seq -> job restored locally, waiting for its agreement
        self._agree_next = 0
        self._agree_thread: threading.Thread | None = None
        if tp_world > 1:
            self._agree_thread = threading.Thread(target=self._agree_loop, name="bsr-agree", daemon=True)
            self._agree_thread.start()

    @property
    def tiers(self) -> list[Tier]:
        return self.retriever.tiers

    def register_kv_caches(self, kv: Sequence[torch.Tensor]) -> None:
        if len(kv) != self.reg.num_tensors:
            raise ValueError(f"{len(kv)} kv caches for {self.reg.num_tensors} registered tensors")
        self.kv = list(kv)

    # -- staging: retiring an arena lost to reads that never landed ----------------------------
    def _new_arena(self, chunks: int) -> StagingArena:
        arena = StagingArena(self.reg.chunk_bytes, chunks, headroom=FETCH_HEADROOM)
        arena.on_quarantine = self._on_quarantine
        return arena

    def _on_quarantine(self, arena: StagingArena) -> None:
        """A run was quarantined (on the restore thread that gave up on its read). Never raises: it runs in
        that restore's clean-up."""
        try:
            self._replace_if_stuck(arena)
        except Exception:  # noqa: BLE001 - no replacement: loads wait for the reads, bounded as before
            log.exception("BSR loader: the staging arena could not be replaced")

    def _replace_if_stuck(self, arena: StagingArena) -> None:
        """Retire `arena` and put a new one of B bytes in its place once its quarantined runs leave no room
        for one window; past the bound, mark it stuck instead (loads that find no room fail at once)."""
        with self._arena_lock:
            if arena is not self.arena or self._closed or arena.can_hold(self._window_chunks):
                return
            if self.staging_retirements >= self.max_staging_retirements:
                arena.stuck_reason = (f"the loader replaced its staging {self.staging_retirements} time(s) already "
                                      f"(max_staging_retirements); loads fail until the reads land")
                log.error("BSR loader: staging lost to reads that never landed and not replaced again: %s",
                          arena.stuck_reason)
                return
            replacement = self._new_arena(arena.capacity_chunks)
            self._register(replacement)
            self.staging_retirements += 1
            self._retired.append(arena)
            self.arena = self.retriever.restorer.arena = replacement
        arena.retire()  # its waiters wait on the replacement
        log.warning("BSR loader: %d staging chunks quarantined behind reads that never landed; staging replaced "
                    "(%d of at most %d times, %s B more until they land)", arena.quarantined_chunks,
                    self.staging_retirements, self.max_staging_retirements, f"{arena.capacity_bytes:,}")

    def _register(self, arena: StagingArena) -> None:
        """Register `arena` with every tier, or with none (a failure undoes what was done)."""
        done: list[Tier] = []
        try:
            for tier in self._registered:
                tier.register_staging(arena.buffer)
                done.append(tier)
        except BaseException:
            for tier in done:
                tier.unregister_staging(arena.buffer)
            raise

    def _sweep_retired(self) -> None:
        """Drop the retired arenas whose late reads all landed: only then is unregistering them safe."""
        with self._arena_lock:
            drained = [a for a in self._retired if a.drained]
            self._retired = [a for a in self._retired if a not in drained]
        for arena in drained:
            arena.close()
            for tier in self._registered:
                tier.unregister_staging(arena.buffer)

    # -- background ------------------------------------------------------------------------
    def submit(self, spec: LoadSpec) -> None:
        """Start the load on a loader thread and return at once. Every TP rank must submit the same
        loads in the same order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader is closed")
            if spec.request_id in self._jobs:
                raise ValueError(f"request {spec.request_id!r} is already loading")
            # the agreement's sequence number only once accepted: a refused submit takes none, else the
            # agreement thread would wait for its number forever (every later load with it)
            job = _Job(next(self._seq), spec, time.perf_counter())
            self._jobs[spec.request_id] = job
        self._threads.submit(self._run_job, job)

    def wait_started(self, request_ids: Sequence[str], timeout: float) -> bool:
        """Wait until the loads of `request_ids` began on their loader threads (True), at most `timeout`
        seconds in all. The caller's thread gives up the interpreter meanwhile, so a just-woken loader thread
        takes it at once instead of waiting for it behind the caller's Python."""
        deadline = time.monotonic() + timeout
        with self._lock:
            jobs = [self._jobs[r] for r in request_ids if r in self._jobs]
        return all(job.running.wait(max(0.0, deadline - time.monotonic())) for job in jobs)

    def cancel(self, request_id: str) -> bool:
        """Stop the request's load at its next window boundary (True if it was loading). Its result is
        still reported, after its in-flight windows completed."""
        with self._lock:
            job = self._jobs.get(request_id)
        if job is None:
            return False
        job.stop.set()
        return True

    @property
    def staging_bytes(self) -> int:
        """Staging of the budget B held now: leased by restores, or quarantined behind reads that never
        landed (in this arena and in any retired one); 0 when every restore gave back what it took."""
        with self._arena_lock:
            arenas = [self.arena, *self._retired]
        return sum(a.live_bytes + a.quarantined_chunks * a.chunk_bytes for a in arenas)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    def take_finished(self) -> list[LoadRecord]:
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
        return out

    def wait_finished(self, timeout: float) -> bool:
        """Wait until some load finished (True) or `timeout` passed with loads still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._finished and self._jobs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return bool(self._finished)

    def _run_job(self, job: _Job) -> None:
        """One load on a loader thread. A BaseException out of the restore (SystemExit from a library) is
        reported as a failed load (its agreement taken part in, so the peers do not wait for it) and then
        re-raised on this thread, whose executor would otherwise swallow it with the load's result."""
        job.started = time.perf_counter()
        job.running.set()
        escaped: BaseException | None = None
        try:
            job.record = self.retriever.restore_local(self._request(job.spec, job.stop), job.spec.num_chunks,
                                                      job.spec.plan_tier)
        except Exception as e:  # noqa: BLE001 - this load fails closed; the others go on
            job.record = failed_record(self.reg, job.spec, e)
        except BaseException as e:  # the window loop already gave back every window's staging
            log.error("BSR: load of %s raised %s; failed closed", job.spec.request_id, type(e).__name__, exc_info=e)
            job.record = failed_record(self.reg, job.spec, e)
            escaped = e
        job.restored = time.perf_counter()
        if self._agree_thread is None:
            self._finish(job, self._commit(job))
        else:
            with self._lock:
                self._agree_queue[job.seq] = job
                self._lock.notify_all()
        if escaped is not None:
            raise escaped

    def _agree_loop(self) -> None:
        """Agreements in submission order (the same on every rank)."""
        while True:
            with self._lock:
                while self._agree_next not in self._agree_queue:
                    if self._closed and not self._jobs:
                        return
                    self._lock.wait(0.5)
                job = self._agree_queue.pop(self._agree_next)
                self._agree_next += 1
            self._finish(job, self._commit(job))

    def _commit(self, job: _Job, *, background: bool = True) -> LoadRecord:
        """The load's agreement; whatever it raises fails this load closed. In the background (the agreement
        thread serves every later load: nothing may end it) a BaseException is logged, not re-raised; on
        the caller's thread (`run`) it is the caller's."""
        assert job.record is not None
        try:
            return self.retriever.commit_local(job.record, commit.make_tag(job.spec.request_id, "commit"))
        except BaseException as e:  # noqa: BLE001 - a bug in the agreement fails this load closed
            if not isinstance(e, Exception):
                if not background:
                    raise
                log.error("BSR: agreement of %s raised %s; failed closed", job.spec.request_id, type(e).__name__,
                          exc_info=e)
            job.record.fail(f"commit: {type(e).__name__}: {e}", job.record.cause or FailureCause.AGREEMENT)
            return job.record.decide(False)

    def _finish(self, job: _Job, record: LoadRecord) -> None:
        now = time.perf_counter()
        _close_record(record, job, queued_s=(job.started or now) - job.submitted, now=now,
                      cancelled=job.stop.is_set())
        with self._lock:
            self._jobs.pop(job.spec.request_id, None)
            self._finished.append(record)
            self._lock.notify_all()

    # -- on the calling thread ---------------------------------------------------------------
    def run(self, spec: LoadSpec) -> LoadRecord:
        """The load on this thread (sync loads): restore, commit, its record. A BaseException (SystemExit) is
        the caller's: it propagates, after the restore gave back its staging."""
        job = _Job(next(self._seq), spec, time.perf_counter())
        job.started = job.submitted
        try:
            job.record = self.retriever.restore_local(self._request(spec, job.stop), spec.num_chunks, spec.plan_tier)
        except Exception as e:  # noqa: BLE001 - this load fails closed
            job.record = failed_record(self.reg, spec, e)
        job.restored = time.perf_counter()
        return _close_record(self._commit(job, background=False), job, queued_s=0.0, now=time.perf_counter(),
                             cancelled=False)

    # -- the restore -----------------------------------------------------------------------
    def _request(self, spec: LoadSpec, stop: threading.Event) -> RestoreRequest:
        """This rank's restore request of one load (its callers fail the load closed on any exception:
        every block invalid)."""
        self._sweep_retired()
        if self.kv is None:
            raise RuntimeError("load before register_kv_caches: no destination tensors")
        tables = [torch.tensor(b, dtype=torch.int64) for b in spec.block_ids]
        keyspace = dataclasses.replace(self.keyspace, salt=self.keyspace.salt if spec.salt is None else spec.salt,
                                       features=tuple(spec.features))
        return RestoreRequest(spec.request_id, spec.tokens, keyspace, self.kv, tables,
                              should_stop=lambda: stop.is_set() or self._closed, local_tokens=spec.local_tokens,
                              end_tokens=spec.num_tokens or None, partial_tokens=spec.partial_tokens)

    # -- shutdown --------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> bool:
        """Cancel every load, wait up to `timeout_s` for them to stop (each stops at its next window
        boundary; a fetch in flight settles within its own timeout), then release the staging. Returns
        False if some load did not stop in time (its staging stays registered, never reused)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            self._lock.notify_all()
        for job in jobs:
            job.stop.set()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._jobs and time.monotonic() < deadline:
                self._lock.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            stopped = not self._jobs
        self._threads.shutdown(wait=stopped, cancel_futures=True)
        if self._agree_thread is not None:
            self._agree_thread.join(max(0.0, deadline - time.monotonic()))
        with self._arena_lock:
            arenas = [self.arena, *self._retired]
        for arena in arenas:
            arena.close()
        if stopped:  # an arena with a read still out (quarantined) stays registered: it may still land there
            for arena in arenas:
                if arena.drained:
                    for tier in self._registered:
                        tier.unregister_staging(arena.buffer)
            self._registered.clear()
        else:
            log.warning("BSR loader: %d load(s) did not stop within %.1f s; their staging is left registered",
                        len(self._jobs), timeout_s)
        return stopped


def failed_record(reg: Registration, spec: LoadSpec, error: BaseException) -> LoadRecord:
    """The record of a load whose restore raised: every group invalid, every block reported."""
    try:
        blocks = request_block_ids(reg, spec.block_ids, check_int("num_chunks", spec.num_chunks, lo=0))
    except Exception:  # noqa: BLE001 - the spec itself is bad: report every block it names
        blocks = all_block_ids(spec.block_ids, reg.num_groups)
    num_chunks = spec.num_chunks if isinstance(spec.num_chunks, int) else 0
    return LoadRecord(spec.request_id, num_chunks, reg.chunk_tokens, [False] * reg.num_groups, LOCAL,
                       blocks, error=f"load failed: {type(error).__name__}: {error}", cause=cause_of(error))


def all_block_ids(block_ids, num_groups: int) -> tuple[frozenset[int], ...]:
    """Per group, every non-negative integer block id of `block_ids` (whatever its shape)."""
    out = []
    groups = list(block_ids) if isinstance(block_ids, (list, tuple)) else []
    for g in range(max(num_groups, len(groups))):
        ids = groups[g] if g < len(groups) else []
        try:
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        except TypeError:
            ids = []
        out.append(frozenset(int(b) for b in ids
                             if isinstance(b, int) and not isinstance(b, bool) and b >= 0))
    return tuple(out)


def _close_record(record: LoadRecord, job: _Job, *, queued_s: float, now: float, cancelled: bool) -> LoadRecord:
    """The loader's part of the record: the load it ran, whether it was asked to stop, where its time went (the
    scheduler's probe, the queue, each phase of its restore attempts, the agreement)."""
    record.spec, record.cancelled = job.spec, cancelled
    t = {"probe_s": job.spec.probe_s}
    for name in (*(f"{phase}_s" for phase in RESTORE_PHASES), "seconds"):
        t["restore_s" if name == "seconds" else name] = sum(getattr(a, name, 0.0) for a in record.attempts)
    t.update(queued_s=queued_s, agree_s=now - (job.restored or now), total_s=now - job.submitted)
    record.timings = t
    return record
