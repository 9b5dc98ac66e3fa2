"""BSR's server module in a real LMCache MP server process, restoring into a real vLLM engine through
vLLM's LMCacheMPConnector (kv_load_failure_policy "recompute").

The server's L1 holds about 6 objects, less than the 8-chunk prefix: the stock server restores none
of it (test_lmcache_server_stock.py), the module restores all of it, W = 2 objects at a time. Each
test saves a prompt of its own (the cold prefill is the reference output), makes the engine forget
it (prefix cache reset, LMCache's L1 cleared, every KV block poisoned) and asks again."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm")

import lmcache_server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402
from lmcache_faults import ENV, l2_adapter_arg  # noqa: E402

from bsr_harness.lmcache_server import LMCacheServer  # noqa: E402

W, N, L1_GB, STORE_THROUGH = S.W, S.N, S.L1_GB, S.STORE_THROUGH
FETCH_TIMEOUT_S = 1.5


class Setup:
    def __init__(self, server: LMCacheServer, llm, l2_dir, faults) -> None:
        self.server, self.llm, self.l2_dir, self.faults = server, llm, l2_dir, faults

    def metric(self, name: str, **labels: str) -> float:
        return self.server.metric(name, **labels) or 0.0

    def arm(self, **faults) -> None:
        self.faults.write_text(json.dumps(faults))


@pytest.fixture(scope="module")
def bsr(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmcache-server-bsr")
    model = U.build_tiny_llama(tmp / "model", seed=7)
    l2_dir, faults = tmp / "l2", tmp / "faults.json"
    l2_dir.mkdir()
    faults.write_text("{}")
    server = LMCacheServer(l2_dir, l1_size_gb=L1_GB, window_chunks=W, l2_adapter=l2_adapter_arg(l2_dir),
                           module_config={"fetch_timeout_s": FETCH_TIMEOUT_S}, extra_args=STORE_THROUGH,
                           env=S.server_env(**{ENV: str(faults)})).start()
    with S.engine_on(server, model) as llm:
        yield Setup(server, llm, l2_dir, faults)


def _restore(setup: Setup, seed: int, damage=None):
    tokens = U.prompt(N * U.CHUNK + 33, seed=seed)
    cold, files = S.save(setup.llm, setup.l2_dir, tokens, N)
    if damage is not None:
        damage(setup.l2_dir, files)
    return cold, U.generate(setup.llm, tokens)


def test_bounded_restore_identical_output(bsr):
    """The whole 8-chunk prefix is restored through an L1 smaller than it, W objects at a time, and the
    output (tokens and logprobs) equals the cold prefill's."""
    windows, held_peak = bsr.metric("bsr_restore_windows"), bsr.metric("bsr_l1_objects_held_peak")
    cold, restored = _restore(bsr, seed=11)
    assert restored[2] == N * U.CHUNK
    assert restored[:2] == cold[:2]
    assert bsr.metric("bsr_restore_windows") - windows == N // W
    assert bsr.metric("bsr_restore_l1_objects_peak") <= W
    assert max(held_peak, bsr.metric("bsr_l1_objects_held_peak")) <= W
    assert bsr.metric("bsr_l1_objects_held") == 0


def _flip_payload_byte(l2_dir, files) -> None:
    path = l2_dir / files[len(files) // 2]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["damaged", "deleted", "late"])
def test_failed_object_fails_closed_and_recomputes(bsr, fault):
    """A damaged object (refused by the checked FS adapter), one deleted between the probe and the
    retrieve, and one that arrives after the window's deadline each fail the retrieve: vLLM gets every
    block invalid, recomputes, and the output still equals the cold prefill's. Nothing stays held."""
    seed = {"damaged": 21, "deleted": 22, "late": 23}[fault]
    cause = {"damaged": "missing", "deleted": "missing", "late": "late"}[fault]
    failed = bsr.metric("bsr_restore_failures", cause=cause)
    if fault == "damaged":
        cold, restored = _restore(bsr, seed, damage=_flip_payload_byte)
    else:
        def arm(l2_dir, files):
            bsr.arm(**({"delete": True} if fault == "deleted" else {"late_s": FETCH_TIMEOUT_S + 1.5}))
        try:
            cold, restored = _restore(bsr, seed, damage=arm)
        finally:
            bsr.arm()
    assert restored[:2] == cold[:2]
    assert bsr.metric("bsr_restore_failures", cause=cause) == failed + 1
    assert bsr.metric("bsr_l1_objects_held") == 0
