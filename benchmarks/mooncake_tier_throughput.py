"""MooncakeTier over tcp/127.0.0.1: fetch with integrity on vs raw `batch_get_into`, put vs raw
upsert, the LMCache Mooncake L2 plugin's verified load, probe time, and failure detection.

    python benchmarks/mooncake_tier_throughput.py [--window-mib 64] [--sizes-kib 1024,256,64] [--reps 7]

Two placements per object size, in one run (ratios are of medians over interleaved reps):
- local: the fetching client hosts the segment (the objects are in its own memory);
- store host: the objects live in a `mooncake_client` process (MooncakeStoreHost), the fetching
  client has no segment, so every byte crosses loopback tcp (the paper's external store host).
"raw" = `batch_get_into` of the same stored objects (header + payload, no checks) into one
registered buffer, called on the benchmark's thread ("raw_thread": the same call on a worker
thread while the caller waits, as a tier fetch runs; on this 2-vCPU host that alone is slower);
"tier" = MooncakeTier.fetch(..., headroom=FETCH_HEADROOM).wait() into a registered staging slot
laid out as a restore's (StagingArena(headroom=FETCH_HEADROOM): 128 bytes of header room before each
chunk): objects in the client's own segment by one checksumming copy (mooncake_local.py), others
whole where their payload goes, header in the room, one get, CRC-32C in place; headers checked.
Called directly on the fetching thread, without the local path (what a client without local
objects does): "room_path" = that read; and into adjacent views without room (a caller's own
buffers, e.g. LMCache's): "get_path" = the landed path (whole-object gets + checksumming copy),
"in_place_path" = the two-phase in-place path (headers in the tail of the view before, borrowed
and put back). "tier_put" = put() from adjacent views (staged in the tier's registered buffer, a
copy), "tier_put_room" = put() from the slot with header room (headers written into the room, each
object upserted from there). GB/s count payload bytes.
Numbers are loopback tcp on this host, not RDMA. Appends a record to
benchmarks/results/mooncake_tier_throughput.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bsr_harness.kernel_bench import cache_evictor
from bsr_harness.mooncake_launcher import MooncakeMaster, free_port
from bsr_harness.mooncake_store_host import MooncakeStoreHost
from bsr_harness.records import add_record_options, record_script
from bsr_kernels import host_crc
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.tiers.base import FETCH_HEADROOM, TierError
from bsr_runtime.tiers.mooncake import MooncakeTier
from bsr_runtime.tiers.mooncake_object import HEADER_SIZE

FP = "bench" * 8


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per function, the functions run round-robin so load drift hits all alike,
    each timed call after a cache flush (otherwise a call reading what the one before it wrote,
    e.g. a get after an upsert, starts warm and the others cold). The round starts one function
    later each rep, so no function always follows the same one (a call right after a get found
    the store host still busy with it: about 0.1 lower ratios for the function placed there)."""
    evict = cache_evictor()  # 128 MiB, 4x the L3 here
    for fn in fns.values():
        fn()  # warm-up
    names = list(fns)
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        for k in names[r % len(names):] + names[: r % len(names)]:
            evict()
            t = time.perf_counter()
            fns[k]()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in ts.items()}


def plugin_for(m: MooncakeMaster):
    try:
        from bsr_runtime.integrations.lmcache.mooncake_l2 import BSRMooncakeL2Adapter, BSRMooncakeL2AdapterConfig
    except ImportError:
        return None
    cfg = BSRMooncakeL2AdapterConfig(m.master_address, m.metadata_server, global_segment_size=0)
    return BSRMooncakeL2Adapter(cfg)


