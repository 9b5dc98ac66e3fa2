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

Integrity. Mooncake does not check what it returns, so every object carries a 128-byte header
(mooncake_object.py): magic, version, registration fingerprint, sha256 of the key, tenant,
payload length and CRC-32C. One chunk is one store object under one key:
- put() stages header + payload in a registered buffer and writes them with one
  `batch_upsert_from` per batch (`batch_put_from_multi_buffers` would gather without the copy,
  but on an existing key it returns 0 and keeps the old object);
- fetch() reads header + payload in one `batch_get_into_multi_buffers` round trip: the header
  into a registered header area, the payload exactly into the caller's view. A window is
  fetched in sub-batches of about `verify_batch_bytes`; each sub-batch's headers are compared
  with what its keys expect in one vectorized step and its payload CRCs are computed in place
  on another thread (ctypes releases the GIL) while the next sub-batch is in flight. The handle
  completes only after every object of the window was verified: nothing unverified is handed on;
- probe() asks `batch_is_exist` once, one key per chunk.
An object under the wrong key (swapped, or another tenant's copied under these keys), of
another registration or tenant, damaged, or in the old two-key format is a CorruptObjectError.
`verify=False` skips the payload CRC (headers are still checked).

Mooncake return codes seen with 0.3.13 over tcp (see the report in the tests):
- batch_get_into[_multi_buffers]: bytes read per key, -704 OBJECT_NOT_FOUND for a missing key,
  -600 INVALID_PARAMS when the object is larger than the buffers (and when the client is not
  set up), -800 when it is smaller (multi buffers), -900 RPC_FAIL / -901 RPC_TIMEOUT when the
  master is gone or hung
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

Threads: two pools of `fetch_workers` Python threads, transfers and verification (joined by
close()); the Mooncake client
runs its own native threads (heartbeat, transfer engine), which its close() stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

import numpy as np
import torch

from bsr_kernels import host_crc

from ..validation import check_int, check_text, check_timeout
from .base import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
)
from .mooncake_buffers import StoreRegistrations
from .mooncake_client import (
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    UNREACHABLE,
    check_port,
    connect_store,
    per_key,
    split_hostport,
)
from .mooncake_local import LocalSegmentReader
from .mooncake_object import HEADER_SIZE, LEGACY_META_SUFFIX, ObjectCodec, RegisteredBuffers, size_problem


