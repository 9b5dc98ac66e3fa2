"""LMCache's filesystem L2 adapter with checked object files and concurrent loads, for LMCache's `plugin`
L2 adapter type.

LMCache 0.5.6's FSL2Adapter stores each object as the raw L1 bytes in a file named after its key,
with nothing binding the bytes to the key: a damaged, swapped or other-tenant file would load as
valid. This subclass writes each file as a 64-byte header (magic, version, payload length, sha256 of
the ObjectKey, CRC-32C of the payload; fs_l2_object.py) + the payload, and checks the header and the
payload's checksum on every load before it sets the key's bit: a failed check (or a headerless file
in LMCache's format) is logged and the key is not loaded, so the restore fails closed. Lookups
report a regular file under the key's name (its existence, not followed if a symlink); deletes are
LMCache's. O_DIRECT is not used (the header breaks its alignment): use_odirect is ignored with a warning.

Files are opened the filesystem tier's way (bsr_runtime/tiers/fs_open.py): relative to the base
directory's descriptor, never following a symlink, never blocking (O_NONBLOCK, so a FIFO in an
object's place cannot hang a load), regular files only (fstat); a store writes a temp file of its own
(O_EXCL, unique name) and renames it over the key's file. A store replaces the key's file whether or
not one is there (`overwrites_objects`: LMCache's FSL2Adapter skips a key whose file exists, so a
damaged object could never be repaired by storing it again). close() waits for running jobs at most
CLOSE_TIMEOUT_S (tiers/_common.py), then abandons a stuck one with a warning.

Each task hands work between threads as few times as it can. FSL2Adapter sends every task from
LMCache's controller thread to its event loop, which awaits one or more thread-pool calls per key, and
back. This plugin runs a task as jobs of its own pool, submitted by the controller thread, which an
eventfd wakes when the task is done: a store is one job, a load `load_concurrency` contiguous parts
(per key: open, header into a small buffer, payload straight into the preallocated L1 memory object
the prefetch controller passed in, CRC in place), and a lookup of at most INLINE_LOOKUP_KEYS keys (a
restore window's) runs on the controller thread itself, its stat calls costing less than two hand-offs.
On this 2-vCPU host each hand-off costs tens of microseconds (benchmarks/thread_handoff.py), and a
windowed retrieve pays them once per window. Every task completes, whatever it
raises, so the controller never waits for one forever.

    {"type": "plugin", "module_path": "bsr_runtime.integrations.lmcache.fs_l2",
     "class_name": "ConcurrentFSL2Adapter",
     "adapter_params": {"base_path": "/data/lmcache", "load_concurrency": 4}}

`load_concurrency` absent: $LMCACHE_FS_LOAD_CONCURRENCY (the adapter's config, config.py), default 1
(one key after another, as LMCache's own load).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import (
    FSL2Adapter,
    FSL2AdapterConfig,
    _object_key_to_filename,
    _readinto_full,
)

from bsr_runtime.config_schema import parse
from bsr_runtime.tiers._common import shutdown_bounded
from bsr_runtime.tiers.fs_format import DIR_FLAGS, TMP_FLAGS
from bsr_runtime.tiers.fs_open import open_regular

from .config import checked_values
from .fs_l2_object import HEADER_SIZE, header_problem, pack_header, payload_problem
from .specs import FSL2Params

logger = init_logger(__name__)


class ConcurrentFSL2AdapterConfig(FSL2AdapterConfig):
    """FSL2AdapterConfig plus `load_concurrency` (None: $LMCACHE_FS_LOAD_CONCURRENCY); every parameter is
    checked by one schema (specs.FSL2Params: unknown keys refused, one error naming every bad key)."""

    def __init__(self, base_path: str, relative_tmp_dir: str | None = None, read_ahead_size: int | None = None,
                 use_odirect: bool = False, load_concurrency: int | None = None) -> None:
        p = parse(FSL2Params, {"base_path": base_path, "relative_tmp_dir": relative_tmp_dir,
                               "read_ahead_size": read_ahead_size, "use_odirect": use_odirect,
                               "load_concurrency": load_concurrency}, "FS L2 plugin adapter_params")
        super().__init__(p.base_path, p.relative_tmp_dir, p.read_ahead_size, p.use_odirect)
        self.load_concurrency = p.load_concurrency

    @classmethod
    def from_dict(cls, d: dict) -> ConcurrentFSL2AdapterConfig:
        p = parse(FSL2Params, d, "FS L2 plugin adapter_params")
        return cls(**p.model_dump())

    @classmethod
    def help(cls) -> str:
        return FSL2AdapterConfig.help() + "\n- load_concurrency (int): concurrent reads per load task (optional)"


def _env_load_concurrency() -> int:
    return checked_values()["fs_load_concurrency"]


INLINE_LOOKUP_KEYS = 64  # ~6 us of stat per key here: at most ~0.4 ms on LMCache's controller thread


class _PartedLoad:
    """A load task's parts: each reports its loaded indices; the last one gets the task's bitmap."""

    def __init__(self, task_id: int, n: int, parts: int) -> None:
        self.task_id, self._bitmap, self._left = task_id, Bitmap(n), parts
        self._lock = threading.Lock()

    def part_done(self, loaded: list[int]) -> Bitmap | None:
        with self._lock:
            for i in loaded:
                self._bitmap.set(i)
            self._left -= 1
            return self._bitmap if self._left == 0 else None


class ConcurrentFSL2Adapter(FSL2Adapter):
    """FSL2Adapter whose object files carry a checked header and whose loads read `load_concurrency` keys at a time."""

    overwrites_objects = True  # a store replaces the key's file (LMCacheTier.overwrites relies on it)

    def __init__(self, config: FSL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__(config)
        if self._use_odirect:
            logger.warning("ConcurrentFSL2Adapter: use_odirect ignored (the object header breaks O_DIRECT alignment)")
            self._use_odirect = False
        conc = getattr(config, "load_concurrency", None)
        self.load_concurrency = int(conc) if conc is not None else _env_load_concurrency()
        logger.info("ConcurrentFSL2Adapter: load_concurrency=%d", self.load_concurrency)
        # every object is opened relative to these (the base directory the user named is resolved once)
        self._base_fd = os.open(os.path.realpath(self._base_path), DIR_FLAGS)
        self._tmp_fd = self._base_fd
        if self._relative_tmp_dir is not None:
            self._tmp_fd = os.open(self._relative_tmp_dir, DIR_FLAGS, dir_fd=self._base_fd)
        # stores, lookups and load parts run here, submitted by LMCache's controller thread: one hand-off
        # there and an eventfd back (FSL2Adapter goes through its event loop, then its thread pool)
        self._pool = ThreadPoolExecutor(max_workers=max(2, self.load_concurrency), thread_name_prefix="bsr-fs-l2")

    def close(self) -> None:
        """Stop the jobs (queued ones cancelled, running ones waited for at most CLOSE_TIMEOUT_S), then
        LMCache's event loop and event fds. A job still running then is abandoned, and with it the event fds
        and directory descriptors it may still use (left open rather than closed under it)."""
        if shutdown_bounded(self._pool, "ConcurrentFSL2Adapter"):
            super().close()
            for fd in {self._tmp_fd, self._base_fd}:
                with contextlib.suppress(OSError):
                    os.close(fd)
            return
        with contextlib.suppress(Exception):
            self._loop.call_soon_threadsafe(self._loop.stop)

    def report_status(self) -> dict:
        status = super().report_status()
        status.update(type="ConcurrentFSL2Adapter", load_concurrency=self.load_concurrency, use_odirect=False)
        return status

    # -- tasks: submitted by LMCache's controller thread straight to the plugin's pool ----------------
    def submit_store_task(self, keys, objects) -> int:
        task_id = self._task_id()
        self._submit(self._run_store, keys, objects, task_id)
        return task_id

    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> int:
        """A lookup of at most INLINE_LOOKUP_KEYS keys runs on the calling thread (a window's stat calls
        cost less than handing them to the pool and back); a longer one on the pool."""
        task_id = self._task_id()
        if len(keys) <= INLINE_LOOKUP_KEYS:
            self._run_lookup(keys, task_id)
        else:
            self._submit(self._run_lookup, keys, task_id)
        return task_id

    def submit_load_task(self, keys, objects) -> int:
        """The keys split into `load_concurrency` contiguous parts, one pool job each; the part that
        finishes last completes the task."""
        task_id = self._task_id()
        n = len(keys)
        parts = max(1, min(self.load_concurrency, n))
        load = _PartedLoad(task_id, n, parts)
        for p in range(parts):
            self._submit(self._run_load_part, keys, objects, load, n * p // parts, n * (p + 1) // parts)
        return task_id

    def _task_id(self) -> int:
        with self._lock:
            return self._get_next_task_id()

    def _submit(self, fn, *args) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: the adapter is closing
            logger.warning("ConcurrentFSL2Adapter: task submitted after close, not run")

    def _run_store(self, keys, objects, task_id) -> None:
        success, stored = False, []
        try:
            success, stored = self._store_all(keys, objects)
            if stored:
                self._notify_keys_stored([key for key, _ in stored], [size for _, size in stored])
        except Exception:
            logger.exception("ConcurrentFSL2Adapter store task %d failed", task_id)
            success = False
        finally:  # the controller always hears back, or it waits for this task forever
            with self._lock:
                self._completed_store_tasks[task_id] = L2StoreResult(success, sum(size for _, size in stored))
            self._store_efd.notify()

    def _store_all(self, keys, objects) -> tuple[bool, list[tuple[Any, int]]]:
        """(every key stored, [(key, bytes added) of each file written]). Each key's file is replaced, present
        or not; an overwritten file adds no bytes to LMCache's L2 usage."""
        success, stored = True, []
        for key, obj in zip(keys, objects, strict=True):
            name = _object_key_to_filename(key)
            try:
                existed = self._write_object(name, key, obj)
            except Exception:
                logger.exception("ConcurrentFSL2Adapter failed to store %s", name)
                success = False
                continue
            stored.append((key, 0 if existed else HEADER_SIZE + len(obj.byte_array)))
        return success, stored

    def _write_object(self, name: str, key, obj) -> bool:
        """Header + payload into a temp file of this writer's own, renamed over `name`; whether a file was there."""
        buf = obj.byte_array
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, TMP_FLAGS, 0o644, dir_fd=self._tmp_fd)
        try:
            try:
                for part in (pack_header(key, obj.data_ptr, len(buf)), memoryview(buf).cast("B")):
                    while part:
                        part = part[os.write(fd, part):]
            finally:
                os.close(fd)
            existed = self._present(name)
            os.replace(tmp, name, src_dir_fd=self._tmp_fd, dst_dir_fd=self._base_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._tmp_fd)
            raise
        return existed

    def _present(self, name: str) -> bool:
        """A regular file under `name` (a symlink is not followed, so it never counts)."""
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self._base_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def _run_lookup(self, keys, task_id) -> None:
        """FSL2Adapter's lookup: a key is present iff a regular file holds its name."""
        bitmap = Bitmap(len(keys))
        try:
            for i, key in enumerate(keys):
                if self._present(_object_key_to_filename(key)):
                    bitmap.set(i)
        except Exception:
            logger.exception("ConcurrentFSL2Adapter lookup task %d failed", task_id)
            bitmap = Bitmap(len(keys))  # nothing found: the prefetch misses, the restore fails closed
        finally:
            with self._lock:
                self._completed_lookup_tasks[task_id] = bitmap
            self._lookup_efd.notify()

    def _run_load_part(self, keys, objects, load: _PartedLoad, begin: int, end: int) -> None:
        loaded: list[int] = []
        try:
            loaded = [i for i in range(begin, end) if self._load_one(keys[i], objects[i])]
        except Exception:
            logger.exception("ConcurrentFSL2Adapter load task %d failed", load.task_id)
        finally:
            bitmap = load.part_done(loaded)
            if bitmap is not None:  # the last part: publish the task
                self._finish_load(keys, load.task_id, bitmap)

    def _finish_load(self, keys, task_id, bitmap) -> None:
        try:
            loaded_keys = [keys[i] for i in bitmap.get_indices_list()]
            if loaded_keys:
                self._notify_keys_accessed(loaded_keys)
        except Exception:
            logger.exception("ConcurrentFSL2Adapter: access notification of load task %d failed", task_id)
        finally:
            with self._lock:
                self._completed_load_tasks[task_id] = bitmap
            self._load_efd.notify()

    def _load_one(self, key, obj) -> bool:
        """One key, checked: open, header into a small buffer, payload straight into the preallocated
        object, checksum in place. True iff the file is the key's own intact object of the object's size."""
        name = _object_key_to_filename(key)
        try:
            why = self._read_checked(key, name, obj)
        except FileNotFoundError:
            return False
        except OSError as e:  # a symlink (ELOOP), a FIFO or device (NotRegularFileError), ...
            why = f"not opened: {e.strerror or e}"
        except Exception:
            logger.exception("ConcurrentFSL2Adapter failed to load %s", name)
            return False
        if why is not None:
            logger.warning("ConcurrentFSL2Adapter refused %s: %s", name, why)
            return False
        return True

    def _read_checked(self, key, name: str, obj) -> str | None:
        """Why the file must not be used (None: it is key's intact object, now in obj). Off the event loop."""
        dst_buf = obj.byte_array
        expected = len(dst_buf)
        header = bytearray(HEADER_SIZE)
        fd = open_regular(name, os.O_RDONLY, dir_fd=self._base_fd)  # no symlink, no FIFO, never blocks
        with os.fdopen(fd, "rb", buffering=0) as f:
            size = os.fstat(fd).st_size
            got = _readinto_full(f, header)
            why = header_problem(key, header[:got], expected)
            if why is not None:
                return why
            if size != HEADER_SIZE + expected:
                return f"file of {size:,} B, expected {HEADER_SIZE} B header + {expected:,} B payload"
            view = memoryview(dst_buf) if not isinstance(dst_buf, memoryview) else dst_buf
            ra = self._read_ahead_size
            num_read = _readinto_full(f, view if ra is None else view[:ra])
            if ra is not None and num_read == ra:
                num_read += _readinto_full(f, view[ra:])
        if num_read != expected:
            return f"incomplete read: expected {expected:,} B of payload, got {num_read:,}"
        return payload_problem(header, obj.data_ptr, expected)
