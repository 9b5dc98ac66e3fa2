"""FilesystemTier: one file per object under a root directory (local SSD, NFS, ...).

File names and the file format are in `fs_format.py`; atomic writes (temp file + os.replace) and
the sweep of what a crashed writer left in `fs_write.py`.

Reads are confined to the root without resolving any path (`fs_open.py`): the root directory
is opened once, and every object is opened relative to it with one openat2 that refuses a
symlink in any component (or, without openat2, component by component with O_NOFOLLOW). A
symlink anywhere below the root fails, so nothing outside the root is ever opened; a directory,
FIFO or device in an object's place fails the fstat S_ISREG check. Both surface as
CorruptObjectError. Header and payload are read with one preadv, the payload straight into
the staging view, and its checksum is computed in place with the GIL released.

A fetch completes its handle only after every read it started has ended (on the first error,
reads not yet started are skipped, as are reads whose deadline passed). `wait()` can still raise
FetchTimeoutError with reads in flight; `handle.quiesce()` returns once none can land.

A window's reads are one job of the tier's native reader (fs_native.Reader: `load_concurrency`
threads of its own, LMCache's LMCACHE_FS_LOAD_CONCURRENCY knob, each taking the next object not
taken), submitted and waited for by the restore's thread and checked there: no Python thread is
woken per window. Without openat2 or the CPU library, and for writes, a thread pool of
`load_concurrency` workers reads and writes object by object.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import _common, fs_native
from ._common import (
    SettledFetchHandle,
    check_host_views,
    crc_at,
    host_views,
    payload_crc,
    shutdown_bounded,
)
from .base import (
    CorruptObjectError,
    FetchHandle,
    FetchTimeoutError,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
)
from .fs_fetch import NativeFetch, as_tier_error
from .fs_format import (  # noqa: F401 - HEADER_SIZE, HEADER_STRUCT, pack_header, key_digest: public here too
    DIR_FLAGS,
    FILE_FLAGS,
    HEADER_SIZE,
    HEADER_STRUCT,
    O_CLOEXEC,
    SUFFIX,
    bad_size_error,
    check_header,
    fingerprint_bytes,
    io_full,
    key_digest,
    object_relpath,
    pack_header,
)
from .fs_open import open_dir, open_object, openat2_works
from .fs_write import checksum_option, load_concurrency_option, sweep_temp_files, write_object

log = logging.getLogger(__name__)

# the probe opens without reading (O_PATH): what a stat sees, and no FIFO or permission stops it
PROBE_FLAGS = getattr(os, "O_PATH", 0) | os.O_NOFOLLOW | O_CLOEXEC
# probe answers that mean "not there" (as the per-object probe: absent, a symlink, not a regular
# file of the object size); any other errno is a tier error
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV, fs_native.NOT_REGULAR,
                     fs_native.WRONG_SIZE})


class _FetchState:
    __slots__ = ("handle", "deadline", "total", "landed", "nbytes", "started", "finished", "error", "final", "lock",
                 "next", "dsts")

    def __init__(self, handle: SettledFetchHandle) -> None:
        self.handle = handle
        self.deadline = handle.deadline
        self.total = len(handle.keys)
        self.landed = 0
        self.nbytes = 0
        self.started = 0
        self.finished = 0
        self.error: BaseException | None = None
        self.final = False
        self.lock = threading.Lock()
        self.next = 0  # the next object a worker takes
        self.dsts: list[tuple[torch.Tensor, int]] = []  # each object's staging view and its address


class FilesystemTier(Tier):
    """Objects as files under `root` (see the module docstring for names, format and safety).

    Args:
        root: an existing writable directory.
        chunk_bytes: the object size c.
        fingerprint: the registration fingerprint every object is written and checked under.
        load_concurrency: reader/writer threads; default env LMCACHE_FS_LOAD_CONCURRENCY or 1.
        fsync: fsync each object file (and its directory) before it becomes visible.
        checksum: "auto" (CRC-32C when google_crc32c's C build is importable, else CRC-32),
            "crc32" or "crc32c". Only affects writes; reads use what each header says.
    """

    name = "filesystem"

    def __init__(
        self,
        root: str | os.PathLike,
        chunk_bytes: int,
        fingerprint: str,
        load_concurrency: int | None = None,
        fsync: bool = False,
        checksum: str = "auto",
    ) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        super().__init__(chunk_bytes, fingerprint)
        load_concurrency = load_concurrency_option(load_concurrency)
        self.checksum = checksum_option(checksum)

        root = os.fspath(root)
        if not os.path.exists(root):
            raise ValueError(f"filesystem tier root {root!r} does not exist")
        if not os.path.isdir(root):
            raise ValueError(f"filesystem tier root {root!r} is not a directory")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"filesystem tier root {root!r} is not writable")
        self.root = os.path.realpath(root)
        self.load_concurrency = load_concurrency
        self.fsync = bool(fsync)
        self.object_size = HEADER_SIZE + chunk_bytes
        self._fp = fingerprint_bytes(fingerprint)
        self._root_fd = os.open(self.root, DIR_FLAGS)
        self._openat2 = openat2_works(self._root_fd)
        # a window's reads one job of the native reader (no Python thread woken per window)
        self._native = hasattr(os, "O_PATH") and fs_native.available()
        self._pool = ThreadPoolExecutor(max_workers=load_concurrency, thread_name_prefix="bsr-fs")
        self._reader = fs_native.Reader(self._root_fd, load_concurrency) if self.batched else None
        self._reader_pid = os.getpid()  # a fork child has none of its threads: it makes its own
        self._lock = threading.Lock()
        self._inflight: set[_FetchState] = set()
        self._closed = False

    # -- paths -----------------------------------------------------------------------------
    def path_of(self, key: str) -> str:
        """Absolute path of the key's object file (for tools and tests; I/O never uses it)."""
        return os.path.join(self.root, object_relpath(key))

    def _open_dir(self, digest_hex: str, create: bool) -> int:
        return open_dir(self._root_fd, self.root, digest_hex, create, self.fsync)

    def _open_object(self, key: str) -> tuple[int, bytes]:
        digest = key_digest(key)
        return open_object(self._root_fd, self.root, key, digest.hex(), self._openat2), digest

    @property
    def batched(self) -> bool:
        """Whether reads go through the native reader and probes a window's objects per native call
        (fs_native.py; it opens with openat2 only), else object by object."""
        return self._native and self._openat2

    # -- probe -----------------------------------------------------------------------------
    def _check(self, op: str) -> None:
        if self._closed:
            raise TierUnavailableError(f"filesystem tier: {op} after close()")

    def _present(self, key: str) -> bool:
        h = key_digest(key).hex()
        try:
            dfd = self._open_dir(h, create=False)
        except (FileNotFoundError, CorruptObjectError):
            return False
        try:
            st = os.stat(h + SUFFIX, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        finally:
            os.close(dfd)
        return stat.S_ISREG(st.st_mode) and st.st_size == self.object_size

    def probe(self, keys: Sequence[str]) -> list[bool]:
        """Existence + regular file + exact size per key; reads no payload, holds nothing."""
        self._check("probe")
        keys = list(keys)
        if self.batched and keys:
            status = fs_native.probe_objects(self._root_fd, [key_digest(k) for k in keys], PROBE_FLAGS,
                                             self.object_size).tolist()
            failed = [s for s in status if s and s not in _ABSENT]
            if failed:
                raise TierError(f"filesystem tier: probe failed: {os.strerror(failed[0])}")
            return [s == 0 for s in status]
        try:
            return [self._present(k) for k in keys]
        except OSError as e:
            raise TierError(f"filesystem tier: probe failed: {e}") from e

    # -- fetch -----------------------------------------------------------------------------
    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float, *,
              headroom: int = 0) -> FetchHandle:
        self._check("fetch")
        keys = tuple(keys)
        check_host_views(keys, views, self.chunk_bytes, "filesystem tier fetch")
        if keys and self.batched and self._reader is not None:
            return self._fetch_native(keys, views, deadline)
        handle = SettledFetchHandle(keys, deadline)
        state = _FetchState(handle)
        if not keys:
            self._finish(state)
            return handle
        state.dsts = [(v, v.data_ptr()) for v in views]
        with self._lock:
            self._inflight.add(state)
        try:
            for _ in range(min(self.load_concurrency, len(keys))):
                self._pool.submit(self._fetch_some, state)
        except RuntimeError as e:  # pool shut down by a concurrent close()
            self._fail(state, TierUnavailableError(f"filesystem tier closed: {e}"))
        return handle

    def _fetch_native(self, keys: tuple[str, ...], views: Sequence[torch.Tensor], deadline: float) -> NativeFetch:
        """The window's reads as one job of the native reader; checked by whoever waits for the handle."""
        digests = [key_digest(k) for k in keys]
        addrs = [v.data_ptr() for v in views]
        if self._reader_pid != os.getpid():
            with self._lock:
                if self._reader_pid != os.getpid():
                    self._reader, self._reader_pid = fs_native.Reader(self._root_fd, self.load_concurrency), \
                        os.getpid()
        try:
            job = self._reader.submit(digests, FILE_FLAGS, self.object_size, HEADER_SIZE, addrs,
                                      fs_native.deadline_ns(deadline))
        except fs_native.ReaderClosed as e:
            raise TierUnavailableError(f"filesystem tier closed: {e}") from e
        return NativeFetch(self, keys, deadline, job, digests, list(zip(views, addrs, strict=True)))

    def _fetch_some(self, state: _FetchState) -> None:
        """One worker's share of a fetch (reads object by object: no openat2 or no CPU library): read the
        next unclaimed object until none is left, the fetch has failed, its deadline has passed or the
        tier is closing."""
        keys = state.handle.keys
        begin = end = 0
        landed, err = 0, None
        while True:
            with state.lock:
                if end > begin:  # account for the reads this worker just ended
                    state.finished += end - begin
                    state.landed += landed
                    state.nbytes += landed * self.chunk_bytes
                    if err is not None and state.error is None:
                        state.error = err
                begin = state.next
                if begin >= state.total or state.error is not None:
                    break
                if self._closed:
                    state.error = TierUnavailableError("filesystem tier closed before the fetch completed")
                    break
                if time.monotonic() > state.deadline:
                    state.error = FetchTimeoutError(f"filesystem tier: deadline passed before {keys[begin]} was read")
                    break
                end = begin + 1
                state.next = end
                state.started += 1
            try:
                self._read_into(keys[begin], state.dsts[begin])
                landed, err = 1, None
            except BaseException as e:
                landed, err = 0, e
        self._maybe_finish(state)

    def _fail(self, state: _FetchState, err: BaseException) -> None:
        with state.lock:
            if state.error is None:
                state.error = err
        self._maybe_finish(state)

    def _maybe_finish(self, state: _FetchState) -> None:
        with state.lock:
            if state.final:
                return
            done_ok = state.error is None and state.landed == state.total
            done_err = state.error is not None and state.started == state.finished
            if not (done_ok or done_err):
                return
            state.final = True
        self._finish(state)

    def _finish(self, state: _FetchState) -> None:
        """Every read of the fetch has ended (or can no longer start): settle, then complete the handle."""
        with self._lock:
            self._inflight.discard(state)
        handle = state.handle
        handle.mark_settled()
        if state.error is not None:
            handle.set_error(as_tier_error(state.error))
        else:
            handle.set_result(state.nbytes)

    def _read_into(self, key: str, dst: tuple[torch.Tensor, int]) -> int:
        """Read the object into `dst` (the staging view and its address), one system call at a time."""
        view, addr = dst
        arr = view.detach().reshape(-1).numpy()
        fd, digest = self._open_object(key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptObjectError(f"filesystem tier: object {key} is not a regular file")
            if st.st_size != self.object_size:
                raise bad_size_error(fd, key, st.st_size, self._fp, self.fingerprint, self.chunk_bytes)
            header = bytearray(HEADER_SIZE)
            n = os.preadv(fd, [header, arr], 0)
            if n != self.object_size:  # a short read: again from the start, until EOF
                n = io_full(os.preadv, fd, [header, arr], 0)
        finally:
            os.close(fd)
        if n != self.object_size:
            raise CorruptObjectError(f"filesystem tier: object {key} is truncated ({n:,} of {self.object_size:,} B)")
        algo, crc = check_header(key, bytes(header), digest, self._fp, self.fingerprint, self.chunk_bytes)
        if crc_at(algo, addr, self.chunk_bytes) != crc:
            raise CorruptObjectError(f"filesystem tier: checksum mismatch for {key}")
        return self.chunk_bytes

    # -- put / delete ----------------------------------------------------------------------
    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
        """Write each view under its key atomically (temp file + os.replace), in parallel."""
        self._check("put")
        keys = list(keys)
        arrays = host_views(keys, views, self.chunk_bytes, "filesystem tier put")
        if not keys:
            return
        try:
            futures = [self._pool.submit(self._write_one, k, a) for k, a in zip(keys, arrays, strict=True)]
        except RuntimeError as e:
            raise TierUnavailableError(f"filesystem tier closed: {e}") from e
        first: BaseException | None = None
        for f in futures:  # wait for all, even after an error: the views must not be read later
            e = f.exception()
            if e is not None and first is None:
                first = e
        if first is not None:
            if isinstance(first, TierError):
                raise first
            raise TierError(f"filesystem tier: put failed: {first!r}") from first

    def _write_one(self, key: str, arr: np.ndarray) -> None:
        digest = key_digest(key)
        h = digest.hex()
        header = pack_header(self._fp, digest, self.chunk_bytes, self.checksum, payload_crc(self.checksum, arr))
        dfd = self._open_dir(h, create=True)
        try:
            write_object(dfd, h, header, arr, self.object_size, self.fsync, key)
        finally:
            os.close(dfd)

    def delete(self, keys: Sequence[str]) -> None:
        self._check("delete")
        self._delete(list(keys))

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            h = key_digest(key).hex()
            try:
                dfd = self._open_dir(h, create=False)
            except (FileNotFoundError, CorruptObjectError):
                continue
            try:
                os.unlink(h + SUFFIX, dir_fd=dfd)
            except FileNotFoundError:
                pass
            except IsADirectoryError as e:
                raise TierError(f"filesystem tier: object {key} is a directory; not deleting it") from e
            except OSError as e:
                raise TierError(f"filesystem tier: deleting {key}: {e}") from e
            finally:
                os.close(dfd)

    # -- maintenance -----------------------------------------------------------------------
    def drop_page_cache(self, keys: Sequence[str]) -> int:
        """Write back and evict each object's pages from the OS page cache (for cold-read
        benchmarks). Returns how many object files were dropped; absent keys are skipped."""
        self._check("drop_page_cache")
        dropped = 0
        for key in keys:
            try:
                fd, _ = self._open_object(key)
            except (MissingObjectError, CorruptObjectError):
                continue
            try:
                os.fdatasync(fd)  # dirty pages are not dropped: write them back first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
        return dropped

    def sweep_temp_files(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files left by writers that crashed mid-put (older than `older_than_s`)."""
        self._check("sweep_temp_files")
        return sweep_temp_files(self._root_fd, older_than_s)

    def close(self) -> None:
        """Cancel queued reads, wait for running ones (at most CLOSE_TIMEOUT_S: a read stuck in the
        kernel is abandoned with a warning, and the root fd left open for it), stop every thread, close
        the root fd. Fetches that had not completed fail with TierUnavailableError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        stopped = shutdown_bounded(self._pool, f"filesystem tier {self.root}")
        if self._reader is not None and not self._reader.close(_common.CLOSE_TIMEOUT_S):
            log.warning("filesystem tier %s: a native read still running after %.1f s; abandoned so that close() "
                        "returns", self.root, _common.CLOSE_TIMEOUT_S)
            stopped = False
        with self._lock:
            stranded = list(self._inflight)
        for state in stranded:  # their queued reads were cancelled: nothing runs any more
            with state.lock:
                if state.error is None:
                    state.error = TierUnavailableError("filesystem tier closed before the fetch completed")
            self._maybe_finish(state)
        if stopped:
            os.close(self._root_fd)

    def __del__(self) -> None:  # pragma: no cover - best effort for tiers never closed
        try:
            if not self._closed:
                self._closed = True
                self._pool.shutdown(wait=False, cancel_futures=True)
                if self._reader is None or self._reader.close(0.5):  # idle threads end at once
                    os.close(self._root_fd)
        except Exception:
            pass
