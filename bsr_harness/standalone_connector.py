"""A scheduler-facing KV connector with vLLM's method names and semantics, without vLLM: the harness's
(fault matrix, fault scenarios, TP workers, tests) way to drive the runtime's planner and retriever
through an engine's request lifecycle. Production engines use their integration (the vLLM connector,
bsr_runtime.integrations.vllm: planner.Planner on the scheduler side, loader.Loader on the workers).

One `StandaloneConnector` per TP rank (scheduler and worker roles in one object; the optional
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

The scheduler part is `planner.Planner`, the worker part `Retriever` on the calling thread; an
engine that loads in the background uses `loader.Loader` instead (the vLLM connector does).

Limitations: loads are synchronous (load_async is always False); a restore always covers
chunks 0..N-1, so `num_computed_tokens` (a local prefix-cache hit) only reduces the tokens
reported, not the bytes moved; saving (the store path) is not wired here (see store.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration
from bsr_runtime import commit
from bsr_runtime.keys import request_salt
from bsr_runtime.loader import failed_record
from bsr_runtime.markers import ForceLocalMarkers
from bsr_runtime.plan import LoadSpec
from bsr_runtime.planner import Planner, block_lists, request_id_of, tokens_of
from bsr_runtime.restore import RestoreConfig, RestoreRequest
from bsr_runtime.retrieve import AgreeFn, LoadRecord, Retriever
from bsr_runtime.tiers.base import Tier

__all__ = ["StandaloneConnector", "ConnectorRequest", "ConnectorStats", "FinishedIds", "LoadSpec", "request_salt"]


@dataclass
class ConnectorRequest:
    """The two fields of vllm.v1.request.Request the connector reads."""

    request_id: str
    prompt_token_ids: list[int]


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


@dataclass
class ConnectorStats:
    probes: int = 0  # lookups against the tiers (get_num_new_matched_tokens)
    skipped_by_marker: int = 0  # lookups not made because a force-local marker was set
    loads: int = 0
    committed: int = 0
    failed: int = 0
    served_by_fallback: int = 0  # committed from another tier than the plan tier
    served_by: dict[str, int] = field(default_factory=dict)


class StandaloneConnector:
    """See the module docstring. `kv_caches`: the registered destination tensors of this rank
    (in registration order); may also be given later with register_kv_caches()."""

    def __init__(self, reg: Registration, tiers: Sequence[Tier], kv_caches: Sequence[torch.Tensor] | None = None,
                 *, config: RestoreConfig | None = None, tp_rank: int = 0, tp_world: int = 1, salt: str = "",
                 model: str = "", markers: ForceLocalMarkers | None = None, agree: AgreeFn | None = None,
                 agree_timeout_s: float = commit.DEFAULT_TIMEOUT_S, agree_plan: bool | None = None,
                 probe_all_ranks: bool = False, unavailable_cooldown_s: float = 30.0) -> None:
        self.reg = reg
        self.tp_rank, self.tp_world = tp_rank, tp_world
        self.retriever = Retriever(reg, tiers, config, agree=agree, agree_timeout_s=agree_timeout_s,
                                   unavailable_cooldown_s=unavailable_cooldown_s)
        # per-rank mode with TP: the ranks agree on N (MIN all-reduce); a single scheduler
        # process instead probes every rank's keys itself (probe_all_ranks)
        agree_plan = (tp_world > 1 and not probe_all_ranks) if agree_plan is None else agree_plan
        self.planner = Planner(reg, self.retriever.tier_set, tp_rank=tp_rank, tp_world=tp_world, salt=salt,
                               model=model, markers=markers, probe_all_ranks=probe_all_ranks, agree_plan=agree_plan,
                               agree_timeout_s=agree_timeout_s)
        self.keyspace = self.planner.keyspace
        self.markers = self.planner.markers
        self.agree_timeout_s = agree_timeout_s
        self.kv: list[torch.Tensor] | None = list(kv_caches) if kv_caches is not None else None
        self._stats = ConnectorStats()
        self._lock = threading.Lock()
        self._outcomes: dict[str, LoadRecord] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()

    @property
    def tiers(self) -> list[Tier]:
        return self.retriever.tiers

    @property
    def stats(self) -> ConnectorStats:
        self._stats.probes = self.planner.stats.probes
        self._stats.skipped_by_marker = self.planner.stats.skipped_by_marker
        return self._stats

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) != self.reg.num_tensors:
            raise ValueError(f"{len(kv_caches)} kv caches for {self.reg.num_tensors} registered tensors")
        self.kv = list(kv_caches)

    def close(self) -> None:
        """Release the staging pool and tier registrations (the tiers stay open: the caller owns them)."""
        self.retriever.close()

    shutdown = close

    def __enter__(self) -> StandaloneConnector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.planner.match(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, block_ids_per_group, num_external_tokens: int) -> None:
        self.planner.allocated(request, block_ids_per_group, num_external_tokens)

    def take_pending_loads(self) -> list[LoadSpec]:
        """Drain the recorded loads (the vLLM wrapper ships them to the workers)."""
        return self.planner.take_loads()

    def on_request_running(self, request) -> bool:
        """RUNNING admission: the request prefills (or decodes) now; drop its marker."""
        return self.planner.running(request_id_of(request))

    def request_finished(self, request, block_ids=None) -> tuple[bool, dict | None]:
        """Teardown (finished or aborted): drop the marker and every per-request state. The
        blocks can be freed at once (no asynchronous save)."""
        rid = request_id_of(request)
        self.planner.finished(rid)
        with self._lock:
            self._outcomes.pop(rid, None)
        return False, None

    request_finished_all_groups = request_finished  # SupportsHMA: block_ids is one list per group

    # -- worker side -------------------------------------------------------------------------
    def start_load(self, loads: Iterable[LoadSpec] | None = None) -> list[LoadRecord]:
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

    def _load(self, spec: LoadSpec) -> LoadRecord:
        try:
            tables = [torch.tensor(b, dtype=torch.int64) for b in spec.block_ids]
            keyspace = self.keyspace if spec.salt is None else _with_salt(self.keyspace, spec.salt)
            req = RestoreRequest(spec.request_id, spec.tokens, keyspace, self.kv, tables)
            local = self.retriever.restore_local(req, spec.num_chunks, spec.plan_tier)
        except Exception as e:  # noqa: BLE001 - this load fails closed; the batch goes on
            local = failed_record(self.reg, spec, e)
        # every rank takes part in the commit agreement, also after a local exception, so the
        # peers fail this request closed at once and the collectives stay aligned
        outcome = self.retriever.commit_local(local, commit.make_tag(spec.request_id, "commit"))
        stats = self._stats
        stats.loads += 1
        with self._lock:
            self._outcomes[spec.request_id] = outcome
            self._finished_recving.add(spec.request_id)
            if outcome.committed:
                stats.committed += 1
                stats.served_by[outcome.served_by] = stats.served_by.get(outcome.served_by, 0) + 1
                plan_name = self.tiers[spec.plan_tier].name if spec.plan_tier is not None else None
                if outcome.served_by != plan_name:
                    stats.served_by_fallback += 1
            else:
                stats.failed += 1
                self._failed_recving.add(spec.request_id)
                for ids in outcome.invalid_block_ids:
                    self._load_errors.update(ids)
        if not outcome.committed:
            self.planner.load_failed(spec.request_id, outcome.error or "external restore failed")
        return outcome

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

    def outcome(self, request_id: str) -> LoadRecord | None:
        with self._lock:
            return self._outcomes.get(request_id)


def _with_salt(space, salt: str):
    import dataclasses

    return dataclasses.replace(space, salt=salt)


# kept importable under their earlier names
_block_lists = block_lists
_request_id = request_id_of
_tokens = tokens_of
