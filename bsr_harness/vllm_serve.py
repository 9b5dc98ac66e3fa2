"""A real `vllm serve` process: started on a free loopback port with this checkout's packages first on
the path (the processes vLLM spawns inherit it); HTTP requests, Prometheus metrics, the memory of its
processes, and a stop that takes the whole process group down. Shared by the tests (tests/vllm_server.py
adds the README's command line) and the benchmarks that drive several engines.

The settings of a small CPU machine are appended to the command (CPU_ARGS).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bsr_harness.mooncake_launcher import free_port
from bsr_harness.process_spawner import stop_process

REPO = Path(__file__).resolve().parent.parent
# the settings of a 2-core CPU machine without a tokenizer: eager (no torch.compile), float32, a small
# KV cache, prefill steps of one chunk (bit-identical output, README), prompts given as token ids
CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--kv-cache-memory-bytes", str(512 << 20),
            "--max-model-len", "8192", "--max-num-batched-tokens", "256", "--skip-tokenizer-init",
            "--enable-prompt-tokens-details"]
START_TIMEOUT_S = 480.0  # three processes import vLLM; minutes on a loaded 2-core machine


class VllmServer:
    """`vllm serve` as a child process group. `argv` starts with "vllm", "serve", the model.

    `worker_in_engine_core`: vLLM's worker runs in the engine core's process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0; the API server and the engine core stay two processes) instead
    of a process of its own, as deployed: two processes importing vLLM instead of three, which halves
    the start of two engines on a 2-core machine (37 s against 71 s here)."""

    def __init__(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                 worker_in_engine_core: bool = False) -> None:
        assert argv[:2] == ["vllm", "serve"], argv
        self.model = argv[2]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        program = str(Path(sys.executable).parent / "vllm")
        self.argv = [program, *argv[1:], "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as deployed: the engine core in its own process
        if worker_in_engine_core:
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def launch(self) -> VllmServer:
        """Start the process; wait_ready() waits for it (start several, then wait for all)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.log_path.parent, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{shlex.join(self.argv)}` exited with code {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer /health in {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)
        return self

    def start(self) -> VllmServer:
        return self.launch().wait_ready()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else "(no log)"

    def post(self, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body or {}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path}: HTTP {e.code}: {e.read()[:2000]!r}\nserver log:\n{self.log_tail()}") \
                from None

    def completion_body(self, tokens: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> dict:
        body = {"model": self.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
                "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
        return body if cache_salt is None else {**body, "cache_salt": cache_salt}

    def complete(self, tokens: list[int], max_tokens: int = 8, *, cache_salt: str | None = None,
                 timeout: float = 300.0) -> dict:
        """A greedy /v1/completions request for a prompt of token ids, with each token's logprob
        (`cache_salt`: a key space of its own, in vLLM's prefix cache and BSR's keys alike)."""
        return self.post("/v1/completions", self.completion_body(tokens, max_tokens, cache_salt), timeout)

    def abandon(self, tokens: list[int], after_s: float, max_tokens: int = 64) -> bool:
        """A completion the client gives up on after `after_s` (it closes the connection: vLLM aborts the
        request). True when it was abandoned, False when it finished first."""
        try:
            self.complete(tokens, max_tokens, timeout=after_s)
        except (TimeoutError, urllib.error.URLError):
            return True
        return False

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The /metrics samples: (name, sorted labels without model_name/engine) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
                out[(s.name, labels)] = s.value
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server's processes (its process group) now."""
        import psutil

        if self.proc is None:
            return 0
        total = 0
        for p in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == self.proc.pid:
                    total += p.memory_info().rss
        return total

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        stop_process(self.proc, 30.0)  # the leader: SIGTERM again (no-op), SIGKILL after 30 s, reaped
        with contextlib.suppress(ProcessLookupError):  # the engine core and worker, should they linger
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


def completion_tokens(resp: dict) -> tuple[list[int], list[float]]:
    """(generated token ids, their logprobs) of a /v1/completions response."""
    choice = resp["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def cached_tokens(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def bsr_value(metrics: dict, name: str, **labels: str) -> float:
    """One sample of VllmServer.metrics() (0 when absent)."""
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)
