"""Restores off the caller's thread under one byte budget (bsr_runtime/loader.py) and the staging arena
they share (bsr_kernels/staging_arena.py): real files, real installs into one set of destination tensors
shared by every request (as an engine's KV cache is), each request in its own blocks.

Expected states come from the source blocks (state_hash of what was stored), never from the loader.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from bsr_harness.experiments import make_source, store_source
from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.testdata import POISON, block_tables, poison
from bsr_kernels import presets
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.admission import Admission
from bsr_runtime.loader import Loader
from bsr_runtime.plan import LoadSpec
from bsr_runtime.restore import RestoreConfig
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier


def _reg():
    return presets.dsv4_flash(scale=1 / 64)


# -- the arena ---------------------------------------------------------------------------------
def _queued(arena: StagingArena, k: int) -> None:
    end = time.monotonic() + 30
    while arena.waiters < k:
        assert time.monotonic() < end, "acquire never queued"
        time.sleep(0.001)


def test_arena_is_first_come_first_served_and_never_exceeds_its_buffer():
    arena = StagingArena(64, 4)
    held = arena.acquire(3)
    got: list[str] = []
    events = {"big": threading.Event(), "small": threading.Event()}
    leases = {}

    def take(name: str, n: int) -> None:
        leases[name] = arena.acquire(n, timeout=30)
        got.append(name)
        events[name].set()

    big = threading.Thread(target=take, args=("big", 4))
    small = threading.Thread(target=take, args=("small", 1))
    big.start()
    _queued(arena, 1)
    small.start()  # 1 chunk is free, but "big" came first
    _queued(arena, 2)
    assert arena.try_acquire(1) is None  # nobody is overtaken
    assert not events["big"].is_set() and not events["small"].is_set()
    held.release()
    assert events["big"].wait(30) and not events["small"].is_set()
    assert arena.live_bytes == 4 * 64
    leases["big"].release()
    assert events["small"].wait(30)
    big.join(30)
    small.join(30)
    assert got == ["big", "small"]
    leases["small"].release()
    assert arena.live_bytes == 0 and arena.peak_bytes == 4 * 64


def test_arena_runs_are_disjoint_views_of_one_buffer_with_headroom():
    arena = StagingArena(32, 6, headroom=16)
    a, b = arena.acquire(2), arena.acquire(3)
    for lease, value in ((a, 1), (b, 2)):
        assert lease.view.shape == (lease.num_chunks, 32)
        lease.view.fill_(value)
    whole = arena.buffer.view(6, 48)
    assert bool((whole[0:2, 16:] == 1).all()) and bool((whole[2:5, 16:] == 2).all())
    assert arena.try_acquire(2) is None  # one chunk left
    a.release()
    c = arena.try_acquire(2)
    assert c is not None and c.first == 0
    for lease in (b, c):
        lease.release()


def test_arena_refuses_what_can_never_fit_and_unsynchronized_release():
    arena = StagingArena(16, 2)
    with pytest.raises(ValueError, match="exceed the staging budget"):
        arena.acquire(3)
    with pytest.raises(ValueError, match="positive int"):
        arena.acquire(0)
    lease = arena.acquire(1)

    class Stream:  # work recorded on a host stream is pending until synchronized
        def synchronize(self) -> None:
            pass

    lease.record(Stream())
    with pytest.raises(RuntimeError, match="synchronized"):
        lease.release()
    lease.synchronize()
    lease.release()
    lease.release()  # idempotent
    assert arena.live_bytes == 0


def test_arena_quarantine_retires_a_run_and_close_wakes_waiters():
    arena = StagingArena(16, 2)
    a = arena.acquire(2)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            arena.acquire(1, timeout=30)
        except BaseException as e:  # noqa: BLE001 - recorded
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    _queued(arena, 1)
    a.quarantine()  # a late writer may still land there: never handed out again
    time.sleep(0.05)
    assert arena.quarantined_chunks == 2 and arena.live_bytes == 0
    assert t.is_alive()  # nothing free to give
    arena.close()
    t.join(10)
    assert not t.is_alive() and errors and "closed" in str(errors[0])


def test_a_wait_on_a_retired_arena_goes_on_on_its_replacement():
    """An arena retired while a window waits on it: the wait goes on, within its bound, on the arena its
    owner put in its place; the retired one leases nothing more and is drained once its leases are back."""
    old, new = StagingArena(16, 2), StagingArena(16, 2)
    current = [old]
    held = old.acquire(2)
    admission = Admission(lambda: current[0])
    got: list = []
    t = threading.Thread(target=lambda: got.append(admission.window(2, timeout=10)))
    t.start()
    _queued(old, 1)
    current[0] = new
    old.retire()
    t.join(10)
    assert got and got[0].lease.arena is new
    assert old.try_acquire(1) is None and not old.drained  # retired; its lease is still out
    held.release()
    got[0].release()
    assert old.drained and new.live_bytes == 0


# -- the loader --------------------------------------------------------------------------------
class Scene:
    """Sources stored in one filesystem tier; one shared destination KV, each request its own blocks."""

    def __init__(self, root, chunks: list[int], seed: int = 0, tp_world: int = 1) -> None:
        self.reg = reg = _reg()
        self.inner = FilesystemTier(root, reg.chunk_bytes, reg.fingerprint, load_concurrency=2)
        self.tier = FaultyTier(self.inner, close_inner=False)
        self.sources = [make_source(reg, n, seed=seed * 100 + i) for i, n in enumerate(chunks)]
        for src in self.sources:  # rank 0's objects
            src.keyspace = dataclasses.replace(src.keyspace, tp_world=tp_world)
        self.expected = [store_source(s, self.inner, window_chunks=8) for s in self.sources]
        blocks, self.tables = block_tables(reg, chunks, seed + 1, spare=1, holes="none")
        self.kv = poison(reg.allocate(blocks))

    def spec(self, i: int) -> LoadSpec:
        src = self.sources[i]
        return LoadSpec(f"req-{i}", src.tokens, src.num_chunks, 0, [t.tolist() for t in self.tables[i]],
                        salt=src.keyspace.salt)

    def restored(self, i: int) -> bool:
        return state_hash(self.reg, self.kv, self.tables[i], self.sources[i].num_chunks) == self.expected[i]

    def untouched(self, i: int) -> bool:
        """Every byte of request i's blocks is still POISON."""
        for t, s in zip(self.kv, self.reg.specs):
            ids = self.tables[i][s.group]
            ids = ids[ids >= 0]
            if not bool((t[ids].view(torch.uint8) == POISON).all()):
                return False
        return True

    def loader(self, w: int, budget_windows: int, depth: int = 1, **kw) -> Loader:
        cfg = RestoreConfig(window_chunks=w, pipeline_depth=depth, fetch_timeout_s=kw.pop("timeout", 30.0),
                            backend="cpu")
        return Loader(self.reg, [self.tier], self.kv, cfg, budget_bytes=budget_windows * w * self.reg.chunk_bytes,
                      **kw)

    def close(self) -> None:
        self.tier.close()
        self.inner.close()


