"""Start and stop a local `mooncake_master` (Mooncake store master with its HTTP metadata server).

Used by the tests, the benchmarks and `bsr` on one machine. Everything binds to 127.0.0.1 where
the binary lets us choose (`--rpc_address`, `--http_metadata_server_host`, `--metrics_host`);
note that mooncake_master 0.3.13 listens for the HTTP metadata server on all interfaces even
with `--http_metadata_server_host=127.0.0.1` (seen with `ss -ltn`), so only run it on machines
where that is acceptable. Each instance gets its own free ports and its own temporary directory,
which is the master's working directory and holds its log (glog to stderr, redirected; no log
files are written anywhere else, snapshots stay off).

    with MooncakeMaster() as m:
        tier = MooncakeTier(chunk_bytes, fp, m.master_address, m.metadata_server)

The master sleeps a fixed 1 s after starting the metadata server before it serves RPC, so
start() takes a little over a second.

Any thread may start, restart or stop a master. Children get PR_SET_PDEATHSIG=SIGKILL, which
Linux ties to the *thread* that forked them, so every child is forked by one spawner thread
that lives as long as the process: a master started from a short-lived worker thread outlives
that thread and still dies with the process (normal exit: the finalizer; SIGKILL: the death
signal).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from pathlib import Path

from bsr_harness.process_spawner import Spawner, kill_quietly, stop_process

HOST = "127.0.0.1"


class MooncakeMasterError(RuntimeError):
    """The master could not be found or did not start."""


def find_master_binary() -> str:
    """`mooncake_master` next to sys.executable (the venv's bin/) or on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise MooncakeMasterError(
        "mooncake_master not found next to the Python interpreter or on PATH; "
        "install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA)"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def fill_free_ports(ports: list[int | None]) -> list[int]:
    """`ports` with each None replaced by a distinct free port (sockets are held until all are
    picked, so the OS cannot hand out one port twice)."""
    held: list[socket.socket] = []
    try:
        out = []
        for port in ports:
            if port is None:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((HOST, 0))
                port = s.getsockname()[1]
            out.append(port)
        return out
    finally:
        for s in held:
            s.close()


def port_answers(port: int, host: str = HOST, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


_HELP_CACHE: dict[str, str] = {}


def _binary_help(binary: str) -> str:
    if binary not in _HELP_CACHE:
        try:
            out = subprocess.run([binary, "--helpshort"], capture_output=True, text=True, timeout=20)
            text = out.stdout + out.stderr
            if "enable_multi_tenants" not in text:  # the flags live outside the "main" module
                out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20)
                text = out.stdout + out.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        _HELP_CACHE[binary] = text
    return _HELP_CACHE[binary]


def supports_multi_tenants(binary: str | None = None) -> bool:
    """Whether this mooncake_master has `--enable_multi_tenants` (strict tenant namespaces)."""
    return "enable_multi_tenants" in _binary_help(binary or find_master_binary())


def _check_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be a finite number of seconds in (0, {threading.TIMEOUT_MAX:g}], got {value!r}")
    return float(value)


def _check_port(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536):
        raise ValueError(f"{name} must be a TCP port number in 1..65535, got {value!r}")
    return value


class MooncakeMaster:
    """A `mooncake_master` child process on 127.0.0.1 with its embedded HTTP metadata server.

    - ports: `rpc_port`, `http_port`, `metrics_port` (free ports unless given); restart() reuses them
    - `master_address` = "127.0.0.1:RPC", `metadata_server` = "http://127.0.0.1:HTTP/metadata"
    - tenants: {name: quota_bytes} turns on `--enable_multi_tenants` with a file quota policy
      written to the temp dir (clients then pass `tenant_id`; unregistered tenants cannot write)
    - the log (`log_path`) lives in a temp dir removed by stop() unless keep_logs
    - any thread may start/stop it: the child is forked by the process-wide spawner thread with
      PR_SET_PDEATHSIG=SIGKILL, so it dies with this process (not with the calling thread), and a
      finalizer kills it if this object is dropped or the interpreter exits
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        tenants: dict[str, int] | None = None,
        enable_multi_tenants: bool = False,
        client_ttl_s: int | None = None,
        default_kv_lease_ttl_ms: int | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        start_timeout_s: float = 20.0,
        stop_timeout_s: float = 5.0,
        keep_logs: bool = False,
    ) -> None:
        for name, port in (("rpc_port", rpc_port), ("http_port", http_port), ("metrics_port", metrics_port)):
            _check_port(name, port)
        self.binary = binary or find_master_binary()
        self.rpc_port, self.http_port, self.metrics_port = fill_free_ports([rpc_port, http_port, metrics_port])
        self.tenants = dict(tenants or {})
        self.enable_multi_tenants = enable_multi_tenants or bool(self.tenants)
        self.client_ttl_s = client_ttl_s
        self.default_kv_lease_ttl_ms = default_kv_lease_ttl_ms
        self.extra_args = list(extra_args)
        self.start_timeout_s = _check_seconds("start_timeout_s", start_timeout_s)
        self.stop_timeout_s = _check_seconds("stop_timeout_s", stop_timeout_s)
        if client_ttl_s is not None:
            _check_seconds("client_ttl_s", client_ttl_s)
        if default_kv_lease_ttl_ms is not None:
            _check_seconds("default_kv_lease_ttl_ms", default_kv_lease_ttl_ms)
        self.keep_logs = keep_logs
        self.workdir: Path | None = None
        self.log_path: Path | None = None
        self.start_seconds: float | None = None  # wall time of the last successful start()
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._finalizer: weakref.finalize | None = None
        if len({self.rpc_port, self.http_port, self.metrics_port}) != 3:
            raise ValueError("rpc, http and metrics ports must differ")
        if self.enable_multi_tenants and not supports_multi_tenants(self.binary):
            raise MooncakeMasterError(f"{self.binary} has no --enable_multi_tenants flag")

    # -- addresses -------------------------------------------------------------------------
    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    def segments(self) -> set[str]:
        """The segments the master has mounted now (its /get_all_segments: "host:port" per line)."""
        url = f"http://{HOST}:{self.metrics_port}/get_all_segments"
        with urllib.request.urlopen(url, timeout=5) as r:
            return set(r.read().decode().split())

    def _http(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}{path}", timeout=5) as r:
            return r.read()

    def keys(self) -> set[str]:
        """Every key the master lists now (its /get_all_keys)."""
        return set(self._http("/get_all_keys").decode().split())

    def placement(self, keys: list[str]) -> dict[str, list[str]]:
        """key -> the segments (store hosts) holding a copy of it, as the master lists them now (its
        /batch_query_keys; [] for a key it does not list)."""
        out: dict[str, list[str]] = {}
        for i in range(0, len(keys), 64):  # short URLs
            batch = keys[i : i + 64]
            query = urllib.parse.urlencode({"keys": ",".join(batch)})
            found = json.loads(self._http(f"/batch_query_keys?{query}"))["data"]
            for key in batch:
                entry = found.get(key) or {}
                out[key] = [v["transport_endpoint_"] for v in (entry.get("values") or [])] if entry.get("ok") else []
        return out

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------
    def _args(self) -> list[str]:
        assert self.workdir is not None
        args = [
            self.binary,
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr=true",  # glog to stderr (our log file), never to /tmp/*.INFO
            "--enable_metric_reporting=false",  # no periodic metrics line every few seconds
            "--enable_snapshot=false",
        ]
        if self.client_ttl_s is not None:
            args.append(f"--client_ttl={int(self.client_ttl_s)}")
        if self.default_kv_lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={int(self.default_kv_lease_ttl_ms)}")
        if self.enable_multi_tenants:
            policy = self.workdir / "tenant_quotas.yaml"
            lines = ["version: 1", "", "tenants:"]
            for name, quota in self.tenants.items():
                lines += [f"  - name: {name}", f"    quota: {int(quota)}"]
            if not self.tenants:
                lines[-1] = "tenants: []"
            policy.write_text("\n".join(lines) + "\n")
            args += [
                "--enable_multi_tenants=true",
                "--tenant_quota_connector_type=file",
                f"--tenant_quota_connector_uri={policy}",
            ]
        return args + self.extra_args

    def start(self) -> MooncakeMaster:
        if self.running():
            return self
        for port in (self.rpc_port, self.http_port, self.metrics_port):
            if port_answers(port):
                raise MooncakeMasterError(f"port {port} on {HOST} is already in use")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="bsr-mooncake-master-"))
            self.log_path = self.workdir / "mooncake_master.log"
        args = self._args()
        assert self.log_path is not None
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"==== start {' '.join(args)}\n".encode())
        self._log.flush()
        t0 = time.monotonic()
        self._proc = Spawner.popen(args, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=self._log,
                                    stderr=subprocess.STDOUT)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, kill_quietly, self._proc)
        try:
            self._wait_ready(t0 + self.start_timeout_s)
        except BaseException:
            self.stop()  # the error carries the log tail; the workdir goes unless keep_logs
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self, deadline: float) -> None:
        rpc_ok = http_ok = False
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise MooncakeMasterError(
                    f"mooncake_master exited with code {self._proc.returncode} during start\n{self.log_tail()}"
                )
            rpc_ok = rpc_ok or port_answers(self.rpc_port)
            http_ok = http_ok or self._metadata_answers()
            if rpc_ok and http_ok:
                return
            if time.monotonic() > deadline:
                raise MooncakeMasterError(
                    f"mooncake_master did not answer within {self.start_timeout_s:.0f}s "
                    f"(rpc port {self.rpc_port}: {'up' if rpc_ok else 'down'}, "
                    f"metadata server {self.http_port}: {'up' if http_ok else 'down'})\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _metadata_answers(self) -> bool:
        url = f"{self.metadata_server}?key=bsr-readiness-probe"
        try:
            with urllib.request.urlopen(url, timeout=0.5):
                return True
        except urllib.error.HTTPError:
            return True  # 404 "metadata not found": the server is up
        except (OSError, ValueError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _terminate(self) -> None:
        proc = self._proc
        if proc is not None:
            stop_process(proc, self.stop_timeout_s)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._log is not None:
            with contextlib.suppress(Exception):
                self._log.close()
            self._log = None

    def stop(self, *, remove_workdir: bool | None = None) -> None:
        """SIGTERM, then SIGKILL after stop_timeout_s; reaps the child. Idempotent."""
        self._terminate()
        remove = (not self.keep_logs) if remove_workdir is None else remove_workdir
        if remove and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
            self.log_path = None

    def kill(self) -> None:
        """SIGKILL without waiting for a graceful exit (crash tests); keeps the workdir."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._terminate()

    def restart(self) -> MooncakeMaster:
        """Stop and start again on the same ports (all objects and registrations are lost)."""
        self.stop(remove_workdir=False)
        deadline = time.monotonic() + self.start_timeout_s
        while any(port_answers(p) for p in (self.rpc_port, self.http_port, self.metrics_port)):
            if time.monotonic() > deadline:
                raise MooncakeMasterError("ports still busy after stopping the master")
            time.sleep(0.05)
        return self.start()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"MooncakeMaster({self.master_address}, {self.metadata_server}, {state})"
