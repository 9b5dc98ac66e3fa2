"""One TP rank of tests/integration/tp/test_tp_ranks.py: a real process in a gloo group on 127.0.0.1.

Spawned with torch.multiprocessing (spawn); writes its results to <outdir>/rank<r>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path

REQ_CHUNKS = 4


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def _summary(out, reg, kv, tables, src) -> dict:
    from bsr_harness.testdata import prefix_block_ids
    from bsr_runtime.state_hash import state_hash

    every = prefix_block_ids(reg, tables, src.num_chunks)  # the oracle, not the code under test
    return {
        "committed": out.committed,
        "exposed_tokens": out.exposed_tokens,
        "served_by": out.served_by,
        "local_ok": all(out.valid_per_group),
        "first_attempt_ok": bool(out.attempts and out.attempts[0].ok),
        "first_error": out.attempts[0].error if out.attempts else None,
        "invalid_is_every_block": out.invalid_block_ids == every,
        "invalid_blocks": out.invalid_blocks,
        "total_blocks": sum(len(s) for s in every),
        "hash_ok": state_hash(reg, kv, tables, src.num_chunks) == src.state_hash,
        "error": out.error,
    }


def rank_main(rank: int, world: int, port: int, mode: str, master_address: str, metadata_server: str,
              outdir: str, agree_timeout_s: float) -> None:
    result: dict = {"rank": rank, "mode": mode, "started": time.time()}
    path = Path(outdir) / f"rank{rank}.json"
    try:
        _init(rank, world, port)
        result["initialised"] = time.time()
        result.update(_run(rank, world, mode, master_address, metadata_server, outdir, agree_timeout_s))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["exception"] = traceback.format_exc()
    result["finished"] = time.time()
    path.write_text(json.dumps(result))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _run(rank, world, mode, master_address, metadata_server, outdir, agree_timeout_s) -> dict:
    import torch

    from bsr_harness.fault_matrix import (
        FETCH,
        INSTALL,
        FaultSpec,
        FetchCallHook,
        disarm,
        make_source,
        store,
    )
    from bsr_harness.faulty_tier import FaultyTier
    from bsr_harness.standalone_connector import ConnectorRequest, StandaloneConnector
    from bsr_harness.testdata import block_tables
    from bsr_kernels import presets
    from bsr_runtime import commit
    from bsr_runtime.restore import RestoreConfig
    from bsr_runtime.tiers import FilesystemTier
    from bsr_runtime.tiers.mooncake import MooncakeTier

    torch.set_num_threads(1)
    reg = presets.dsv4_flash(scale=1 / 64)
    out: dict = {}
    fs_root = Path(outdir) / f"fs{rank}"
    fs_root.mkdir()
    # no segment of its own: objects live on the module's standalone store host, so a rank that
    # dies takes none of its peers' objects with it
    remote = FaultyTier(MooncakeTier(reg.chunk_bytes, reg.fingerprint, master_address, metadata_server,
                                     global_segment_size=0))
    fs = FilesystemTier(fs_root, reg.chunk_bytes, reg.fingerprint)  # an empty lower tier
    salt = f"tp-{mode}"
    # every rank: the same requests (same tokens), its own objects and state (kv_seed)
    sources = {name: make_source(reg, REQ_CHUNKS, seed=50 + i, salt=salt, tp_rank=rank, tp_world=world,
                                 kv_seed=1000 * rank + i)
               for i, name in enumerate(["healthy", "rank1_fetch", "rank0_install", "after", "late"])}
    for src in sources.values():
        store(src, remote)
    blocks, tables = block_tables(reg, [REQ_CHUNKS] * len(sources), 77 + rank)
    kv = reg.allocate(blocks)
    conn = StandaloneConnector(reg, [remote, fs], kv, config=RestoreConfig(window_chunks=2, pipeline_depth=1,
                                                                     backend="torch"),
                        tp_rank=rank, tp_world=world, salt=salt, agree_timeout_s=agree_timeout_s)
    try:
        def one(name: str, idx: int, fault: FaultSpec | None = None, hook=None) -> dict:
            src = sources[name]
            req = ConnectorRequest(name, src.tokens)
            tokens, _ = conn.get_num_new_matched_tokens(req, 0)  # agrees on N across ranks
            conn.update_state_after_alloc(req, [t.tolist() for t in tables[idx]], tokens)
            if fault is not None:
                fault.arm(conn.retriever, remote, rank)
            if hook is not None:
                remote.plan.fail_fetch = hook
            t0 = time.monotonic()
            (o,) = conn.start_load()
            elapsed = time.monotonic() - t0
            disarm(conn.retriever, [remote, fs])
            s = _summary(o, reg, kv, tables[idx], src)
            s.update(tokens=tokens, seconds=elapsed, marker_set=conn.markers.is_set(name),
                     failed_recving=sorted(conn.get_finished(set()).failed_recving))
            conn.on_request_running(req)
            s["marker_cleared"] = not conn.markers.is_set(name)
            conn.request_finished(req)
            return s

        if mode == "faults":
            out["healthy"] = one("healthy", 0)
            out["rank1_fetch"] = one("rank1_fetch", 1, FaultSpec(window=1, phase=FETCH, rank=1))
            out["rank0_install"] = one("rank0_install", 2, FaultSpec(window=0, phase=INSTALL, rank=0))
            out["after"] = one("after", 3)
            out["poisoned"] = commit.is_poisoned()
        elif mode == "hang":  # rank 1 stalls in its fetch past the agreement timeout, then finishes
            stall = FetchCallHook(0, lambda i, keys: time.sleep(agree_timeout_s + 2.0)) if rank == 1 else None
            out["late"] = one("late", 4, hook=stall)
            out["poisoned"] = commit.is_poisoned()
            out["why"] = commit.last_error
            import torch.distributed as dist

            dist.barrier()  # the next decision, once both ranks are past the late one
            t0 = time.monotonic()
            try:
                out["agree_after"] = commit.agree([True] * reg.num_groups, timeout_s=agree_timeout_s, tag=1)
            except commit.AgreementFailed as e:
                out["agree_after"], out["why_after"] = None, str(e)
            out["agree_after_s"] = time.monotonic() - t0
            out["poisoned_after"] = commit.is_poisoned()
        elif mode == "die":  # rank 1 dies in the middle of its restore
            if rank == 1:
                def die(i, keys):
                    os._exit(3)

                one("late", 4, hook=FetchCallHook(1, die))
            else:
                out["late"] = one("late", 4)
        else:
            raise ValueError(mode)
    finally:
        conn.close()
        remote.close()
        fs.close()
    return out