def _wait_all(loader: Loader, n: int, timeout: float = 120.0) -> list:
    out: list = []
    end = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < end, f"only {len(out)} of {n} loads finished"
        loader.wait_finished(0.5)
        out += loader.take_finished()
    return out


def test_concurrent_loads_interleave_within_the_budget(tmp_path):
    """8 loads at once under B = 4 windows: every one commits with its source's state, staging never
    above B, and more than one load held staging at once (they ran concurrently)."""
    scene = Scene(tmp_path, [5, 9, 3, 12, 7, 4, 10, 6])
    scene.tier.plan.delay_s = 0.01  # each window completes 10 ms late: loads overlap
    loader = scene.loader(w=2, budget_windows=4)
    try:
        for i in range(8):
            loader.submit(scene.spec(i))
        results = _wait_all(loader, 8)
        assert sorted(r.request_id for r in results) == [f"req-{i}" for i in range(8)]
        assert all(r.committed for r in results), [r.error for r in results]
        assert all(scene.restored(i) for i in range(8))
        b = 4 * 2 * scene.reg.chunk_bytes
        assert loader.arena.peak_bytes <= b
        assert loader.arena.peak_bytes > 2 * scene.reg.chunk_bytes  # several loads' windows live at once
        assert all(r.attempts[-1].peak_staging_bytes <= 2 * scene.reg.chunk_bytes for r in results)
        assert loader.arena.live_bytes == 0
        for r in results:  # where the time went, per phase
            t = r.timings
            assert t["total_s"] >= t["restore_s"] >= t["fetch_s"] > 0 and t["install_s"] > 0
    finally:
        assert loader.close(30)
        scene.close()


