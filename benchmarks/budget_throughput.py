"""Throughput of concurrent restores under a global byte budget: B = W*c vs B = 4*W*c.

The workload of tests/unit/test_concurrent_budget.py, healthy requests only: `--requests` requests
(threads) of random length (1..`--max-chunks` chunks, seeded), each with its own BoundedRestorer
at W chunks and pipeline depth `--depth`, all leasing their staging from ONE StagingArena of B bytes,
restoring from a filesystem tier (page cache warm). B = W*c admits one full window at a time, which is
what the serial lock gives (each restorer with its own W chunks, one restore at a time); B = 4*W*c lets up
to four windows be in flight. The serial lock is measured as a third row for reference. Each configuration
runs `--rounds` rounds (all requests at once per round) after one warm-up round; requests/s and GB/s are
over all rounds.
Every restore's state hash is checked. Appends a record to benchmarks/results/budget_throughput.jsonl.

    .venv/bin/python benchmarks/budget_throughput.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time

import torch

from bsr_cli.args import add_window_chunks
from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.records import add_record_options, record_script
from bsr_kernels import presets
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier
from bsr_runtime.tiers.base import FETCH_HEADROOM


def build(reg, tier, args):
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        n = rng.randint(1, args.max_chunks)
        src = make_source(reg, n, seed=args.seed * 1000 + i)
        expected = store_source(src, tier, window_chunks=4)
        dst = Destinations(reg, n, seed=args.seed * 1000 + i + 500)
        jobs.append(dict(n=n, src=src, expected=expected, dst=dst))
    return jobs


def run_round(reg, tier, jobs, staging: dict, args) -> tuple[float, int]:
    """One round; `staging`: the restorers' keyword (a shared `arena`, or a `serial` lock over their own)."""
    restorers = [BoundedRestorer(reg, RestoreConfig(window_chunks=args.window, pipeline_depth=args.depth),
                                 **staging) for _ in jobs]
    for j in jobs:
        j["dst"].poison()
    reports: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs) + 1)

    def work(k: int) -> None:
        j = jobs[k]
        barrier.wait()
        req = RestoreRequest(f"bench-{k}", j["src"].tokens, j["src"].keyspace, j["dst"].kv, j["dst"].tables)
        reports[k] = restorers[k].restore(req, tier, j["n"])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    moved = 0
    for j, rep in zip(jobs, reports):
        if not (rep is not None and rep.ok and state_hash(reg, j["dst"].kv, j["dst"].tables, j["n"]) == j["expected"]):
            raise SystemExit(f"restore failed or state hash differs: {rep}")
        moved += rep.bytes_moved
    for r in restorers:
        r.close()
    return elapsed, moved


def measure(reg, tier, jobs, make_staging, args) -> dict:
    total_s, total_b, peak = 0.0, 0, 0
    for r in range(args.rounds + 1):  # a warm-up round first
        staging = make_staging()
        arena = staging.get("arena")
        if arena is not None:  # a shared arena is its owner's to register
            tier.register_staging(arena.buffer)
        s, b = run_round(reg, tier, jobs, staging, args)
        if arena is not None:
            tier.unregister_staging(arena.buffer)
            peak = max(peak, arena.peak_bytes)
        if r:
            total_s += s
            total_b += b
    n = len(jobs) * args.rounds
    return dict(rps=n / total_s, gbps=total_b / total_s / 1e9, seconds=total_s, peak=peak)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-chunks", type=int, default=12)
    add_window_chunks(ap, default=4, help="W (chunks) of each restore")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load-concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the output (and the command) to this file")
    add_record_options(ap)
    args = ap.parse_args(argv)

    reg = presets.dsv4_flash(scale=1 / 64)
    c = reg.chunk_bytes
    lines = []

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    emit(f"$ {' '.join([os.path.relpath(sys.executable)] + sys.argv)}")
    emit(f"dsv4_flash(scale=1/64): c = {c:,} B; {args.requests} concurrent requests of 1..{args.max_chunks} chunks "
         f"(seed {args.seed}); W = {args.window}, depth {args.depth}; filesystem tier, load_concurrency "
         f"{args.load_concurrency}, page cache warm; {args.rounds} rounds after a warm-up; "
         f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bsr-budget-bench-") as root:
        tier = FilesystemTier(root, c, reg.fingerprint, load_concurrency=args.load_concurrency)
        try:
            jobs = build(reg, tier, args)
            emit(f"workload: {sum(j['n'] for j in jobs)} chunks per round "
                 f"({sum(j['n'] for j in jobs) * c / 1e6:.1f} MB)")
            w_c = args.window * c
            configs = [  # (label, budget B, the restorers' staging)
                ("serial lock", None, lambda: {"serial": threading.Lock()}),
                ("B = W*c", w_c, lambda: {"arena": StagingArena(c, args.window, headroom=FETCH_HEADROOM)}),
                ("B = 4*W*c", 4 * w_c, lambda: {"arena": StagingArena(c, 4 * args.window, headroom=FETCH_HEADROOM)}),
            ]
            results, rows = {}, []
            emit(f"{'admission':<28}{'req/s':>10}{'GB/s':>10}{'seconds':>10}{'peak reserved B':>18}")
            for name, budget, make in configs:
                r = measure(reg, tier, jobs, make, args)
                results[name] = r
                peak = f"{r['peak']:,}" if r["peak"] else "-"
                label = name if budget is None else f"{name} = {budget:,} B"
                emit(f"{label:<28}{r['rps']:>10.1f}{r['gbps']:>10.3f}{r['seconds']:>10.3f}{peak:>18}")
                rows.append({"admission": name, "budget_bytes": budget, "requests_per_s": round(r["rps"], 1),
                             "GBps": round(r["gbps"], 3), "seconds": round(r["seconds"], 3),
                             "peak_reserved_bytes": r["peak"] or None})
            base, wide = results["B = W*c"], results["B = 4*W*c"]
            emit(f"ratio (B = 4*W*c) / (B = W*c): {wide['rps'] / base['rps']:.2f}x req/s, "
                 f"{wide['gbps'] / base['gbps']:.2f}x GB/s")
            record_script(args, "budget_throughput", {
                "chunk_bytes": c, "chunks_per_round": sum(j["n"] for j in jobs), "rows": rows,
                "wide_vs_narrow_requests_per_s": round(wide["rps"] / base["rps"], 2)}, omit=("out",))
        finally:
            tier.close()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
