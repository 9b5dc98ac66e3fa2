"""LMCache's multiprocess server as a child process, on free loopback ports, with or without BSR's
server module: for the tests, the README quick start's check and the server benchmarks.

    with LMCacheServer(l2_dir, l1_size_gb=0.5, window_chunks=4) as server:
        kv = server.kv_transfer_config()        # vLLM's LMCacheMPConnector pointed at it
        ...
        server.metrics()                        # its Prometheus output (LMCache's and BSR's gauges)

Every wait is bounded: the start (the port answers) and the stop (SIGTERM, then SIGKILL). The
child dies with this process (process_spawner). Nothing here imports LMCache.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .mooncake_launcher import fill_free_ports, port_answers
from .process_spawner import Spawner, stop_process

SERVER_MODULE = "bsr_runtime.integrations.lmcache.server_module"


class LMCacheServerError(RuntimeError):
    pass


def server_module_arg(window_chunks: int, **config) -> str:
    """The --server-module JSON of BSR's module (prefetch_window_chunks = W, other config keys)."""
    return json.dumps({"module_path": SERVER_MODULE, "config": {"prefetch_window_chunks": window_chunks, **config}})


def fs_l2_arg(base_path: str | os.PathLike, *, checked: bool = False) -> str:
    """--l2-adapter JSON: LMCache's own FS adapter, or (`checked`) BSR's FS plugin whose object files
    carry a header and a CRC (a damaged file is refused at load)."""
    if not checked:
        return json.dumps({"type": "fs", "base_path": os.fspath(base_path)})
    return json.dumps({"type": "plugin", "module_path": "bsr_runtime.integrations.lmcache.fs_l2",
                       "class_name": "ConcurrentFSL2Adapter", "adapter_params": {"base_path": os.fspath(base_path)}})


class LMCacheServer:
    """One `python -m lmcache.v1.multiprocess.server` child (lmcache_driven transfer on CPU)."""

    def __init__(self, l2_dir: str | os.PathLike, *, l1_size_gb: float = 0.5, window_chunks: int | None = None,
                 module_config: dict | None = None, checked_fs: bool = False, l2_adapter: str | None = None,
                 port: int | None = None,
                 transfer_mode: str = "lmcache_driven", extra_args: list[str] | None = None,
                 start_timeout_s: float = 60.0, stop_timeout_s: float = 10.0, env: dict | None = None,
                 argv: list[str] | None = None) -> None:
        self.l2_dir = Path(l2_dir)
        self.l1_size_gb, self.window_chunks = l1_size_gb, window_chunks
        self.module_config = module_config or {}
        self.checked_fs, self.transfer_mode = checked_fs, transfer_mode
        self.l2_adapter = l2_adapter  # --l2-adapter JSON of its own (default: fs_l2_arg)
        self.extra_args = list(extra_args or [])
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.port, self.metrics_port = fill_free_ports([port, None])
        self.argv = argv  # a command line of its own (the README's); its --port and --prometheus-port are used
        if argv is not None:
            self.port = int(argv[argv.index("--port") + 1])
            self.metrics_port = int(argv[argv.index("--prometheus-port") + 1])
        self.env = env
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None

    def args(self) -> list[str]:
        if self.argv is not None:
            return list(self.argv)
        args = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost",
                "--port", str(self.port), "--chunk-size", "256", "--l1-size-gb", str(self.l1_size_gb),
                "--no-l1-use-lazy", "--eviction-policy", "LRU", "--supported-transfer-mode", self.transfer_mode,
                "--l2-adapter", self.l2_adapter or fs_l2_arg(self.l2_dir, checked=self.checked_fs),
                "--prometheus-port", str(self.metrics_port)]
        if self.window_chunks is not None:
            args += ["--server-module", server_module_arg(self.window_chunks, **self.module_config)]
        return args + self.extra_args

    def start(self) -> LMCacheServer:
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        fd, log = tempfile.mkstemp(prefix="lmcache-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self._proc = Spawner.popen(self.args(), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(time.monotonic() + self.start_timeout_s)
        return self

    def _wait_ready(self, deadline: float) -> None:
        while not port_answers(self.port, "127.0.0.1"):
            if self._proc.poll() is not None:
                raise LMCacheServerError(f"LMCache server exited ({self._proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise LMCacheServerError(f"LMCache server did not listen within {self.start_timeout_s}s:\n"
                                         f"{self.log_tail()}")
            time.sleep(0.1)

    def run_to_exit(self, timeout_s: float = 60.0) -> tuple[int, str]:
        """Start the server expecting it to refuse: (exit code, its output), bounded."""
        env = {**os.environ, **(self.env or {})}
        try:
            proc = subprocess.run(self.args(), capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as e:
            raise LMCacheServerError(f"LMCache server still running after {timeout_s}s") from e
        return proc.returncode, proc.stdout + proc.stderr

    def kv_transfer_config(self, *, policy: str = "recompute", **extra) -> dict:
        """vLLM's kv_transfer_config of an engine with LMCache's LMCacheMPConnector on this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mp_transfer_mode": self.transfer_mode, **extra}}

    def metrics(self, timeout_s: float = 5.0) -> str:
        """The server's Prometheus output."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the Prometheus output (the first whose labels include `labels`)."""
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, rest = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in rest for k, v in labels.items()):
                return float(value)
        return None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (the server's KeyboardInterrupt path closes it), SIGKILL after stop_timeout_s."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, self.stop_timeout_s)
        if self._log is not None:
            with contextlib.suppress(Exception):
                self._log.close()
            self._log = None

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