def test_a_short_load_is_not_stuck_behind_a_long_one(tmp_path):
    """One window of budget: a 1-window load submitted after a 24-window one finishes first."""
    scene = Scene(tmp_path, [48, 2])
    scene.tier.plan.delay_s = 0.02
    loader = scene.loader(w=2, budget_windows=1)
    try:
        loader.submit(scene.spec(0))
        time.sleep(0.1)  # the long one is well under way
        loader.submit(scene.spec(1))
        results = _wait_all(loader, 2)
        assert [r.request_id for r in results] == ["req-1", "req-0"]
        assert all(r.committed for r in results) and scene.restored(0) and scene.restored(1)
        assert loader.arena.peak_bytes == 2 * scene.reg.chunk_bytes
    finally:
        assert loader.close(30)
        scene.close()


def test_wait_started_returns_once_the_loads_began_and_is_bounded_when_they_cannot(tmp_path):
    """The step that starts loads waits for their threads to begin (vLLM connector, load_start_wait_s):
    True once each began; with every loader thread busy a queued load cannot begin, and the wait ends
    at its bound with False."""
    scene = Scene(tmp_path, [30, 2])
    scene.tier.plan.delay_s = 0.03
    loader = scene.loader(w=2, budget_windows=2, max_restores=1)  # one loader thread
    try:
        loader.submit(scene.spec(0))
        assert loader.wait_started(["req-0"], 5.0)
        t0 = time.monotonic()
        loader.submit(scene.spec(1))  # queued behind req-0 on the only thread
        assert not loader.wait_started(["req-1"], 0.05)
        assert 0.04 <= time.monotonic() - t0 < 1.0
        assert loader.wait_started(["gone"], 0.0)  # not loading: nothing to wait for
        results = _wait_all(loader, 2)
        assert all(r.committed for r in results) and scene.restored(0) and scene.restored(1)
    finally:
        assert loader.close(30)
        scene.close()


def test_cancel_stops_at_a_window_boundary_and_nothing_lands_after_the_result(tmp_path):
    scene = Scene(tmp_path, [40])
    scene.tier.plan.delay_s = 0.03
    loader = scene.loader(w=2, budget_windows=1)
    try:
        loader.submit(scene.spec(0))
        time.sleep(0.15)
        assert loader.cancel("req-0")
        (result,) = _wait_all(loader, 1)
        assert result.cancelled and not result.committed and result.exposed_tokens == 0
        att = result.attempts[-1]
        assert 0 < att.windows_installed < 20
        assert result.invalid_blocks == result.total_blocks  # fail closed: all of them
        poison(scene.kv)  # the engine frees the blocks once the result is reported: nothing may land now
        time.sleep(20 * 0.03 + 0.3)  # longer than the windows left would have taken
        assert scene.untouched(0)
        assert loader.arena.live_bytes == 0 and loader.in_flight == 0
    finally:
        assert loader.close(30)
        scene.close()


def test_close_with_loads_in_flight_is_bounded_and_returns_every_byte(tmp_path):
    scene = Scene(tmp_path, [30, 30, 30])
    scene.tier.plan.delay_s = 0.05
    loader = scene.loader(w=2, budget_windows=2)
    for i in range(3):
        loader.submit(scene.spec(i))
    time.sleep(0.2)
    t0 = time.monotonic()
    assert loader.close(10)
    assert time.monotonic() - t0 < 5  # each stops at its next window boundary
    assert loader.arena.live_bytes == 0 and loader.in_flight == 0
    results = loader.take_finished()
    assert len(results) == 3 and not any(r.committed for r in results)
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name.startswith("bsr-restore")]
    with pytest.raises(RuntimeError, match="closed"):
        loader.submit(scene.spec(0))
    scene.close()


