"""Real-engine helpers for LMCache's MP server with vLLM's LMCacheMPConnector (with and without BSR's
server module): save a prompt, make the engine forget it, restore it."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import vllm_util as U

from bsr_harness.testdata import poison

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# The server tests' setting: an 8-chunk prefix, W = 2, and an L1 of 1.5 MiB (about 6 objects of the
# tiny model's 256 KiB chunks): smaller than the prefix.
W = 2
N = 8
L1_GB = 0.0015
# objects leave L1 once L2 holds them (LMCache's BufferOnlyStorePolicy): stores pass through the small
# L1 one chunk a step instead of filling it (a store that finds L1 full is dropped)
STORE_THROUGH = ["--l2-store-policy", "skip_l1"]


def server_env(**extra: str) -> dict:
    """The server child's environment: this checkout and tests/ first on its path (the module, the
    fault plugin), LMCache's banner off."""
    path = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "LMCACHE_DISABLE_BANNER": "1", **extra}


def kv_caches() -> list:
    """The engine's KV cache tensors, as the LMCacheMPConnector worker registered them."""
    return list(U.worker_connector().worker_adapter.kv_caches.values())


def object_files(l2_dir: Path) -> set[str]:
    return {p.name for p in Path(l2_dir).iterdir() if p.is_file()}


def forget(llm, timeout_s: float = 30.0) -> None:
    """vLLM's prefix cache reset (which also asks the LMCache server to clear its L1 of idle
    objects), then every KV block poisoned: what the next request gets it can only get from the
    server's L2. The reset is refused until the connector reported its stores: step until then."""
    end = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        assert time.monotonic() < end, "vLLM kept refusing to reset its prefix cache"
        llm.llm_engine.step()
        time.sleep(0.05)
    poison(kv_caches())


def save(llm, l2_dir: Path, tokens, num_chunks: int, timeout_s: float = 30.0):
    """Prefill `tokens` cold (nothing stored yet: the cold reference), wait until the server's L2 holds
    their `num_chunks` objects, make the engine forget them. Returns (cold output, the new files)."""
    before = object_files(l2_dir)
    cold = U.generate(llm, tokens)
    assert cold[2] == 0, "the prompt was not new to the server"
    end = time.monotonic() + timeout_s
    while len(new := object_files(l2_dir) - before) < num_chunks:
        assert time.monotonic() < end, f"L2 holds {len(new)}/{num_chunks} objects of the prompt"
        llm.llm_engine.step()
        time.sleep(0.05)
    forget(llm)
    return cold, sorted(new)


@contextlib.contextmanager
def engine_on(server, model: str):
    """The started `server` and an in-process engine using it (LMCacheMPConnector); both stopped after."""
    try:
        llm = U.make_llm(model, server.kv_transfer_config())
        try:
            yield llm
        finally:
            U.shutdown(llm)
    finally:
        server.stop()
