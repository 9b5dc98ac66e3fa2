"""The fail-closed retrieve of one request on one TP rank, over ordered tiers.

    plan:     probe the tiers in order (probe-only: nothing resident, nothing held);
              the plan is the longest complete prefix N, on the first tier that has it
    restore:  BoundedRestorer from the plan tier, window by window, into the request's blocks
    on any failure (missing key, timeout, checksum, store error, install exception, in any
    window): the attempt fails closed — every destination block of the request in every
    group is invalid (also the ones earlier windows already filled), zero external tokens,
    staging released and slot events drained (BoundedRestorer.restore) — then
    fallback: probe the other tiers in order; the first that holds the SAME complete prefix
              (all N chunks) restores it into the same blocks (overwriting the partial state);
              if none does, the outcome is local recompute ("local")
    commit:   q[r][g] is reduced over the TP ranks (commit.agree, MIN all-reduce with a
              timeout); the prefix is committed only if every rank and group is valid,
              otherwise nothing is committed on any rank and every rank reports every block
              of the request invalid (HMA collapse: no per-group boundary)

A tier that raised TierUnavailableError is skipped (probe and restore) for
`unavailable_cooldown_s`, so a dead store costs one failure, not one per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration

from . import commit
from .causes import FailureCause, cause_of
from .keys import KeySpace, PrefixKeys
from .plan import LoadSpec
from .probe import probe_prefix
from .restore import RESTORE_PHASES, BoundedRestorer, RestoreConfig, RestoreReport, RestoreRequest
from .tiers.base import Tier, TierError
from .validation import check_duration, check_int, check_timeout

LOCAL = "local"  # served_by when no tier served the prefix: the engine prefills it locally
NO_TIER = "none"


def request_block_ids(reg: Registration, block_tables: Sequence[torch.Tensor | Sequence[int]],
                      num_chunks: int) -> tuple[frozenset[int], ...]:
    """Per group, the destination block ids covering chunks 0..num_chunks-1 (-1 = not
    resident, skipped): the blocks a restore of that prefix writes, all of which a failed
    restore reports invalid."""
    if len(block_tables) != reg.num_groups:
        raise ValueError(f"{len(block_tables)} block tables for {reg.num_groups} groups")
    out = []
    for g, table in enumerate(block_tables):
        need = reg.blocks_needed(g, num_chunks * reg.chunk_tokens)
        ids = table[:need].tolist() if isinstance(table, torch.Tensor) else list(table)[:need]
        out.append(frozenset(int(b) for b in ids if int(b) >= 0))
    return tuple(out)


@dataclass
class ProbeDecision:
    """The probe decision: N chunks on tier `tier_index` (None: no tier holds chunk 0). A prefix may
    end inside its last chunk (`num_tokens`), and that chunk may be the prompt's partial chunk (the
    `partial_tokens` tokens past its last whole chunk: PrefixKeys' partial chunk)."""

    num_chunks: int
    tier_index: int | None
    tier: str
    probes: list[tuple[str, int | str]] = field(default_factory=list)  # (tier, prefix chunks | error)
    num_tokens: int | None = None  # the prefix's tokens (None: num_chunks whole chunks)
    partial_tokens: int = 0


def _from_report(name: str, default: float | int | None = 0):
    """An Attempt's figure read from its restore report (`default` when the tier was not restored from)."""
    return property(lambda self: default if self.report is None else getattr(self.report, name),
                    doc=f"RestoreReport.{name} of the attempt's restore ({default!r} without one)")


@dataclass
class Attempt:
    """One tier tried for the prefix: probed (fallback tiers), restored or skipped. A restore's own
    figures are its RestoreReport's (`report`), read through, never copied."""

    tier: str
    ok: bool
    probed_chunks: int | None = None  # None: not probed here (the plan tier was probed by the scheduler)
    error: str | None = None
    cause: FailureCause | None = None  # why it failed (None: it did not)
    seconds: float = 0.0
    report: RestoreReport | None = None  # the restore's record, when the tier was restored from

    windows = _from_report("windows")
    windows_installed = _from_report("windows_installed")
    failed_window = _from_report("failed_window", None)
    peak_staging_bytes = _from_report("peak_staging_bytes")
    prepare_s = _from_report("prepare_s", 0.0)
    admit_s = _from_report("admit_s", 0.0)
    submit_s = _from_report("submit_s", 0.0)
    fetch_s = _from_report("fetch_s", 0.0)
    install_s = _from_report("install_s", 0.0)
    sync_s = _from_report("sync_s", 0.0)

    _FIGURES = ("windows", "windows_installed", "failed_window", "peak_staging_bytes",
                *(f"{phase}_s" for phase in RESTORE_PHASES))

    @classmethod
    def from_report(cls, rep: RestoreReport, probed: int | None, seconds: float) -> Attempt:
        return cls(rep.tier, rep.ok, probed, rep.error, rep.cause, seconds, rep)

    def to_dict(self) -> dict:
        """Flat: what was tried and its restore's figures (the report itself is RestoreReport.to_dict)."""
        out = {"tier": self.tier, "ok": self.ok, "probed_chunks": self.probed_chunks, "error": self.error,
               "cause": self.cause, "seconds": self.seconds}
        return out | {name: getattr(self, name) for name in self._FIGURES}


