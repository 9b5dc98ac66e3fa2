"""MooncakeTier on one machine over tcp/127.0.0.1: master start, put/get throughput, the cost
of the integrity records and crc, and how long failures take to surface.

    python benchmarks/mooncake_tier_throughput.py [--chunks 64] [--chunk-mib 1] [--reps 5]

Prints one JSON object. Numbers are loopback tcp on this host, not RDMA.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch

from bsr_harness.mooncake_launcher import MooncakeMaster, free_port
from bsr_kernels.staging_pool import StagingPool
from bsr_runtime.tiers.base import TierError
from bsr_runtime.tiers.mooncake import MooncakeTier


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n, c = args.chunks, int(args.chunk_mib * (1 << 20))
    out: dict = {"chunks": n, "chunk_bytes": c}

    starts = []
    for _ in range(3):
        with MooncakeMaster() as m:
            starts.append(m.start_seconds)
    out["master_start_s"] = [round(s, 3) for s in starts]

    with MooncakeMaster() as m:
        segment = max(256 << 20, 4 * n * c)
        t0 = time.monotonic()
        tier = MooncakeTier(c, "bench" * 8, m.master_address, m.metadata_server, global_segment_size=segment)
        out["tier_setup_s"] = round(time.monotonic() - t0, 3)
        raw = tier._store
        pool = StagingPool(c, capacity_chunks=n, num_slots=1)
        tier.register_staging(pool.buffer)
        src = torch.randint(0, 256, (n * c,), dtype=torch.uint8)
        src_views = [src[i * c : (i + 1) * c] for i in range(n)]
        reg_t0 = time.monotonic()
        tier.register_staging(src)  # sources registered too: zero-copy puts
        out["register_buffer_s"] = round(time.monotonic() - reg_t0, 4)
        keys = [f"bench-{i}" for i in range(n)]
        lease = pool.acquire(n)
        views = [lease.chunk(i) for i in range(n)]
        ptr_dst = [v.data_ptr() for v in views]
        ptr_src = [v.data_ptr() for v in src_views]

        def timeit(fn) -> float:
            ts = []
            for _ in range(args.reps):
                t = time.monotonic()
                fn()
                ts.append(time.monotonic() - t)
            return statistics.median(ts)

        total = n * c
        t_put = timeit(lambda: tier.put(keys, src_views))
        t_get = timeit(lambda: tier.fetch(keys, views, time.monotonic() + 60).wait())
        assert torch.equal(lease.view, src)
        tier.verify = False
        t_get_noverify = timeit(lambda: tier.fetch(keys, views, time.monotonic() + 60).wait())
        tier.verify = True
        t_raw_put = timeit(lambda: raw.batch_upsert_from(keys, ptr_src, [c] * n))
        t_raw_get = timeit(lambda: raw.batch_get_into(keys, ptr_dst, [c] * n))
        meta_keys = [k + ".meta" for k in keys]
        t_meta_get = timeit(lambda: raw.get_batch(meta_keys))
        blobs = raw.get_batch(meta_keys)
        t_meta_put = timeit(lambda: raw.upsert_batch(meta_keys, blobs))
        t_probe = timeit(lambda: tier.probe(keys))
        import zlib

        t_crc = timeit(lambda: [zlib.crc32(memoryview(v.numpy())) for v in views])
        # an unregistered destination: registered for the call and unregistered after
        dst = torch.zeros(n * c, dtype=torch.uint8)
        dviews = [dst[i * c : (i + 1) * c] for i in range(n)]
        t_get_unreg = timeit(lambda: tier.fetch(keys, dviews, time.monotonic() + 60).wait())
        out.update(
            {
                "tier_put_GBps": gbps(total, t_put),
                "tier_fetch_GBps": gbps(total, t_get),
                "tier_fetch_noverify_GBps": gbps(total, t_get_noverify),
                "tier_fetch_unregistered_dst_GBps": gbps(total, t_get_unreg),
                "raw_batch_upsert_from_GBps": gbps(total, t_raw_put),
                "raw_batch_get_into_GBps": gbps(total, t_raw_get),
                "meta_get_batch_ms_per_window": round(t_meta_get * 1e3, 2),
                "meta_upsert_batch_ms_per_window": round(t_meta_put * 1e3, 2),
                "probe_ms_per_window": round(t_probe * 1e3, 2),
                "crc32_GBps": gbps(total, t_crc),
            }
        )
        # a second client without a segment of its own: every byte crosses loopback tcp
        reader = MooncakeTier(c, "bench" * 8, m.master_address, m.metadata_server, global_segment_size=0)
        reader.register_staging(pool.buffer)
        reader.register_staging(src)
        rkeys = [f"bench-remote-{i}" for i in range(n)]
        t_rput = timeit(lambda: reader.put(rkeys, src_views))  # lands in the first client's segment
        lease.view.zero_()
        t_rget = timeit(lambda: reader.fetch(rkeys, views, time.monotonic() + 60).wait())
        assert torch.equal(lease.view, src)
        reader.verify = False
        t_rget_nv = timeit(lambda: reader.fetch(rkeys, views, time.monotonic() + 60).wait())
        t_rraw = timeit(lambda: reader._store.batch_get_into(rkeys, ptr_dst, [c] * n))
        out.update(
            {
                "remote_tier_put_GBps": gbps(total, t_rput),
                "remote_tier_fetch_GBps": gbps(total, t_rget),
                "remote_tier_fetch_noverify_GBps": gbps(total, t_rget_nv),
                "remote_raw_batch_get_into_GBps": gbps(total, t_rraw),
            }
        )
        reader.close()
        pool.release(lease)
        t0 = time.monotonic()
        tier.close()
        out["tier_close_s"] = round(time.monotonic() - t0, 3)

        # failure detection
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

        tier = MooncakeTier(c, "bench" * 8, m.master_address, m.metadata_server)
        tier.put(keys[:4], src_views[:4])
        m.stop()
        for name, op in (("probe", lambda: tier.probe(keys[:4])), ("put", lambda: tier.put(keys[:4], src_views[:4]))):
            t0 = time.monotonic()
            try:
                op()
            except TierError as e:
                out[f"master_down_{name}_error"] = f"{type(e).__name__}: {e}"
            out[f"master_down_{name}_s"] = round(time.monotonic() - t0, 3)
        t0 = time.monotonic()
        tier.close()
        out["tier_close_master_down_s"] = round(time.monotonic() - t0, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
