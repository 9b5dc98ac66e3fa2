"""A real `vllm serve` process for tests: started from the README's command line, on a free loopback
port, with this checkout's packages first on the path (the engine core and worker processes vLLM
spawns inherit it); HTTP requests, Prometheus metrics, and a stop that takes the whole process
group down.

The README's command runs as written with three substitutions: the `vllm` program of this Python
environment, the model (a tiny local one) and the filesystem tier's root (a temporary directory);
the settings of a small CPU machine are appended (CPU_ARGS).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bsr_harness.mooncake_launcher import free_port

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# the settings of a 2-core CPU machine without a tokenizer: eager (no torch.compile), float32, a small
# KV cache, prefill steps of one chunk (bit-identical output, README), prompts given as token ids
CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--kv-cache-memory-bytes", str(512 << 20),
            "--max-model-len", "8192", "--max-num-batched-tokens", "256", "--skip-tokenizer-init",
            "--enable-prompt-tokens-details"]
START_TIMEOUT_S = 480.0  # three processes import vLLM; minutes on a loaded 2-core machine


def readme_serve_argv() -> list[str]:
    """The README's `vllm serve ... --kv-transfer-config '<json>'` command line, split as a shell would."""
    m = re.search(r"^vllm serve .*--kv-transfer-config '\{.*\}'$", README.read_text(), re.MULTILINE)
    assert m, "README has no `vllm serve ... --kv-transfer-config '<json>'` line"
    return shlex.split(m.group(0))


def with_fs_root(argv: list[str], root: str | Path) -> list[str]:
    """`argv` with the filesystem tier's root of its --kv-transfer-config JSON replaced by `root`."""
    i = argv.index("--kv-transfer-config") + 1
    kv = json.loads(argv[i])
    (fs,) = [t for t in kv["kv_connector_extra_config"]["tiers"] if t["type"] == "filesystem"]
    fs["root"] = str(root)
    return [*argv[:i], json.dumps(kv), *argv[i + 1:]]


class VllmServer:
    """`vllm serve` as a child process group. `argv` starts with "vllm", "serve", the model."""

    def __init__(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None) -> None:
        assert argv[:2] == ["vllm", "serve"], argv
        self.model = argv[2]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        program = str(Path(sys.executable).parent / "vllm")
        self.argv = [program, *argv[1:], "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as deployed: the engine core in its own process
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.log_path.parent, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{shlex.join(self.argv)}` exited with code {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer /health in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)
        return self

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

    def complete(self, tokens: list[int], max_tokens: int = 8) -> dict:
        """A greedy /v1/completions request for a prompt of token ids, with each token's logprob."""
        return self.post("/v1/completions", {
            "model": self.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})

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

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the engine core and worker, should they linger
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


def completion_tokens(resp: dict) -> tuple[list[int], list[float]]:
    """(generated token ids, their logprobs) of a /v1/completions response."""
    choice = resp["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def cached_tokens(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]
