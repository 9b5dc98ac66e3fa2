"""The one window loop: store and restore ordering, and clean-up on every path out.

- The store path records the gather's completion and synchronizes before the slot is hashed
  and put: with a gather whose copy lands only when its host stream is synchronized, the
  stored state equals the source (a loop that skipped the synchronize would store poison).
- A failure of any exception type in any step of a restore (stage, wait, install) returns
  every staging byte and every budget byte, and fails closed; a BaseException that is not an
  Exception is re-raised after the clean-up.
"""

from __future__ import annotations

import threading

import pytest
import torch
from kernel_util import POISON, random_kv
from restore_util import StoredPrefix, fresh_request, random_tables, store_random_prefix

from bsr_harness.memory_tier import MemoryTier
from bsr_kernels import StagingArena, WindowInstaller, gather_window, presets
from bsr_runtime import saver as saver_mod
from bsr_runtime import store as store_mod
from bsr_runtime.admission import Admission
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.plan import Window, plan_windows
from bsr_runtime.restore import BoundedRestorer, RestoreConfig
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tier_source import TierSource
from bsr_runtime.tiers.base import FETCH_HEADROOM
from bsr_runtime.window_loop import LoopStats, WindowFailed, WindowLoop, map_onto_destination

REG = presets.llama_like(layers=2, kv_heads=1, head_dim=16, block_size=16)


