"""The filesystem tier's reads and probes in native code (csrc/bsr_fs_read.c).

Read one object at a time from Python and each open, fstat, read and close gives the GIL up and
takes it back; while the engine's step thread runs Python every take-back can wait a switch
interval (5 ms), so a restore running beside the engine ran 2-4x slower than alone. And a window's
read handed to a Python worker thread costs GIL hand-offs of its own, per window: at W = 8 they were
most of a restore. So a window's objects are one job of a `Reader`, read on the reader's own threads
without the interpreter; the caller submits it and waits for it (ctypes releases the GIL for both).
The library opens and reads under the same rules as fs_open.py (openat2 refusing any symlink or
escape, a regular file of the exact size, read whole); what a header says is checked by the tier, in
Python, from the bytes a job leaves.

`available()` is False without the CPU library; the tier then reads object by object.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from bsr_kernels import cpu_backend

from .fs_format import digest_relpath

NOT_REGULAR, WRONG_SIZE, SHORT = 1001, 1002, 1003  # bsr_abi.h BSR_FS_*
SKIPPED, LATE, CANCELLED = 1004, 1005, 1006  # not read: an earlier object failed, the deadline, close
_DIGEST_BYTES = 32
_RELPATH_BYTES = len(digest_relpath(bytes(_DIGEST_BYTES))) + 1  # with its NUL


def available() -> bool:
    lib = cpu_backend.library()
    return lib is not None and hasattr(lib, "bsr_fs_reader_open")


def _relpaths(digests: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The NUL-terminated `ab/cd/<hex>.bsr` of each digest in one buffer, and their addresses."""
    # one string built at once: a numpy slice assignment per path cost ~1 us each, per window of reads
    text = "".join(f"{path}\0" for path in map(digest_relpath, digests))
    buf = np.frombuffer(bytearray(text.encode()), dtype=np.uint8)
    if buf.size != len(digests) * _RELPATH_BYTES:  # the library reads path i at i * _RELPATH_BYTES
        raise ValueError(f"object digests must be {_DIGEST_BYTES} bytes each (sha256)")
    addrs = buf.ctypes.data + np.arange(len(digests), dtype=np.int64) * _RELPATH_BYTES
    return buf, addrs


def probe_objects(root_fd: int, digests: Sequence[bytes], flags: int, object_size: int) -> np.ndarray:
    """Per object 0 (a regular file of object_size bytes), an errno or a code above."""
    n = len(digests)
    buf, paths = _relpaths(digests)
    status = np.zeros(n, dtype=np.int64)
    if cpu_backend.library().bsr_fs_probe_objects(root_fd, n, paths.ctypes.data, flags, object_size,
                                                  status.ctypes.data) != 0:
        raise ValueError(f"bsr_fs_probe_objects: invalid arguments (n={n})")
    del buf
    return status


_MAX_WAIT_NS = 10**17  # about three years: "no bound" (threading.TIMEOUT_MAX in ns would overflow int64)


def _ns(seconds: float) -> int:
    return min(_MAX_WAIT_NS, max(0, int(seconds * 1e9)))


def deadline_ns(deadline_s: float) -> int:
    """A time.monotonic() deadline in ns, as far as int64 reaches (threading.TIMEOUT_MAX from now does not)."""
    return min(2**63 - 1, int(deadline_s * 1e9))


