"""Soak of a Mooncake cluster shared by two `vllm serve` engines (issue 39): 10 minutes of mixed requests
(long shared prefixes, new prefixes, aborts) while a store host is killed (SIGKILL) and started again
every minute, in turn.

    python benchmarks/mooncake_cluster_soak.py [--minutes 10] [--kill-every-s 60] [--client-ttl-s 2]

All real processes on 127.0.0.1: a `mooncake_master` (its client TTL: how long it lists a lost host's
objects), three store hosts of 256 MiB, two engines of one tiny random-weight model built locally
(engine 0 saves 2 copies of every object, engine 1 one copy), two client threads per engine
(bsr_harness.cluster_soak). Checked at the end: every answered request's tokens against a cold prefill
of its prompt (logprobs too: bit for bit only where a request ran alone, since requests sharing an
engine's steps move its prefill boundaries), no request lost or hung, BSR's gauges (restore staging of
the budget B, save staging, loads in flight) and vLLM's (requests running or waiting, KV cache in use)
back to zero, the engines' resident memory every 5 s. Appends a record to
benchmarks/results/mooncake_cluster_soak.jsonl (bsr_harness.records).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bsr_harness.cluster_soak import SoakPlan, cluster_engines, run_soak
from bsr_harness.mooncake_cluster import MooncakeCluster
from bsr_harness.records import add_record_options, record_script
from bsr_harness.tiny_model import build_tiny_llama


def verdict(f: dict) -> dict:
    """The soak's checks, each true or false."""
    return {"no_request_lost": f["lost"] == 0 and not f["hung_threads"],
            "tokens_identical_to_cold": f["tokens_identical"] == f["answered"],
            "no_save_failed": not any(f["saves_failed"]),
            "staging_budget_loads_zero": all(not any(v.values()) for v in f["levels_at_end"]),
            "engines_hold_nothing": all(not any(v.values()) for v in f["engine_at_end"]),
            "memory_flat": max(f["rss_growth_mib"]) < 128}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every-s", type=float, default=60.0)
    ap.add_argument("--client-ttl-s", type=int, default=2, help="the master's --client_ttl")
    ap.add_argument("--seed", type=int, default=39)
    add_record_options(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bsr-cluster-soak-") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "model", seed=39)
        with MooncakeCluster(hosts=3, segment_bytes=256 << 20, client_ttl_s=args.client_ttl_s) as cluster:
            engines = cluster_engines(cluster, model, work, replica_nums=(2, 1))
            try:
                figures = run_soak(engines, cluster, SoakPlan(duration_s=60 * args.minutes,
                                                              kill_every_s=args.kill_every_s, seed=args.seed))
            finally:
                for e in engines:
                    e.stop()
    figures["checks"] = verdict(figures)
    print(figures["checks"])
    record_script(args, "mooncake_cluster_soak", figures)


if __name__ == "__main__":
    main()