def _split(start: int, end: int, ways: int) -> list[tuple[int, int]]:
    """[start, end) in up to `ways` contiguous, nearly equal parts."""
    n = end - start
    ways = max(1, min(ways, n))
    cuts = [start + (n * i) // ways for i in range(ways + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


@dataclass(frozen=True)
class MooncakeTierOptions:
    """How a MooncakeTier's client connects and moves data; every field is checked here."""

    protocol: str = "tcp"  # "rdma" on real clusters
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 512 << 20  # this client's segment of the store (0: a pure client)
    local_buffer_size: int = 16 << 20
    device_name: str = ""
    connect_timeout_s: float = 10.0
    rpc_timeout_s: float = 5.0
    tenant_id: str = "default"
    verify: bool = True  # CRC-32C of every payload on fetch
    fetch_workers: int = 2
    verify_batch_bytes: int = 4 << 20  # sub-batch of a fetch verified while the next one lands
    verify_threads: int = 1
    put_batch_bytes: int = 64 << 20
    local_reads: bool = True  # objects in this client's own segment: one checksumming copy (mooncake_local.py)

    def __post_init__(self) -> None:
        for name in ("protocol", "local_hostname", "device_name", "tenant_id"):
            check_text(name, getattr(self, name))
        for name in ("connect_timeout_s", "rpc_timeout_s"):
            check_timeout(name, getattr(self, name))
        for name in ("global_segment_size", "local_buffer_size"):
            check_int(name, getattr(self, name), lo=0)
        for name in ("fetch_workers", "verify_threads", "verify_batch_bytes", "put_batch_bytes"):
            check_int(name, getattr(self, name), lo=1)
        for name in ("verify", "local_reads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


class MooncakeTier(Tier):
    """A tier backed by a Mooncake store; see the module docstring for the data path."""

    name = "mooncake"

    def __init__(self, chunk_bytes: int, fingerprint: str, master_address: str, metadata_server: str,
                 options: MooncakeTierOptions | None = None, **overrides) -> None:
        """`options` (or keyword overrides of its fields) configure the client; see MooncakeTierOptions."""
        o = dataclasses.replace(options or MooncakeTierOptions(), **overrides)
        super().__init__(chunk_bytes, fingerprint)
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.master_address = master_address
        self.metadata_server = metadata_server
        self.options = o
        self.protocol = o.protocol
        self.local_hostname = o.local_hostname
        self.tenant_id = o.tenant_id
        self.verify = o.verify
        self.connect_timeout_s = o.connect_timeout_s
        self._closing = threading.Event()
        self._closed = False
        self._store = None
        self._pending: dict[int, FetchHandle] = {}  # FetchHandle is unhashable (dataclass eq)
        self._pending_lock = threading.Lock()
        self.object_bytes = HEADER_SIZE + chunk_bytes
        self.codec = ObjectCodec(fingerprint, o.tenant_id)
        self._batch_objects = max(1, o.verify_batch_bytes // self.object_bytes)
        self._put_objects = max(1, o.put_batch_bytes // self.object_bytes)
        self._sizes = [HEADER_SIZE, chunk_bytes]
        self.stats = {"fetches": 0, "get_calls": 0, "objects_verified": 0, "local_reads": 0, "puts": 0,
                      "temp_registrations": 0}
        self._registrations = StoreRegistrations(lambda: self._store, self._registration_error, self.stats)

        store, self.rpc_timeout_s = connect_store(
            master_address, metadata_server, protocol=o.protocol, local_hostname=o.local_hostname,
            global_segment_size=o.global_segment_size, local_buffer_size=o.local_buffer_size,
            device_name=o.device_name, connect_timeout_s=o.connect_timeout_s, rpc_timeout_s=o.rpc_timeout_s,
            tenant_id=o.tenant_id,
        )
        self._store = store
        # a pure client (no segment) holds no objects; without the CPU library there is no fused copy
        local = o.local_reads and o.global_segment_size > 0 and host_crc.available()
        self._local = LocalSegmentReader(store, self.object_bytes) if local else None
        self._headers = RegisteredBuffers(self._register_owned, self._unregister_owned)  # fetch header areas
        self._staging = RegisteredBuffers(self._register_owned, self._unregister_owned)  # put staging
        workers = o.fetch_workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bsr-mooncake-fetch")
        self._verify_ways = o.verify_threads
        self._verifiers = ThreadPoolExecutor(max_workers=workers * self._verify_ways,
                                             thread_name_prefix="bsr-mooncake-verify")

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

    def _master_answers(self) -> bool:
        try:
            check_port(*split_hostport(self.master_address), 0.5, "master")
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
        if code in UNREACHABLE:
            return TierUnavailableError(f"{key}: Mooncake master unreachable (code {code})")
        store = self._store
        if store is not None:  # a size mismatch (-600 larger, -800 smaller, or a short read)
            with contextlib.suppress(Exception):
                size = store.get_size(key)
                if size >= 0 and size != self.object_bytes:
                    legacy = size == self.chunk_bytes and store.is_exist(key + LEGACY_META_SUFFIX) == 1
                    return size_problem(key, size, self.chunk_bytes, legacy)
        if code >= 0:
            return CorruptObjectError(f"{key}: read {code} B, expected {self.object_bytes} B")
        return TierError(f"{key}: Mooncake error {code}")

    def _register_owned(self, ptr: int, size: int) -> None:
        rc = self._live_store().register_buffer(ptr, size)
        if rc != 0:
            raise self._registration_error(size, rc)

    def _unregister_owned(self, ptr: int) -> None:
        if self._store is not None:
            self._store.unregister_buffer(ptr)

    # -- Tier API --------------------------------------------------------------------------
    def register_staging(self, buffer: torch.Tensor) -> None:
        self._live_store()
        self._registrations.add(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    def unregister_staging(self, buffer: torch.Tensor) -> None:
        """Drop the registration made by register_staging (before the buffer is freed)."""
        self._registrations.remove(buffer.data_ptr())

    def probe(self, keys: Sequence[str]) -> list[bool]:
        """One `batch_is_exist` for the keys (one key per chunk); holds nothing."""
        store = self._live_store()
        keys = list(keys)
        if not keys:
            return []
        codes = per_key(store.batch_is_exist(keys), len(keys), "batch_is_exist")
        for k, code in zip(keys, codes, strict=True):
            if code < 0:
                if code in UNREACHABLE:
                    raise TierUnavailableError(f"probe: Mooncake master unreachable (code {code})")
                raise TierError(f"probe of {k} failed with code {code}")
        present = [c == 1 for c in codes]
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
        ptrs = [v.data_ptr() for v in views]
        headers = self._headers.acquire(len(keys) * HEADER_SIZE)
        try:
            rest = self._read_local(keys, ptrs, headers) if self._local is not None else range(len(keys))
            if rest:  # header rows [0, done) hold the local objects' headers
                done, rest_ptrs = len(keys) - len(rest), [ptrs[i] for i in rest]
                taken = self._registrations.take(rest_ptrs, self.chunk_bytes)  # a copy needs none
                try:
                    self._transfer_and_verify(store, [keys[i] for i in rest], rest_ptrs,
                                              headers[done * HEADER_SIZE :], deadline)
                finally:
                    self._registrations.give_back(taken)
        finally:
            self._headers.release(headers)
        return len(keys) * self.chunk_bytes

    def _read_local(self, keys: list[str], ptrs: list[int], headers: torch.Tensor) -> list[int]:
        """Copy + checksum the objects held in this client's segment (header rows 0..k-1), check
        them, and return the indices of the other keys (for the get path)."""
        local = self._local.addresses(keys)
        if not local:
            return list(range(len(keys)))
        idx = sorted(local)
        n, h, base = len(idx), HEADER_SIZE, headers.data_ptr()
        dst = [ptrs[i] for i in idx]
        crcs = self._local.copy([local[i] for i in idx], [base + j * h for j in range(n)], dst, h, self.chunk_bytes)
        rows = headers[: n * h].numpy().reshape(n, h)
        self.codec.check([keys[i] for i in idx], rows, dst, [self.chunk_bytes] * n, verify=self.verify,
                         landed_crcs=crcs)
        self.stats["local_reads"] += n
        self.stats["objects_verified"] += n
        return [i for i in range(len(keys)) if i not in local]

    def _transfer_and_verify(self, store, keys: list[str], ptrs: list[int], headers: torch.Tensor,
                             deadline: float) -> None:
        """Sub-batch by sub-batch: one round trip lands headers + payloads, then the sub-batch is
        verified, split across the verifier threads, while the next one is in flight. Returns (or
        raises) only after every transfer ended and every started verification finished."""
        n, step, h = len(keys), self._batch_objects, HEADER_SIZE
        hbase = headers.data_ptr()
        rows = headers[: n * h].numpy().reshape(n, h)
        checks: list[Future] = []
        landed = 0
        try:
            for s in range(0, n, step):
                e = min(n, s + step)
                if s and (time.monotonic() >= deadline or any(f.done() and f.exception() for f in checks)):
                    break  # the caller stopped waiting, or the window already failed
                bufs = [[hbase + i * h, ptrs[i]] for i in range(s, e)]
                codes = per_key(store.batch_get_into_multi_buffers(keys[s:e], bufs, [self._sizes] * (e - s)),
                                e - s, "batch_get_into_multi_buffers")
                self.stats["get_calls"] += 1
                for k, code in zip(keys[s:e], codes, strict=True):
                    if code != self.object_bytes:
                        raise self._error_for(k, code)
                for a, b in _split(s, e, self._verify_ways):
                    checks.append(self._verifiers.submit(self._verify, keys[a:b], rows[a:b], ptrs[a:b]))
                landed = e
        finally:
            wait_all(checks)
        for f in checks:
            f.result()  # the first failed part raises
        if landed < n:
            raise FetchTimeoutError(f"fetch of {n} objects passed its deadline after {landed} had landed")

    def _verify(self, keys: list[str], rows: np.ndarray, ptrs: list[int]) -> None:
        self.codec.check(keys, rows, ptrs, [self.chunk_bytes] * len(keys), verify=self.verify)
        self.stats["objects_verified"] += len(keys)

    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor]) -> None:
        """Header + payload per object, staged in a registered buffer, one upsert per batch."""
        store = self._live_store()
        keys = list(keys)
        self._check_views(keys, views)
        for s in range(0, len(keys), self._put_objects):
            self._put_batch(store, keys[s : s + self._put_objects], views[s : s + self._put_objects])

    def _put_batch(self, store, keys: list[str], views: Sequence[torch.Tensor]) -> None:
        n, ob = len(keys), self.object_bytes
        buf = self._staging.acquire(n * ob)
        try:
            rows = buf[: n * ob].view(n, ob)
            for row, k, v in zip(rows, keys, views, strict=True):
                row[HEADER_SIZE:].copy_(v.reshape(-1))
                self.codec.write_header(row, k, self.chunk_bytes)
            base = buf.data_ptr()
            codes = per_key(store.batch_upsert_from(keys, [base + i * ob for i in range(n)], [ob] * n), n,
                            "batch_upsert_from")
        finally:
            self._staging.release(buf)
        self.stats["puts"] += 1
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if bad:
            k, c = bad[0]
            if c in UNREACHABLE:
                raise TierUnavailableError(f"put of {len(bad)} objects failed: master unreachable ({c})")
            hint = " (store full)" if c == NO_AVAILABLE_HANDLE else ""
            raise TierError(f"put of {len(bad)}/{len(keys)} objects failed, first {k}: code {c}{hint}")

    def delete(self, keys: Sequence[str]) -> None:
        """Remove chunks (and a record of the old two-key format, if one is left). force=True: a
        read leaves a lease (10 s by default) during which a plain remove returns
        OBJECT_HAS_LEASE; delete is an explicit eviction."""
        store = self._live_store()
        keys = list(keys)
        if not keys:
            return
        all_keys = keys + [k + LEGACY_META_SUFFIX for k in keys]
        codes = per_key(store.batch_remove(all_keys, True), len(all_keys), "batch_remove")
        bad = [(k, c) for k, c in zip(all_keys, codes, strict=True) if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            k, c = bad[0]
            raise self._error_for(k, c) if c in UNREACHABLE else TierError(f"remove of {k} failed with {c}")

    def worker_threads(self) -> set[threading.Thread]:
        """The tier's long-lived Python threads (fetch and verify pools; joined by close())."""
        pools = (getattr(self, "_pool", None), getattr(self, "_verifiers", None))
        return {t for p in pools if p is not None for t in getattr(p, "_threads", ())}

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
        verifiers = getattr(self, "_verifiers", None)
        if verifiers is not None:
            verifiers.shutdown(wait=True, cancel_futures=True)
        with self._pending_lock:  # fetches cancelled before they started
            for h in self._pending.values():
                h.set_error(TierUnavailableError("Mooncake tier closed before the fetch ran"))
            self._pending.clear()
        self._closed = True
        for owned in (self._headers, self._staging):  # unregistered through self._store
            owned.close()
        store, self._store = self._store, None
        if store is None:
            return
        self._registrations.clear(store)
        with contextlib.suppress(Exception):
            store.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()
