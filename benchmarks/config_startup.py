"""What checking configurations with pydantic schemas costs at start-up: each import in a fresh
interpreter (median of --reps), side by side with what it sits on (Python itself, torch, vLLM), and
the check itself per call (ConnectorConfig.from_extra, make_tier's spec, the LMCache knobs).

    PYTHONPATH=. python benchmarks/config_startup.py [--reps 5] [--no-vllm] [--record DIR | --no-record]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bsr_harness.records import add_record_options, record_script

IMPORTS = {
    "python -c pass": "pass",
    "import pydantic (BaseModel)": "from pydantic import BaseModel",
    "import torch": "import torch",
    "import bsr_runtime.tiers.factory": "import bsr_runtime.tiers.factory",
    "import bsr_runtime.config_schema": "import bsr_runtime.config_schema",
    "bsr --help (parser only)": "from bsr_cli import build_parser; build_parser().format_help()",
}
VLLM_IMPORTS = {
    "import vllm": "import vllm",
    "import bsr_runtime.connector_config": "import bsr_runtime.connector_config",
}


def fresh(code: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_call(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-vllm", action="store_true")
    add_record_options(ap)
    args = ap.parse_args()
    rows = {**IMPORTS, **({} if args.no_vllm else VLLM_IMPORTS)}
    figures: dict[str, float] = {}
    base = None
    print(f"{'fresh interpreter':48s} {'median s':>9s} {'over python':>12s}")
    for name, code in rows.items():
        s = fresh(code, args.reps)
        base = s if base is None else base
        figures[f"{name} s"] = s
        print(f"{name:48s} {s:9.3f} {s - base:12.3f}")

    from bsr_kernels import presets
    from bsr_runtime.config_schema import parse
    from bsr_runtime.tiers.registry import parse_tier_spec

    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=16, block_size=16)  # noqa: F841 - as a tier needs
    spec = {"type": "mooncake", "master_address": "h:1", "metadata_server": "http://h:2/m", "fetch_workers": 4}
    print(f"\n{'per call':48s} {'us':>9s}")
    figures["tier spec us"] = per_call(lambda: parse_tier_spec(spec), 2000) * 1e6
    print(f"{'tier spec (mooncake, 4 keys)':48s} {figures['tier spec us']:9.1f}")
    if not args.no_vllm:
        from bsr_runtime.connector_config import ConnectorConfig

        extra = {"tiers": [{"type": "filesystem", "root": "/x"}, spec], "window_chunks": 8,
                 "tuning": {"backend": "auto", "save_staging_chunks": 4, "chunk_tokens": 256}}
        figures["ConnectorConfig.from_extra us"] = per_call(lambda: ConnectorConfig.from_extra(extra), 2000) * 1e6
        print(f"{'ConnectorConfig.from_extra (2 tiers, 5 keys)':48s} {figures['ConnectorConfig.from_extra us']:9.1f}")
    try:
        from bsr_runtime.integrations.lmcache.config import LMCacheKnobs

        knobs = {"fs_load_concurrency": 2, "evict_retained": True}
        figures["LMCache knobs us"] = per_call(lambda: parse(LMCacheKnobs, knobs, "x"), 2000) * 1e6
        print(f"{'LMCache knobs (2 of 3 keys)':48s} {figures['LMCache knobs us']:9.1f}")
    except ImportError:
        pass
    record_script(args, "config_startup", figures)


if __name__ == "__main__":
    main()
