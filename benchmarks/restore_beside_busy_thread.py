"""A restore from the filesystem tier beside a thread that runs Python (what an engine's step thread
does while a background load runs): its time alone and beside the busy thread, with the tier reading
a window's objects as one job of its native reader (batched) and one object at a time (per-object),
interleaved in one run, and the probe of the same prefix likewise.

Every GIL hand-off of the restoring threads can wait a switch interval (5 ms) while the other thread
runs Python, so what a restore pays beside a busy engine grows with the hand-offs it makes:

    busy / alone      the slowdown beside the busy thread (1.0: none)
    batched / per-object beside the busy thread

    PYTHONPATH=. python benchmarks/restore_beside_busy_thread.py [--chunks 128,512] [--reps 9]

Appends a record to benchmarks/results/restore_beside_busy_thread.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time

import torch

from bsr_harness.records import add_record_options, record_script
from bsr_harness.testdata import poisoned, request_tables
from bsr_kernels import presets
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.probe import probe_prefix
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.store import store_prefix
from bsr_runtime.tiers import FilesystemTier

W = 32
DEFAULT_INTERVAL = sys.getswitchinterval()
SHORT_INTERVAL = 0.0005
# (batched reads, the interpreter's switch interval): what the tier did before, what it does now, and
# now with a shorter switch interval (the restoring threads get the GIL back sooner)
VARIANTS = ((False, DEFAULT_INTERVAL), (True, DEFAULT_INTERVAL), (True, SHORT_INTERVAL))


class BusyThread:
    """A thread running pure Python until stopped (it holds the GIL but for forced switches)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _case(n: int, reps: int, root: str) -> dict:
    reg = presets.llama_like(layers=2, kv_heads=2, head_dim=32, block_size=64, dtype=torch.float32)
    tier = FilesystemTier(root, reg.chunk_bytes, reg.fingerprint)
    space = KeySpace(reg.fingerprint, 0, 1, "")
    tokens = torch.randint(0, 50_000, (n * reg.chunk_tokens,), generator=torch.Generator().manual_seed(n)).tolist()
    blocks, tables = request_tables(reg, n, 1, spare=2, holes="none")
    src = poisoned(reg, blocks)
    for t in src:
        t.normal_()
    store_prefix(reg, tier, space, tokens, src, tables, window_chunks=W)
    dst_blocks, dst_tables = request_tables(reg, n, 2, spare=2, holes="none")
    dst = poisoned(reg, dst_blocks)
    req = RestoreRequest("bench", tokens, space, dst, dst_tables)
    times: dict[tuple[bool, bool, float], list[tuple[float, float]]] = {}
    with BoundedRestorer(reg, RestoreConfig(window_chunks=W)) as restorer:
        for busy in (False, True):
            ctx = BusyThread() if busy else None
            if ctx:
                ctx.__enter__()
            try:
                for _ in range(reps):
                    for batched, interval in VARIANTS:
                        tier._native = batched
                        sys.setswitchinterval(interval)
                        t0 = time.perf_counter()
                        probe_prefix(tier, PrefixKeys(space, tokens, reg.chunk_tokens))
                        t1 = time.perf_counter()
                        rep = restorer.restore(req, tier, n)
                        t2 = time.perf_counter()
                        if not rep.ok:
                            raise RuntimeError(rep.error)
                        times.setdefault((busy, batched, interval), []).append((t2 - t1, t1 - t0))
            finally:
                sys.setswitchinterval(DEFAULT_INTERVAL)
                if ctx:
                    ctx.__exit__(None, None, None)
    tier.close()
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in times.items()}
    row = {"chunks": n, "tokens": n * reg.chunk_tokens, "mib": n * reg.chunk_bytes / 2**20}
    for (busy, batched, interval), (r, p) in med.items():
        tag = f"{'busy' if busy else 'alone'}_{'batched' if batched else 'per_object'}"
        tag += "" if interval == DEFAULT_INTERVAL else "_short_switch"
        row[f"restore_{tag}_ms"] = r * 1e3
        row[f"probe_{tag}_ms"] = p * 1e3
    for kind in ("batched", "per_object"):
        row[f"busy_over_alone_{kind}"] = row[f"restore_busy_{kind}_ms"] / row[f"restore_alone_{kind}_ms"]
    row["busy_batched_over_per_object"] = row["restore_busy_batched_ms"] / row["restore_busy_per_object_ms"]
    row["busy_short_switch_over_alone"] = row["restore_busy_batched_short_switch_ms"] / row["restore_alone_batched_ms"]
    row["busy_probe_batched_over_per_object"] = row["probe_busy_batched_ms"] / row["probe_busy_per_object_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="128,512", help="prefix lengths in chunks of 256 tokens")
    ap.add_argument("--reps", type=int, default=9, help="interleaved restores per case; medians")
    add_record_options(ap)
    args = ap.parse_args()
    rows = []
    for n in (int(c) for c in args.chunks.split(",")):
        with tempfile.TemporaryDirectory(prefix="bsr-busy-") as root:
            rows.append(_case(n, args.reps, root))
    print(f"medians of {args.reps}, W = {W}; b = batched reads, p = per-object reads, s = batched with a "
          f"{SHORT_INTERVAL * 1e3:g} ms switch interval (default {DEFAULT_INTERVAL * 1e3:g} ms)")
    print(f"{'tokens':>7} {'alone b/p ms':>14} {'busy b/p/s ms':>20} {'busy/alone b':>12} {'busy/alone p':>12} "
          f"{'busy/alone s':>12} {'busy b/p':>8} {'probe busy b/p ms':>18}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['restore_alone_batched_ms']:>6.1f}/{r['restore_alone_per_object_ms']:<7.1f} "
              f"{r['restore_busy_batched_ms']:>6.1f}/{r['restore_busy_per_object_ms']:.1f}/"
              f"{r['restore_busy_batched_short_switch_ms']:<6.1f} "
              f"{r['busy_over_alone_batched']:>12.2f} {r['busy_over_alone_per_object']:>12.2f} "
              f"{r['busy_short_switch_over_alone']:>12.2f} {r['busy_batched_over_per_object']:>8.2f} "
              f"{r['probe_busy_batched_ms']:>8.1f}/{r['probe_busy_per_object_ms']:<8.1f}")
    record_script(args, "restore_beside_busy_thread", {"window_chunks": W, "rows": rows})


if __name__ == "__main__":
    main()
