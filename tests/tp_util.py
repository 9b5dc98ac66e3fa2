"""Real TP ranks for tests: `world` spawned processes, joined within a bound (a hung rank is killed
and fails the test), each leaving its results in OUTDIR/rank<r>.json."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def run_ranks(target: Callable, args_of: Callable[[int], tuple], world: int, outdir: Path, join_s: float,
              what: str = "") -> tuple[dict[int, dict], list[int | None]]:
    """Run target(*args_of(r)) in one spawned process per rank; (each rank's results, exit codes)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(10)
    assert not hung, f"{what}{': ' if what else ''}ranks still running after {join_s}s"
    results = {}
    for r in range(world):
        f = Path(outdir) / f"rank{r}.json"
        if f.exists():
            results[r] = json.loads(f.read_text())
            assert "exception" not in results[r], results[r]["exception"]
    return results, [p.exitcode for p in procs]
