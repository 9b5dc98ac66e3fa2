"""The scheduler side of a restore: the probe decision, force-local markers, and the load recorded
once the engine allocated the request's blocks. Engine-neutral; holds no staging.

    match(request, num_computed_tokens) -> external tokens
        probe-only lookup over the ordered tiers (TierSet.plan), chunk aligned, leaving at least
        one prompt token to compute; 0 without any lookup while the request carries a force-local
        marker, or when the engine's own cache holds every candidate chunk. One scheduler probing
        for every TP rank takes the shortest rank's prefix (`probe_all_ranks`); ranks planning for
        themselves agree on N with a MIN all-reduce (`agree_plan`).
    match_in_background(request, num_computed_tokens) -> external tokens, or None
        the same decision with the lookup on the planner's probe thread: None while it runs (the
        engine asks again at its next step), then the answer. The caller's thread pays no key
        derivation and no tier round trip. `start_lookup(request)` starts it as the request arrives.
    allocated(request, block_ids_per_group, num_external_tokens)
        records the load of N chunks into the request's blocks (one list per HMA group)
    take_loads() -> [LoadSpec]     the loads recorded since the last call (shipped to the workers)
    load_failed(request_id)        sets the force-local marker: the next match answers 0
    running(request_id)            admitted RUNNING: the marker is cleared
    finished(request_id)           teardown: the marker and every per-request state are dropped
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bsr_kernels import Registration

from . import commit
from .keys import KeySpace
from .markers import ForceLocalMarkers
from .retrieve import ProbeDecision, TierSet
from .tiers.base import Tier
from .validation import check_int


@dataclass
class LoadSpec:
    """One recorded load: N chunks of the request's prefix into its per-group block ids (what the
    scheduler side ships to the workers)."""

    request_id: str
    tokens: list[int]
    num_chunks: int
    plan_tier: int | None
    block_ids: list[list[int]]
    salt: str | None = None  # the request's tenant salt (None: the connector's)
    probe_s: float = 0.0  # the scheduler's probe for this request (keys and tier lookups)


@dataclass
class PlannerStats:
    probes: int = 0  # lookups against the tiers
    skipped_by_marker: int = 0  # lookups not made because a force-local marker was set
    probe_s: float = 0.0


def request_id_of(request) -> str:
    return request if isinstance(request, str) else request.request_id


def tokens_of(request) -> list[int]:
    for name in ("prompt_token_ids", "all_token_ids"):
        toks = getattr(request, name, None)
        if toks is not None:
            return list(toks)
    raise ValueError(f"request {request_id_of(request)!r} has no prompt_token_ids")


def request_salt(base: str, request) -> str:
    """The tenant salt of a request: the connector's salt, plus the request's own `cache_salt`
    (vLLM's per-request prefix-cache isolation) when it has one."""
    cache_salt = getattr(request, "cache_salt", None)
    return f"{base}\0{cache_salt}" if cache_salt else base


def block_lists(blocks) -> list[list[int]]:
    """Per-group block ids from a tuple/list of lists or tensors, or anything with
    get_block_ids() (vLLM's KVCacheBlocks)."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    return [t.tolist() if isinstance(t, torch.Tensor) else [int(b) for b in t] for t in blocks]


class Planner:
    """See the module docstring. `tiers`: the ordered tiers (or a TierSet sharing their health)."""

    def __init__(self, reg: Registration, tiers: Sequence[Tier] | TierSet, *, tp_rank: int = 0, tp_world: int = 1,
                 salt: str = "", model: str = "", markers: ForceLocalMarkers | None = None,
                 probe_all_ranks: bool = True, agree_plan: bool = False,
                 agree_timeout_s: float = commit.DEFAULT_TIMEOUT_S, unavailable_cooldown_s: float = 30.0) -> None:
        self.reg = reg
        self.tier_set = tiers if isinstance(tiers, TierSet) else TierSet(reg, tiers, unavailable_cooldown_s)
        self.tp_world = tp_world
        self.keyspace = KeySpace(reg.fingerprint, tp_rank, tp_world, salt, model)
        self.markers = markers if markers is not None else ForceLocalMarkers()
        self.probe_all_ranks = probe_all_ranks
        self.agree_plan = agree_plan
        self.agree_timeout_s = agree_timeout_s
        self.stats = PlannerStats()
        self._lock = threading.Lock()
        self._plans: dict[str, tuple[ProbeDecision, int, float]] = {}  # request -> (plan, num_computed_tokens, probe s)
        self._pending: dict[str, LoadSpec] = {}
        self._probing: dict[str, Future] = {}  # request -> its lookup on the probe thread
        self._probe_thread: ThreadPoolExecutor | None = None

    @property
    def tiers(self) -> list[Tier]:
        return self.tier_set.tiers

    def match(self, request, num_computed_tokens: int) -> int:
        """External tokens the tiers can restore beyond `num_computed_tokens` (see the module docstring)."""
        num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, lo=0)
        t0 = time.perf_counter()
        plan = self._quick_plan(request, num_computed_tokens)
        if plan is None:
            plan = self._lookup(request)
        return self._decide(request, plan, num_computed_tokens, time.perf_counter() - t0)

    def start_lookup(self, request) -> None:
        """Start the request's lookup on the probe thread now (it arrived; the engine asks later)."""
        rid = request_id_of(request)
        if self.markers.is_set(rid):
            return
        with self._lock:
            if rid in self._probing:
                return
            if self._probe_thread is None:
                self._probe_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bsr-probe")
            self._probing[rid] = self._probe_thread.submit(self._timed_lookup, request)

    def match_in_background(self, request, num_computed_tokens: int) -> int | None:
        """match() with the lookup on the probe thread: None until it finished (see the module docstring)."""
        num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, lo=0)
        rid = request_id_of(request)
        with self._lock:
            running = self._probing.get(rid)
        plan = self._quick_plan(request, num_computed_tokens)
        if plan is not None:  # a marker, or the engine holds it all: whatever a lookup found is moot
            with self._lock:
                self._probing.pop(rid, None)
            return self._decide(request, plan, num_computed_tokens, 0.0)
        if running is None:
            self.start_lookup(request)
            return None
        if not running.done():
            return None
        with self._lock:
            self._probing.pop(rid, None)
        plan, probe_s = running.result()
        return self._decide(request, plan, num_computed_tokens, probe_s)

    def _timed_lookup(self, request) -> tuple[ProbeDecision, float]:
        t0 = time.perf_counter()
        try:
            plan = self._lookup(request)
        except Exception:  # noqa: BLE001 - a lookup that fails is a miss (TierSet.plan already is)
            plan = ProbeDecision(0, None, "none")
        return plan, time.perf_counter() - t0

    def _quick_plan(self, request, num_computed_tokens: int) -> ProbeDecision | None:
        """The decisions that need no lookup: a force-local marker, or nothing the engine lacks."""
        ct = self.reg.chunk_tokens
        if self.markers.is_set(request_id_of(request)):
            self.stats.skipped_by_marker += 1
            return ProbeDecision(0, None, "marker")
        num_tokens = getattr(request, "num_prompt_tokens", None)
        if num_tokens is None:
            num_tokens = len(tokens_of(request))
        if max(0, (num_tokens - 1) // ct) * ct <= num_computed_tokens:  # the engine's own cache holds it all
            return ProbeDecision(0, None, "local")
        return None

    def _lookup(self, request) -> ProbeDecision:
        tokens = tokens_of(request)
        max_chunks = max(0, (len(tokens) - 1) // self.reg.chunk_tokens)  # at least one token left to compute
        keyspace = dataclasses.replace(self.keyspace, salt=request_salt(self.keyspace.salt, request))
        self.stats.probes += 1
        if self.probe_all_ranks and self.tp_world > 1:
            return self._plan_all_ranks(tokens, max_chunks, keyspace)
        return self.tier_set.plan(tokens, keyspace, max_chunks)

    def _decide(self, request, plan: ProbeDecision, num_computed_tokens: int, probe_s: float) -> int:
        """Record the plan the load will follow; the external tokens beyond what the engine holds."""
        rid = request_id_of(request)
        ct = self.reg.chunk_tokens
        if self.agree_plan:
            out = commit.all_min([plan.num_chunks], timeout_s=self.agree_timeout_s,
                                 tag=commit.make_tag(rid, "plan"))
            n = 0 if out is None else out[0]
            if n < plan.num_chunks:
                plan = ProbeDecision(n, plan.tier_index if n else None, plan.tier if n else "none", plan.probes)
        self.stats.probe_s += probe_s
        with self._lock:
            if plan.num_chunks * ct <= num_computed_tokens:
                self._plans.pop(rid, None)
                return 0
            self._plans[rid] = (plan, num_computed_tokens, probe_s)
        return plan.num_chunks * ct - num_computed_tokens

    def _plan_all_ranks(self, tokens: list[int], max_chunks: int, keyspace: KeySpace) -> ProbeDecision:
        best: ProbeDecision | None = None
        for r in range(self.tp_world):
            p = self.tier_set.plan(tokens, dataclasses.replace(keyspace, tp_rank=r), max_chunks)
            if best is None or p.num_chunks < best.num_chunks:
                best = p
            max_chunks = min(max_chunks, p.num_chunks)
        assert best is not None
        return best

    def allocated(self, request, block_ids_per_group, num_external_tokens: int) -> LoadSpec | None:
        """The engine allocated the request's blocks: record its load (None when nothing is loaded)."""
        check_int("num_external_tokens", num_external_tokens)
        rid = request_id_of(request)
        with self._lock:
            entry = self._plans.pop(rid, None)
            if num_external_tokens <= 0 or entry is None:
                self._pending.pop(rid, None)
                return None
            plan, computed, probe_s = entry
            n = min(plan.num_chunks, (computed + num_external_tokens) // self.reg.chunk_tokens)
            blocks = block_lists(block_ids_per_group)
            if len(blocks) != self.reg.num_groups:
                raise ValueError(f"{len(blocks)} block lists for {self.reg.num_groups} KV-cache groups")
            spec = LoadSpec(rid, tokens_of(request), n, plan.tier_index, blocks,
                            request_salt(self.keyspace.salt, request), probe_s)
            self._pending[rid] = spec
            return spec

    def take_loads(self) -> list[LoadSpec]:
        with self._lock:
            loads = list(self._pending.values())
            self._pending.clear()
        return loads

    def load_failed(self, request_id: str, reason: str = "external load failed") -> None:
        self.markers.set(request_id, reason)

    def running(self, request_id: str) -> bool:
        """RUNNING admission: drop the marker (True if one was set)."""
        return self.markers.clear_on_running(request_id)

    def finished(self, request_id: str) -> bool:
        """Teardown: drop the marker and every per-request state (True if a marker was set)."""
        cleared = self.markers.clear_on_teardown(request_id)
        with self._lock:
            self._plans.pop(request_id, None)
            self._pending.pop(request_id, None)
            self._probing.pop(request_id, None)
        return cleared

    def close(self) -> None:
        if self._probe_thread is not None:
            self._probe_thread.shutdown(wait=True, cancel_futures=True)
