"""A real `vllm serve` process for tests: started from the README's command line, on a free loopback
port, with this checkout's packages first on the path (the engine core and worker processes vLLM
spawns inherit it); HTTP requests, Prometheus metrics, and a stop that takes the whole process
group down (the server itself: bsr_harness.vllm_serve).

The README's command runs as written with three substitutions: the `vllm` program of this Python
environment, the model (a tiny local one) and the filesystem tier's root (a temporary directory);
the settings of a small CPU machine are appended (CPU_ARGS).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from bsr_harness.vllm_serve import (  # noqa: F401 - the tests' names for the harness's server
    CPU_ARGS,
    START_TIMEOUT_S,
    VllmServer,
    bsr_value,
    cached_tokens,
    completion_tokens,
)

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


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
