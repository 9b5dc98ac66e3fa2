"""BSR's server module under tensor parallelism: a real vLLM CPU engine at TP = 2 (two worker
processes) with LMCacheMPConnector and a real LMCache MP server loading the module. Each rank stores
and retrieves its own objects (its KV heads: LMCache's kv_rank), window by window, through an L1
smaller than the prefix, at pipeline depth 2; a damaged object of rank 1 alone fails rank 1's retrieve, and vLLM then
recomputes the request on both ranks (the ranks agree: no rank keeps a prefix the other could not
restore). Every KV block of both workers is poisoned before each restore, so a block a retrieve did
not write, or a failure vLLM did not act on, shows in the output."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

vllm = pytest.importorskip("vllm")

import lmcache_server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402
from lmcache_faults import ENV, l2_adapter_arg  # noqa: E402

from bsr_harness.lmcache_server import LMCacheServer  # noqa: E402

W, N = S.W, S.N
L1_GB = S.L1_GB  # about 12 of a rank's 128 KiB objects: less than the 2 x 8 the prompt stores


def _poison_worker_kv(worker) -> int:
    """Run in each worker process (collective_rpc): every byte of its KV cache poisoned."""
    from bsr_harness.testdata import poison

    return len(poison(worker.model_runner.kv_caches))


def _forget(llm, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        assert time.monotonic() < end, "vLLM kept refusing to reset its prefix cache"
        llm.llm_engine.step()
        time.sleep(0.05)
    assert all(llm.collective_rpc(_poison_worker_kv, timeout=30))


def _kv_rank(filename: str) -> int:
    """The TP rank of an object file of LMCache's FS layout: <model>@0x<kv_rank>@..., kv_rank the
    bitmap (world_size << 24) | (rank << 16) | (local_world_size << 8) | local_rank."""
    return (int(filename.split("@")[1], 16) >> 16) & 0xFF


def _metric(server: LMCacheServer, name: str, **labels: str) -> float:
    return server.metric(name, **labels) or 0.0


@pytest.mark.slow
def test_tp2_ranks_retrieve_their_own_objects_and_one_failed_rank_recomputes_both(tmp_path, monkeypatch):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on the CPU needs two cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM cannot bind 2 workers to 1 NUMA node itself
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the poisoning function
    model = U.build_tiny_llama(tmp_path / "model", seed=8)
    l2_dir, faults = tmp_path / "l2", tmp_path / "faults.json"
    l2_dir.mkdir()
    faults.write_text("{}")
    server = LMCacheServer(l2_dir, l1_size_gb=L1_GB, window_chunks=W, l2_adapter=l2_adapter_arg(l2_dir),
                           module_config={"pipeline_depth": 2}, extra_args=S.STORE_THROUGH,
                           env=S.server_env(**{ENV: str(faults)})).start()
    try:
        llm = U.make_llm(model, server.kv_transfer_config(), multiprocess=True, tensor_parallel_size=2,
                         distributed_executor_backend="mp")
        try:
            tokens = U.prompt(N * U.CHUNK + 33, seed=31)
            cold = U.generate(llm, tokens)
            end = time.monotonic() + 60
            while len(files := sorted(S.object_files(l2_dir))) < 2 * N:
                assert time.monotonic() < end, f"L2 holds {len(files)}/{2 * N} objects of the prompt"
                llm.llm_engine.step()
                time.sleep(0.05)
            assert Counter(_kv_rank(f) for f in files) == {0: N, 1: N}, files

            _forget(llm)
            ok, windows = _metric(server, "bsr_restores", outcome="ok"), _metric(server, "bsr_restore_windows")
            restored = U.generate(llm, tokens)
            assert restored[2] == N * U.CHUNK
            assert restored[:2] == cold[:2]
            assert _metric(server, "bsr_restores", outcome="ok") - ok == 2  # one retrieve per rank
            assert _metric(server, "bsr_restore_windows") - windows == 2 * N // W
            # depth 2: window j+1 prefetched into L1 while window j is copied, so two windows' objects
            assert _metric(server, "bsr_l1_objects_held_peak") == 2 * W
            assert _metric(server, "bsr_l1_objects_held") == 0

            _forget(llm)
            path = l2_dir / next(f for f in files if _kv_rank(f) == 1 and f in files[len(files) // 2:])
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF  # refused by BSR's checked FS adapter on load: rank 1's retrieve fails
            path.write_bytes(bytes(data))
            ok = _metric(server, "bsr_restores", outcome="ok")
            failed = _metric(server, "bsr_restores", outcome="failed")
            again = U.generate(llm, tokens)
            assert _metric(server, "bsr_restores", outcome="failed") - failed == 1  # rank 1
            assert _metric(server, "bsr_restores", outcome="ok") - ok <= 1  # rank 0's own objects were fine
            assert again[:2] == cold[:2]  # recomputed on both ranks (rank 1's blocks were poison)
            assert _metric(server, "bsr_l1_objects_held") == 0
        finally:
            U.shutdown(llm)
    finally:
        server.stop()