@dataclass
class LoadRecord:
    """The one record of one request's load on one rank, filled as the load goes: this rank's restore
    (q[r][.], each tier tried with its restore's RestoreReport), then the commit decision over every rank
    (`decide`), then what the loader knows (`spec`, `cancelled`, `timings`). Reports, metrics and tests
    read it; nothing copies it into another record."""

    request_id: str
    num_chunks: int
    chunk_tokens: int
    valid_per_group: list[bool]  # this rank's q[r][.]
    restored_from: str  # the tier whose objects this rank's restore put in the blocks, or LOCAL
    block_ids: tuple[frozenset[int], ...]  # per group, every destination block of the request
    attempts: list[Attempt] = field(default_factory=list)
    error: str | None = None
    cause: FailureCause | None = None  # why it failed here, or (decided) why it was not committed; None: it was
    committed: bool | None = None  # None until the commit decision
    agreed: bool = False  # the commit rule over every rank and group
    spec: LoadSpec | None = None  # the load it ran (loads through the Loader)
    cancelled: bool = False  # asked to stop (request aborted, engine shutting down)
    timings: dict[str, float] = field(default_factory=dict)  # the loader's: probe, queue, phases, agreement

    def fail(self, error: str, cause: FailureCause) -> None:
        """This rank's restore failed: every group invalid here."""
        self.valid_per_group = [False] * len(self.valid_per_group)
        self.error, self.cause = error, cause

    def decide(self, agreed: bool) -> LoadRecord:
        """The commit decision over this rank's restore: all or nothing. Not committed, the cause is this
        rank's own, else the commit rule (another rank or group was invalid)."""
        self.agreed = bool(agreed)
        self.committed = self.agreed and all(self.valid_per_group)
        if self.committed:
            self.cause = None
        elif self.cause is None:
            self.error, self.cause = self.error or "another rank or group was invalid (commit rule)", \
                FailureCause.COMMIT_RULE
        return self

    @property
    def exposed_tokens(self) -> int:
        """External tokens the engine may count as computed (0 unless committed)."""
        return self.num_chunks * self.chunk_tokens if self.committed else 0

    @property
    def served_by(self) -> str:
        """The tier whose objects are in the blocks, or LOCAL when nothing was committed."""
        return self.restored_from if self.committed else LOCAL

    @property
    def invalid_block_ids(self) -> tuple[frozenset[int], ...]:
        """Per group; every block of the request unless committed."""
        return tuple(frozenset() for _ in self.block_ids) if self.committed else self.block_ids

    @property
    def outcome(self) -> str:
        return "committed" if self.committed else "failed_closed"

    @property
    def invalid_blocks(self) -> int:
        return sum(len(s) for s in self.invalid_block_ids)

    @property
    def total_blocks(self) -> int:
        return sum(len(s) for s in self.block_ids)

    @property
    def tiers_tried(self) -> list[str]:
        return [a.tier for a in self.attempts]

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "num_chunks": self.num_chunks, "committed": bool(self.committed),
                "exposed_tokens": self.exposed_tokens, "served_by": self.served_by,
                "invalid_block_ids": [sorted(s) for s in self.invalid_block_ids],
                "block_ids": [sorted(s) for s in self.block_ids], "valid_per_group": list(self.valid_per_group),
                "agreed": self.agreed, "attempts": [a.to_dict() for a in self.attempts], "error": self.error,
                "cause": self.cause, "outcome": self.outcome, "cancelled": self.cancelled, "timings": self.timings}


AgreeFn = Callable[..., bool]  # agree(valid_per_group, *, timeout_s, tag) -> bool


