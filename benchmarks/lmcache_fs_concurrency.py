"""Filesystem load concurrency 1 vs 4 through LMCache's FS L2 adapter, page cache dropped.

The state of a 524032-token prefix (scaled DeepSeek-V4-Flash) is written once through the LMCache
tier; then it is restored from the tier (BoundedRestorer) with W = 32 at load concurrency 1 and 4,
each after dropping the page cache of every object file (posix_fadvise DONTNEED). Prints seconds,
GB/s, LMCache's L1 peak and the throughput ratio; L1 peak must not change. Appends a record to
benchmarks/results/lmcache_fs_concurrency.jsonl (bsr_harness.records).

    python benchmarks/lmcache_fs_concurrency.py [--tokens 524032] [--scale 0.015625]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from bsr_cli.args import add_window_chunks
from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.records import add_record_options, record_script
from bsr_kernels import presets
from bsr_runtime.integrations.lmcache import LMCacheTier, fs_l2_config
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash


def drop_page_cache(root: str) -> int:
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=524032)
    ap.add_argument("--scale", type=float, default=1 / 64)
    add_window_chunks(ap, default=32, help="W (chunks)")
    add_record_options(ap)
    args = ap.parse_args(argv)
    reg = presets.dsv4_flash(scale=args.scale)
    n = args.tokens // reg.chunk_tokens
    lines = [f"{reg.describe()}; {n} chunks, W = {args.window}; LMCache FS L2, page cache dropped before each run"]
    src = make_source(reg, n, seed=0)
    expected = state_hash(reg, src.kv, src.block_tables, n)
    dst = Destinations(reg, n, seed=1)
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="bsr-lmcache-ab-") as root:
        l1 = (args.window + 2) * (reg.chunk_bytes + 4096)
        with LMCacheTier.create(reg, l1, [fs_l2_config(root)]) as tier:
            store_source(src, tier, args.window)
        for conc in (1, 4):
            files = drop_page_cache(root)
            with LMCacheTier.create(reg, l1, [fs_l2_config(root, load_concurrency=conc)]) as tier:
                depth = tier.preferred_pipeline_depth(args.window * reg.chunk_bytes)
                cfg = RestoreConfig(window_chunks=args.window, pipeline_depth=depth)
                dst.poison()
                measure = tier.l1_tracker.start()
                with BoundedRestorer(reg, cfg) as restorer:
                    rep = restorer.restore(RestoreRequest(f"ab-{conc}", src.tokens, src.keyspace, dst.kv, dst.tables),
                                           tier, n)
                tier.l1_tracker.stop(measure)
            l1_peak = measure.peak - measure.baseline
            ok = rep.ok and state_hash(reg, dst.kv, dst.tables, n) == expected
            gbps = rep.bytes_moved / rep.total_s / 1e9
            results[conc] = (rep, gbps, l1_peak)
            lines.append(f"  concurrency {conc}: {rep.total_s:6.2f} s  {gbps:5.2f} GB/s  L1 peak "
                         f"{l1_peak / 2**20:.2f} MiB  ({files} files dropped)  "
                         f"hash {'ok' if ok else 'BAD'}")
            rows.append({"load_concurrency": conc, "seconds": round(rep.total_s, 3), "GBps": round(gbps, 3),
                         "l1_peak_bytes": l1_peak, "files_dropped": files, "state_hash_ok": ok})
    (r1, g1, p1), (r4, g4, p4) = results[1], results[4]
    lines.append(f"  throughput ratio 4/1: {g4 / g1:.2f}x; L1 peak unchanged: {p1 == p4}")
    print("\n".join(lines))
    record_script(args, "lmcache_fs_concurrency", {
        "chunks": n, "chunk_bytes": reg.chunk_bytes, "rows": rows, "ratio_4_vs_1": round(g4 / g1, 2),
        "l1_peak_unchanged": p1 == p4})
    return 0 if r1.ok and r4.ok else 1


if __name__ == "__main__":
    sys.exit(main())
