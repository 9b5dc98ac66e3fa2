"""FilesystemTier throughput: put and cold/warm fetch of N objects, per load concurrency.

    python benchmarks/fs_tier_throughput.py --root /path/on/ssd --objects 256 --mib 1 --conc 1 4

Cold reads drop the object files from the page cache first (FilesystemTier.drop_page_cache,
which fdatasyncs then POSIX_FADV_DONTNEED). Fetches go window by window into one StagingArena
slot of `--window-chunks` chunks, like a bounded restore. Also reports the checksum cost. Appends a record
to benchmarks/results/fs_tier_throughput.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib

import torch

from bsr_cli.args import add_window_chunks
from bsr_harness.records import add_record_options, record_script
from bsr_kernels import StagingArena
from bsr_runtime.tiers import FilesystemTier
from bsr_runtime.tiers import _common as checksums


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def crc_rates(buf: torch.Tensor, reps: int = 64) -> dict[str, float]:
    arr = buf.numpy()
    out = {}
    fns = {"crc32 (zlib)": zlib.crc32}
    if checksums._crc32c is not None:
        fns["crc32c (google_crc32c)"] = checksums._crc32c.value
    for name, fn in fns.items():
        fn(arr)
        t = time.perf_counter()
        for _ in range(reps):
            fn(arr)
        out[name] = gbps(reps * arr.nbytes, time.perf_counter() - t)
    return out


def run(root: str, n: int, chunk: int, conc: int, window: int, checksum: str) -> dict[str, float]:
    g = torch.Generator().manual_seed(conc)
    src = torch.randint(1, 256, (n, chunk), dtype=torch.uint8, generator=g)
    keys = [f"bench-{conc}-{checksum}-{i}" for i in range(n)]
    pool = StagingArena(chunk, window)
    res = {}
    with FilesystemTier(root, chunk, "b" * 32, load_concurrency=conc, checksum=checksum) as t:
        t0 = time.perf_counter()
        t.put(keys, list(src))
        res["put (page cache)"] = gbps(n * chunk, time.perf_counter() - t0)
        t0 = time.perf_counter()
        t.drop_page_cache(keys)  # includes writing the dirty pages back
        res["put+writeback"] = gbps(n * chunk, time.perf_counter() - t0 + n * chunk / res["put (page cache)"] / 1e9)

        def fetch_all() -> float:
            busy = 0.0  # time inside fetch+wait only; the byte check runs outside the clock
            for w in range(0, n, window):
                ks = keys[w : w + window]
                lease = pool.acquire(len(ks))
                t0 = time.perf_counter()
                t.fetch(ks, [lease.chunk(i) for i in range(len(ks))], time.monotonic() + 600).wait()
                busy += time.perf_counter() - t0
                ok = (lease.view.numpy().reshape(len(ks), chunk) == src[w : w + len(ks)].numpy()).all()
                pool.release(lease)
                assert ok
            return busy

        t.drop_page_cache(keys)
        res["fetch cold"] = gbps(n * chunk, fetch_all())
        res["fetch warm"] = gbps(n * chunk, fetch_all())
        t.delete(keys)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=None)
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--mib", type=float, default=1.0)
    add_window_chunks(ap, default=32, help="W: chunks per fetch (one staging slot)")
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--checksum", nargs="+", default=["auto"])
    add_record_options(ap)
    a = ap.parse_args()
    chunk = int(a.mib * (1 << 20)) // 16 * 16
    with tempfile.TemporaryDirectory(dir=a.root) as root:
        print(f"root {root}: {a.objects} objects x {chunk:,} B, window {a.window}")
        crcs = crc_rates(torch.randint(1, 256, (chunk,), dtype=torch.uint8))
        for name, r in crcs.items():
            print(f"  {name:<24} {r:6.2f} GB/s (one thread, {chunk:,} B buffers)")
        rows = []
        for checksum in a.checksum:
            for conc in a.conc:
                r = run(root, a.objects, chunk, conc, a.window, checksum)
                line = "  ".join(f"{k} {v:6.2f}" for k, v in r.items())
                print(f"  checksum={checksum:<6} load_concurrency={conc}: {line}  GB/s")
                rows.append({"checksum": checksum, "load_concurrency": conc,
                             **{f"{k}_GBps": round(v, 2) for k, v in r.items()}})
    record_script(a, "fs_tier_throughput", {"object_bytes": chunk, "checksum_GBps": {k: round(v, 2) for k, v in
                                                                                   crcs.items()}, "rows": rows},
                  omit=("root",))


if __name__ == "__main__":
    main()
