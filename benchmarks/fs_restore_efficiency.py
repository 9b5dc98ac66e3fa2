"""Restore efficiency of the filesystem tier from a warm page cache, against a floor measured in
the same run.

    python benchmarks/fs_restore_efficiency.py --scale 0.0625 --chunks 256 --window-chunks 32 --rounds 3

restore: BoundedRestorer.restore of the whole prefix (W chunks per window, pipeline depth 2,
         install backend --backend) from a FilesystemTier whose object files are in the page cache.
floor:   reading the same object files into one buffer (one preadv per file, one thread) plus one
         contiguous copy of the same payload bytes: what any restore must at least do.
ratio:   restore throughput / floor throughput (goal >= 0.5). Rounds are interleaved; the median
         of each side is reported.
Appends a record to benchmarks/results/fs_restore_efficiency.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bsr_cli.args import add_window_chunks
from bsr_harness.records import add_record_options, record_script
from bsr_harness.testdata import block_tables, poison
from bsr_kernels import presets
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.store import store_prefix
from bsr_runtime.tiers import FilesystemTier
from bsr_runtime.tiers.fs_format import HEADER_SIZE


def floor_seconds(paths: list[str], chunk_bytes: int, buf: torch.Tensor, dst: torch.Tensor) -> float:
    """Read every object file into one buffer, then one contiguous copy of the payloads (both
    buffers allocated and touched beforehand, as the restore's staging and destinations are)."""
    size = HEADER_SIZE + chunk_bytes
    mv = memoryview(buf.numpy())
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.preadv(fd, [mv[i * size : (i + 1) * size]], 0)
        finally:
            os.close(fd)
    payload = buf.view(len(paths), size)[:, HEADER_SIZE:]
    dst.view(len(paths), chunk_bytes).copy_(payload)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1 / 16)
    ap.add_argument("--chunks", type=int, default=256)
    add_window_chunks(ap, default=32, help="W (chunks)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--load-concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default=None)
    add_record_options(ap)
    a = ap.parse_args()
    reg = presets.dsv4_flash(scale=a.scale)
    n, c = a.chunks, reg.chunk_bytes
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50_000, (n * reg.chunk_tokens + 1,), generator=gen).tolist()
    space = KeySpace(reg.fingerprint)
    blocks, (src_tables, dst_tables) = block_tables(reg, [n, n], 1)
    src = reg.allocate(blocks)
    for t in src:
        t.view(torch.uint8).view(-1).random_(0, 256, generator=gen)
    dst = poison(reg.allocate(blocks))
    with tempfile.TemporaryDirectory(dir=a.root) as root, \
            FilesystemTier(root, c, reg.fingerprint, load_concurrency=a.load_concurrency) as tier:
        store_prefix(reg, tier, space, tokens, src, src_tables, n, window_chunks=a.window)
        paths = [tier.path_of(k) for k in PrefixKeys(space, tokens, reg.chunk_tokens).window(0, n)]
        flat = torch.zeros(n * c, dtype=torch.uint8)
        files = torch.zeros(n * (HEADER_SIZE + c), dtype=torch.uint8)
        floor_seconds(paths, c, files, flat)  # warm the page cache
        cfg = RestoreConfig(window_chunks=a.window, pipeline_depth=2, backend=a.backend)
        restore_s, floor_s, backend = [], [], None
        with BoundedRestorer(reg, cfg) as restorer:
            for _ in range(a.rounds):
                req = RestoreRequest("bench", tokens, space, dst, dst_tables)
                rep = restorer.restore(req, tier, n)
                assert rep.ok, rep.error
                restore_s.append(rep.total_s)
                backend = rep.backend
                floor_s.append(floor_seconds(paths, c, files, flat))
    gb = n * c / 1e9
    r, f = statistics.median(restore_s), statistics.median(floor_s)
    print(f"{reg.describe()}; {n} chunks = {gb:.3f} GB; W={a.window}, depth 2, backend {backend}, "
          f"load_concurrency {a.load_concurrency}; median of {a.rounds} interleaved rounds, warm page cache")
    print(f"  restore (BoundedRestorer, fs tier)   {r:7.3f} s  {gb / r:6.2f} GB/s")
    print(f"  floor (read files + one copy)        {f:7.3f} s  {gb / f:6.2f} GB/s")
    print(f"  restore / floor throughput           {f / r:7.2f}  (goal >= 0.5)")
    record_script(a, "fs_restore_efficiency", {
        "registration": reg.name, "chunk_bytes": c, "bytes": n * c, "backend": backend,
        "restore_s": round(r, 4), "restore_GBps": round(gb / r, 2), "floor_s": round(f, 4),
        "floor_GBps": round(gb / f, 2), "restore_vs_floor": round(f / r, 2)}, omit=("root",))


if __name__ == "__main__":
    main()
