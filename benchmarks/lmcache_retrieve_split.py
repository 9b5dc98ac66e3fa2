"""Where a windowed retrieve through LMCache spends its time, against LMCache's whole-plan prefetch.

    python benchmarks/lmcache_retrieve_split.py [--chunks 2047] [--window 32] [--rounds 5]

One LMCacheAdapter over LMCache's StorageManager with the BSR filesystem L2 plugin (as
`bsr sweep --tier lmcache-fs`: dsv4-flash@1/64, L1 large enough for the whole plan); the prefix is
stored once, then retrieved at W and at W = 0 (whole plan) alternately. Per retrieve, wall-clock
milliseconds of: the StorageManager calls the retrieve makes (summed over its windows), the window
stages' construction (building the window's keys and submitting its prefetch), and the loop's own
fetch / install / sync split from the report. Medians over the rounds; the last column is what
the windows cost above the whole plan. Appends a record to benchmarks/results/lmcache_retrieve_split.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bsr_harness.experiments import Destinations, make_source  # noqa: E402
from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_harness.tier_setup import TierOptions, open_lmcache  # noqa: E402
from bsr_kernels import presets  # noqa: E402
from bsr_runtime.integrations.lmcache import retrieve as lmcache_retrieve  # noqa: E402
from bsr_runtime.restore import RestoreRequest  # noqa: E402

SM_CALLS = ("submit_prefetch_task", "wait_prefetch_status", "query_prefetch_status", "read_prefetched_results",
            "finish_read_prefetched", "delete_l1_keys")


def timed(spent: dict[str, float], name: str, fn):
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=2047)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    add_record_options(ap)
    args = ap.parse_args()
    reg = presets.dsv4_flash(scale=1 / 64)
    n = args.chunks
    src = make_source(reg, n)
    spent: dict[str, float] = defaultdict(float)
    stage_cls = lmcache_retrieve.L1RestoreStage
    with open_lmcache(TierOptions(name="lmcache-fs"), reg, l1_bytes=(n + 2) * (reg.chunk_bytes + 4096)) as ad:
        for name in SM_CALLS:
            setattr(ad.sm, name, timed(spent, name, getattr(ad.sm, name)))
        stage_init = stage_cls.__init__
        stage_cls.__init__ = timed(spent, "stage construction", stage_init)
        try:
            ad.store(src.keyspace, src.tokens, src.kv, src.block_tables)
            dst = Destinations(reg, n, seed=1)
            rows: dict[int, list[dict[str, float]]] = {args.window: [], 0: []}
            for r in range(args.rounds + 1):
                for w in ((args.window, 0) if r % 2 else (0, args.window)):
                    spent.clear()
                    rep = ad.retrieve(RestoreRequest("split", src.tokens, src.keyspace, dst.kv, dst.tables), n,
                                      window_chunks=w)
                    if not rep.ok:
                        sys.exit(f"retrieve failed: {rep.error}")
                    if r:  # the first round warms up
                        rows[w].append({"total": rep.total_s, "fetch (loop)": rep.fetch_s,
                                        "install (loop)": rep.install_s, "sync (loop)": rep.sync_s, **spent})
        finally:
            stage_cls.__init__ = stage_init
    keys = list(rows[args.window][0])
    med = {w: {k: statistics.median(row.get(k, 0.0) for row in rs) * 1e3 for k in keys} for w, rs in rows.items()}
    windows = -(-n // args.window)
    print(f"{reg.name}, {n} chunks, W={args.window} ({windows} windows) against W=0; medians of {args.rounds} "
          f"rounds, ms")
    print(f"{'':28} {'W=' + str(args.window):>10} {'W=0':>10} {'difference':>11} {'per window':>11}")
    rows = []
    for k in keys:
        a, b = med[args.window][k], med[0].get(k, 0.0)
        print(f"{k:28} {a:10.1f} {b:10.1f} {a - b:11.1f} {(a - b) / windows * 1e3:9.0f} us")
        rows.append({"part": k, "windowed_ms": round(a, 2), "whole_plan_ms": round(b, 2),
                     "difference_ms": round(a - b, 2), "per_window_us": round((a - b) / windows * 1e3)})
    record_script(args, "lmcache_retrieve_split", {"windows": windows, "rows": rows})


if __name__ == "__main__":
    main()
