"""The paper's E1 sweep on this machine, all rows from one run.

Prefixes of 32768 .. 524032 tokens of the scaled 167-tensor DeepSeek-V4-Flash registration are
restored with W = 32 (pipeline depth 2) and with the whole-plan baseline (W = 0), from the
filesystem tier and from Mooncake over loopback TCP (a real mooncake_master plus a standalone
mooncake_client store host, so every byte crosses TCP). Then the filesystem load-concurrency
A/B (1 vs 4) at the longest prefix with the page cache dropped for the object files.

    python benchmarks/e1_sweep.py [--scale 0.015625] [--tiers fs,mooncake] [--out benchmarks/results]

Prints the table and the ratios, and writes NAME.json and NAME.txt under --out (--name, default e1_sweep).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from bsr_harness.experiments import Destinations, make_source, source_hashes, store_source, sweep
from bsr_kernels import presets
from bsr_runtime.keys import PrefixKeys
from bsr_runtime.tiers import FilesystemTier

PAPER_TOKENS = [32768, 65536, 131072, 262144, 393216, 524032]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(rows) -> list[str]:
    out = [f"{'tier':9} {'tokens':>7} {'chunks':>6} {'W':>3} {'win':>4} {'peak MiB':>9} {'s':>6} {'GB/s':>5} "
           f"{'hash':>4} | {'W=0 peak MiB':>12} {'W=0 s':>6} {'t ratio':>7}"]
    base = {(r.tier, r.tokens): r for r in rows if r.window_chunks == 0}
    for r in rows:
        if r.window_chunks == 0:
            continue
        b = base.get((r.tier, r.tokens))
        tail = (f"{_mib(b.peak_staging_bytes):>12} {b.seconds:6.2f} {r.seconds / b.seconds:7.3f}" if b else "")
        out.append(f"{r.tier:9} {r.tokens:7d} {r.chunks:6d} {r.window_chunks:3d} {r.windows:4d} "
                   f"{_mib(r.peak_staging_bytes):>9} {r.seconds:6.2f} {r.gbps:5.2f} "
                   f"{'ok' if r.state_hash_ok else 'BAD':>4} | {tail}")
    return out


def fs_concurrency_ab(src, root: Path, window: int, depth: int, expected) -> list[str]:
    lines = ["", f"filesystem load concurrency A/B at {src.num_chunks * src.reg.chunk_tokens} tokens, "
             f"W={window}, page cache dropped before each run:"]
    keys = PrefixKeys(src.keyspace, src.tokens, src.reg.chunk_tokens)
    dst = Destinations(src.reg, src.num_chunks, seed=7)
    results = {}
    for conc in (1, 4):
        with FilesystemTier(root, src.reg.chunk_bytes, src.reg.fingerprint, load_concurrency=conc) as tier:
            for first in range(0, src.num_chunks, 256):
                tier.drop_page_cache(keys.window(first, min(256, src.num_chunks - first)))
            (row,) = sweep(src, tier, [src.num_chunks * src.reg.chunk_tokens], [window], depth=depth,
                           expected=expected, dst=dst)  # one run: a repeat would read from the page cache
            for first in range(0, src.num_chunks, 256):
                tier.drop_page_cache(keys.window(first, min(256, src.num_chunks - first)))
            fetch_gbps = fetch_only_gbps(tier, keys, src.reg.chunk_bytes, window)
        results[conc] = (row, fetch_gbps)
        lines.append(f"  concurrency {conc}: restore {row.seconds:6.2f} s {row.gbps:5.2f} GB/s, "
                     f"fetch only {fetch_gbps:5.2f} GB/s, peak staging {_mib(row.peak_staging_bytes)} MiB, "
                     f"hash {'ok' if row.state_hash_ok else 'BAD'}")
    (r1, f1), (r4, f4) = results[1], results[4]
    lines.append(f"  ratio 4/1: restore {r4.gbps / r1.gbps:.2f}x, fetch only {f4 / f1:.2f}x; "
                 f"peak staging unchanged: {r1.peak_staging_bytes == r4.peak_staging_bytes}")
    return lines


def fetch_only_gbps(tier, keys, chunk_bytes: int, window: int) -> float:
    """Read the whole prefix window by window into one W-chunk buffer, no install: the tier's
    load throughput on its own (the restore on this CPU is bound by the install)."""
    buf = torch.empty(window * chunk_bytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    for first in range(0, keys.num_chunks, window):
        n = min(window, keys.num_chunks - first)
        views = [buf[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(n)]
        tier.fetch(keys.window(first, n), views, time.monotonic() + 120).wait()
    return keys.num_chunks * chunk_bytes / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1 / 64)
    ap.add_argument("--tokens", default=",".join(map(str, PAPER_TOKENS)))
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--tiers", default="fs,mooncake")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the median is reported")
    ap.add_argument("--skip-ab", action="store_true", help="skip the filesystem concurrency A/B")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--name", default="e1_sweep", help="base name of the .txt/.json results (default e1_sweep)")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    reg = presets.dsv4_flash(scale=args.scale)
    max_chunks = max(tokens) // reg.chunk_tokens
    header = [f"command: python benchmarks/e1_sweep.py {shlex.join(argv if argv is not None else sys.argv[1:])}",
              f"registration: {reg.describe()} (scale {args.scale:g}; unscaled c = "
              f"{presets.dsv4_flash().chunk_bytes:,} B, paper {presets.PAPER_DSV4_CHUNK_BYTES:,} B)",
              f"W = {args.window} chunks, pipeline depth {args.depth}; W = 0 is the whole-plan baseline"]
    print("\n".join(header), flush=True)
    t0 = time.perf_counter()
    src = make_source(reg, max_chunks, seed=0)
    expected = source_hashes(src, [t // reg.chunk_tokens for t in tokens])
    dst = Destinations(reg, src.num_chunks, seed=1)
    print(f"source state: {max_chunks} chunks, {_mib(max_chunks * reg.chunk_bytes)} MiB "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    rows, extra = [], []

    def on_row(r):
        print(f"  {r.tier} tokens={r.tokens} W={r.window_chunks}: {r.seconds:.2f} s, "
              f"peak {_mib(r.peak_staging_bytes)} MiB, hash {'ok' if r.state_hash_ok else 'BAD'}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bsr-e1-") as tmp:
        if "fs" in args.tiers.split(","):
            with FilesystemTier(tmp, reg.chunk_bytes, reg.fingerprint, load_concurrency=4) as fs:
                store_source(src, fs)
                rows += sweep(src, fs, tokens, [args.window, 0], depth=args.depth, expected=expected, dst=dst,
                              repeat=args.repeat, on_row=on_row)
            if not args.skip_ab:
                extra += fs_concurrency_ab(src, Path(tmp), args.window, args.depth, expected)
        if "mooncake" in args.tiers.split(","):
            from bsr_harness.mooncake_launcher import MooncakeMaster, MooncakeStoreHost
            from bsr_runtime.tiers.mooncake import MooncakeTier

            seg = int(max_chunks * reg.chunk_bytes * 1.25) + (256 << 20)
            with MooncakeMaster() as m, MooncakeStoreHost(m, seg):
                tier = MooncakeTier(reg.chunk_bytes, reg.fingerprint, m.master_address, m.metadata_server,
                                    global_segment_size=0)
                try:
                    store_source(src, tier)
                    rows += sweep(src, tier, tokens, [args.window, 0], depth=args.depth, expected=expected,
                                  dst=dst, repeat=args.repeat, on_row=on_row)
                finally:
                    tier.close()
    lines = header + [""] + table(rows) + extra
    bsr = [r for r in rows if r.window_chunks]
    peaks = {r.peak_staging_bytes for r in bsr}
    worst = max((r.seconds / b.seconds for r in bsr for b in rows
                 if b.window_chunks == 0 and (b.tier, b.tokens) == (r.tier, r.tokens)), default=float("nan"))
    wc = _mib(args.window * reg.chunk_bytes)
    lines += ["", f"BSR peak staging identical in every row: {len(peaks) == 1} "
              f"({', '.join(_mib(p) + ' MiB' for p in sorted(peaks))}; W*c = {wc} MiB)",
              f"worst BSR time / whole-plan time: {worst:.3f}",
              f"all state hashes equal: {all(r.state_hash_ok for r in rows)}",
              f"total wall time: {time.perf_counter() - t0:.0f} s"]
    print("\n".join(lines[len(header):]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.txt").write_text("\n".join(lines) + "\n")
    (out / f"{args.name}.json").write_text(json.dumps([r.to_dict() for r in rows], indent=1) + "\n")
    return 0 if all(r.state_hash_ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
