"""The paper's whole-plan capacity ladder, through LMCache 0.5.6's real storage stack.

A source prefix of the scaled DeepSeek-V4-Flash registration is written once into an LMCache FS
L2 directory through LMCache's own write path (reserve_write / finish_write, store controller).
Then, per prefix length:

- whole plan (W = 0: one LMCache prefetch of every key, through the LMCache tier): a StorageManager
  whose L1 is raised through doubling rungs (1 MiB, 2 MiB, ...) until the full prefix restores with
  the state hash of the source; LMCache reserves L1 for the whole plan at once, so every rung below N
  objects gets zero hits;
- BSR through LMCache (W = 32, the same tier): one StorageManager with L1 fixed at 32 objects (32*c
  plus LMCache's alignment padding of each object), the same for every length.

    python benchmarks/lmcache_ladder.py [--scale 0.015625] [--tokens 32768,65536,131072,262144] [--window-chunks 32]

Prints `tokens, chunk_bytes, first_passing_rung_bytes, bsr_capacity_bytes, bsr_pass` (plus the
whole-plan bytes, BSR's measured L1 peak above baseline and both times) and appends a record to
benchmarks/results/lmcache_ladder.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # read by LMCache's loggers when they are created

from bsr_cli.args import add_window_chunks  # noqa: E402
from bsr_harness.experiments import Destinations, make_source, store_source  # noqa: E402
from bsr_harness.records import add_record_options, record_script  # noqa: E402
from bsr_kernels import presets  # noqa: E402
from bsr_runtime.integrations.lmcache import LMCacheTier, align_up, fs_l2_config  # noqa: E402
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest  # noqa: E402
from bsr_runtime.state_hash import state_hash  # noqa: E402

ALIGN = 4096  # LMCache's default L1 alignment


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f}"


def attempt(tier: LMCacheTier, src, dst: Destinations, n: int, w: int, expected: str
            ) -> tuple[bool, object, float, int]:
    """(restored hash-equal, report, seconds, LMCache's L1 peak above its baseline) of one restore."""
    dst.poison()
    req = RestoreRequest(f"ladder-{n}-{w}", src.tokens, src.keyspace, dst.kv, dst.tables)
    cfg = RestoreConfig(window_chunks=w, pipeline_depth=tier.preferred_pipeline_depth(w * src.reg.chunk_bytes))
    measure = tier.l1_tracker.start()
    t = time.perf_counter()
    with BoundedRestorer(src.reg, cfg) as restorer:
        rep = restorer.restore(req, tier, n)
    secs = time.perf_counter() - t
    tier.l1_tracker.stop(measure)
    ok = rep.ok and state_hash(src.reg, dst.kv, dst.tables, n) == expected
    return ok, rep, secs, measure.peak - measure.baseline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1 / 64, help="dsv4_flash entry-width scale (default 1/64)")
    ap.add_argument("--tokens", default="32768,65536,131072,262144", help="prefix lengths, comma separated")
    add_window_chunks(ap, default=32, help="BSR window W (chunks)")
    ap.add_argument("--first-rung", type=int, default=1 << 20, help="first whole-plan L1 rung in bytes")
    ap.add_argument("--max-rungs", type=int, default=16)
    ap.add_argument("--workdir", default=None, help="where the FS L2 objects go (default: a temp dir)")
    add_record_options(ap)
    args = ap.parse_args(argv)

    reg = presets.dsv4_flash(scale=args.scale)
    c = reg.chunk_bytes
    obj = align_up(c, ALIGN)
    tokens = [int(t) for t in args.tokens.split(",")]
    counts = [t // reg.chunk_tokens for t in tokens]
    n_max = max(counts)
    w = args.window
    bsr_capacity = w * obj
    header = [
        f"# LMCache 0.5.6 storage stack, FS L2; registration {reg.describe()}",
        f"# L1 objects are allocated at align_up(c, {ALIGN}) = {obj:,} B (LMCache's per-object overhead "
        f"{obj - c:,} B); BSR L1 capacity = W*{obj:,} B = {bsr_capacity:,} B",
    ]
    print("\n".join(header), flush=True)

    src = make_source(reg, n_max, seed=3)
    dst = Destinations(reg, n_max, seed=4)
    expected = {n: state_hash(reg, src.kv, src.block_tables, n) for n in counts}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bsr-lmcache-ladder-", dir=args.workdir) as root:
        t = time.perf_counter()
        with LMCacheTier.create(reg, bsr_capacity, [fs_l2_config(root)]) as tier:
            measure = tier.l1_tracker.start()
            stored_hash = store_source(src, tier, w)
            tier.l1_tracker.stop(measure)
        assert stored_hash == state_hash(reg, src.kv, src.block_tables, n_max)
        header.append(f"# stored {n_max} chunks ({_mib(n_max * c)} MiB) into the FS L2 in "
                      f"{time.perf_counter() - t:.1f} s through L1 of {_mib(bsr_capacity)} MiB "
                      f"(L1 peak {_mib(measure.peak - measure.baseline)} MiB)")
        print(header[-1], flush=True)

        # BSR at W with L1 fixed at W objects, one StorageManager for every length
        bsr = {}
        with LMCacheTier.create(reg, bsr_capacity, [fs_l2_config(root)]) as tier:
            for n in counts:
                ok, rep, secs, l1_peak = attempt(tier, src, dst, n, w, expected[n])
                bsr[n] = (ok and l1_peak <= bsr_capacity, rep, secs, l1_peak)

        cols = (f"{'tokens':>7} {'chunk_bytes':>11} {'first_passing_rung_bytes':>24} {'bsr_capacity_bytes':>18} "
                f"{'bsr_pass':>8} | {'whole_plan_bytes':>16} {'rungs':>5} {'W=0 s':>6} {'bsr_peak_bytes':>14} "
                f"{'bsr s':>6} {'windows':>7}")
        print(cols, flush=True)
        for tok, n in zip(tokens, counts):
            rung, tried, passed, whole_s = args.first_rung, 0, None, None
            while tried < args.max_rungs:
                tried += 1
                with LMCacheTier.create(reg, rung, [fs_l2_config(root)]) as tier:
                    ok, rep, secs, _ = attempt(tier, src, dst, n, 0, expected[n])
                if ok:
                    passed, whole_s = rung, secs
                    break
                rung *= 2
            bsr_ok, brep, bsecs, bpeak = bsr[n]
            row = {
                "tokens": tok, "chunks": n, "chunk_bytes": c, "l1_object_bytes": obj,
                "whole_plan_bytes": n * obj, "first_passing_rung_bytes": passed, "rungs_tried": tried,
                "whole_plan_seconds": whole_s, "bsr_window_chunks": w, "bsr_capacity_bytes": bsr_capacity,
                "bsr_pass": bool(bsr_ok), "bsr_peak_l1_bytes_over_baseline": bpeak,
                "bsr_peak_staging_bytes": brep.peak_staging_bytes, "bsr_seconds": bsecs, "bsr_windows": brep.windows,
                "bsr_error": brep.error,
            }
            rows.append(row)
            line = (f"{tok:7d} {c:11d} {passed if passed is not None else '-':>24} {bsr_capacity:18d} "
                    f"{str(row['bsr_pass']):>8} | {n * obj:16d} {tried:5d} "
                    f"{whole_s if whole_s is not None else float('nan'):6.2f} {bpeak:14d} "
                    f"{bsecs:6.2f} {brep.windows:7d}")
            print(line, flush=True)

    record_script(args, "lmcache_ladder", {"registration": reg.name, "align_bytes": ALIGN, "rows": rows},
                  omit=("workdir",))
    return 0 if all(r["bsr_pass"] and r["first_passing_rung_bytes"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
