"""A scheduler-facing KV connector with vLLM's method names and semantics, without vLLM.

One `BSRConnector` per TP rank (scheduler and worker roles in one object; the optional
`bsr_runtime.integrations.vllm` package splits them for vLLM). The request lifecycle:

    get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)
        probe-only lookup over the ordered tiers, chunk aligned, leaving at least one prompt
        token to compute; 0 without any lookup while the request carries a force-local marker.
        With TP (world > 1, `agree_plan`) the ranks agree on N with a MIN all-reduce.
    update_state_after_alloc(request, block_ids_per_group, num_external_tokens)
        records the load of N chunks into the request's blocks (one list per HMA group)
    start_load()
        runs every recorded load synchronously (Retriever.retrieve: windowed restore, tier
        fallback, commit rule across ranks). A failed load is reported per request:
        failed_recving, every block of the request in every group invalid, and a
        force-local marker, so the next admission pass prefills locally.
    get_finished(finished_req_ids) -> (finished_sending, finished_recving); `.failed_recving`
    get_block_ids_with_load_errors() -> set[int]
    on_request_running(request)          RUNNING admission: clears the marker
    request_finished(request, block_ids) teardown: clears the marker and all state -> (False, None)

Limitations: loads are synchronous (load_async is always False); a restore always covers
chunks 0..N-1, so `num_computed_tokens` (a local prefix-cache hit) only reduces the tokens
reported, not the bytes moved; saving (the store path) is not wired here (see store.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration

from . import commit
from .keys import KeySpace
from .markers import ForceLocalMarkers
from .restore import RestoreConfig, RestoreRequest
from .retrieve import LOCAL, AgreeFn, LocalResult, Plan, RetrieveOutcome, Retriever, request_block_ids
from .tiers.base import Tier
from .validation import check_int


@dataclass
class ConnectorRequest:
    """The two fields of vllm.v1.request.Request the connector reads."""

    request_id: str
    prompt_token_ids: list[int]


@dataclass
class LoadSpec:
    """One recorded load: N chunks of the request's prefix into its per-group block ids
    (what the vLLM wrapper carries from scheduler to workers in the connector metadata)."""

    request_id: str
    tokens: list[int]
    num_chunks: int
    plan_tier: int | None
    block_ids: list[list[int]]
    salt: str | None = None  # the request's tenant salt (None: the connector's)


class FinishedIds(tuple):
    """(finished_sending, finished_recving) as vLLM's get_finished returns, plus
    `failed_recving`: the subset of finished_recving whose load failed closed."""

    failed_recving: set[str]

    def __new__(cls, sending: set[str], recving: set[str], failed: set[str]) -> FinishedIds:
        obj = super().__new__(cls, (sending, recving))
        obj.failed_recving = failed
        return obj

    @property
    def finished_sending(self) -> set[str]:
        return self[0]

    @property
    def finished_recving(self) -> set[str]:
        return self[1]


def _request_id(request) -> str:
    return request if isinstance(request, str) else request.request_id


def _tokens(request) -> list[int]:
    for name in ("prompt_token_ids", "all_token_ids"):
        toks = getattr(request, name, None)
        if toks is not None:
            return list(toks)
    raise ValueError(f"request {_request_id(request)!r} has no prompt_token_ids")


def request_salt(base: str, request) -> str:
    """The tenant salt of a request: the connector's salt, plus the request's own `cache_salt`
    (vLLM's per-request prefix-cache isolation) when it has one."""
    cache_salt = getattr(request, "cache_salt", None)
    return f"{base}\0{cache_salt}" if cache_salt else base


def _block_lists(blocks) -> list[list[int]]:
    """Per-group block ids from a tuple/list of lists or tensors, or anything with
    get_block_ids() (vLLM's KVCacheBlocks)."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    return [t.tolist() if isinstance(t, torch.Tensor) else [int(b) for b in t] for t in blocks]


@dataclass
class ConnectorStats:
    probes: int = 0  # lookups against the tiers (get_num_new_matched_tokens)
    skipped_by_marker: int = 0  # lookups not made because a force-local marker was set
    loads: int = 0
    committed: int = 0
    failed: int = 0
    served_by_fallback: int = 0  # committed from another tier than the plan tier
    served_by: dict[str, int] = field(default_factory=dict)


class BSRConnector:
    """See the module docstring. `kv_caches`: the registered destination tensors of this rank
    (in registration order); may also be given later with register_kv_caches()."""

    def __init__(self, reg: Registration, tiers: Sequence[Tier], kv_caches: Sequence[torch.Tensor] | None = None,
                 *, config: RestoreConfig | None = None, tp_rank: int = 0, tp_world: int = 1, salt: str = "",
                 model: str = "", markers: ForceLocalMarkers | None = None, agree: AgreeFn | None = None,
                 agree_timeout_s: float = commit.DEFAULT_TIMEOUT_S, agree_plan: bool | None = None,
                 probe_all_ranks: bool = False, unavailable_cooldown_s: float = 30.0) -> None:
        self.reg = reg
        self.tp_rank, self.tp_world = tp_rank, tp_world
        self.keyspace = KeySpace(reg.fingerprint, tp_rank, tp_world, salt, model)
        self.markers = markers if markers is not None else ForceLocalMarkers()
        self.retriever = Retriever(reg, tiers, config, agree=agree, agree_timeout_s=agree_timeout_s,
                                   unavailable_cooldown_s=unavailable_cooldown_s)
        self.agree_timeout_s = agree_timeout_s
        # per-rank mode with TP: the ranks agree on N (MIN all-reduce); a single scheduler
        # process instead probes every rank's keys itself (probe_all_ranks)
        self.agree_plan = (tp_world > 1 and not probe_all_ranks) if agree_plan is None else agree_plan
        self.probe_all_ranks = probe_all_ranks
        self.kv: list[torch.Tensor] | None = list(kv_caches) if kv_caches is not None else None
        self.stats = ConnectorStats()
        self._lock = threading.Lock()
        self._plans: dict[str, tuple[Plan, int]] = {}  # request -> (plan, num_computed_tokens)
        self._pending: dict[str, LoadSpec] = {}
        self._outcomes: dict[str, RetrieveOutcome] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()

    @property
    def tiers(self) -> list[Tier]:
        return self.retriever.tiers

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) != self.reg.num_tensors:
            raise ValueError(f"{len(kv_caches)} kv caches for {self.reg.num_tensors} registered tensors")
        self.kv = list(kv_caches)

    def close(self) -> None:
        """Release the staging pool and tier registrations (the tiers stay open: the caller owns them)."""
        self.retriever.close()

    shutdown = close

    def __enter__(self) -> BSRConnector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, lo=0)
        rid = _request_id(request)
        tokens = _tokens(request)
        keyspace = dataclasses.replace(self.keyspace, salt=request_salt(self.keyspace.salt, request))
        ct = self.reg.chunk_tokens
        if self.markers.is_set(rid):
            self.stats.skipped_by_marker += 1
            plan = Plan(0, None, "marker")
        else:
            max_chunks = max(0, (len(tokens) - 1) // ct)  # at least one token is left to compute
            self.stats.probes += 1
            if self.probe_all_ranks and self.tp_world > 1:
                plan = self._plan_all_ranks(tokens, max_chunks, keyspace)
            else:
                plan = self.retriever.plan(tokens, keyspace, max_chunks)
        if self.agree_plan:
            out = commit.all_min([plan.num_chunks], timeout_s=self.agree_timeout_s,
                                 tag=commit.make_tag(rid, "plan"))
            n = 0 if out is None else out[0]
            if n < plan.num_chunks:
                plan = Plan(n, plan.tier_index if n else None, plan.tier if n else "none", plan.probes)
        with self._lock:
            if plan.num_chunks * ct <= num_computed_tokens:
                self._plans.pop(rid, None)
                return 0, False
            self._plans[rid] = (plan, num_computed_tokens)
        return plan.num_chunks * ct - num_computed_tokens, False

    def _plan_all_ranks(self, tokens: list[int], max_chunks: int, keyspace: KeySpace) -> Plan:
        best: Plan | None = None
        for r in range(self.tp_world):
            space = dataclasses.replace(keyspace, tp_rank=r)
            p = self.retriever.plan(tokens, space, max_chunks)
            if best is None or p.num_chunks < best.num_chunks:
                best = p
            max_chunks = min(max_chunks, p.num_chunks)
        assert best is not None
        return best

    def update_state_after_alloc(self, request, block_ids_per_group, num_external_tokens: int) -> None:
        check_int("num_external_tokens", num_external_tokens)
        rid = _request_id(request)
        with self._lock:
            entry = self._plans.pop(rid, None)
            if num_external_tokens <= 0 or entry is None:
                self._pending.pop(rid, None)
                return
            plan, computed = entry
            n = min(plan.num_chunks, (computed + num_external_tokens) // self.reg.chunk_tokens)
            blocks = _block_lists(block_ids_per_group)
            if len(blocks) != self.reg.num_groups:
                raise ValueError(f"{len(blocks)} block lists for {self.reg.num_groups} KV-cache groups")
            self._pending[rid] = LoadSpec(rid, _tokens(request), n, plan.tier_index, blocks,
                                          request_salt(self.keyspace.salt, request))

    def take_pending_loads(self) -> list[LoadSpec]:
        """Drain the recorded loads (the vLLM wrapper ships them to the workers)."""
        with self._lock:
            loads = list(self._pending.values())
            self._pending.clear()
        return loads

    def on_request_running(self, request) -> bool:
        """RUNNING admission: the request prefills (or decodes) now; drop its marker."""
        return self.markers.clear_on_running(_request_id(request))

    def request_finished(self, request, block_ids=None) -> tuple[bool, dict | None]:
        """Teardown (finished or aborted): drop the marker and every per-request state. The
        blocks can be freed at once (no asynchronous save)."""
        rid = _request_id(request)
        self.markers.clear_on_teardown(rid)
        with self._lock:
            self._plans.pop(rid, None)
            self._pending.pop(rid, None)
            self._outcomes.pop(rid, None)
        return False, None

    request_finished_all_groups = request_finished  # SupportsHMA: block_ids is one list per group

    # -- worker side -------------------------------------------------------------------------
    def start_load(self, loads: Iterable[LoadSpec] | None = None) -> list[RetrieveOutcome]:
        """Run the given loads (default: every load recorded by update_state_after_alloc), in
        order, synchronously. Every TP rank must run the same loads in the same order.

        Each load completes or fails closed on its own: a load that raises (a bad block id, a
        bad spec, a bug) is reported like any failed load (failed_recving, every block of every
        group invalid, force-local marker) and the rest of the batch still runs."""
        if self.kv is None:  # before draining: the recorded loads stay pending
            raise RuntimeError("start_load before register_kv_caches: no destination tensors")
        if loads is None:
            loads = self.take_pending_loads()
        return [self._load(spec) for spec in loads]

    def _load(self, spec: LoadSpec) -> RetrieveOutcome:
        try:
            tables = [torch.tensor(b, dtype=torch.int64) for b in spec.block_ids]
            keyspace = self.keyspace if spec.salt is None else dataclasses.replace(self.keyspace, salt=spec.salt)
            req = RestoreRequest(spec.request_id, spec.tokens, keyspace, self.kv, tables)
            local = self.retriever.restore_local(req, spec.num_chunks, spec.plan_tier)
        except Exception as e:  # noqa: BLE001 - this load fails closed; the batch goes on
            local = self._failed_local(spec, e)
        # every rank takes part in the commit agreement, also after a local exception, so the
        # peers fail this request closed at once and the collectives stay aligned
        outcome = self.retriever.commit_local(local, commit.make_tag(spec.request_id, "commit"))
        self.stats.loads += 1
        with self._lock:
            self._outcomes[spec.request_id] = outcome
            self._finished_recving.add(spec.request_id)
            if outcome.committed:
                self.stats.committed += 1
                self.stats.served_by[outcome.served_by] = self.stats.served_by.get(outcome.served_by, 0) + 1
                plan_name = self.tiers[spec.plan_tier].name if spec.plan_tier is not None else None
                if outcome.served_by != plan_name:
                    self.stats.served_by_fallback += 1
            else:
                self.stats.failed += 1
                self._failed_recving.add(spec.request_id)
                for ids in outcome.invalid_block_ids:
                    self._load_errors.update(ids)
        if not outcome.committed:
            self.markers.set(spec.request_id, outcome.error or "external restore failed")
        return outcome

    def _failed_local(self, spec: LoadSpec, error: BaseException) -> LocalResult:
        """The local result of a load that raised: every group invalid, every block reported."""
        reg = self.reg
        try:
            blocks = request_block_ids(reg, spec.block_ids, check_int("num_chunks", spec.num_chunks, lo=0))
        except Exception:  # noqa: BLE001 - the spec itself is bad: report every block it names
            blocks = _all_block_ids(spec.block_ids, reg.num_groups)
        num_chunks = spec.num_chunks if isinstance(spec.num_chunks, int) else 0
        return LocalResult(spec.request_id, num_chunks, reg.chunk_tokens, [False] * reg.num_groups, LOCAL,
                           blocks, error=f"load failed: {type(error).__name__}: {error}")

    def get_finished(self, finished_req_ids: set[str] | None = None) -> FinishedIds:
        """Requests whose load finished since the last call (committed or failed closed);
        `failed_recving` names the failed ones. Nothing is ever sent asynchronously."""
        with self._lock:
            recving, failed = self._finished_recving, self._failed_recving
            self._finished_recving, self._failed_recving = set(), set()
        return FinishedIds(set(), recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids (all groups) of failed loads since the last call. Per-group sets are in
        outcome(request_id).invalid_block_ids."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def outcome(self, request_id: str) -> RetrieveOutcome | None:
        with self._lock:
            return self._outcomes.get(request_id)


def _all_block_ids(block_ids, num_groups: int) -> tuple[frozenset[int], ...]:
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
