"""The scheduler side of a restore: the probe decision, force-local markers, and the load recorded
once the engine allocated the request's blocks. Engine-neutral; holds no staging.

    match(request, num_computed_tokens) -> external tokens
        probe-only lookup over the ordered tiers (TierSet.plan), chunk aligned, leaving at least
        one prompt token to compute; 0 without any lookup while the request carries a force-local
        marker, or when the engine's own cache holds every candidate chunk. One scheduler probing
        for every TP rank takes the shortest rank's prefix (`probe_all_ranks`); ranks planning for
        themselves agree on N with a MIN all-reduce (`agree_plan`).
    match_in_background(request, num_computed_tokens) -> external tokens, or None
        the same decision with the lookup on a probe thread: None while it runs (the engine asks
        again at its next step), then the answer. The caller's thread pays no key derivation and no
        tier round trip. `start_lookup(request)` starts it as the request arrives.

Every lookup is bounded and isolated: each runs on a probe thread of its own (lookups.py), and one
that has not answered `probe_timeout_s` after it was asked for is a miss (0 external tokens: the
request prefills locally), counted in `stats.probe_timeouts`; `match` waits for it no longer either.
    allocated(request, block_ids_per_group, num_external_tokens)
        records the load of N chunks into the request's blocks (one list per HMA group): only the
        blocks allocated for the external tokens. The chunks the engine's own cache holds are not
        restored, and inside the chunk where that local hit ends its blocks read -1 (not written):
        they may be shared with running requests. A failed load reports only the blocks it wrote.
    take_loads() -> [LoadSpec]     the loads recorded since the last call (shipped to the workers)
    load_failed(request_id)        sets the force-local marker: the next match answers 0
    new_epoch()                    nothing stored before it is looked up or loaded again (the
                                   engine's weights changed in place): a fresh nonce in every salt
    running(request_id)            admitted RUNNING: the marker is cleared
    finished(request_id)           teardown: the marker and every per-request state are dropped
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration

from . import commit
from .keys import KeyInputs, KeySpace, PrefixKeys, salt_only
from .load_blocks import block_align, only_blocks_of
from .lookups import Lookup, LookupThreads
from .markers import ForceLocalMarkers
from .plan import LoadSpec
from .retrieve import ProbeDecision, TierSet
from .tiers.base import Tier, TierError
from .validation import check_duration, check_int, check_timeout

log = logging.getLogger(__name__)

DEFAULT_PROBE_TIMEOUT_S = 5.0


@dataclass
class PlannerStats:
    probes: int = 0  # lookups against the tiers
    skipped_by_marker: int = 0  # lookups not made because a force-local marker was set
    probe_timeouts: int = 0  # lookups past probe_timeout_s, answered as a miss
    probe_s: float = 0.0
    refused: dict[str, int] = field(default_factory=dict)  # reason -> requests BSR could not key
    epochs: int = 0  # new_epoch() calls


def request_id_of(request) -> str:
    return request if isinstance(request, str) else request.request_id


def tokens_of(request) -> list[int]:
    for name in ("prompt_token_ids", "all_token_ids"):
        toks = getattr(request, name, None)
        if toks is not None:
            return list(toks)
    raise ValueError(f"request {request_id_of(request)!r} has no prompt_token_ids")


def block_lists(blocks) -> list[list[int]]:
    """Per-group block ids from a tuple/list of lists or tensors, or anything with
    get_block_ids() (vLLM's KVCacheBlocks)."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    return [t.tolist() if isinstance(t, torch.Tensor) else [int(b) for b in t] for t in blocks]


def exposed_tokens(plan: ProbeDecision, chunk_tokens: int) -> int:
    return plan.num_chunks * chunk_tokens if plan.num_tokens is None else plan.num_tokens


class Planner:
    """See the module docstring. `tiers`: the ordered tiers (or a TierSet sharing their health)."""

    def __init__(self, reg: Registration, tiers: Sequence[Tier] | TierSet, *, tp_rank: int = 0, tp_world: int = 1,
                 salt: str = "", model: str = "", markers: ForceLocalMarkers | None = None,
                 probe_all_ranks: bool = True, agree_plan: bool = False,
                 agree_timeout_s: float = commit.DEFAULT_TIMEOUT_S, unavailable_cooldown_s: float = 30.0,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, probe_wait_s: float = 0.0,
                 restore_partial_chunk: bool = False,
                 key_inputs: Callable[[str, object], KeyInputs] = salt_only) -> None:
        self.reg = reg
        self.key_inputs = key_inputs
        # not with groups whose objects hold each chunk's last window only (Registration.tail_groups): a
        # prefix ending inside a chunk does not end where that window does
        self.restore_partial_chunk = restore_partial_chunk and not reg.tail_groups
        self.block_align = block_align(reg)
        self.probe_timeout_s = check_timeout("probe_timeout_s", probe_timeout_s)
        self.probe_wait_s = min(check_duration("probe_wait_s", probe_wait_s), self.probe_timeout_s)
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
        self._lookups = LookupThreads(self._timed_lookup)
        self._refused: set[str] = set()  # requests counted as refused (counted once each)

    @property
    def tiers(self) -> list[Tier]:
        return self.tier_set.tiers

    def match(self, request, num_computed_tokens: int) -> int:
        """External tokens the tiers can restore beyond `num_computed_tokens` (see the module docstring)."""
        num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, lo=0)
        t0 = time.perf_counter()
        plan = self._quick_plan(request, num_computed_tokens)
        if plan is None:
            plan = self._wait_lookup(request)
        return self._decide(request, plan, num_computed_tokens, time.perf_counter() - t0)

    def start_lookup(self, request) -> Lookup | None:
        """Start the request's lookup on a probe thread now (it arrived; the engine asks later); the
        lookup, or None (a force-local marker, or closed)."""
        rid = request_id_of(request)
        if self.markers.is_set(rid):
            return None
        return self._lookups.start(rid, request)

    def _wait_lookup(self, request) -> ProbeDecision:
        """The request's lookup on a probe thread, waited for on the caller's thread up to its bound."""
        rid = request_id_of(request)
        lookup = self._lookups.start(rid, request)
        if lookup is None:  # closed
            return ProbeDecision(0, None, "none")
        try:
            plan, _ = lookup.future.result(max(0.0, lookup.started + self.probe_timeout_s - time.monotonic()))
        except (FutureTimeout, CancelledError):
            return self._timed_out(rid, lookup)
        except BaseException:  # bad input: the caller's, as when the lookup ran on its thread
            self._forget(rid, lookup)
            raise
        self._forget(rid, lookup)
        return plan

    def _timed_out(self, rid: str, lookup: Lookup) -> ProbeDecision:
        """A lookup past its bound: a miss (the request prefills locally); its probe is left to finish."""
        lookup.future.cancel()  # a lookup still queued never probes
        self._forget(rid, lookup)
        self.stats.probe_timeouts += 1
        log.warning("BSR: the lookup of %s did not answer within %.1f s: a miss, prefilled locally",
                    rid, self.probe_timeout_s)
        return ProbeDecision(0, None, "timeout")

    def _forget(self, rid: str, lookup: Lookup) -> None:
        self._lookups.forget(rid, lookup)

    def match_in_background(self, request, num_computed_tokens: int) -> int | None:
        """match() with the lookup on a probe thread: None until it answered or passed its bound (see the
        module docstring)."""
        num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, lo=0)
        rid = request_id_of(request)
        running = self._lookups.get(rid)
        plan = self._quick_plan(request, num_computed_tokens)
        if plan is not None:  # a marker, or the engine holds it all: whatever a lookup found is moot
            if running is not None:
                running.future.cancel()
                self._forget(rid, running)
            return self._decide(request, plan, num_computed_tokens, 0.0)
        if running is None:
            running = self._lookups.start(rid, request)
            if running is None:  # closed
                return None
        if not running.waited_in_step and self.probe_wait_s > 0:
            # once per request, the step thread waits a little for the probe (its thread then has
            # the interpreter to itself instead of sharing it with the step's) rather than a step
            running.waited_in_step = True
            with contextlib.suppress(Exception):  # not answered yet, or failed: read below
                running.future.result(self.probe_wait_s)
        if not running.future.done() or running.future.cancelled():
            waited = time.monotonic() - running.started
            if waited < self.probe_timeout_s:
                return None
            return self._decide(request, self._timed_out(rid, running), num_computed_tokens, waited)
        self._forget(rid, running)
        try:
            plan, probe_s = running.future.result()
        except Exception:  # noqa: BLE001 - a lookup that fails is a miss
            plan, probe_s = ProbeDecision(0, None, "none"), 0.0
        return self._decide(request, plan, num_computed_tokens, probe_s)

    def _timed_lookup(self, request) -> tuple[ProbeDecision, float]:
        t0 = time.perf_counter()
        plan = self._lookup(request)  # a tier that fails is a miss already (TierSet.plan); bad input raises
        return plan, time.perf_counter() - t0

    def inputs(self, request) -> KeyInputs:
        """The request's key inputs in the current epoch (the key_inputs hook over this salt)."""
        return self.key_inputs(self.keyspace.salt, request)

    def refused(self, request) -> str | None:
        """Why BSR cannot key the request (None: it can); counted once per request."""
        why = self.inputs(request).refused
        rid = request_id_of(request)
        if why is not None and rid not in self._refused:
            self._refused.add(rid)
            self.stats.refused[why] = self.stats.refused.get(why, 0) + 1
            log.info("BSR: request %s is neither saved nor restored: its %s cannot be keyed", rid, why)
        return why

    def _quick_plan(self, request, num_computed_tokens: int) -> ProbeDecision | None:
        """The decisions that need no lookup: a force-local marker, a request BSR cannot key, or
        nothing the engine lacks."""
        ct = self.reg.chunk_tokens
        if self.markers.is_set(request_id_of(request)):
            self.stats.skipped_by_marker += 1
            return ProbeDecision(0, None, "marker")
        if self.refused(request) is not None:
            return ProbeDecision(0, None, "refused")
        num_tokens = getattr(request, "num_prompt_tokens", None)
        if num_tokens is None:
            num_tokens = len(tokens_of(request))
        if max(0, (num_tokens - 1) // ct) * ct <= num_computed_tokens:  # the engine's own cache holds it all
            return ProbeDecision(0, None, "local")
        return None

    def _lookup(self, request) -> ProbeDecision:
        tokens = tokens_of(request)
        ct, n = self.reg.chunk_tokens, len(tokens)
        # at least one token left to compute: up to the last whole block before it, or whole chunk
        end = (n - 1) // self.block_align * self.block_align if self.restore_partial_chunk else (n - 1) // ct * ct
        inputs = self.inputs(request)
        if inputs.refused is not None:
            return ProbeDecision(0, None, "refused")
        keyspace = dataclasses.replace(self.keyspace, salt=inputs.salt, features=inputs.features)
        self.stats.probes += 1
        max_chunks = min(n // ct, -(-end // ct))  # whole chunks only: a partial chunk has its own object
        partial = (n - n // ct * ct) // self.block_align * self.block_align if self.restore_partial_chunk else 0
        # one walk of the key chain: the probe's, which the partial chunk's key then continues
        keys = PrefixKeys(keyspace, tokens, ct, partial)
        if self.probe_all_ranks and self.tp_world > 1:
            plan = self._plan_all_ranks(tokens, max_chunks, keyspace, keys)
        else:
            plan = self.tier_set.plan(tokens, keyspace, max_chunks, keys)
        return self._with_partial_chunk(plan, keys, end)

    def _with_partial_chunk(self, plan: ProbeDecision, keys: PrefixKeys, end: int) -> ProbeDecision:
        """The prefix in tokens: up to `end` (the last whole block before the prompt's last token), past
        the last whole chunk only through the prompt's partial chunk on the plan tier (every rank's)."""
        ct = self.reg.chunk_tokens
        plan.num_tokens = min(plan.num_chunks * ct, end)
        full, partial = keys.full_chunks, keys.partial_tokens
        if plan.num_tokens >= end or plan.num_chunks != full or not partial or plan.tier_index is None:
            return plan
        tier = self.tiers[plan.tier_index]
        ranks = range(self.tp_world) if self.probe_all_ranks else (keys.space.tp_rank,)
        partial_keys = [(keys if r == keys.space.tp_rank else
                         PrefixKeys(dataclasses.replace(keys.space, tp_rank=r), keys.tokens, ct, partial)
                         ).window(full, 1)[0] for r in ranks]
        try:
            held = all(tier.probe(partial_keys))
        except TierError:
            held = False
        if held:
            plan.num_chunks, plan.num_tokens, plan.partial_tokens = full + 1, min(end, full * ct + partial), partial
        return plan

    def _decide(self, request, plan: ProbeDecision, num_computed_tokens: int, probe_s: float) -> int:
        """Record the plan the load will follow; the external tokens beyond what the engine holds."""
        rid = request_id_of(request)
        ct = self.reg.chunk_tokens
        if self.agree_plan:  # the shortest rank's prefix, in whole chunks unless every rank has the same
            mine = exposed_tokens(plan, ct)
            out = commit.all_min([mine], timeout_s=self.agree_timeout_s, tag=commit.make_tag(rid, "plan"))
            n = 0 if out is None else out[0]
            if n < mine:
                n = n // ct * ct
                plan = ProbeDecision(n // ct, plan.tier_index if n else None, plan.tier if n else "none", plan.probes)
        self.stats.probe_s += probe_s
        with self._lock:
            if exposed_tokens(plan, ct) <= num_computed_tokens:
                self._plans.pop(rid, None)
                return 0
            self._plans[rid] = (plan, num_computed_tokens, probe_s)
        return exposed_tokens(plan, ct) - num_computed_tokens

    def _plan_all_ranks(self, tokens: list[int], max_chunks: int, keyspace: KeySpace,
                        keys: PrefixKeys) -> ProbeDecision:
        best: ProbeDecision | None = None
        for r in range(self.tp_world):
            p = self.tier_set.plan(tokens, dataclasses.replace(keyspace, tp_rank=r), max_chunks,
                                   keys if r == keyspace.tp_rank else None)
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
            ct, tokens = self.reg.chunk_tokens, tokens_of(request)
            end = min(exposed_tokens(plan, ct), computed + num_external_tokens)
            n = -(-end // ct)
            partial = plan.partial_tokens if n > len(tokens) // ct else 0  # the last chunk is the partial chunk
            blocks = block_lists(block_ids_per_group)
            if len(blocks) != self.reg.num_groups:
                raise ValueError(f"{len(blocks)} block lists for {self.reg.num_groups} KV-cache groups")
            inputs = self.inputs(request)
            spec = LoadSpec(rid, tokens, n, plan.tier_index,
                            only_blocks_of(self.reg, blocks, computed, end, n), inputs.salt, probe_s,
                            local_tokens=min(computed, end), features=inputs.features, num_tokens=end,
                            partial_tokens=partial)
            self._pending[rid] = spec
            return spec

    def take_loads(self) -> list[LoadSpec]:
        with self._lock:
            loads = list(self._pending.values())
            self._pending.clear()
        return loads

    def load_failed(self, request_id: str, reason: str = "external load failed") -> None:
        self.markers.set(request_id, reason)

    def new_epoch(self) -> None:
        """Forget everything stored so far, for this planner: a fresh random nonce joins the salt of
        every later key (random, so two engines that both changed their weights never share a
        keyspace), and lookups made under the old one are dropped. Objects stored before stay in
        the tiers for other engines (those still holding the old weights) and are misses here."""
        with self._lock:
            self.keyspace = dataclasses.replace(self.keyspace, salt=f"{self.keyspace.salt}\0epoch\0{uuid.uuid4().hex}")
            self._plans.clear()
            self._lookups.drop()  # a queued one never probes; a running one's answer is dropped
            self.stats.epochs += 1

    def running(self, request_id: str) -> bool:
        """RUNNING admission: drop the marker (True if one was set)."""
        return self.markers.clear_on_running(request_id)

    def finished(self, request_id: str) -> bool:
        """Teardown: drop the marker and every per-request state (True if a marker was set)."""
        cleared = self.markers.clear_on_teardown(request_id)
        with self._lock:
            self._plans.pop(request_id, None)
            self._pending.pop(request_id, None)
            self._refused.discard(request_id)
        self._lookups.drop(request_id)  # still queued: never probes
        return cleared

    def close(self) -> None:
        """Drop the queued lookups; a probe thread ends after its current probe (never waited for: one
        may be stuck in a tier)."""
        self._lookups.close()
