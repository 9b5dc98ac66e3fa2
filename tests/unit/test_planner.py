"""The scheduler side's decisions without an engine (bsr_runtime/planner.py): the probe decision, its
lookup off the caller's thread, force-local markers, the load recorded at allocation. Real files; the
expected prefixes are written out."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from bsr_harness.experiments import make_source, store_source
from bsr_kernels import presets
from bsr_runtime.keys import PrefixKeys, request_salt
from bsr_runtime.planner import Planner
from bsr_runtime.tiers import FilesystemTier

CT = 256


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None


class GatedTier(FilesystemTier):
    """A filesystem tier whose probe waits for a gate (a slow store)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.probes = 0

    def probe(self, keys):
        self.probes += 1
        assert self.gate.wait(30)
        return super().probe(keys)


def _scene(tmp_path, chunks: int = 6):
    reg = presets.dsv4_flash(scale=1 / 64)
    tier = GatedTier(tmp_path, reg.chunk_bytes, reg.fingerprint)
    src = make_source(reg, chunks, seed=4)
    tier.gate.set()
    store_source(src, tier, window_chunks=4)
    tier.gate.clear()
    tier.probes = 0
    return reg, tier, src


def _wait_answer(planner, req, computed=0, timeout=30.0):
    end = time.monotonic() + timeout
    while (n := planner.match_in_background(req, computed)) is None:
        assert time.monotonic() < end
        time.sleep(0.005)
    return n


def test_the_lookup_never_blocks_the_caller(tmp_path):
    """A slow store: the engine's thread gets None at once, asks again later, and gets the answer."""
    reg, tier, src = _scene(tmp_path)
    planner = Planner(reg, [tier])
    try:
        req = Req("r", src.tokens + [7] * 10)
        t0 = time.monotonic()
        assert planner.match_in_background(req, 0) is None  # the probe waits for the gate
        assert planner.match_in_background(req, 0) is None
        assert time.monotonic() - t0 < 1.0
        tier.gate.set()
        assert _wait_answer(planner, req) == 6 * CT
        spec = planner.allocated(req, [[1, 2, 3]] * reg.num_groups, 6 * CT)
        assert spec is not None and spec.num_chunks == 6 and spec.plan_tier == 0 and spec.probe_s > 0
        assert planner.take_loads() == [spec] and planner.take_loads() == []
    finally:
        planner.close()
        tier.close()


def test_the_step_waits_once_for_a_lookup_up_to_probe_wait_s(tmp_path):
    """probe_wait_s: the first ask waits that long for the probe and, answered, decides in the same step;
    a probe slower than that costs the step the wait once, later asks return at once."""
    reg, tier, src = _scene(tmp_path)
    tier.gate.set()
    planner = Planner(reg, [tier], probe_wait_s=5.0)
    try:
        assert planner.match_in_background(Req("fast", src.tokens + [7]), 0) == 6 * CT  # the first ask
        tier.gate.clear()
        planner.probe_wait_s = 0.2
        slow = Req("slow", src.tokens + [8])
        t0 = time.monotonic()
        assert planner.match_in_background(slow, 0) is None
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        assert planner.match_in_background(slow, 0) is None  # no second wait
        again = time.monotonic() - t1
        assert 0.2 <= waited < 2.0 and again < 0.1, (waited, again)
        tier.gate.set()
        assert _wait_answer(planner, slow) == 6 * CT
    finally:
        planner.close()
        tier.close()


def test_without_probe_wait_the_first_ask_returns_at_once(tmp_path):
    reg, tier, src = _scene(tmp_path)
    planner = Planner(reg, [tier])  # probe_wait_s 0: the engine-neutral default
    try:
        t0 = time.monotonic()
        assert planner.match_in_background(Req("r", src.tokens + [7]), 0) is None  # the probe waits for the gate
        assert time.monotonic() - t0 < 0.1
        tier.gate.set()
    finally:
        planner.close()
        tier.close()


def test_a_lookup_started_on_arrival_is_ready_when_asked(tmp_path):
    reg, tier, src = _scene(tmp_path)
    tier.gate.set()
    planner = Planner(reg, [tier])
    try:
        req = Req("r", src.tokens + [7])
        planner.start_lookup(req)
        planner.start_lookup(req)  # once per request
        time.sleep(0.3)
        assert planner.match_in_background(req, 0) == 6 * CT  # one token is left to compute
        assert tier.probes == 1
    finally:
        planner.close()
        tier.close()


