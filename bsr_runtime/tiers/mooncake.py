"""MooncakeTier: chunks in a Mooncake store (`mooncake.store.MooncakeDistributedStore`).

Data path
- register_staging(buffer) registers the staging pool's buffer once (`register_buffer`), and
  fetch() runs `batch_get_into(keys, ptrs, sizes)` straight into the slot views on a worker
  thread (the call releases the GIL), so a fetch is asynchronous and never copies a window.
- A view (fetch target or put source) that does not lie inside a registered buffer is
  registered for the duration of the call and unregistered afterwards (contiguous views are
  coalesced into one registration). Over TCP the client would also accept unregistered local
  memory, but over RDMA it must be registered, so the tier always registers.
- put() uses `batch_upsert_from` (zero copy from registered memory). `batch_put_from` on an
  existing key returns 0 but keeps the old object; upsert replaces it, which is the overwrite
  the Tier contract asks for.

Integrity. Mooncake does not check what it returns, so every chunk has a companion object
`key + ".meta"` (magic, version, length, CRC-32C or zlib CRC-32, fingerprint). put() writes all of a
window's records with one `upsert_batch`; fetch() reads them with one `get_batch` and checks
the crc of the landed bytes; probe() asks `batch_is_exist` once for the chunks and their
records together. A chunk whose record is gone (evicted separately) counts as absent.
`verify=False` skips the crc (the record is still written, read and checked for length and
fingerprint).

Mooncake return codes seen with 0.3.13 over tcp (see the report in the tests):
- batch_get_into: bytes read per key, -704 OBJECT_NOT_FOUND for a missing key, -600
  INVALID_PARAMS when the object is larger than the buffer (and when the client is not set
  up), -900 RPC_FAIL / -901 RPC_TIMEOUT when the master is gone or hung
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

Threads: one pool of `fetch_workers` Python threads (joined by close()); the Mooncake client
runs its own native threads (heartbeat, transfer engine), which its close() stops.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from ._common import CRC32, CRC32C, DEFAULT_CHECKSUM, payload_crc
from .base import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
)

META_SUFFIX = ".meta"
_META_MAGIC = b"BSRM"
# version 1: crc is zlib CRC-32; version 2: CRC-32C (google_crc32c, ~6x faster here)
_META_VERSIONS = {1: CRC32, 2: CRC32C}
_META_VERSION = 2 if DEFAULT_CHECKSUM == CRC32C else 1
_META = struct.Struct("<4sHHQI")  # magic, version, fingerprint length, object length, checksum

# Mooncake ErrorCode values (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200
RPC_FAIL = -900
RPC_TIMEOUT = -901
_UNREACHABLE = {RPC_FAIL, RPC_TIMEOUT}

_ENV_LOCK = threading.Lock()


def meta_key(key: str) -> str:
    return key + META_SUFFIX


def encode_meta(fingerprint: str, length: int, crc: int) -> bytes:
    fp = fingerprint.encode()
    return _META.pack(_META_MAGIC, _META_VERSION, len(fp), length, crc) + fp


def decode_meta(blob: bytes) -> tuple[str, int, int, int]:
    """(fingerprint, length, checksum algorithm, checksum) from a record; ValueError if it is not one."""
    if len(blob) < _META.size:
        raise ValueError(f"integrity record of {len(blob)} B is too short")
    magic, version, fp_len, length, crc = _META.unpack_from(blob)
    if magic != _META_MAGIC or version not in _META_VERSIONS or len(blob) != _META.size + fp_len:
        raise ValueError("not a BSR integrity record")
    return blob[_META.size :].decode(errors="replace"), length, _META_VERSIONS[version], crc


def crc32_of(view: torch.Tensor, algo: int = DEFAULT_CHECKSUM) -> int:
    t = view if view.device.type == "cpu" else view.cpu()
    return payload_crc(algo, t.numpy())


def _per_key(results: list, n: int, op: str) -> list:
    if len(results) != n:
        raise TierError(f"Mooncake {op} returned {len(results)} results for {n} keys")
    return results


def _check_port(host: str, port: int, timeout: float, what: str) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as e:
        raise TierUnavailableError(f"Mooncake {what} {host}:{port} does not answer: {e}") from e


def _split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


class MooncakeTier(Tier):
    """A tier backed by a Mooncake store; see the module docstring for the data path."""

    name = "mooncake"

    def __init__(
        self,
        chunk_bytes: int,
        fingerprint: str,
        master_address: str,
        metadata_server: str,
        *,
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 512 << 20,
        local_buffer_size: int = 16 << 20,
        device_name: str = "",
        connect_timeout_s: float = 10.0,
        rpc_timeout_s: float = 5.0,
        tenant_id: str = "default",
        verify: bool = True,
        fetch_workers: int = 2,
    ) -> None:
        super().__init__(chunk_bytes, fingerprint)
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.master_address = master_address
        self.metadata_server = metadata_server
        self.protocol = protocol
        self.local_hostname = local_hostname
        self.tenant_id = tenant_id
        self.verify = verify
        self.connect_timeout_s = connect_timeout_s
        self._regions: list[tuple[int, int]] = []  # permanently registered [start, end)
        self._temp_regs: dict[int, tuple[int, int]] = {}  # ptr -> (size, refcount)
        self._reg_lock = threading.Lock()
        self._closing = threading.Event()
        self._closed = False
        self._store = None
        self._pending: dict[int, FetchHandle] = {}  # FetchHandle is unhashable (dataclass eq)
        self._pending_lock = threading.Lock()
        self.stats = {"fetches": 0, "puts": 0, "meta_ops": 0, "temp_registrations": 0}

        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # pragma: no cover - depends on the install
            raise TierUnavailableError(f"mooncake.store cannot be imported: {e}") from e

        deadline = time.monotonic() + connect_timeout_s
        # Fail fast (connection refused is immediate) before setup(), which retries for ~90 s.
        mhost, mport = _split_hostport(master_address)
        _check_port(mhost, mport, connect_timeout_s, "master")
        url = urlparse(metadata_server)
        if url.scheme in ("http", "https") and url.hostname:
            _check_port(url.hostname, url.port or 80, max(0.1, deadline - time.monotonic()), "metadata server")

        store = MooncakeDistributedStore()
        # setup() holds the GIL in 0.3.13, so the worker thread below cannot time it out by
        # itself: what bounds it is (retries) x (RPC timeout) <= connect_timeout_s. A retry
        # only helps when the randomly chosen client port collides with another client's.
        retries = 2
        rpc_ms = max(200, int(1000 * min(rpc_timeout_s, connect_timeout_s / (retries + 0.5))))
        self.rpc_timeout_s = rpc_ms / 1000
        env = {
            "MC_RPC_TIMEOUT_MS": str(rpc_ms),
            "MC_RPC_CONNECT_TIMEOUT_MS": str(rpc_ms),
            "MC_STORE_CLIENT_SETUP_RETRIES": str(retries),
        }
        if protocol == "tcp":
            env["MC_TCP_BIND_ADDRESS"] = local_hostname
        result: dict = {}
        abandoned = threading.Event()
        handoff = threading.Lock()  # makes "caller gave up" vs "setup returned" atomic

        def run_setup() -> None:
            try:
                result["rc"] = store.setup(
                    local_hostname,
                    metadata_server,
                    global_segment_size,
                    local_buffer_size,
                    protocol,
                    device_name,
                    master_address,
                    None,
                    False,
                    "",
                    tenant_id,
                )
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
            raise TierUnavailableError(
                f"Mooncake setup against {master_address} did not finish within {connect_timeout_s:.1f}s"
            )
        if "exc" in result:
            raise TierUnavailableError(f"Mooncake setup failed: {result['exc']}") from result["exc"]
        if result.get("rc") != 0:
            with contextlib.suppress(Exception):
                store.close()
            raise TierUnavailableError(f"Mooncake setup against {master_address} returned {result.get('rc')}")
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=max(1, fetch_workers), thread_name_prefix="bsr-mooncake-fetch")

    # -- helpers ---------------------------------------------------------------------------
    def _live_store(self):
        if self._store is None or self._closed:
            raise TierUnavailableError("Mooncake tier is closed")
        return self._store

    def _check_views(self, keys: Sequence[str], views: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} views")
        for v in views:
            if v.dtype != torch.uint8 or v.numel() != self.chunk_bytes or not v.is_contiguous():
                raise ValueError(
                    f"views must be contiguous uint8 of {self.chunk_bytes} B, got {v.dtype} {tuple(v.shape)}"
                )

    def _covered(self, ptr: int, size: int) -> bool:
        return any(s <= ptr and ptr + size <= e for s, e in self._regions)

    def _register_missing(self, ptrs: Sequence[int]) -> list[int]:
        """Temporarily register the ranges of views outside any registered buffer; returns
        the pointers to release with _release()."""
        c = self.chunk_bytes
        outside = sorted({p for p in ptrs if not self._covered(p, c)})
        ranges: list[list[int]] = []
        for p in outside:
            if ranges and p <= ranges[-1][1]:
                ranges[-1][1] = max(ranges[-1][1], p + c)
            else:
                ranges.append([p, p + c])
        taken: list[int] = []
        store = self._store
        with self._reg_lock:
            try:
                for start, end in ranges:
                    size, n = self._temp_regs.get(start, (end - start, 0))
                    if n == 0:
                        rc = store.register_buffer(start, end - start)
                        if rc != 0:
                            raise self._registration_error(end - start, rc)
                        self.stats["temp_registrations"] += 1
                        size = end - start
                    elif size < end - start:
                        raise TierError("overlapping temporary registrations of different sizes")
                    self._temp_regs[start] = (size, n + 1)
                    taken.append(start)
            except BaseException:
                self._release_locked(taken)
                raise
        return taken

    def _release(self, taken: list[int]) -> None:
        if taken:
            with self._reg_lock:
                self._release_locked(taken)

    def _release_locked(self, taken: list[int]) -> None:
        for start in taken:
            size, n = self._temp_regs[start]
            if n <= 1:
                del self._temp_regs[start]
                if self._store is not None:
                    self._store.unregister_buffer(start)
            else:
                self._temp_regs[start] = (size, n - 1)

    def _master_answers(self) -> bool:
        try:
            _check_port(*_split_hostport(self.master_address), 0.5, "master")
            return True
        except TierUnavailableError:
            return False

    def _registration_error(self, size: int, rc: int) -> TierError:
        # registration publishes the buffer to the metadata server; with the master (and its
        # embedded metadata server) gone it fails with a bare -600
        if not self._master_answers():
            return TierUnavailableError(f"register_buffer({size} B) returned {rc}: the Mooncake master is down")
        return TierError(f"register_buffer({size} B) returned {rc}")

    def _error_for(self, key: str, code: int) -> TierError:
        if code == OBJECT_NOT_FOUND:
            return MissingObjectError(f"{key}: not in the Mooncake store")
        if code in _UNREACHABLE:
            return TierUnavailableError(f"{key}: Mooncake master unreachable (code {code})")
        if code == INVALID_PARAMS and self._store is not None:
            with contextlib.suppress(Exception):
                size = self._store.get_size(key)
                if size > self.chunk_bytes:
                    return CorruptObjectError(f"{key}: object of {size} B, expected {self.chunk_bytes} B")
        if code >= 0:
            return CorruptObjectError(f"{key}: object of {code} B, expected {self.chunk_bytes} B")
        return TierError(f"{key}: Mooncake error {code}")

    # -- Tier API --------------------------------------------------------------------------
    def register_staging(self, buffer: torch.Tensor) -> None:
        store = self._live_store()
        ptr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if self._covered(ptr, size):
            return
        rc = store.register_buffer(ptr, size)
        if rc != 0:
            raise self._registration_error(size, rc)
        self._regions.append((ptr, ptr + size))

    def unregister_staging(self, buffer: torch.Tensor) -> None:
        """Drop the registration made by register_staging (before the buffer is freed)."""
        ptr = buffer.data_ptr()
        for region in [r for r in self._regions if r[0] == ptr]:
            self._regions.remove(region)
            if self._store is not None:
                self._store.unregister_buffer(ptr)

    def probe(self, keys: Sequence[str]) -> list[bool]:
        store = self._live_store()
        keys = list(keys)
        if not keys:
            return []
        codes = _per_key(store.batch_is_exist(keys + [meta_key(k) for k in keys]), 2 * len(keys), "batch_is_exist")
        n = len(keys)
        for k, code in zip(keys + keys, codes, strict=True):
            if code < 0:
                if code in _UNREACHABLE:
                    raise TierUnavailableError(f"probe: Mooncake master unreachable (code {code})")
                raise TierError(f"probe of {k} failed with code {code}")
        present = [codes[i] == 1 and codes[n + i] == 1 for i in range(n)]
        return present

    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float) -> FetchHandle:
        self._live_store()
        keys = tuple(keys)
        self._check_views(keys, views)
        handle = FetchHandle(keys=keys, deadline=deadline)
        if not keys:
            handle.set_result(0)
            return handle
        views = list(views)
        with self._pending_lock:
            self._pending[id(handle)] = handle
        try:
            self._pool.submit(self._fetch_worker, handle, views)
        except RuntimeError as e:  # the pool is shut down: close() raced us
            with self._pending_lock:
                self._pending.pop(id(handle), None)
            raise TierUnavailableError("Mooncake tier is closed") from e
        return handle

    def _fetch_worker(self, handle: FetchHandle, views: list[torch.Tensor]) -> None:
        try:
            handle.set_result(self._fetch_now(list(handle.keys), views, handle.deadline))
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            handle.set_error(e)
        finally:
            with self._pending_lock:
                self._pending.pop(id(handle), None)

    def _fetch_now(self, keys: list[str], views: list[torch.Tensor], deadline: float) -> int:
        if time.monotonic() >= deadline:
            # Never start a transfer the caller has stopped waiting for (its slot may be reused).
            raise FetchTimeoutError(f"fetch of {len(keys)} objects started after its deadline")
        store = self._live_store()
        self.stats["fetches"] += 1
        self.stats["meta_ops"] += 1
        metas = _per_key(store.get_batch([meta_key(k) for k in keys]), len(keys), "get_batch")
        ptrs = [v.data_ptr() for v in views]
        taken = self._register_missing(ptrs)
        try:
            codes = _per_key(
                store.batch_get_into(keys, ptrs, [self.chunk_bytes] * len(keys)), len(keys), "batch_get_into"
            )
        finally:
            self._release(taken)
        for k, code in zip(keys, codes, strict=True):
            if code != self.chunk_bytes:
                raise self._error_for(k, code)
        for k, v, blob in zip(keys, views, metas, strict=True):
            if not blob:
                raise MissingObjectError(f"{k}: integrity record {meta_key(k)} is missing")
            try:
                fp, length, algo, crc = decode_meta(bytes(blob))
            except ValueError as e:
                raise CorruptObjectError(f"{k}: {e}") from e
            if fp != self.fingerprint:
                raise CorruptObjectError(f"{k}: written under fingerprint {fp[:16]}, expected {self.fingerprint[:16]}")
            if length != self.chunk_bytes:
                raise CorruptObjectError(f"{k}: recorded length {length}, expected {self.chunk_bytes}")
            if self.verify and crc32_of(v, algo) != crc:
                raise CorruptObjectError(f"{k}: crc32 mismatch")
        return len(keys) * self.chunk_bytes

    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor]) -> None:
        store = self._live_store()
        keys = list(keys)
        self._check_views(keys, views)
        if not keys:
            return
        metas = [encode_meta(self.fingerprint, self.chunk_bytes, crc32_of(v)) for v in views]
        ptrs = [v.data_ptr() for v in views]
        taken = self._register_missing(ptrs)
        try:
            codes = _per_key(
                store.batch_upsert_from(keys, ptrs, [self.chunk_bytes] * len(keys)), len(keys), "batch_upsert_from"
            )
        finally:
            self._release(taken)
        self.stats["puts"] += 1
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if bad:
            k, c = bad[0]
            if c in _UNREACHABLE:
                raise TierUnavailableError(f"put of {len(bad)} objects failed: master unreachable ({c})")
            hint = " (store full)" if c == NO_AVAILABLE_HANDLE else ""
            raise TierError(f"put of {len(bad)}/{len(keys)} objects failed, first {k}: code {c}{hint}")
        self.stats["meta_ops"] += 1
        rc = store.upsert_batch([meta_key(k) for k in keys], metas)
        if rc != 0:
            if rc in _UNREACHABLE:
                raise TierUnavailableError(f"writing integrity records failed: master unreachable ({rc})")
            raise TierError(f"writing {len(keys)} integrity records failed with code {rc}")

    def delete(self, keys: Sequence[str]) -> None:
        """Remove chunks and their records. force=True: a read leaves a lease (10 s by default)
        during which a plain remove returns OBJECT_HAS_LEASE; delete is an explicit eviction."""
        store = self._live_store()
        keys = list(keys)
        if not keys:
            return
        all_keys = keys + [meta_key(k) for k in keys]
        codes = _per_key(store.batch_remove(all_keys, True), len(all_keys), "batch_remove")
        bad = [(k, c) for k, c in zip(all_keys, codes, strict=True) if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            k, c = bad[0]
            raise self._error_for(k, c) if c in _UNREACHABLE else TierError(f"remove of {k} failed with {c}")

    def health(self) -> int:
        """Mooncake health_check(): 0 healthy, 1 not set up / closed, 2 master unreachable."""
        return 1 if self._store is None or self._closed else self._store.health_check()

    def close(self) -> None:
        """Stop the fetch workers (waiting for transfers in flight), unregister every buffer
        and close the client (its segment is unmounted: objects it hosted are gone)."""
        if self._closed:
            return
        self._closing.set()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._pending_lock:  # fetches cancelled before they started
            for h in self._pending.values():
                h.set_error(TierUnavailableError("Mooncake tier closed before the fetch ran"))
            self._pending.clear()
        self._closed = True
        store, self._store = self._store, None
        if store is None:
            return
        with self._reg_lock:
            for start in list(self._temp_regs):
                with contextlib.suppress(Exception):
                    store.unregister_buffer(start)
            self._temp_regs.clear()
        for start, _ in self._regions:
            with contextlib.suppress(Exception):
                store.unregister_buffer(start)
        self._regions.clear()
        with contextlib.suppress(Exception):
            store.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()