class Reader:
    """A reader's threads (`threads` of them, each reading the next object not taken): jobs read without
    the interpreter. Every job it was given is kept alive here until it has ended (its arrays are written
    by the reader's threads), whether or not its caller still holds it."""

    def __init__(self, root_fd: int, threads: int) -> None:
        self._lib = cpu_backend.library()  # calls that may block give the GIL up
        # calls of microseconds keep it: beside an engine's step thread each give-up and take-back of the GIL
        # can wait a switch interval, and a window would pay that for queueing its read and asking if it ended
        self._quick = cpu_backend.library_holding_gil()
        self._ptr = self._lib.bsr_fs_reader_open(root_fd, threads)
        if not self._ptr:
            raise OSError(f"bsr_fs_reader_open: no reader of {threads} threads")
        self._lock = threading.Lock()
        self._jobs: dict[int, ReadJob] = {}  # not yet seen ended
        self._stopped = False  # closed with every thread ended: the reader may be freed

    def submit(self, digests: Sequence[bytes], flags: int, object_size: int, head_bytes: int,
               bodies: Sequence[int], deadline_ns: int) -> ReadJob:
        """Queue the reads of each object (its head to the job's heads, its body to the address bodies[i]);
        an object not started by `deadline_ns` (time.monotonic_ns) is not read. ReaderClosed once closed."""
        n = len(digests)
        if n == 0:
            raise ValueError("a read job needs at least one object")
        if self._jobs:
            with self._lock:
                pending = list(self._jobs.values())
            for job in pending:  # jobs ended but never waited for: let them go
                job.wait(0)
        paths_buf, paths = _relpaths(digests)
        job = ReadJob(self, n, head_bytes, paths_buf, paths, np.array(bodies, dtype=np.int64))
        jid = self._quick.bsr_fs_reader_submit(self._ptr, n, paths.ctypes.data, flags, object_size, head_bytes,
                                               job.heads.ctypes.data, job.bodies.ctypes.data, job.crcs.ctypes.data,
                                               job.status.ctypes.data, int(deadline_ns))
        if jid == -2:
            raise ReaderClosed("the filesystem tier's reader is closed")
        if jid < 0:
            raise ValueError(f"bsr_fs_reader_submit: invalid arguments (n={n}, object_size={object_size})")
        job.id = jid
        with self._lock:
            self._jobs[jid] = job
        return job

    def _wait(self, job: ReadJob, timeout_s: float) -> bool:
        rc = self._quick.bsr_fs_reader_wait(self._ptr, job.id, 0)  # ended already: the GIL kept
        if rc == 0 and timeout_s > 0:
            rc = self._lib.bsr_fs_reader_wait(self._ptr, job.id, _ns(timeout_s))
        if rc == 0:
            return False
        with self._lock:  # ended (-1: a job it was given is unknown to it only once another waiter forgot it)
            self._jobs.pop(job.id, None)
        self._quick.bsr_fs_reader_forget(self._ptr, job.id)
        return True

    def hold(self, on: bool | None = None) -> int:
        """Tests: while on, each thread that took an object waits before reading it (a read stuck in the
        kernel); None leaves it as it is. Returns how many threads wait so."""
        return self._quick.bsr_fs_reader_hold(self._ptr, -1 if on is None else int(bool(on)))

    def wait_held(self, threads: int, timeout_s: float) -> bool:
        """Tests: True once `threads` threads wait under hold (within `timeout_s`)."""
        end = time.monotonic() + timeout_s
        while self.hold() < threads:
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout_s: float) -> bool:
        """Cancel what was not started; True once every thread ended within `timeout_s`, else False (a
        thread stuck in a read is left running, and the reader is never freed under it)."""
        self._stopped = self._lib.bsr_fs_reader_close(self._ptr, _ns(timeout_s)) == 1
        return self._stopped

    def __del__(self) -> None:  # the jobs hold their reader: nothing can use it any more
        if getattr(self, "_stopped", False):
            self._lib.bsr_fs_reader_free(self._ptr)


class ReaderClosed(RuntimeError):
    """A job submitted to a closed reader."""


class ReadJob:
    """One job of a Reader: per object its header bytes (`heads`), the CRC-32C of its body as read
    (`crcs`) and its `status` (0, an errno or a code above), valid once `wait` returned True."""

    def __init__(self, reader: Reader, n: int, head_bytes: int, paths_buf: np.ndarray, paths: np.ndarray,
                 bodies: np.ndarray) -> None:
        self.reader, self.id = reader, -1
        self.heads = np.empty((n, head_bytes), dtype=np.uint8)
        self.crcs = np.zeros(n, dtype=np.uint32)
        self.status = np.zeros(n, dtype=np.int64)
        self.bodies = bodies
        self._paths = (paths_buf, paths)  # read by the reader's threads until the job ended
        self._ended = False

    def wait(self, timeout_s: float) -> bool:
        """True once every object of the job was read or will never be (nothing writes its bodies any more);
        False after `timeout_s` without."""
        if not self._ended and self.reader._wait(self, timeout_s):
            self._ended = True
        return self._ended