class TierSet:
    """The ordered tiers of one registration with their health, and the probe decision over them.

    A tier that raised TierUnavailableError is skipped (probe and restore) for
    `unavailable_cooldown_s`. Holds no staging: the scheduler side plans with it alone."""

    def __init__(self, reg: Registration, tiers: Sequence[Tier], unavailable_cooldown_s: float = 30.0) -> None:
        if not tiers:
            raise ValueError("a retriever needs at least one tier")
        for t in tiers:
            if t.chunk_bytes != reg.chunk_bytes:
                raise ValueError(f"tier {t.name} holds {t.chunk_bytes:,} B objects, the registration "
                                 f"{reg.chunk_bytes:,} B")
        self.reg = reg
        self.tiers = list(tiers)
        self.unavailable_cooldown_s = check_duration("unavailable_cooldown_s", unavailable_cooldown_s)
        self._down_until: dict[int, float] = {}  # id(tier) -> monotonic time it may be tried again

    def available(self, tier: Tier) -> bool:
        until = self._down_until.get(id(tier))
        return until is None or time.monotonic() >= until

    def mark_unavailable(self, tier: Tier) -> None:
        self._down_until[id(tier)] = time.monotonic() + self.unavailable_cooldown_s

    def note_failure(self, tier: Tier, cause: FailureCause | None) -> None:
        """Tier health from a failure's cause: an unreachable tier is skipped for the cooldown."""
        if cause is FailureCause.UNAVAILABLE:
            self.mark_unavailable(tier)

    def reset_health(self) -> None:
        self._down_until.clear()

    def plan(self, tokens: Sequence[int], keyspace: KeySpace, max_chunks: int | None = None,
             keys: PrefixKeys | None = None) -> ProbeDecision:
        """Probe the tiers in order; the plan is the longest complete prefix, on the first tier
        holding it. Stops at the first tier with every candidate chunk. Never raises on a tier
        failure: a tier that fails its probe counts as a miss. `keys`: the prefix's keys in
        `keyspace` when the caller has them (the first tier's probe walks their chain, so the
        caller's next key after the probed chunks costs one hash)."""
        if keys is None:
            keys = PrefixKeys(keyspace, tokens, self.reg.chunk_tokens)
        if max_chunks is not None:
            check_int("max_chunks", max_chunks)
        cand = keys.num_chunks if max_chunks is None else max(0, min(max_chunks, keys.num_chunks))
        best = ProbeDecision(0, None, NO_TIER)
        if cand == 0:
            return best
        for i, tier in enumerate(self.tiers):
            if not self.available(tier):
                best.probes.append((tier.name, "skipped: unavailable"))
                continue
            try:
                n = probe_prefix(tier, keys, cand).prefix_chunks  # a later tier restarts the chain walk
            except TierError as e:
                self.note_failure(tier, cause_of(e))
                best.probes.append((tier.name, f"{type(e).__name__}: {e}"))
                continue
            best.probes.append((tier.name, n))
            if n > best.num_chunks:
                best.num_chunks, best.tier_index, best.tier = n, i, tier.name
            if n == cand:
                break
        return best


