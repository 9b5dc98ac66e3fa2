"""The comparison of test_lmcache_server_module.py: the same server (L1 of about 6 objects, 8-chunk
prefix), loaded with BSR's module at prefetch_window_chunks = 0, which leaves LMCache's own lookup and
retrieve in place. Its lookup reserves L1 for the whole hit, which does not fit: nothing of the
prefix is restored and the engine prefills it all again (the module restores all of it)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import lmcache_server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402

from bsr_harness.lmcache_server import LMCacheServer  # noqa: E402


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmcache-server-stock")
    model = U.build_tiny_llama(tmp / "model", seed=7)
    l2_dir = tmp / "l2"
    server = LMCacheServer(l2_dir, l1_size_gb=S.L1_GB, window_chunks=0, extra_args=S.STORE_THROUGH,
                           env=S.server_env()).start()
    with S.engine_on(server, model) as llm:
        yield server, llm, l2_dir


def test_w0_is_the_stock_path_which_needs_the_whole_prefix_in_l1(stock):
    server, llm, l2_dir = stock
    tokens = U.prompt(S.N * U.CHUNK + 33, seed=11)
    cold, _ = S.save(llm, l2_dir, tokens, S.N)
    restored = U.generate(llm, tokens)
    assert restored[2] < S.N * U.CHUNK  # the L1 cannot hold the whole prefix the stock lookup reserves
    assert restored[:2] == cold[:2]
    assert "bsr_" not in server.metrics()  # no module was loaded: no BSR gauge, no BSR handler
