"""The README's LMCache quick start as written: its `python -m lmcache.v1.multiprocess.server ...
--server-module ...` line runs as the server process and its `vllm serve ... LMCacheMPConnector ...`
line's --kv-transfer-config configures a real engine (in-process, the settings `vllm serve` would
pass). Substituted: this Python, free ports, the L2 directory, the model. A prompt saved by the engine
is restored through the module with the output of its cold prefill."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

vllm = pytest.importorskip("vllm")

import lmcache_server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402

from bsr_harness.lmcache_server import LMCacheServer  # noqa: E402
from bsr_harness.mooncake_launcher import fill_free_ports  # noqa: E402

N = 8


def _readme_lines() -> tuple[list[str], list[str]]:
    text = (S.ROOT / "README.md").read_text()
    server = re.search(r"^python -m lmcache\.v1\.multiprocess\.server .*$", text, re.MULTILINE)
    serve = re.search(r"^vllm serve .*LMCacheMPConnector.*$", text, re.MULTILINE)
    assert server and serve, "README has no LMCache server quick start"
    return shlex.split(server.group(0)), shlex.split(serve.group(0))


def _set(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def test_readme_lmcache_server_quick_start(tmp_path):
    server_argv, serve_argv = _readme_lines()
    assert server_argv[:3] == ["python", "-m", "lmcache.v1.multiprocess.server"]
    port, metrics_port = fill_free_ports([None, None])
    server_argv[0] = sys.executable
    _set(server_argv, "--port", str(port))
    _set(server_argv, "--prometheus-port", str(metrics_port))
    l2 = json.loads(server_argv[server_argv.index("--l2-adapter") + 1])
    l2["base_path"] = str(tmp_path / "l2")
    _set(server_argv, "--l2-adapter", json.dumps(l2))
    kv = json.loads(serve_argv[serve_argv.index("--kv-transfer-config") + 1])
    kv["kv_connector_extra_config"]["lmcache.mp.port"] = port
    assert serve_argv[serve_argv.index("--block-size") + 1] == str(U.BLOCK_SIZE)

    model = U.build_tiny_llama(tmp_path / "model", seed=9)
    with LMCacheServer(tmp_path / "l2", argv=server_argv, env=S.server_env()) as server:
        llm = U.make_llm(model, kv)
        try:
            tokens = U.prompt(N * U.CHUNK + 33, seed=31)
            cold, _ = S.save(llm, tmp_path / "l2", tokens, N)
            restored = U.generate(llm, tokens)
        finally:
            U.shutdown(llm)
        assert restored[2] == N * U.CHUNK
        assert restored[:2] == cold[:2]
        assert server.metric("bsr_restore_windows") >= 1
        assert server.metric("bsr_restores", outcome="ok") >= 1


def test_readme_autostart_line_parses_as_lmcache_parses_it():
    """The README's autostart line: LMCache's launcher reads its server arguments, and the server's own
    argument parser finds BSR's module with W in them (no server is started)."""
    import argparse

    from lmcache.integration.vllm.mp_server_launcher import MPServerAutostartConfig
    from lmcache.v1.multiprocess.config import add_mp_server_args, parse_args_to_mp_server_config

    line = re.search(r"^vllm serve .*lmcache\.mp\.autostart.*$", (S.ROOT / "README.md").read_text(), re.MULTILINE)
    assert line, "README has no autostart line"
    argv = shlex.split(line.group(0))
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    config = MPServerAutostartConfig.from_extra_config(extra, "localhost", extra["lmcache.mp.port"])
    assert config.enabled
    parser = argparse.ArgumentParser()
    add_mp_server_args(parser)
    args, _ = parser.parse_known_args(list(config.server_args))
    mp = parse_args_to_mp_server_config(args)
    assert mp.supported_transfer_mode == "lmcache_driven"
    (module,) = mp.server_modules
    assert module.module_path == "bsr_runtime.integrations.lmcache.server_module"
    assert module.config["prefetch_window_chunks"] == 32