def test_tp_agreements_run_in_submission_order_on_every_rank(tmp_path):
    """With TP > 1 the commit agreement of each load runs on one thread in the order the loads were
    submitted, however they finish locally (the same order on every rank keeps the collectives aligned)."""
    scene = Scene(tmp_path, [30, 2], tp_world=2)
    scene.tier.plan.delay_s = 0.02
    order: list[int] = []
    tags: dict[int, str] = {}

    def agree(valid, *, timeout_s, tag):
        order.append(tag)
        return all(valid)

    from bsr_runtime import commit

    for i in range(2):
        tags[commit.make_tag(f"req-{i}", "commit")] = f"req-{i}"
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, backend="cpu")
    loader = Loader(scene.reg, [scene.tier], scene.kv, cfg, budget_bytes=4 * scene.reg.chunk_bytes,
                    tp_world=2, agree=agree)
    try:
        loader.submit(scene.spec(0))
        loader.submit(scene.spec(1))
        results = _wait_all(loader, 2)
        assert [tags[t] for t in order] == ["req-0", "req-1"]
        assert [r.request_id for r in results] == ["req-0", "req-1"]
        assert all(r.committed and r.agreed for r in results)
    finally:
        assert loader.close(30)
        scene.close()


def test_a_budget_smaller_than_one_window_is_refused_before_anything_moves(tmp_path):
    reg = _reg()
    with FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint) as tier:
        cfg = RestoreConfig(window_chunks=4, pipeline_depth=1)
        with pytest.raises(ValueError, match="raise B to at least"):
            Loader(reg, [tier], None, cfg, budget_bytes=3 * reg.chunk_bytes)
        with pytest.raises(ValueError, match="W > 0"):
            Loader(reg, [tier], None, RestoreConfig(window_chunks=0))
        depth2 = RestoreConfig(window_chunks=4, pipeline_depth=2)  # windows of 2: fits 3 chunks
        Loader(reg, [tier], None, depth2, budget_bytes=3 * reg.chunk_bytes).close(5)


# -- a late read (issue 35, item 1) ------------------------------------------------------------
def _late_read_fails_closed(scene: Scene, loader: Loader, gate: threading.Event, i: int = 0) -> StagingArena:
    """Load i with its read held back past its fetch timeout (and the grace after it): it fails closed
    and its staging run is quarantined while the read may still land. Returns the arena it was in."""
    arena = loader.arena
    scene.tier.plan.read_gate = gate
    loader.submit(scene.spec(i))
    (first,) = _wait_all(loader, 1, timeout=10)
    scene.tier.plan.read_gate = None
    assert not first.committed and "FetchTimeoutError" in (first.error or "")
    assert arena.quarantined_chunks == 2  # the whole budget: one window of W = 2
    return arena


def _settled(arena: StagingArena, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while arena.quarantined_chunks:
        assert time.monotonic() < end, "the quarantined run never came back"
        time.sleep(0.01)


def test_a_late_read_gives_its_quarantined_staging_back_when_it_lands(tmp_path):
    """Default budget (one window), no replacement arena: once the late read landed, the next load gets
    the staging back and commits, instead of waiting for it forever."""
    scene = Scene(tmp_path, [2, 2])
    loader = scene.loader(w=2, budget_windows=1, timeout=0.2, max_staging_retirements=0)
    gate = threading.Event()
    try:
        arena = _late_read_fails_closed(scene, loader, gate)
        gate.set()  # the read lands
        _settled(arena)
        loader.submit(scene.spec(1))
        (second,) = _wait_all(loader, 1, timeout=10)
        assert second.committed and scene.restored(1), second.error
        assert loader.arena is arena and arena.live_bytes == 0
    finally:
        gate.set()
        loader.close(5)
        scene.close()


def _held_budget(loader: Loader):
    """Every chunk of the budget leased (a load that holds its staging): later loads must wait."""
    return loader.arena.acquire(loader.arena.capacity_chunks)


def test_a_wait_for_staging_ends_on_cancel(tmp_path):
    """The budget is held: cancel() ends a load waiting for staging at once (it never reaches a window
    boundary, where cancellation was asked before)."""
    scene = Scene(tmp_path, [2, 2])
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, fetch_timeout_s=0.2, backend="cpu")
    loader = Loader(scene.reg, [scene.tier], scene.kv, cfg)  # default budget (one window), default bound
    held = _held_budget(loader)
    try:
        loader.submit(scene.spec(1))
        end = time.monotonic() + 10
        while loader.arena.waiters == 0:
            assert time.monotonic() < end, "the load never waited for staging"
            time.sleep(0.005)
        t0 = time.monotonic()
        assert loader.cancel("req-1")
        (cancelled,) = _wait_all(loader, 1, timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert cancelled.cancelled and not cancelled.committed and scene.untouched(1)
        assert "cancelled" in (cancelled.error or "")
    finally:
        held.release()
        loader.close(5)
        scene.close()


def test_a_wait_for_staging_is_bounded(tmp_path):
    """The budget is held: a later load's wait for staging ends at its bound, failed closed with the
    budget named; a loader given no bound takes the default one, never an unbounded wait."""
    scene = Scene(tmp_path, [2, 2])
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, fetch_timeout_s=0.2, backend="cpu",
                        admission_timeout_s=0.5)
    loader = Loader(scene.reg, [scene.tier], scene.kv, cfg)
    held = _held_budget(loader)
    try:
        t0 = time.monotonic()
        loader.submit(scene.spec(1))
        (bounded,) = _wait_all(loader, 1, timeout=10)
        assert time.monotonic() - t0 < 3
        assert not bounded.committed and "no staging" in (bounded.error or "")
        assert scene.untouched(1)
        unbounded = Loader(scene.reg, [scene.tier], scene.kv, dataclasses.replace(cfg, admission_timeout_s=None))
        from bsr_runtime.loader import DEFAULT_STAGING_WAIT_S

        assert unbounded.config.admission_timeout_s == DEFAULT_STAGING_WAIT_S
        unbounded.close(5)
    finally:
        held.release()
        loader.close(5)
        scene.close()