class DelayedHostStream:
    """A host stream: submitted copies run on a worker thread, late, and are complete only
    once synchronize() returned."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self._threads: list[threading.Thread] = []

    def submit(self, fn) -> None:
        t = threading.Thread(target=lambda: (threading.Event().wait(self.delay_s), fn()))
        t.start()
        self._threads.append(t)

    def synchronize(self) -> None:
        for t in self._threads:
            t.join()
        self._threads.clear()


def test_store_synchronizes_an_asynchronous_gather_before_the_put(monkeypatch):
    num_chunks = 6
    blocks, tables = random_tables(REG, num_chunks, seed=1)
    kv = random_kv(REG, blocks, seed=2)
    tokens = list(range(num_chunks * REG.chunk_tokens))
    space = KeySpace(REG.fingerprint, 0, 1, "")
    stream = DelayedHostStream()

    def delayed_gather(out, reg, kv_, tables_, first, n, *, backend="auto", stream=None, end_tokens=None):
        out.fill_(POISON)  # what a put would see if it ran before the copy landed
        stream.submit(lambda: gather_window(out, reg, kv_, tables_, first, n, backend="torch"))
        return "delayed"

    monkeypatch.setattr(saver_mod, "gather_window", delayed_gather)
    tier = MemoryTier(REG.chunk_bytes, REG.fingerprint)
    expected = state_hash(REG, kv, tables, num_chunks)
    rep = store_mod.store_prefix(REG, tier, space, tokens, kv, tables, window_chunks=2, stream=stream)
    assert rep.state_hash == expected and rep.num_chunks == num_chunks
    # what the tier holds is what the gathers wrote, not the poison the staging held before they landed
    req = fresh_request(StoredPrefix(REG, tokens, space, num_chunks, expected), seed=4)
    out = BoundedRestorer(REG, RestoreConfig(window_chunks=2, backend="torch")).restore(req, tier, num_chunks)
    assert out.ok, out.error
    assert state_hash(REG, req.kv, req.block_tables, num_chunks) == expected


def _stored(num_chunks: int = 8):
    tier = MemoryTier(REG.chunk_bytes, REG.fingerprint)
    return tier, store_random_prefix(REG, tier, num_chunks, seed=3, window_chunks=4)


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [KeyError("k"), TypeError("t"), AssertionError("a"), OverflowError("o"), _Boom()])
@pytest.mark.parametrize("where", ["install", "fetch"])
def test_any_exception_fails_closed_and_leaks_nothing(exc, where):
    tier, stored = _stored()
    budget = StagingArena(REG.chunk_bytes, 8)

    def make_installer(*a, **kw):
        inner = WindowInstaller(*a, **kw)

        class Raising:
            def install(self, staging, first, n):
                if first >= 2:
                    raise exc
                return inner.install(staging, first, n)
        return Raising()

    if where == "fetch":
        inner_fetch = tier.fetch
        calls = []

        def fetch(keys, views, deadline, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise exc
            return inner_fetch(keys, views, deadline, **kw)
        tier.fetch = fetch
        make = WindowInstaller
    else:
        make = make_installer
    cfg = RestoreConfig(window_chunks=4, pipeline_depth=2)
    for _ in range(5):  # a leak would exhaust the budget and block (the timeout turns that into a failure)
        restorer = BoundedRestorer(REG, cfg, arena=budget, make_installer=make)
        rep = restorer.restore(fresh_request(stored, seed=5), tier, stored.num_chunks)
        assert not rep.ok and rep.committed_tokens == 0
        assert type(exc).__name__ in rep.error
        assert budget.live_bytes == 0
        if where == "fetch":
            calls.clear()


def test_keyboard_interrupt_is_reraised_after_cleanup():
    tier, stored = _stored()
    budget = StagingArena(REG.chunk_bytes, 8)

    class Interrupting:
        def __init__(self, *a, **kw):
            pass

        def install(self, staging, first, n):
            raise KeyboardInterrupt

    restorer = BoundedRestorer(REG, RestoreConfig(window_chunks=4, pipeline_depth=2), arena=budget,
                               make_installer=Interrupting)
    with pytest.raises(KeyboardInterrupt):
        restorer.restore(fresh_request(stored, seed=6), tier, stored.num_chunks)
    assert budget.live_bytes == 0
    # the staging still works afterwards
    ok = BoundedRestorer(REG, RestoreConfig(window_chunks=4), arena=budget)
    assert ok.restore(fresh_request(stored, seed=7), tier, stored.num_chunks).ok


class _Fetched:
    def __init__(self, log, win, fail_at=None):
        self.log, self.win, self.fail_at = log, win, fail_at

    def fetched(self):
        self.log.append(("fetched", self.win.index))
        if self.fail_at == "fetched":
            raise ValueError("missing")
        return [(0, self.win.num_chunks, torch.empty(0))]

    def synchronize(self, stream):
        self.log.append(("synchronize", self.win.index))

    def release(self):
        self.log.append(("release", self.win.index))

    def abandon(self, stream):
        self.log.append(("abandon", self.win.index))


class _Source:
    """Fetches a logging window; `fail_at` names the step window 1 fails in."""

    def __init__(self, log, fail_at=None):
        self.log, self.fail_at = log, fail_at

    def submit(self, win, reservation):
        self.log.append(("submit", win.index))
        return _Fetched(self.log, win, self.fail_at if win.index == 1 else None)


def _windows(n):
    return [Window(i, 2 * i, 2) for i in range(n)]


def test_loop_order_at_depth_two_and_abandon_on_failure():
    log: list = []
    budget = StagingArena(16, 4)
    loop = WindowLoop(Admission(budget), depth=2)
    loop.restore(_windows(3), _Source(log), lambda v, first, n: log.append(("install", first)) or "x")
    assert [e for e in log if e[1] == 0] == [("submit", 0), ("fetched", 0), ("install", 0),
                                             ("synchronize", 0), ("release", 0)]
    # depth 2: window 1 is submitted before window 0 is fetched; installs at each window's first chunk
    assert log.index(("submit", 1)) < log.index(("fetched", 0))
    assert [e for e in log if e[0] == "install"] == [("install", 0), ("install", 2), ("install", 4)]
    assert loop.stats.windows_done == 3 and loop.stats.chunks_done == 6 and budget.live_bytes == 0

    log.clear()
    loop = WindowLoop(Admission(budget), depth=2, stats=LoopStats())
    with pytest.raises(WindowFailed) as ei:
        loop.restore(_windows(3), _Source(log, "fetched"), lambda v, first, n: "x")
    assert ei.value.window == 1 and loop.stats.failed_window == 1
    assert ("abandon", 1) in log and ("release", 1) not in log and budget.live_bytes == 0


def test_a_tier_source_fetches_only_when_the_loop_asks():
    """Making a TierSource fetches and leases nothing; the loop asks it once per window, in order,
    for that window's keys; a fetch the tier refuses gives the window's staging back at once."""
    tier, stored = _stored(8)
    asked: list[list[str]] = []
    tier_fetch = tier.fetch

    def fetch(keys, views, deadline, **kw):
        asked.append(list(keys))
        return tier_fetch(keys, views, deadline, **kw)

    tier.fetch = fetch
    pool = StagingArena(REG.chunk_bytes, 4, headroom=FETCH_HEADROOM)
    source = TierSource(tier, PrefixKeys(stored.keyspace, stored.tokens, REG.chunk_tokens), 5.0)
    assert asked == [] and pool.live_bytes == 0 and pool.peak_bytes == 0

    installed = []
    loop = WindowLoop(Admission(pool))
    loop.restore(plan_windows(8, 4), source, lambda staged, first, n: installed.append((first, n)) or "x")
    all_keys = PrefixKeys(stored.keyspace, stored.tokens, REG.chunk_tokens).window(0, 8)
    assert asked == [all_keys[:4], all_keys[4:]] and installed == [(0, 4), (4, 4)]
    assert pool.live_bytes == 0 and loop.stats.windows_done == 2

    def refuse(keys, views, deadline, **kw):
        raise _Boom("refused")

    tier.fetch = refuse
    source = TierSource(tier, PrefixKeys(stored.keyspace, stored.tokens, REG.chunk_tokens), 5.0)
    with pytest.raises(WindowFailed) as failed:
        WindowLoop(Admission(pool)).restore(plan_windows(8, 4), source, lambda staged, first, n: "x")
    assert isinstance(failed.value.cause, _Boom) and pool.live_bytes == 0


@pytest.mark.parametrize("depth, threads", [(1, 0), (2, 1)])
def test_installs_keep_to_one_thread_while_the_next_fetch_runs(depth, threads):
    """At depth 2 each install but the last overlaps the next window's fetch: the restorer asks the
    installer for one cpu thread; at depth 1 for the backend's own choice (0: two from its threshold)."""
    tier, stored = _stored()
    asked = []

    def make(*a, **kw):
        asked.append(kw.get("cpu_threads"))
        return WindowInstaller(*a, **kw)

    with BoundedRestorer(REG, RestoreConfig(window_chunks=4, pipeline_depth=depth),
                         make_installer=make) as restorer:
        req = fresh_request(stored, seed=3)
        rep = restorer.restore(req, tier, stored.num_chunks)
    assert rep.ok and asked == [threads]
    assert state_hash(REG, req.kv, req.block_tables, stored.num_chunks) == stored.state_hash


