"""MooncakeTier: chunks in a Mooncake store (`mooncake.store.MooncakeDistributedStore`).

One chunk is one store object under one key: a 128-byte header (mooncake_object.py: magic,
version, registration fingerprint, sha256 of the key, tenant, payload length, CRC-32C), then the
payload. Mooncake does not check what it returns; the tier checks every object before the fetch
handle completes, so nothing unverified is handed on.

Reads (fetch(), on a worker thread; the Mooncake calls and the native copies release the GIL).
A window is read by one of three paths:
- local: objects in this client's own segment (global_segment_size > 0) are found with one
  `batch_get_replica_desc` (which leases them as a get does) and moved by one checksumming copy
  (mooncake_local.py, bsr_kernels.host_crc): header to a header area, payload to its view, the
  CRC of each piece computed as it lands; one pass over memory instead of a get plus a CRC pass;
- in place: each object lands whole, by one transfer, where its payload goes, its header in the
  128 bytes before the payload. A restore's staging leaves that room before every chunk
  (fetch(headroom=FETCH_HEADROOM), StagingArena(headroom=...)): the whole window then lands in one
  get (or gets of `in_place_batch_bytes`), CRCs computed in place after it; no copy. For adjacent
  views without room (a caller's own buffers) those bytes belong to the view before, so the read
  lands in two phases (even positions, then odd ones; the tails the second phase borrows are
  saved and put back) and a run's first object lands its header in the header area; the even
  views' CRCs run on a verifier thread while the odd phase lands;
- landed: objects land whole in one of two registered landing buffers of `verify_batch_bytes`
  (one sub-batch while the previous one is copied into the views by the checksumming copy on a
  verifier thread). Used, for views without room, over tcp for a read that fits one landing
  buffer (one get and a copy cost less there than the two gets of the in-place phases) or whose
  views are never adjacent (a view starting no run needs a two-buffer get, slower over tcp for
  small objects than the copy), and when asked (`land_whole=True`).
Measured for 64 MiB windows from a store host over tcp by benchmarks/mooncake_tier_throughput.py.
Each landed header is compared with what its key expects in one vectorized step. An object
under the wrong key (swapped, or another tenant's copied under these keys), of another
registration or tenant, damaged, or in the old two-key format is a CorruptObjectError.
`verify=False` skips the payload CRC comparison (headers are still checked).

Writes: put() writes header + payload with one `batch_upsert_from` per batch: in place when the
views have header room (a store's staging: the header written into the 128 bytes before each
view), else staged in a registered buffer (upsert replaces an existing key, which the Tier contract asks for;
`batch_put_from[_multi_buffers]` on an existing key returns 0 and keeps the old object). Views
read in place are registered once (register_staging) or for one call.
probe() asks `batch_is_exist` once, one key per chunk.

A cluster (several store hosts): every put stores `replica_num` copies, each on another host; a read
that fails on a lost host waits for the master to drop that host and reads a surviving copy, or
fails at once (HostLostError) where there is none; a put placed on a lost host is put again on the
live ones (mooncake_hosts.py).

Mooncake's return codes and process-wide settings: see mooncake_client.py.

Threads: two pools of `fetch_workers` Python threads, transfers and verification (joined by
close()); the Mooncake client
runs its own native threads (heartbeat, transfer engine), which its close() stops.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from bsr_kernels import host_crc

from ..config_schema import parse
from . import _common
from ._common import shutdown_bounded
from .base import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    HostLostError,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
    depth_by_window,
)
from .mooncake_buffers import StoreRegistrations
from .mooncake_client import (
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    UNREACHABLE,
    check_port,
    connect_store,
    per_key,
    split_hostport,
)
from .mooncake_hosts import HostBook, await_surviving_copy, put_on_live_hosts
from .mooncake_local import LocalSegmentReader
from .mooncake_object import HEADER_SIZE, LEGACY_META_SUFFIX, ObjectCodec, RegisteredBuffers, size_problem
from .mooncake_options import MooncakeTierOptions
from .mooncake_reads import ReadPaths


class MooncakeTier(Tier):
    """A tier backed by a Mooncake store; see the module docstring for the data path."""

    name = "mooncake"

    def __init__(self, chunk_bytes: int, fingerprint: str, master_address: str, metadata_server: str,
                 options: MooncakeTierOptions | None = None, **overrides) -> None:
        """`options` (or keyword overrides of its fields) configure the client; see MooncakeTierOptions."""
        base = {} if options is None else {k: getattr(options, k) for k in MooncakeTierOptions.model_fields}
        o = parse(MooncakeTierOptions, {**base, **overrides}, "Mooncake tier options")
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
        self._put_objects = max(1, o.put_batch_bytes // self.object_bytes)
        self.stats = {"fetches": 0, "get_calls": 0, "objects_verified": 0, "local_reads": 0, "puts": 0,
                      "temp_registrations": 0, "failovers": 0, "put_retries": 0}
        self._registrations = StoreRegistrations(lambda: self._store, self._registration_error, self.stats)
        self._hosts = HostBook(metadata_server)  # the store hosts a put retry may prefer

        store, self.rpc_timeout_s = connect_store(
            master_address, metadata_server, protocol=o.protocol, local_hostname=o.local_hostname,
            global_segment_size=o.global_segment_size, local_buffer_size=o.local_buffer_size,
            device_name=o.device_name, connect_timeout_s=o.connect_timeout_s, rpc_timeout_s=o.rpc_timeout_s,
            tenant_id=o.tenant_id,
        )
        self._store = store
        # a pure client (no segment) holds no objects; without the CPU library there is no fused copy
        local = o.local_reads and o.global_segment_size > 0 and host_crc.available()
        workers = o.fetch_workers
        self._verifiers = ThreadPoolExecutor(max_workers=workers * o.verify_threads,
                                             thread_name_prefix="bsr-mooncake-verify")
        self._reads = ReadPaths(
            self._live_store, local=LocalSegmentReader(store) if local else None,
            land_whole=o.land_whole if o.land_whole is not None else (None if o.protocol == "tcp" else False),
            batch_bytes=o.verify_batch_bytes, in_place_batch_bytes=o.in_place_batch_bytes, verifiers=self._verifiers,
            registrations=self._registrations, register=self._register_owned, unregister=self._unregister_owned,
            error_for=self._error_for, stats=self.stats)
        self._staging = RegisteredBuffers(self._register_owned, self._unregister_owned)  # put staging
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bsr-mooncake-fetch")

    def preferred_pipeline_depth(self, window_bytes: int) -> int:
        """Over tcp by the window's size (base.depth_by_window: the socket copies, the transfer engine's
        threads and a store host on the same machine take the cores); RDMA moves bytes without them: 2."""
        return depth_by_window(window_bytes) if self.protocol == "tcp" else 2

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

    def _error_for(self, key: str, code: int, payload_bytes: int | None = None) -> TierError:
        payload_bytes = self.chunk_bytes if payload_bytes is None else payload_bytes
        if code == OBJECT_NOT_FOUND:
            return MissingObjectError(f"{key}: not in the Mooncake store")
        if code in UNREACHABLE:
            return TierUnavailableError(f"{key}: Mooncake master unreachable (code {code})")
        store = self._store
        if store is not None:  # a size mismatch (-600 larger, -800 smaller, or a short read)
            with contextlib.suppress(Exception):
                size = store.get_size(key)
                if size >= 0 and size != HEADER_SIZE + payload_bytes:
                    legacy = size == payload_bytes and store.is_exist(key + LEGACY_META_SUFFIX) == 1
                    return size_problem(key, size, payload_bytes, legacy)
        if code == TRANSFER_FAIL:
            return HostLostError(key, f"{key}: the store host holding it does not answer (code {code})")
        if code >= 0:
            return CorruptObjectError(f"{key}: read {code} B, expected {HEADER_SIZE + payload_bytes} B")
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

    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float, *,
              headroom: int = 0) -> FetchHandle:
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
            self._pool.submit(self._fetch_worker, handle, views, headroom)
        except RuntimeError as e:  # the pool is shut down: close() raced us
            with self._pending_lock:
                self._pending.pop(id(handle), None)
            raise TierUnavailableError("Mooncake tier is closed") from e
        return handle

    def _fetch_worker(self, handle: FetchHandle, views: list[torch.Tensor], headroom: int) -> None:
        try:
            handle.set_result(self._fetch_now(list(handle.keys), views, handle.deadline, headroom))
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            handle.set_error(e)
        finally:
            with self._pending_lock:
                self._pending.pop(id(handle), None)

    def _fetch_now(self, keys: list[str], views: list[torch.Tensor], deadline: float, headroom: int = 0) -> int:
        if time.monotonic() >= deadline:
            # Never start a transfer the caller has stopped waiting for (its slot may be reused).
            raise FetchTimeoutError(f"fetch of {len(keys)} objects started after its deadline")
        store = self._live_store()
        self.stats["fetches"] += 1
        ptrs, sizes = [v.data_ptr() for v in views], [self.chunk_bytes] * len(keys)
        while True:
            try:
                self._reads.read(self.codec, keys, ptrs, sizes, deadline, verify=self.verify, headroom=headroom)
                return len(keys) * self.chunk_bytes
            except HostLostError as lost:  # its other copies (replica_num > 1) are read once the master drops it
                await_surviving_copy(store, lost, deadline, self._closing)
                self.stats["failovers"] += 1

    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
        """Header + payload per object, one upsert per batch: written in place (header in the room
        before each view, the object upserted from there) when headroom >= HEADER_SIZE, else staged
        in a registered buffer."""
        store = self._live_store()
        keys = list(keys)
        self._check_views(keys, views)
        in_place = headroom >= HEADER_SIZE
        if in_place and any(v.storage_offset() < HEADER_SIZE for v in views):  # before any object is written
            raise ValueError("put(headroom=...): a view starts less than a header after its buffer's start")
        put = self._put_in_place if in_place else self._put_batch
        for s in range(0, len(keys), self._put_objects):
            put(store, keys[s : s + self._put_objects], views[s : s + self._put_objects])

    def _put_in_place(self, store, keys: list[str], views: Sequence[torch.Tensor]) -> None:
        """Each object as header (written into the room before its view) + the view itself: no copy."""
        rows = [v.as_strided((self.object_bytes,), (1,), v.storage_offset() - HEADER_SIZE) for v in views]
        for row, k in zip(rows, keys, strict=True):
            self.codec.write_header(row, k, self.chunk_bytes)
        starts = [r.data_ptr() for r in rows]
        taken = self._registrations.take(starts, self.object_bytes)
        try:
            codes = self._upsert(store, keys, starts)
        finally:
            self._registrations.give_back(taken)
        self._put_done(keys, codes)

    def _put_batch(self, store, keys: list[str], views: Sequence[torch.Tensor]) -> None:
        n, ob = len(keys), self.object_bytes
        buf = self._staging.acquire(n * ob)
        try:
            rows = buf[: n * ob].view(n, ob)
            for row, k, v in zip(rows, keys, views, strict=True):
                row[HEADER_SIZE:].copy_(v.reshape(-1))
                self.codec.write_header(row, k, self.chunk_bytes)
            base = buf.data_ptr()
            codes = self._upsert(store, keys, [base + i * ob for i in range(n)])
        finally:
            self._staging.release(buf)
        self._put_done(keys, codes)

    def _upsert(self, store, keys: list[str], starts: list[int]) -> list[int]:
        """One code per key of upserting object i from starts[i], `replica_num` copies each; keys the master
        placed on a lost store host are put again on live ones (mooncake_hosts.put_on_live_hosts)."""
        def upsert(rows: list[int], config) -> list[int]:
            return per_key(store.batch_upsert_from([keys[i] for i in rows], [starts[i] for i in rows],
                                                   [self.object_bytes] * len(rows), config),
                           len(rows), "batch_upsert_from")

        return put_on_live_hosts(store, keys, upsert, self.options.replica_num, self.stats, self._hosts)

    def _put_done(self, keys: list[str], codes: list[int]) -> None:
        self.stats["puts"] += 1
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if bad:
            k, c = bad[0]
            if c in UNREACHABLE:
                raise TierUnavailableError(f"put of {len(bad)} objects failed: master unreachable ({c})")
            hint = {NO_AVAILABLE_HANDLE: " (store full)", TRANSFER_FAIL: " (placed on a lost store host)"}.get(c, "")
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
        """Stop the fetch workers (waiting for transfers in flight at most CLOSE_TIMEOUT_S), unregister
        every buffer and close the client (its segment is unmounted: objects it hosted are gone). A
        worker still running then is abandoned with a warning, with the client and its registrations."""
        if self._closed:
            return
        self._closing.set()
        stopped = True
        for pool in (getattr(self, "_pool", None), getattr(self, "_verifiers", None)):
            if pool is not None:
                # a running transfer ends within its RPC timeout: wait for that at least
                stopped = shutdown_bounded(pool, f"Mooncake tier ({self.master_address})",
                                           max(_common.CLOSE_TIMEOUT_S, 2 * self.rpc_timeout_s)) and stopped
        with self._pending_lock:  # fetches cancelled before they started (or abandoned running)
            for h in self._pending.values():
                h.set_error(TierUnavailableError("Mooncake tier closed before the fetch ran"))
            self._pending.clear()
        self._closed = True
        if not stopped:  # a transfer may still land in registered buffers: leave them and the client alone
            self._store = None
            return
        self._reads.close()  # header and landing buffers, unregistered through self._store
        self._staging.close()
        store, self._store = self._store, None
        if store is None:
            return
        self._registrations.clear(store)
        with contextlib.suppress(Exception):
            store.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()
