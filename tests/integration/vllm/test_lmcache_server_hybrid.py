"""BSR's server module with a hybrid model (sliding-window and full-attention layers) whose KV LMCache
keeps in two object groups (--separate-object-groups): a restore moves both groups window by window
with output equal to cold; a damaged object of one group fails the whole retrieve, so the whole
prefix is recomputed (one invalid group collapses the prefix), and the output is still cold's."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import lmcache_server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402

from bsr_harness.lmcache_server import LMCacheServer  # noqa: E402

N = 8
GROUPS = 2


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmcache-server-hybrid")
    model = U.build_tiny_llama(tmp / "model", seed=4, sliding_window=512,
                               layer_types=["sliding_attention", "full_attention"])
    l2_dir = tmp / "l2"
    server = LMCacheServer(l2_dir, l1_size_gb=0.01, window_chunks=S.W, checked_fs=True,
                           extra_args=[*S.STORE_THROUGH, "--separate-object-groups"], env=S.server_env()).start()
    with S.engine_on(server, model) as llm:
        yield server, llm, l2_dir


def test_hybrid_restore_and_one_damaged_group_collapses_the_prefix(hybrid):
    server, llm, l2_dir = hybrid
    tokens = U.prompt(N * U.CHUNK + 33, seed=3)
    cold, files = S.save(llm, l2_dir, tokens, GROUPS * N)
    restored = U.generate(llm, tokens)
    assert restored[2] == N * U.CHUNK and restored[:2] == cold[:2]
    assert server.metric("bsr_restore_l1_objects_peak") <= GROUPS * S.W

    tokens = U.prompt(N * U.CHUNK + 33, seed=4)
    cold, files = S.save(llm, l2_dir, tokens, GROUPS * N)
    failed = server.metric("bsr_restore_failures", cause="missing") or 0.0
    for name in files:  # damage every object of the sliding-window group only: one group invalid
        path = l2_dir / name
        if server_group(path) == 1:
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF
            path.write_bytes(bytes(data))
    restored = U.generate(llm, tokens)
    assert restored[:2] == cold[:2]
    assert server.metric("bsr_restore_failures", cause="missing") == failed + 1
    assert server.metric("bsr_l1_objects_held") == 0


def server_group(path) -> int:
    """The object group of an FS L2 object file, from LMCache's file name."""
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key

    return _filename_to_object_key(path.name).object_group_id
