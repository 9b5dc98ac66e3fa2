"""Experiments shared by the benchmarks and the `bsr` command: the E1 sweep.

A source state for the longest prefix is written once to a tier; then prefixes of several
lengths are restored with the bounded path (W > 0) and the whole-plan baseline (W = 0) into
fresh destination blocks, and each row records peak staging, seconds and whether the
restored state hashes equal to what was stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from bsr_harness.testdata import poison, request_tables
from bsr_kernels import Registration
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.probe import probe_prefix
from bsr_runtime.restore import RESTORE_PHASES, BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.store import store_prefix
from bsr_runtime.tiers.base import Tier


@dataclass
class SourceState:
    """A request's prefix held in (source) destination blocks, plus its keys."""

    reg: Registration
    tokens: list[int]
    keyspace: KeySpace
    kv: list[torch.Tensor]
    block_tables: list[torch.Tensor]

    @property
    def num_chunks(self) -> int:
        return len(self.tokens) // self.reg.chunk_tokens


def make_source(reg: Registration, num_chunks: int, seed: int = 0, salt: str = "") -> SourceState:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100_000, (num_chunks * reg.chunk_tokens,), generator=gen).tolist()
    blocks, tables = request_tables(reg, num_chunks, gen, spare=0, holes="window")
    kv = reg.allocate(blocks)
    for t in kv:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
    return SourceState(reg, tokens, KeySpace(reg.fingerprint, salt=salt), kv, tables)


def store_source(src: SourceState, tier: Tier, window_chunks: int = 32, progress=None) -> str:
    rep = store_prefix(src.reg, tier, src.keyspace, src.tokens, src.kv, src.block_tables,
                       window_chunks=window_chunks, progress=progress)
    return rep.state_hash


@dataclass
class SweepRow:
    tier: str
    tokens: int
    chunks: int
    window_chunks: int
    pipeline_depth: int
    windows: int
    chunk_bytes: int
    staging_capacity_bytes: int
    peak_staging_bytes: int
    bytes_moved: int
    seconds: float
    gbps: float
    fetch_s: float
    install_s: float
    sync_s: float
    committed_tokens: int
    probed_tokens: int
    state_hash_ok: bool
    ok: bool
    error: str | None = None
    prepare_s: float = 0.0  # the restore's phases beside fetch / install / sync (restore.RESTORE_PHASES)
    admit_s: float = 0.0
    submit_s: float = 0.0
    tier_floor_s: float | None = None  # the tier's own reads of the same objects at this W (tier_floor.py)

    def to_dict(self) -> dict:
        return asdict(self)