# -- a read that never lands (issue 35, leftover of item 1) ---------------------------------------
class RegistrationLog(FaultyTier):
    """A FaultyTier that records which staging buffers are registered with it now."""

    def __init__(self, inner) -> None:
        super().__init__(inner, close_inner=False)
        self.registered: list[int] = []

    def register_staging(self, buffer) -> None:
        super().register_staging(buffer)
        self.registered.append(buffer.data_ptr())

    def unregister_staging(self, buffer) -> None:
        super().unregister_staging(buffer)
        self.registered.remove(buffer.data_ptr())


def test_a_read_that_never_lands_does_not_fail_every_later_load(tmp_path):
    """Default budget (one window): a read that never lands quarantines the whole budget. The loader
    retires that arena and allocates a replacement, so the next load commits at once instead of failing
    at the staging wait's bound (was: every later load failed, `no staging`, until the read landed).
    The retired arena stays registered until its read lands, then it is unregistered and dropped."""
    scene = Scene(tmp_path, [2, 2, 2])
    scene.tier = RegistrationLog(scene.inner)
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, fetch_timeout_s=0.2, backend="cpu",
                        admission_timeout_s=2.0)
    loader = Loader(scene.reg, [scene.tier], scene.kv, cfg)
    gate = threading.Event()
    try:
        stuck = _late_read_fails_closed(scene, loader, gate)
        for i in (1, 2):
            t0 = time.monotonic()
            loader.submit(scene.spec(i))
            (later,) = _wait_all(loader, 1, timeout=10)
            assert later.committed and scene.restored(i), later.error
            assert time.monotonic() - t0 < 1.5  # not after a wait for staging
        assert loader.arena is not stuck and loader.staging_retirements == 1
        assert stuck.buffer.data_ptr() in scene.tier.registered  # its read may still land: kept registered
        gate.set()  # the read lands at last
        _settled(stuck)
        loader.submit(scene.spec(1))  # a load sweeps the drained arena
        _wait_all(loader, 1, timeout=10)
        assert scene.tier.registered == [loader.arena.buffer.data_ptr()]
    finally:
        gate.set()
        loader.close(5)
        scene.close()
    assert scene.tier.registered == []


def test_staging_replacements_are_bounded_then_loads_fail_at_once_with_the_reason(tmp_path):
    """max_staging_retirements = 1: the second read that never lands is not answered by a second
    replacement; the next load fails closed at once (not at the wait's bound), cause `staging`, and says
    why. Once the reads land, loads commit again."""
    scene = Scene(tmp_path, [2, 2, 2])
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, fetch_timeout_s=0.2, backend="cpu",
                        admission_timeout_s=20.0)
    loader = Loader(scene.reg, [scene.tier], scene.kv, cfg, max_staging_retirements=1)
    gates = [threading.Event(), threading.Event()]
    try:
        _late_read_fails_closed(scene, loader, gates[0])
        last = _late_read_fails_closed(scene, loader, gates[1], i=1)
        assert loader.arena is last and loader.staging_retirements == 1
        t0 = time.monotonic()
        loader.submit(scene.spec(2))
        (refused,) = _wait_all(loader, 1, timeout=10)
        assert time.monotonic() - t0 < 5  # far below the 20 s bound
        assert not refused.committed and scene.untouched(2)
        assert refused.cause == "staging"
        assert "never landed" in refused.error and "max_staging_retirements" in refused.error
        gates[1].set()
        _settled(last)
        loader.submit(scene.spec(2))
        (ok,) = _wait_all(loader, 1, timeout=10)
        assert ok.committed and scene.restored(2), ok.error
    finally:
        for g in gates:
            g.set()
        loader.close(5)
        scene.close()


