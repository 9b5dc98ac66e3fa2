"""Restore time of one prefix from a Mooncake cluster of 1, 2 and 3 store hosts, with 1 and 2 copies of
every object (replica_num), over tcp on 127.0.0.1 (issue 39).

    python benchmarks/mooncake_cluster.py [--chunks 512] [--window 32] [--reps 7] [--scale 64]

Per configuration: a master and that many store hosts (`mooncake_client`, MooncakeCluster), a writer
MooncakeTier (no segment of its own) stores the prefix with `replica_num` copies (the master places
them), then a reader MooncakeTier (no segment) restores it with a BoundedRestorer (W chunks, pipeline
depth 1: Mooncake's over tcp) `--reps` times: median and best seconds, the state hash checked every
time, and how the master spread the objects over the hosts; `store_s`: the writer's put of the prefix
(every copy), once. Every byte crosses loopback tcp; on this
2-core machine the hosts and the reader share the cores, so more hosts spread objects, not bandwidth.
RDMA (`protocol: rdma`, `device_name`) is not measured here (no RDMA NIC). Appends a record to
benchmarks/results/mooncake_cluster.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.mooncake_cluster import MooncakeCluster
from bsr_harness.records import add_record_options, record_script
from bsr_kernels import presets
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers.mooncake import MooncakeTier

CONFIGS = ((1, 1), (2, 1), (3, 1), (2, 2), (3, 2))  # (store hosts, replica_num)


def restore_times(reg, src, tier: MooncakeTier, expected: str, window: int, reps: int) -> list[float]:
    dst = Destinations(reg, src.num_chunks, seed=3)
    restorer = BoundedRestorer(reg, RestoreConfig(window_chunks=window, pipeline_depth=1, fetch_timeout_s=60.0))
    times = []
    try:
        for _ in range(reps):
            dst.poison()
            t = time.perf_counter()
            rep = restorer.restore(RestoreRequest("bench", src.tokens, src.keyspace, dst.kv, dst.tables), tier,
                                   src.num_chunks)
            times.append(time.perf_counter() - t)
            if not rep.ok or state_hash(reg, dst.kv, dst.tables, src.num_chunks) != expected:
                raise RuntimeError(f"restore failed or restored another state: {rep.error}")
    finally:
        restorer.close()
    return times


def run_config(reg, src, hosts: int, replicas: int, args) -> dict:
    segment = max(64 << 20, 2 * replicas * src.num_chunks * (reg.chunk_bytes + 4096) // hosts)
    with MooncakeCluster(hosts=hosts, segment_bytes=segment) as cluster:
        m = cluster.master
        writer = MooncakeTier(reg.chunk_bytes, reg.fingerprint, m.master_address, m.metadata_server,
                              global_segment_size=0, replica_num=replicas)
        reader = MooncakeTier(reg.chunk_bytes, reg.fingerprint, m.master_address, m.metadata_server,
                              global_segment_size=0)
        try:
            t = time.perf_counter()
            expected = store_source(src, writer, window_chunks=args.window)
            store_s = time.perf_counter() - t
            where = m.placement(sorted(m.keys()))
            times = restore_times(reg, src, reader, expected, args.window, args.reps)
        finally:
            reader.close()
            writer.close()
    per_host = Counter(h for copies in where.values() for h in copies)
    nbytes = src.num_chunks * reg.chunk_bytes
    return {"store_hosts": hosts, "replica_num": replicas, "chunks": src.num_chunks, "bytes": nbytes,
            "copies_per_object": sorted({len(c) for c in where.values()}),
            "objects_per_host": sorted(per_host.values(), reverse=True),
            "store_s": round(store_s, 4), "restore_s_median": round(statistics.median(times), 4),
            "restore_s_best": round(min(times), 4),
            "gbps_median": round(nbytes / statistics.median(times) / 1e9, 3), "state_hash_ok": True}


def table(rows: list[dict]) -> str:
    out = ["hosts  replicas  copies  objects/host       store s  median s  best s   GB/s"]
    out += [f"{r['store_hosts']:>5}  {r['replica_num']:>8}  {str(r['copies_per_object']):>6}  "
            f"{str(r['objects_per_host']):<17}  {r['store_s']:>7.4f}  {r['restore_s_median']:>8.4f}  "
            f"{r['restore_s_best']:>6.4f}  {r['gbps_median']:>5.3f}" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=512, help="chunks of the prefix (256 tokens each)")
    ap.add_argument("--window", type=int, default=32, help="W, chunks per window")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scale", type=int, default=64, help="DeepSeek-V4-Flash registration scaled by 1/SCALE")
    add_record_options(ap)
    args = ap.parse_args()
    reg = presets.dsv4_flash(scale=1 / args.scale)
    src = make_source(reg, args.chunks, seed=39)
    rows = [run_config(reg, src, hosts, replicas, args) for hosts, replicas in CONFIGS]
    print(table(rows))
    figures = {"chunk_bytes": reg.chunk_bytes, "protocol": "tcp", "rows": rows}
    print(json.dumps(figures))
    record_script(args, "mooncake_cluster", figures)


if __name__ == "__main__":
    main()