class Destinations:
    """Destination blocks for the longest prefix, reused (re-poisoned) by every row."""

    def __init__(self, reg: Registration, num_chunks: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.reg = reg
        self.blocks, self.tables = request_tables(reg, num_chunks, gen, spare=0, holes="window")
        self.kv = reg.allocate(self.blocks)

    def poison(self) -> None:
        poison(self.kv)


def source_hashes(src: SourceState, chunk_counts: Sequence[int]) -> dict[int, str]:
    return {n: state_hash(src.reg, src.kv, src.block_tables, n) for n in sorted(set(chunk_counts))}


def pipeline_depth(tier: Tier, depth: int | None, window_bytes: int) -> int:
    """`depth` as given, else the tier's preferred one for windows of `window_bytes`."""
    return tier.preferred_pipeline_depth(window_bytes) if depth is None else depth


class TierTarget:
    """What a sweep restores from: a BSR tier (LMCache's too), restored by one BoundedRestorer per W."""

    def __init__(self, tier: Tier, reg: Registration, windows: Sequence[int], *, depth: int | None = None,
                 fetch_timeout_s: float = 120.0, backend: str = "auto", name: str | None = None,
                 whole_plan_chunks: int | None = None) -> None:
        """`depth` None: the tier's preferred pipeline depth at each W; `name` the rows' tier (default the tier's name).
        `whole_plan_chunks`: the largest prefix W = 0 restores; its staging is allocated for that once,
        before any restore (the whole plan at its best, as a system that sized its cache up front)."""
        self.tier = tier
        self.name = name or tier.name
        whole = None if whole_plan_chunks is None else whole_plan_chunks * reg.chunk_bytes
        self.restorers = {w: BoundedRestorer(reg, RestoreConfig(window_chunks=w,
                                                                pipeline_depth=pipeline_depth(tier, depth,
                                                                                              w * reg.chunk_bytes),
                                                                fetch_timeout_s=fetch_timeout_s, backend=backend,
                                                                max_staging_bytes=whole if w == 0 else None))
                          for w in windows}

    def probe_chunks(self, src: SourceState, n: int) -> int:
        return probe_prefix(self.tier, PrefixKeys(src.keyspace, src.tokens[: n * src.reg.chunk_tokens],
                                                  src.reg.chunk_tokens)).prefix_chunks

    def restore(self, w: int, req: RestoreRequest, n: int):
        return self.restorers[w].restore(req, self.tier, n)

    def capacity(self, w: int, n: int, chunk_bytes: int) -> int:
        return self.restorers[w].staging_capacity_bytes or n * chunk_bytes

    def close(self) -> None:
        for r in self.restorers.values():
            r.close()


def sweep(src: SourceState, target: Tier | TierTarget, token_counts: Sequence[int],
          windows: Sequence[int], *, depth: int | None = None, fetch_timeout_s: float = 120.0, backend: str = "auto",
          expected: dict[int, str] | None = None, dst: Destinations | None = None, repeat: int = 1,
          on_row: Callable[[SweepRow], None] | None = None) -> list[SweepRow]:
    """One row per (tokens, W), the median of `repeat` runs (a length's runs at every W interleaved).
    `expected` maps chunk counts to source state hashes; a row's state_hash_ok holds only if every run
    restored them."""
    reg = src.reg
    chunk_counts = [t // reg.chunk_tokens for t in token_counts]
    if max(chunk_counts) > src.num_chunks:
        raise ValueError(f"sweep asks for {max(chunk_counts)} chunks, the source holds {src.num_chunks}")
    expected = expected or source_hashes(src, chunk_counts)
    dst = dst or Destinations(reg, src.num_chunks, seed=1)
    if isinstance(target, Tier):
        target = TierTarget(target, reg, windows, depth=depth, fetch_timeout_s=fetch_timeout_s, backend=backend,
                            whole_plan_chunks=max(chunk_counts))
    rows = []
    try:
        for tokens, n in zip(token_counts, chunk_counts):
            probed = target.probe_chunks(src, n)
            reports: dict[int, list] = {w: [] for w in windows}
            for r in range(repeat):  # the W's runs interleaved: drift on a shared machine hits every W alike
                for w in windows:
                    dst.poison()
                    req = RestoreRequest(f"sweep-{tokens}-{w}-{r}", src.tokens, src.keyspace, dst.kv, dst.tables)
                    rep = target.restore(w, req, min(n, probed))
                    rep.ok = rep.ok and state_hash(reg, dst.kv, dst.tables, n) == expected[n]
                    reports[w].append(rep)
            for w in windows:
                row = _sweep_row(target.name, reg, tokens, n, w, probed, reports[w],
                                 target.capacity(w, n, reg.chunk_bytes))
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    finally:
        target.close()
    return rows


def _sweep_row(tier: str, reg: Registration, tokens: int, n: int, w: int, probed: int, reports: list,
               capacity: int) -> SweepRow:
    """The row of one (tokens, W): the median run's figures; state_hash_ok only if every run restored the state."""
    rep = sorted(reports, key=lambda r: r.total_s)[len(reports) // 2]
    return SweepRow(
        tier=tier, tokens=tokens, chunks=n, window_chunks=w, pipeline_depth=rep.pipeline_depth,
        windows=rep.windows, chunk_bytes=reg.chunk_bytes, staging_capacity_bytes=capacity,
        peak_staging_bytes=rep.peak_staging_bytes, bytes_moved=rep.bytes_moved,
        seconds=rep.total_s, gbps=rep.bytes_moved / rep.total_s / 1e9 if rep.total_s else 0.0,
        committed_tokens=rep.committed_tokens, probed_tokens=probed * reg.chunk_tokens,
        state_hash_ok=all(r.ok for r in reports), ok=all(r.committed_tokens == n * reg.chunk_tokens for r in reports),
        error=rep.error, **{f"{phase}_s": getattr(rep, f"{phase}_s") for phase in RESTORE_PHASES},
    )


def ladder(src: SourceState, tier: Tier, tokens: int, window: int, *, first_rung: int = 1 << 20,
           depth: int | None = None, dst: Destinations | None = None, max_rungs: int = 40) -> dict:
    """Whole-plan capacity ladder for one prefix: W = 0 with staging capacity raised through
    doubling rungs until the full prefix restores (state hash equal), beside BSR at `window`
    with capacity W*c."""
    reg = src.reg
    n = tokens // reg.chunk_tokens
    if not 0 < n <= src.num_chunks:
        raise ValueError(f"ladder prefix of {tokens} tokens: need 1..{src.num_chunks} chunks")
    dst = dst or Destinations(reg, src.num_chunks, seed=1)
    expected = state_hash(reg, src.kv, src.block_tables, n)

    def attempt(w: int, capacity: int):
        dst.poison()
        cfg = RestoreConfig(window_chunks=w, pipeline_depth=pipeline_depth(tier, depth, w * reg.chunk_bytes),
                            max_staging_bytes=capacity)
        with BoundedRestorer(reg, cfg) as restorer:
            req = RestoreRequest(f"ladder-{tokens}-{w}-{capacity}", src.tokens, src.keyspace, dst.kv, dst.tables)
            rep = restorer.restore(req, tier, n)
        ok = rep.ok and state_hash(reg, dst.kv, dst.tables, n) == expected
        return ok, rep

    rung, tried = first_rung, 0
    while True:
        tried += 1
        ok, _ = attempt(0, rung)
        if ok or tried >= max_rungs:
            break
        rung *= 2
    bsr_capacity = window * reg.chunk_bytes
    bsr_ok, bsr_rep = attempt(window, bsr_capacity)
    return {
        "tier": tier.name, "tokens": tokens, "chunks": n, "chunk_bytes": reg.chunk_bytes,
        "whole_plan_bytes": n * reg.chunk_bytes, "first_passing_rung_bytes": rung if ok else None,
        "rungs_tried": tried, "bsr_window_chunks": window, "bsr_capacity_bytes": bsr_capacity,
        "bsr_peak_staging_bytes": bsr_rep.peak_staging_bytes,
        "bsr_pass": bool(bsr_ok and bsr_rep.peak_staging_bytes <= bsr_capacity),
    }