def test_no_lookup_for_a_marked_request_or_one_the_engine_holds(tmp_path):
    reg, tier, src = _scene(tmp_path)
    tier.gate.set()
    planner = Planner(reg, [tier])
    try:
        req = Req("m", src.tokens + [7])
        planner.load_failed("m", "test")
        assert planner.match_in_background(req, 0) == 0 and planner.match(req, 0) == 0
        assert planner.stats.skipped_by_marker == 2 and tier.probes == 0
        assert planner.running("m") and not planner.running("m")
        held = Req("h", src.tokens + [7])
        assert planner.match_in_background(held, 6 * CT) == 0  # the engine's cache holds every chunk
        assert planner.match(held, 6 * CT) == 0 and tier.probes == 0
        assert planner.match(held, 2 * CT) == 4 * CT and tier.probes == 1  # beyond a shorter local hit
    finally:
        planner.close()
        tier.close()


def test_tenants_do_not_see_each_others_prefixes(tmp_path):
    reg, tier, src = _scene(tmp_path)
    tier.gate.set()
    planner = Planner(reg, [tier])
    try:
        assert planner.match(Req("a", src.tokens + [1]), 0) == 6 * CT
        assert planner.match(Req("b", src.tokens + [1], cache_salt="bob"), 0) == 0
        assert planner.match(Req("c", src.tokens), 0) == 5 * CT  # whole chunks only: the last token is computed
        assert request_salt("", Req("x", [], "bob")) == "\0bob" and request_salt("e", Req("y", [])) == "e"
    finally:
        planner.close()
        tier.close()


def test_a_finished_request_leaves_nothing_behind(tmp_path):
    reg, tier, src = _scene(tmp_path)
    planner = Planner(reg, [tier])
    try:
        req = Req("r", src.tokens + [7])
        assert planner.match_in_background(req, 0) is None
        planner.finished("r")  # aborted while its lookup runs
        tier.gate.set()
        assert planner.allocated(req, [[1]] * reg.num_groups, 6 * CT) is None  # no plan: nothing loads
        assert planner.take_loads() == []
        assert _wait_answer(planner, req) == 6 * CT  # asked again: a fresh lookup
    finally:
        planner.close()
        tier.close()


# -- a stuck probe (issue 35, item 2) ----------------------------------------------------------
class StuckTier(FilesystemTier):
    """A filesystem tier whose probe of any key in `stuck` waits for a gate (one request's objects on a
    hung device); every other probe is the real one."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.stuck: set[str] = set()

    def probe(self, keys):
        if self.stuck.intersection(keys):
            self.gate.wait(30)
        return super().probe(keys)


def _stuck_scene(tmp_path):
    """Two stored prefixes, the first one's probe stuck."""
    reg = presets.dsv4_flash(scale=1 / 64)
    tier = StuckTier(tmp_path, reg.chunk_bytes, reg.fingerprint)
    stuck, healthy = make_source(reg, 6, seed=4), make_source(reg, 6, seed=5)
    for src in (stuck, healthy):
        store_source(src, tier, window_chunks=4)
    tier.stuck = set(PrefixKeys(stuck.keyspace, stuck.tokens, reg.chunk_tokens).window(0, 1))
    return reg, tier, Req("stuck", stuck.tokens + [7]), Req("healthy", healthy.tokens + [7])


def test_a_stuck_probe_does_not_block_another_requests_lookup(tmp_path):
    reg, tier, stuck, healthy = _stuck_scene(tmp_path)
    planner = Planner(reg, [tier])
    try:
        assert planner.match_in_background(stuck, 0) is None  # its probe hangs
        time.sleep(0.05)
        assert _wait_answer(planner, healthy, timeout=3) == 6 * CT  # answered beside it, not after it
    finally:
        tier.gate.set()
        planner.close()
        tier.close()


def test_a_probe_past_its_bound_is_a_miss(tmp_path):
    """Background and on the caller's thread alike: a probe that outlives probe_timeout_s answers 0 (the
    request prefills locally) and is counted; the next request's lookup is not held by it."""
    reg, tier, stuck, healthy = _stuck_scene(tmp_path)
    planner = Planner(reg, [tier], probe_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert _wait_answer(planner, stuck, timeout=3) == 0
        assert 0.3 <= time.monotonic() - t0 < 2
        assert planner.allocated(stuck, [[1]] * reg.num_groups, 0) is None
        t0 = time.monotonic()
        assert planner.match(Req("stuck-sync", stuck.prompt_token_ids), 0) == 0
        assert 0.3 <= time.monotonic() - t0 < 2
        assert planner.stats.probe_timeouts == 2
        assert planner.match(healthy, 0) == 6 * CT
        t0 = time.monotonic()
        planner.close()  # never waits for a probe still stuck in the tier
        assert time.monotonic() - t0 < 1
    finally:
        tier.gate.set()
        planner.close()
        tier.close()