class Retriever:
    """Plans, restores and commits requests of one registration on one rank over ordered tiers.

    Owns a BoundedRestorer (its own staging arena) unless one is given; `close()` releases it.
    `agree` is commit.agree by default (torch.distributed when initialised, else local AND).
    """

    def __init__(self, reg: Registration, tiers: Sequence[Tier] | TierSet, config: RestoreConfig | None = None, *,
                 restorer: BoundedRestorer | None = None, agree: AgreeFn | None = None,
                 agree_timeout_s: float = commit.DEFAULT_TIMEOUT_S, unavailable_cooldown_s: float = 30.0) -> None:
        self.tier_set = tiers if isinstance(tiers, TierSet) else TierSet(reg, tiers, unavailable_cooldown_s)
        self.reg = reg
        self.tiers = self.tier_set.tiers
        self.agree_timeout_s = check_timeout("agree_timeout_s", agree_timeout_s)
        self.unavailable_cooldown_s = self.tier_set.unavailable_cooldown_s
        self._own_restorer = restorer is None
        self.restorer = restorer or BoundedRestorer(reg, config)
        self.agree_fn: AgreeFn = agree or commit.agree

    @property
    def config(self) -> RestoreConfig:
        return self.restorer.config

    def close(self) -> None:
        if self._own_restorer:
            self.restorer.close()

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tier health and the plan (TierSet) -------------------------------------------------
    def tier_available(self, tier: Tier) -> bool:
        return self.tier_set.available(tier)

    def mark_unavailable(self, tier: Tier) -> None:
        self.tier_set.mark_unavailable(tier)

    def reset_tier_health(self) -> None:
        self.tier_set.reset_health()

    def plan(self, tokens: Sequence[int], keyspace: KeySpace, max_chunks: int | None = None) -> ProbeDecision:
        return self.tier_set.plan(tokens, keyspace, max_chunks)

    # -- restore on this rank ----------------------------------------------------------------
    def restore_local(self, req: RestoreRequest, num_chunks: int, plan_tier: int | None = 0) -> LoadRecord:
        """Restore chunks 0..num_chunks-1 of `req` on this rank: the plan tier first (already
        probed by the caller), then every other tier that probes the complete prefix. Does not
        commit: see `commit_local` / `retrieve`."""
        reg = self.reg
        num_chunks = check_int("num_chunks", num_chunks, lo=0)
        if plan_tier is not None:
            plan_tier = check_int("plan_tier", plan_tier, lo=0, hi=len(self.tiers) - 1)
        block_ids = request_block_ids(reg, req.block_tables, num_chunks)
        res = LoadRecord(req.request_id, num_chunks, reg.chunk_tokens, [True] * reg.num_groups, LOCAL, block_ids)
        if num_chunks == 0:
            return res
        order = list(range(len(self.tiers)))
        if plan_tier is not None:
            order.remove(plan_tier)
            order.insert(0, plan_tier)
        failures: list[tuple[str, FailureCause]] = []  # (what failed, its cause), in the order tried
        for pos, i in enumerate(order):
            if req.should_stop is not None and req.should_stop():
                failures.append(("cancelled", FailureCause.CANCELLED))
                break
            tier, raised = self.tiers[i], False
            att, probed = self._before_restore(req, tier, num_chunks, probe=pos > 0 or plan_tier is None)
            if att is None:  # restored here (not in a helper: one frame fewer between a load and its install)
                t0 = time.perf_counter()
                try:
                    rep = self.restorer.restore(req, tier, num_chunks)
                    self.tier_set.note_failure(tier, rep.cause)
                    att = Attempt.from_report(rep, probed, time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - bad destinations or a bug: fail closed, no retry
                    att = Attempt(tier.name, False, probed, error=f"{type(e).__name__}: {e}", cause=cause_of(e),
                                  seconds=time.perf_counter() - t0)
                    raised = True
            res.attempts.append(att)
            if att.ok:
                res.restored_from = att.tier
                return res
            failures.append((f"{att.tier}: {att.error}", att.cause or FailureCause.OTHER))
            if raised:
                break  # the restore raised: bad destinations or a bug, no other tier would do better
        # no tier restored the complete prefix: local recompute, every group invalid here
        if not failures:
            failures.append(("no tier holds the complete prefix", FailureCause.MISSING))
        res.fail("; ".join(text for text, _ in failures), failures[0][1])  # the first tier tried names the cause
        return res

    def _before_restore(self, req: RestoreRequest, tier: Tier, num_chunks: int,
                        probe: bool) -> tuple[Attempt | None, int | None]:
        """A tier about to be tried: (its failed attempt, None) when it is skipped in its cooldown or its probe
        fails (a fallback tier must hold the SAME complete prefix), each with its cause, set where it was
        caught; else (None, the chunks it probed, None when not probed here)."""
        if not self.tier_available(tier):
            return Attempt(tier.name, False, error="skipped: unavailable (cooldown)",
                           cause=FailureCause.UNAVAILABLE), None
        if not probe:
            return None, None
        try:
            probed = probe_prefix(tier, req.prefix_keys(self.reg.chunk_tokens), num_chunks).prefix_chunks
        except TierError as e:
            self.tier_set.note_failure(tier, cause_of(e))
            return Attempt(tier.name, False, error=f"probe: {type(e).__name__}: {e}", cause=cause_of(e)), None
        if probed < num_chunks:
            return Attempt(tier.name, False, probed, error=f"holds {probed}/{num_chunks} chunks",
                           cause=FailureCause.MISSING), None
        return None, probed

    # -- commit ----------------------------------------------------------------------------
    def retrieve(self, req: RestoreRequest, num_chunks: int, plan_tier: int | None = 0, *,
                 tag: int | None = None) -> LoadRecord:
        """restore_local, then the commit rule over every rank (self.agree_fn), then its decision.
        Every rank of the TP group must call it for the same requests in the same order."""
        local = self.restore_local(req, num_chunks, plan_tier)
        return self.commit_local(local, tag)

    def commit_local(self, local: LoadRecord, tag: int | None = None) -> LoadRecord:
        """The commit rule over every rank (self.agree_fn) for one rank's local result, then
        the decision (LoadRecord.decide). A rank whose restore raised takes part with an all-invalid vector."""
        tag = commit.make_tag(local.request_id, "commit") if tag is None else tag
        try:
            agreed = self.agree_fn(local.valid_per_group, timeout_s=self.agree_timeout_s, tag=tag)
        except Exception as e:  # noqa: BLE001 - an agreement that cannot be reached is a no
            local.error = (local.error + "; " if local.error else "") + f"agree: {type(e).__name__}: {e}"
            local.cause = local.cause or FailureCause.AGREEMENT  # this rank's own failure came first
            agreed = False
        return local.decide(agreed)