def one_size(tier: MooncakeTier, plugin, c: int, window: int, reps: int) -> dict:
    n = max(1, window // c)
    ob = HEADER_SIZE + c
    pool = StagingArena(c, n, headroom=FETCH_HEADROOM)  # as a restore's
    flat = StagingArena(c, n)  # adjacent views, no room
    for b in (pool.buffer, flat.buffer):
        tier.register_staging(b)
    src = torch.randint(0, 256, (n * c,), dtype=torch.uint8)
    src_views = [src[i * c : (i + 1) * c] for i in range(n)]
    tier.register_staging(src)
    raw_dst = torch.empty(n * ob, dtype=torch.uint8)
    tier.register_staging(raw_dst)
    keys = [f"bench-{c}-{i}" for i in range(n)]
    lease, flat_lease = pool.acquire(n), flat.acquire(n)
    views, flat_views = lease.chunks(), flat_lease.chunks()
    ptrs, flat_ptrs = [v.data_ptr() for v in views], [v.data_ptr() for v in flat_views]
    raw_ptrs = [raw_dst.data_ptr() + i * ob for i in range(n)]
    tier.put(keys, src_views)
    raw_get = lambda: tier._store.batch_get_into(keys, raw_ptrs, [ob] * n)  # noqa: E731
    fns = {  # raw_upsert writes back what raw_get just read (valid objects)
        "raw_get": raw_get,
        # the same get on a worker thread, as the tier's fetch runs (the caller waits)
        "raw_get_thread": lambda: _on_thread(raw_get),
        "tier_fetch": lambda: tier.fetch(keys, views, time.monotonic() + 60, headroom=pool.headroom).wait(),
        "room_path": lambda: get_path(tier, keys, ptrs, c, None, pool.headroom),
        "get_path": lambda: get_path(tier, keys, flat_ptrs, c, land_whole=True),
        "in_place_path": lambda: get_path(tier, keys, flat_ptrs, c, land_whole=False),
        "raw_upsert": lambda: tier._store.batch_upsert_from(keys, raw_ptrs, [ob] * n),
    }
    if plugin is not None:
        pnames = [f"bench-l2-{c}-{i}" for i in range(n)]
        codes = plugin._put_objects(plugin._tier._live_store(), pnames, [_Obj(v) for v in src_views], [c] * n)
        assert all(x == 0 for x in codes), set(codes)
        plugin._tier.register_staging(flat.buffer)
        fns["plugin_load"] = lambda: _check_all(plugin._load_verified(pnames, flat_ptrs, [c] * n), n)
    t = interleaved(fns, reps)
    tier.fetch(keys, views, time.monotonic() + 60, headroom=pool.headroom).wait()  # the slot holds the payloads
    t_puts = interleaved({"tier_put": lambda: tier.put(keys, src_views),  # adjacent views: staged (a copy)
                          "tier_put_room": lambda: tier.put(keys, views, headroom=pool.headroom)},  # in place
                         max(3, reps // 2))
    t_put = t_puts["tier_put"]
    tier.fetch(keys, views, time.monotonic() + 60, headroom=pool.headroom).wait()
    assert torch.equal(lease.view.reshape(-1), src)
    total = n * c
    out = {"object_KiB": c >> 10, "objects": n, "window_MiB": round(total / 2**20, 1)}
    out.update({f"{k}_GBps": gbps(total, v) for k, v in t.items() if k != "raw_upsert"})
    out["tier_vs_raw"] = round(t["raw_get"] / t["tier_fetch"], 3)
    out["tier_vs_raw_thread"] = round(t["raw_get_thread"] / t["tier_fetch"], 3)
    out["room_path_vs_raw"] = round(t["raw_get"] / t["room_path"], 3)
    out["get_path_vs_raw"] = round(t["raw_get"] / t["get_path"], 3)
    out["in_place_path_vs_raw"] = round(t["raw_get"] / t["in_place_path"], 3)
    if "plugin_load" in t:
        out["plugin_vs_tier"] = round(t["tier_fetch"] / t["plugin_load"], 3)
    out["tier_put_GBps"] = gbps(total, t_put)
    out["tier_put_room_GBps"] = gbps(total, t_puts["tier_put_room"])
    out["raw_upsert_GBps"] = gbps(total, t["raw_upsert"])
    if plugin is not None:
        plugin._tier.unregister_staging(flat.buffer)
    pool.release(lease)
    flat.release(flat_lease)
    for b in (pool.buffer, flat.buffer, raw_dst, src):
        tier.unregister_staging(b)
    tier.delete(keys)
    if plugin is not None:
        plugin._tier._live_store().batch_remove(pnames, True)
    return out


_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-raw-get")


def _on_thread(fn) -> None:
    _WORKER.submit(fn).result()


def get_path(tier: MooncakeTier, keys: list[str], ptrs: list[int], c: int, land_whole: bool | None,
             headroom: int = 0) -> None:
    """The tier's read without its local path, by the landed or the in-place path (or, with
    headroom, into views with header room)."""
    reads = tier._reads
    saved = reads.local, reads.land_whole
    reads.local, reads.land_whole = None, land_whole
    try:
        reads.read(tier.codec, keys, ptrs, [c] * len(keys), time.monotonic() + 60, headroom=headroom)
    finally:
        reads.local, reads.land_whole = saved


class _Obj:
    def __init__(self, t: torch.Tensor) -> None:
        self.data_ptr = t.data_ptr()
        self.n = t.numel()

    def get_size(self) -> int:
        return self.n


def _check_all(good: list[int], n: int) -> None:
    assert len(good) == n, f"{n - len(good)} objects refused"


def probe_time(tier: MooncakeTier, c: int, chunks: int, reps: int) -> dict:
    keys = [f"probe-{i}" for i in range(chunks)]
    one = torch.zeros(c, dtype=torch.uint8)
    tier.put(keys[:1], [one])
    t = interleaved({"p": lambda: tier.probe(keys)}, reps)["p"]
    tier.delete(keys[:1])
    return {"probe_chunks": chunks, "probe_tokens": chunks * 256, "probe_ms": round(t * 1e3, 2)}


def failure_detection(m: MooncakeMaster, c: int) -> dict:
    out: dict = {}
    port = free_port()
    t0 = time.monotonic()
    try:
        MooncakeTier(c, "x", f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata")
    except TierError:
        pass
    out["unreachable_master_detect_s"] = round(time.monotonic() - t0, 4)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        t0 = time.monotonic()
        try:
            MooncakeTier(c, "x", f"127.0.0.1:{srv.getsockname()[1]}", m.metadata_server, connect_timeout_s=10)
        except TierError:
            pass
        out["silent_master_detect_s"] = round(time.monotonic() - t0, 3)
    return out


def crc_overlap(tier: MooncakeTier, c: int, window: int, reps: int) -> dict:
    """Whether the CRC of a window's landed objects should overlap the transfer: one get of the window
    into a restore's staging slot (header room) then the CRC of every payload, against the window in
    k gets with each get's CRCs on a second thread while the next get lands; ratios to the same raw
    get alone."""
    n = max(1, window // c)
    pool = StagingArena(c, n, headroom=FETCH_HEADROOM)
    tier.register_staging(pool.buffer)
    src = torch.randint(0, 256, (n * c,), dtype=torch.uint8)
    tier.register_staging(src)
    keys = [f"overlap-{c}-{i}" for i in range(n)]
    tier.put(keys, [src[i * c : (i + 1) * c] for i in range(n)])
    lease = pool.acquire(n)
    ptrs = [v.data_ptr() for v in lease.chunks()]
    second = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-crc")

    def get(a: int, b: int) -> None:
        _check_all([i for i, code in enumerate(tier._store.batch_get_into(
            keys[a:b], [p - HEADER_SIZE for p in ptrs[a:b]], [HEADER_SIZE + c] * (b - a))) if code > 0], b - a)

    def in_gets(k: int):
        def read() -> None:
            pending = []
            for j in range(k):
                a, b = n * j // k, n * (j + 1) // k
                get(a, b)
                if j < k - 1:
                    pending.append(second.submit(host_crc.crc32c_many, ptrs[a:b], c))
                else:
                    host_crc.crc32c_many(ptrs[a:b], c)
            for f in pending:
                f.result()
        return read

    fns = {"raw_get": lambda: get(0, n), "one_get_then_crc": in_gets(1)}
    fns.update({f"{k}_gets_overlapped": in_gets(k) for k in (2, 4, 8) if k <= n})
    t = interleaved(fns, reps)
    second.shutdown()
    pool.release(lease)
    for b in (pool.buffer, src):
        tier.unregister_staging(b)
    tier.delete(keys)
    ratios = {f"{k}_vs_raw": round(t["raw_get"] / v, 3) for k, v in t.items() if k != "raw_get"}
    return {"object_KiB": c >> 10, **ratios}


def run(args) -> dict:
    """local: the tier's own segment holds the objects (no plugin: a second client's segment would
    share the placement). store_host: tier and plugin have no segment; a mooncake_client holds all."""
    sizes = [int(s) << 10 for s in args.sizes_kib.split(",")]
    window = int(args.window_mib * (1 << 20))
    out: dict = {"window_MiB": args.window_mib, "reps": args.reps, "local": [], "store_host": []}
    seg = 3 * window + (256 << 20)
    with MooncakeMaster() as m:
        for placement in args.placements.split(","):
            host = MooncakeStoreHost(m, 2 * seg).start() if placement == "store_host" else None
            try:
                for c in sizes:
                    tier = MooncakeTier(c, FP, m.master_address, m.metadata_server,
                                        global_segment_size=0 if host else seg,
                                        in_place_batch_bytes=int(args.in_place_batch_mib * (1 << 20)))
                    plugin = plugin_for(m) if args.plugin and host else None
                    try:
                        out[placement].append(one_size(tier, plugin, c, window, args.reps))
                        print(json.dumps({placement: out[placement][-1]}), flush=True)
                        if host and c == sizes[0]:
                            out.update(probe_time(tier, c, args.probe_chunks, args.reps))
                        if host and args.crc_overlap:
                            out.setdefault("crc_overlap", []).append(crc_overlap(tier, c, window, args.reps))
                            print(json.dumps({"crc_overlap": out["crc_overlap"][-1]}), flush=True)
                    finally:
                        if plugin is not None:
                            plugin.close()
                        tier.close()
            finally:
                if host:
                    host.stop()
        if args.failures:
            out.update(failure_detection(m, sizes[0]))
    return out


def table(out: dict) -> str:
    cols = ["object_KiB", "objects", "raw_get_GBps", "tier_fetch_GBps", "tier_vs_raw", "tier_vs_raw_thread",
            "room_path_vs_raw", "get_path_vs_raw",
            "in_place_path_vs_raw",
            "plugin_load_GBps",
            "plugin_vs_tier", "tier_put_GBps", "tier_put_room_GBps", "raw_upsert_GBps"]
    lines = ["placement   " + " ".join(f"{c:>16}" for c in cols)]
    for placement in ("local", "store_host"):
        for row in out[placement]:
            lines.append(f"{placement:<11} " + " ".join(f"{row.get(c, '-')!s:>16}" for c in cols))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window-mib", type=float, default=64.0)
    ap.add_argument("--sizes-kib", default="1024,256,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--probe-chunks", type=int, default=2047)
    ap.add_argument("--no-plugin", dest="plugin", action="store_false")
    ap.add_argument("--in-place-batch-mib", type=float, default=128.0,
                    help="the tier's in_place_batch_bytes (the gets of an in-place phase), in MiB")
    ap.add_argument("--placements", default="local,store_host", help="local, store_host or both")
    ap.add_argument("--failures", action="store_true", help="also time failure detection")
    ap.add_argument("--crc-overlap", action="store_true",
                    help="store host: also one get + CRC against the window in 2/4/8 gets, CRCs overlapped")
    add_record_options(ap)
    args = ap.parse_args()
    out = run(args)
    print(table(out))
    print(json.dumps(out))
    record_script(args, "mooncake_tier_throughput", out)


if __name__ == "__main__":
    main()
