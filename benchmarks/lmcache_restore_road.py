"""A restore through LMCache installed from L1 against the copy road, side by side in one run.

The state of each prefix (scaled DeepSeek-V4-Flash) is written once through the LMCache tier (FS L2,
warm page cache); then it is restored with BoundedRestorer at W and as the whole plan (W = 0), by
both roads in turn, in alternating order, `--repeat` times:

- in place: the tier's WindowSource (LMCacheTier.window_source): each window installed straight from
  the L1 objects LMCache prefetched (one copy per byte);
- copy: the tier's `fetch` into BSR's staging, then the install from staging (L1 -> staging ->
  blocks: what a tier without a source of its own does), forced here by hiding the tier's source.

Prints the median seconds of each (prefix, W, road), the ratio copy / in place, and BSR / whole plan
for each road, wall clock and CPU time of the process (all its threads, LMCache's included: less
sensitive than the wall clock to other work on a shared machine); every restore must reproduce the
source's state hash. Appends a record to
benchmarks/results/lmcache_restore_road.jsonl (bsr_harness.records).

    python benchmarks/lmcache_restore_road.py [--tokens 32768,131072] [--window-chunks 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # read by LMCache's loggers when they are created

from bsr_cli.args import add_window_chunks, parse_tokens  # noqa: E402
from bsr_harness.experiments import Destinations, make_source, store_source  # noqa: E402
from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_kernels import presets  # noqa: E402
from bsr_runtime.integrations.lmcache import LMCacheTier, fs_l2_config  # noqa: E402
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest  # noqa: E402
from bsr_runtime.state_hash import state_hash  # noqa: E402

ROADS = ("in_place", "copy")


def restore_once(tier: LMCacheTier, restorer: BoundedRestorer, road: str, src, dst: Destinations, n: int,
                 expected: str) -> tuple[float, float, bool, int]:
    """(seconds, CPU seconds of the process, state hash reproduced, peak staging bytes) of one restore of
    n chunks by `road`."""
    if road == "copy":
        tier.window_source = lambda keys, timeout_s: None  # the restore falls back to TierSource
    try:
        dst.poison()
        cpu = time.process_time()
        rep = restorer.restore(RestoreRequest(f"road-{road}-{n}", src.tokens, src.keyspace, dst.kv, dst.tables),
                               tier, n)
        cpu = time.process_time() - cpu
    finally:
        tier.__dict__.pop("window_source", None)
    good = rep.ok and state_hash(src.reg, dst.kv, dst.tables, n) == expected
    return rep.total_s, cpu, good, rep.peak_staging_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=parse_tokens, default=[32768, 131072], help="prefix lengths, comma separated")
    ap.add_argument("--scale", type=float, default=1 / 64, help="dsv4_flash entry-width scale (default 1/64)")
    add_window_chunks(ap, default=32, help="BSR window W (chunks)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per (prefix, W, road); the median counts")
    add_record_options(ap)
    args = ap.parse_args(argv)
    reg = presets.dsv4_flash(scale=args.scale)
    w = args.window
    n_max = max(args.tokens) // reg.chunk_tokens
    src = make_source(reg, n_max, seed=0)
    dst = Destinations(reg, n_max, seed=1)
    print(f"{reg.describe()}; W = {w}, {args.repeat} runs each, LMCache FS L2 (warm page cache), L1 of "
          f"{n_max + 2} objects")
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="bsr-lmcache-road-") as root, \
            LMCacheTier.create(reg, (n_max + 2) * (reg.chunk_bytes + 4096), [fs_l2_config(root)]) as tier:
        store_source(src, tier, w)
        restorers = {x: BoundedRestorer(reg, RestoreConfig(window_chunks=x, pipeline_depth=1)) for x in (w, 0)}
        try:
            for tokens in args.tokens:
                n = tokens // reg.chunk_tokens
                expected = state_hash(reg, src.kv, src.block_tables, n)
                times = {(x, road): [] for x in (w, 0) for road in ROADS}
                cpus = {(x, road): [] for x in (w, 0) for road in ROADS}
                peaks = {}
                for i in range(args.repeat):
                    for road in ROADS if i % 2 == 0 else ROADS[::-1]:  # neither road always goes first
                        for x in (w, 0):
                            s, cpu, good, peak = restore_once(tier, restorers[x], road, src, dst, n, expected)
                            ok = ok and good
                            times[(x, road)].append(s)
                            cpus[(x, road)].append(cpu)
                            peaks[(x, road)] = peak
                row = {"tokens": tokens, "chunks": n, "window_chunks": w}
                for clock, runs in (("s", times), ("cpu_s", cpus)):
                    med = {k: statistics.median(v) for k, v in runs.items()}
                    for road in ROADS:
                        row[f"{road}_{clock}"] = round(med[(w, road)], 4)
                        row[f"{road}_whole_{clock}"] = round(med[(0, road)], 4)
                        row[f"{road}_bsr_vs_whole_{clock}"] = round(med[(w, road)] / med[(0, road)], 3)
                    row[f"copy_vs_in_place_{clock}"] = round(med[(w, "copy")] / med[(w, "in_place")], 3)
                    row[f"copy_vs_in_place_whole_{clock}"] = round(med[(0, "copy")] / med[(0, "in_place")], 3)
                    print(f"  {tokens:>7} tokens, {'wall' if clock == 's' else 'CPU '}: W={w} in place "
                          f"{row[f'in_place_{clock}']:.3f} s, copy {row[f'copy_{clock}']:.3f} s (copy / in place "
                          f"{row[f'copy_vs_in_place_{clock}']:.2f}); whole plan in place "
                          f"{row[f'in_place_whole_{clock}']:.3f} s, copy {row[f'copy_whole_{clock}']:.3f} s "
                          f"({row[f'copy_vs_in_place_whole_{clock}']:.2f}); BSR / whole: in place "
                          f"{row[f'in_place_bsr_vs_whole_{clock}']:.2f}, copy {row[f'copy_bsr_vs_whole_{clock}']:.2f}")
                for road in ROADS:
                    row[f"{road}_peak_staging_bytes"] = peaks[(w, road)]
                rows.append(row)
        finally:
            for r in restorers.values():
                r.close()
    print(f"state hash reproduced by every restore: {ok}")
    record_script(args, "lmcache_restore_road", {"chunk_bytes": reg.chunk_bytes, "rows": rows, "state_hash_ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