# -- a BaseException in a fetch (issue 35, item 5) ----------------------------------------------
def test_a_base_exception_in_a_fetch_is_reported_as_a_failed_load(tmp_path):
    """SystemExit raised out of a tier's fetch (a library) on a loader thread: the load is reported,
    failed closed with the cause named, its staging given back, and the loader goes on; on the caller's
    thread (sync loads) the SystemExit is the caller's."""
    scene = Scene(tmp_path, [4, 2, 2])
    loader = scene.loader(w=2, budget_windows=1)
    try:
        scene.tier.plan.raise_in_fetch = SystemExit("a library exited")
        loader.submit(scene.spec(0))
        (failed,) = _wait_all(loader, 1, timeout=5)
        assert not failed.committed and failed.exposed_tokens == 0
        assert "SystemExit" in (failed.error or "")
        assert failed.invalid_blocks == failed.total_blocks
        assert loader.arena.live_bytes == 0 and loader.in_flight == 0
        with pytest.raises(SystemExit):
            loader.run(scene.spec(2))
        assert loader.arena.live_bytes == 0
        scene.tier.plan.raise_in_fetch = None
        loader.submit(scene.spec(1))
        (ok,) = _wait_all(loader, 1, timeout=5)
        assert ok.committed and scene.restored(1)
    finally:
        assert loader.close(5)
        scene.close()


def test_a_load_reaches_the_backend_in_at_most_seven_frames(tmp_path, monkeypatch):
    """Issue 38: from a load (Loader.run, what a sync start_load calls; a background load starts one frame
    lower, at the loader thread's _run_job) to the install backend's window call there were 16 Python frames,
    7 of them only forwarding; at most 7 now (Loader.run, Retriever.restore_local, BoundedRestorer.restore and
    _run, WindowLoop.restore and _restore_window, WindowInstaller.install): with the connector's start_load_kv
    and WorkerSide.start_load above and the backend's run below, 10 from vLLM's call to the C call. The frames
    are counted at the backend's call (a wrapper registered for the torch backend), from Loader.run down."""
    import dataclasses as dc
    import traceback

    from bsr_kernels import backends

    reg = _reg()
    tier = FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint)
    src = make_source(reg, 4, seed=5)
    expected = state_hash(reg, src.kv, src.block_tables, 4)
    store_source(src, tier, window_chunks=4)
    stacks = []
    torch_backend = backends.get_backend("torch")

    def run(*a, **kw):
        stacks.append(traceback.extract_stack()[:-1])
        return torch_backend.run(*a, **kw)

    monkeypatch.setitem(backends._REGISTRY, "torch", dc.replace(torch_backend, run=run))
    blocks, tables = block_tables(reg, [4], 1, spare=0, holes="none")
    kv = reg.allocate(blocks)
    poison(kv)
    loader = Loader(reg, [tier], kv, RestoreConfig(window_chunks=2, backend="torch"))
    try:
        result = loader.run(LoadSpec("r", src.tokens, 4, 0, [t.tolist() for t in tables[0]]))
        assert result.committed and state_hash(reg, kv, tables[0], 4) == expected
    finally:
        loader.close()
        tier.close()
    assert stacks, "the torch backend never ran"
    stack = stacks[0]
    top = max(i for i, f in enumerate(stack) if f.name == "run" and f.filename.endswith("bsr_runtime/loader.py"))
    frames = [f for f in stack[top:] if "/bsr_" in f.filename]  # Loader.run down to the backend's caller
    assert len(frames) <= 7, "\n".join(f"{f.filename}:{f.lineno} {f.name}" for f in frames)
