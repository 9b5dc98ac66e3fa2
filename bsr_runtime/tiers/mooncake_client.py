"""Connecting a Mooncake store client (`mooncake.store.MooncakeDistributedStore`) in bounded time.

Shared by MooncakeTier and the LMCache Mooncake L2 plugin.

Mooncake return codes seen with 0.3.13 over tcp (see the report in the tests):
- batch_get_into[_multi_buffers]: bytes read per key, -704 OBJECT_NOT_FOUND for a missing key,
  -600 INVALID_PARAMS when the object is larger than the buffers (and when the client is not
  set up), -800 when it is smaller (multi buffers), -900 RPC_FAIL / -901 RPC_TIMEOUT when the
  master is gone or hung, -800 TRANSFER_FAIL when the store host holding the object is lost (after
  ~1 s of the transfer engine's reconnection attempts; at once when it dies mid-transfer)
- batch_is_exist: 1 / 0 per key, negative error codes (e.g. -900) per key on failure
- remove: -706 OBJECT_HAS_LEASE for 10 s after a read unless force=True (delete forces)
- setup() with no master: retries MC_STORE_CLIENT_SETUP_RETRIES (default 20) times, ~4.4 s
  each (~90 s), then returns -1; it holds the GIL while it does. The tier first connects to
  the master and metadata ports (a refused connection fails at once) and bounds setup by
  (2 retries) x MC_RPC_TIMEOUT_MS <= connect_timeout_s
- master RPCs wait up to MC_RPC_TIMEOUT_MS (default 30 s) on a hung master; the tier uses
  `rpc_timeout_s` (5 s) instead

Process-wide settings. The client reads a few environment variables when it is created; the
tier sets these for the duration of setup() unless the user has set them: MC_TCP_BIND_ADDRESS
(the address the client advertises to peers: `local_hostname`, so tcp traffic stays on
loopback in tests; the client still listens on all interfaces, which the library does not
let us change), MC_RPC_TIMEOUT_MS and MC_RPC_CONNECT_TIMEOUT_MS, MC_STORE_CLIENT_SETUP_RETRIES.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from urllib.parse import urlparse

from .base import TierError, TierUnavailableError

# Mooncake ErrorCode values (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200
RPC_FAIL = -900
RPC_TIMEOUT = -901
TRANSFER_FAIL = -800  # the transfer failed: the store host holding the object does not answer (or, for
# batch_get_into_multi_buffers, an object smaller than its buffers: the tier checks the size first)
UNREACHABLE = {RPC_FAIL, RPC_TIMEOUT}

_ENV_LOCK = threading.Lock()


def per_key(results: list, n: int, op: str) -> list:
    if len(results) != n:
        raise TierError(f"Mooncake {op} returned {len(results)} results for {n} keys")
    return results


def check_port(host: str, port: int, timeout: float, what: str) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as e:
        raise TierUnavailableError(f"Mooncake {what} {host}:{port} does not answer: {e}") from e


def split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def connect_store(master_address: str, metadata_server: str, *, protocol: str, local_hostname: str,
                  global_segment_size: int, local_buffer_size: int, device_name: str,
                  connect_timeout_s: float, rpc_timeout_s: float, tenant_id: str):
    """(set-up client, effective RPC timeout in s). Raises TierUnavailableError within about
    connect_timeout_s when the master or metadata server does not answer or setup() fails."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # pragma: no cover - depends on the install
        raise TierUnavailableError(f"mooncake.store cannot be imported: {e}") from e

    deadline = time.monotonic() + connect_timeout_s
    # Fail fast (connection refused is immediate) before setup(), which retries for ~90 s.
    mhost, mport = split_hostport(master_address)
    check_port(mhost, mport, connect_timeout_s, "master")
    url = urlparse(metadata_server)
    if url.scheme in ("http", "https") and url.hostname:
        check_port(url.hostname, url.port or 80, max(0.1, deadline - time.monotonic()), "metadata server")

    store = MooncakeDistributedStore()
    # setup() holds the GIL in 0.3.13, so the worker thread below cannot time it out by
    # itself: what bounds it is (retries) x (RPC timeout) <= connect_timeout_s. A retry
    # only helps when the randomly chosen client port collides with another client's.
    retries = 2
    rpc_ms = max(200, int(1000 * min(rpc_timeout_s, connect_timeout_s / (retries + 0.5))))
    env = {
        "MC_RPC_TIMEOUT_MS": str(rpc_ms),
        "MC_RPC_CONNECT_TIMEOUT_MS": str(rpc_ms),
        "MC_STORE_CLIENT_SETUP_RETRIES": str(retries),
    }
    if protocol == "tcp":
        env["MC_TCP_BIND_ADDRESS"] = local_hostname
    args = (local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, device_name,
            master_address, None, False, "", tenant_id)
    _setup_bounded(store, args, env, deadline, f"Mooncake setup against {master_address}", connect_timeout_s)
    return store, rpc_ms / 1000


def _setup_bounded(store, args: tuple, env: dict[str, str], deadline: float, what: str, timeout_s: float) -> None:
    """store.setup(*args) on a thread with `env` set (unless the user set it), given up at deadline."""
    result: dict = {}
    abandoned = threading.Event()
    handoff = threading.Lock()  # makes "caller gave up" vs "setup returned" atomic

    def run_setup() -> None:
        try:
            result["rc"] = store.setup(*args)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            result["exc"] = e
        with handoff:
            result["done"] = True
            gave_up = abandoned.is_set()
        if gave_up:  # the caller gave up: do not leave a half-open client behind
            with contextlib.suppress(Exception):
                store.close()

    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        for k, v in env.items():
            if saved[k] is None:
                os.environ[k] = v
        try:
            th = threading.Thread(target=run_setup, name="bsr-mooncake-setup", daemon=True)
            th.start()
            th.join(max(0.1, deadline - time.monotonic()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
    with handoff:
        timed_out = not result.get("done")
        if timed_out:
            abandoned.set()
    if timed_out:
        raise TierUnavailableError(f"{what} did not finish within {timeout_s:.1f}s")
    if "exc" in result:
        raise TierUnavailableError(f"Mooncake setup failed: {result['exc']}") from result["exc"]
    if result.get("rc") != 0:
        with contextlib.suppress(Exception):
            store.close()
        raise TierUnavailableError(f"{what} returned {result.get('rc')}")
