"""One TP rank of tests/integration/tp/test_tp_recovery.py: a real process in a gloo group on 127.0.0.1
running the worker's Loader (bsr_runtime/loader.py) with its agreement on a gloo group of its own, as
the vLLM connector does, over a real filesystem tier of the rank's own objects.

Spawned with torch.multiprocessing (spawn); writes its results to <outdir>/rank<r>.json. Every wait
here is bounded: a rank that waits for a load past its bound records it as not finished.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path

AGREE_TIMEOUT_S = 1.0  # generous beside the 1 s lag of the slow rank: a loaded machine must not flake the healthy loads
WAIT_S = 8.0  # the longest a rank waits for one load's result


def rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    result: dict = {"rank": rank}
    try:
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        result.update(_run(rank, world, Path(outdir)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["exception"] = traceback.format_exc()
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a stalled agreement thread of the old code must not keep the process alive


def _run(rank: int, world: int, outdir: Path) -> dict:
    import dataclasses
    import functools

    import torch
    import torch.distributed as dist

    from bsr_harness.experiments import make_source, store_source
    from bsr_harness.faulty_tier import FaultyTier
    from bsr_harness.testdata import block_tables
    from bsr_kernels import presets
    from bsr_runtime import commit
    from bsr_runtime.loader import Loader
    from bsr_runtime.plan import LoadSpec
    from bsr_runtime.restore import RestoreConfig
    from bsr_runtime.tiers import FilesystemTier

    torch.set_num_threads(1)
    reg = presets.dsv4_flash(scale=1 / 64)
    names = ["slow", "after", "dup", "next"]
    sources = {}
    (outdir / f"fs{rank}").mkdir()
    inner = FilesystemTier(outdir / f"fs{rank}", reg.chunk_bytes, reg.fingerprint)
    tier = FaultyTier(inner)
    for i, name in enumerate(names):  # the same tokens on every rank, each rank's own objects
        src = make_source(reg, 2, seed=60 + i)
        src.keyspace = dataclasses.replace(src.keyspace, tp_rank=rank, tp_world=world)
        store_source(src, inner, window_chunks=2)
        sources[name] = src
    blocks, tables = block_tables(reg, [2] * len(names), 7 + rank, holes="none")
    kv = reg.allocate(blocks)
    cfg = RestoreConfig(window_chunks=2, pipeline_depth=1, fetch_timeout_s=10.0, backend="cpu")

    def spec(name: str) -> LoadSpec:
        i, src = names.index(name), sources[name]
        return LoadSpec(name, src.tokens, src.num_chunks, 0, [t.tolist() for t in tables[i]])

    def loader() -> Loader:
        # a gloo group of BSR's own per loader, as the connector makes one (connector._agreement_group)
        group = dist.new_group(ranks=list(range(world)), backend="gloo")
        return Loader(reg, [tier], kv, cfg, tp_rank=rank, tp_world=world,
                      agree=functools.partial(commit.agree, group=group), agree_timeout_s=AGREE_TIMEOUT_S)

    taken: dict = {}  # results taken while waiting for another load (two can finish before one take)

    def wait(ld: Loader, name: str) -> dict:
        end = time.monotonic() + WAIT_S
        while name not in taken and time.monotonic() < end:
            ld.wait_finished(0.1)
            taken.update((r.request_id, r) for r in ld.take_finished())
        o = taken.pop(name, None)
        if o is None:
            return {"finished": False}
        return {"finished": True, "committed": o.committed, "agreed": o.agreed, "error": o.error,
                "cause": None if o.cause is None else o.cause.value}

    out: dict = {}
    try:
        # item 3: rank 1 restores late, past the agreement timeout; the next load agrees afresh
        ld = loader()
        if rank == 1:
            tier.plan.delay_s = AGREE_TIMEOUT_S + 1.0
        ld.submit(spec("slow"))
        out["slow"] = wait(ld, "slow")
        tier.plan.delay_s = 0.0
        dist.barrier()  # the next step: an engine hands every rank its loads in the same step
        ld.submit(spec("after"))
        out["after"] = wait(ld, "after")
        ld.close(2)
        # item 4: a refused submit (the request is already loading) takes nothing; the next load finishes
        ld = loader()
        ld.submit(spec("dup"))  # still loading (its result waits for the agreement) when submitted again
        try:
            ld.submit(spec("dup"))
            out["refused"] = False
        except ValueError:
            out["refused"] = True
        ld.submit(spec("next"))
        out["dup"] = wait(ld, "dup")
        out["next"] = wait(ld, "next")
        ld.close(2)
    finally:
        tier.close()
    return out
