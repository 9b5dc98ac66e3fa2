"""`vllm serve` as the README writes it: the real server process, the README's --kv-transfer-config JSON
(its filesystem root moved to a temporary directory), requests over HTTP, vLLM's /metrics.

The server's local prefix cache would answer a repeated prompt by itself; the test drops it between
requests (POST /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1), as a restarted server or
another replica would be without it, so the repeat must come from the tier.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm")

import vllm_server as S  # noqa: E402
import vllm_util as U  # noqa: E402

PROMPT_CHUNKS = 11
BSR_COUNTERS = ("vllm:bsr_loads_committed_total", "vllm:bsr_restored_tokens_total", "vllm:bsr_restored_bytes_total",
                "vllm:bsr_restore_windows_total", "vllm:bsr_saved_chunks_total")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-serve")
    model = U.build_tiny_llama(work / "model", seed=21)
    argv = S.with_fs_root(S.readme_serve_argv(), work / "bsr-kv")
    argv[2] = model
    srv = S.VllmServer(argv, work / "vllm_serve.log", env={"VLLM_SERVER_DEV_MODE": "1"})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _bsr(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_metrics(server: S.VllmServer, name: str, at_least: float, **labels: str) -> dict:
    """/metrics once `name` reached `at_least` (the front end exports a step's stats after its output)."""
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if _bsr(m, name, **labels) >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def _restored_again(server: S.VllmServer, tokens: list[int]) -> dict:
    assert server.post("/reset_prefix_cache")["success"]  # the local copy gone: the tier must serve it
    return server.complete(tokens)


def test_readme_serve_command_restores_over_http(server):
    """Two identical completions requests: the first prefills and saves, the second is restored by the
    connector (usage cached_tokens, vLLM's external-hit counter and the connector's counters) with
    the same tokens and logprobs."""
    tokens = U.prompt(PROMPT_CHUNKS * U.CHUNK + 5, seed=31)
    first = server.complete(tokens)
    assert S.cached_tokens(first) == 0
    second = _restored_again(server, tokens)
    assert S.cached_tokens(second) == PROMPT_CHUNKS * U.CHUNK
    assert S.completion_tokens(second) == S.completion_tokens(first)  # tokens and logprobs, bit for bit
    m = _wait_metrics(server, "vllm:bsr_loads_committed_total", 1)
    assert _bsr(m, "vllm:external_prefix_cache_hits_total") == PROMPT_CHUNKS * U.CHUNK
    assert _bsr(m, "vllm:bsr_loads_committed_total") == 1
    assert _bsr(m, "vllm:bsr_restored_tokens_total") == PROMPT_CHUNKS * U.CHUNK
    assert _bsr(m, "vllm:bsr_saved_chunks_total", tier="filesystem") == PROMPT_CHUNKS
    chunk_bytes = _bsr(m, "vllm:bsr_restored_bytes_total") / PROMPT_CHUNKS
    # 2 layers x K and V x 2 KV heads x head size 32 x 256 tokens x 4 bytes (the tiny Llama, float32)
    assert chunk_bytes == 2 * 2 * 2 * 32 * U.CHUNK * 4
    assert _bsr(m, "vllm:bsr_saved_bytes_total", tier="filesystem") == PROMPT_CHUNKS * chunk_bytes
    # W = 32 of the README and the filesystem tier's depth 2: one window of 11 chunks, two 16-chunk slots
    assert _bsr(m, "vllm:bsr_restore_windows_total") == 1
    assert 0 < _bsr(m, "vllm:bsr_peak_staging_bytes") <= 32 * chunk_bytes
    assert _bsr(m, "vllm:bsr_restore_seconds_count") == 1
    assert all(_bsr(m, "vllm:bsr_loads_failed_total", cause=c) == 0 for c in ("corrupt", "missing", "other"))


def test_failed_load_shows_in_metrics(server, tmp_path):
    """A flipped byte in one object: the load fails closed, the output is still the cold one (recompute),
    and /metrics counts the failure under its cause; the recompute's save repairs the objects, so the
    next restore commits."""
    tokens = U.prompt(PROMPT_CHUNKS * U.CHUNK + 9, seed=32)
    before = server.metrics()
    root = _fs_root(server)
    known = set(root.rglob("*.bsr"))
    first = server.complete(tokens)
    new = sorted(set(root.rglob("*.bsr")) - known, key=os.path.getmtime)
    assert len(new) == PROMPT_CHUNKS
    _flip_byte(new[PROMPT_CHUNKS // 2])
    failed = _restored_again(server, tokens)
    assert S.completion_tokens(failed) == S.completion_tokens(first)  # recomputed
    m = _wait_metrics(server, "vllm:bsr_loads_failed_total",
                      _bsr(before, "vllm:bsr_loads_failed_total", cause="corrupt") + 1, cause="corrupt")
    assert _bsr(m, "vllm:bsr_loads_failed_total", cause="corrupt") == \
        _bsr(before, "vllm:bsr_loads_failed_total", cause="corrupt") + 1
    assert _bsr(m, "vllm:bsr_loads_committed_total") == _bsr(before, "vllm:bsr_loads_committed_total")
    assert _bsr(m, "vllm:bsr_restored_tokens_total") == _bsr(before, "vllm:bsr_restored_tokens_total")
    repaired = _restored_again(server, tokens)
    assert S.cached_tokens(repaired) == PROMPT_CHUNKS * U.CHUNK
    assert S.completion_tokens(repaired) == S.completion_tokens(first)
    m = _wait_metrics(server, "vllm:bsr_loads_committed_total", _bsr(before, "vllm:bsr_loads_committed_total") + 1)
    assert _bsr(m, "vllm:bsr_loads_committed_total") == _bsr(before, "vllm:bsr_loads_committed_total") + 1


def _fs_root(server: S.VllmServer):
    import json
    from pathlib import Path

    kv = json.loads(server.argv[server.argv.index("--kv-transfer-config") + 1])
    return Path(kv["kv_connector_extra_config"]["tiers"][0]["root"])


def _flip_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