def test_staged_runs_map_onto_their_destination_block_slices():
    a, b = torch.zeros(2), torch.ones(1)
    slices = list(map_onto_destination(Window(3, 8, 4), [(0, 2, a), (3, 1, b)]))
    assert [(s.first_chunk, s.num_chunks) for s in slices] == [(8, 2), (11, 1)]
    assert slices[0].staged is a and slices[1].staged is b


def test_a_store_whose_put_fails_raises_naming_the_tier_and_gives_its_staging_back(monkeypatch):
    """store_prefix goes through the Saver: a tier that refuses every put fails the store with a TierError
    naming the tier and the chunks (a Saver alone only records it), and nothing is left leased."""
    from bsr_harness.faulty_tier import FaultyTier
    from bsr_runtime.tiers.base import TierError

    num_chunks = 6
    blocks, tables = random_tables(REG, num_chunks, seed=11)
    kv = random_kv(REG, blocks, seed=12)
    tokens = list(range(num_chunks * REG.chunk_tokens))
    tier = FaultyTier(MemoryTier(REG.chunk_bytes, REG.fingerprint))

    def refuse(*a, **kw):
        raise TierError("put refused")

    tier.put = refuse
    leased = []
    real = saver_mod.Saver.close

    def close(self, timeout_s=30.0):
        leased.append(self.arena)
        return real(self, timeout_s)

    monkeypatch.setattr(saver_mod.Saver, "close", close)
    with pytest.raises(TierError, match="memory: store of chunks 0..0 failed: .*put refused"):
        store_mod.store_prefix(REG, tier, KeySpace(REG.fingerprint), tokens, kv, tables, window_chunks=2)
    assert leased and leased[0].live_bytes == 0 and len(tier.inner) == 0
