"""The filesystem tier's reads and probes, a window's objects per call (csrc/bsr_fs_read.c).

Read one object at a time from Python and each open, fstat, read and close gives the GIL up and
takes it back; while the engine's step thread runs Python every take-back can wait a switch
interval (5 ms), so a restore beside a busy engine ran 2-4x slower than alone. One call per
window gives it up once. The library opens and reads under the same rules as fs_open.py (openat2
refusing any symlink or escape, a regular file of the exact size, read whole); what a header says
is checked by the tier, in Python, from the bytes this returns.

`available()` is False without the CPU library; the tier then reads object by object.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bsr_kernels import cpu_backend

from .fs_format import digest_relpath

NOT_REGULAR, WRONG_SIZE, SHORT = 1001, 1002, 1003  # bsr_abi.h BSR_FS_*
_DIGEST_BYTES = 32
_RELPATH_BYTES = len(digest_relpath(bytes(_DIGEST_BYTES))) + 1  # with its NUL


def available() -> bool:
    lib = cpu_backend.library()
    return lib is not None and hasattr(lib, "bsr_fs_read_objects")


def _relpaths(digests: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The NUL-terminated `ab/cd/<hex>.bsr` of each digest in one buffer, and their addresses."""
    # one string built at once: a numpy slice assignment per path cost ~1 us each, per window of reads
    text = "".join(f"{path}\0" for path in map(digest_relpath, digests))
    buf = np.frombuffer(bytearray(text.encode()), dtype=np.uint8)
    if buf.size != len(digests) * _RELPATH_BYTES:  # the library reads path i at i * _RELPATH_BYTES
        raise ValueError(f"object digests must be {_DIGEST_BYTES} bytes each (sha256)")
    addrs = buf.ctypes.data + np.arange(len(digests), dtype=np.int64) * _RELPATH_BYTES
    return buf, addrs


def read_objects(root_fd: int, digests: Sequence[bytes], flags: int, object_size: int, head_bytes: int,
                 bodies: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(heads: n x head_bytes uint8, crcs: CRC-32C of each body as read, status: 0 or an errno /
    the codes above) of reading each object's head and body (to the address bodies[i])."""
    n = len(digests)
    buf, paths = _relpaths(digests)
    heads = np.empty((n, head_bytes), dtype=np.uint8)
    crcs = np.zeros(n, dtype=np.uint32)
    status = np.zeros(n, dtype=np.int64)
    body = np.ascontiguousarray(np.asarray(bodies, dtype=np.int64))
    rc = cpu_backend.library().bsr_fs_read_objects(root_fd, n, paths.ctypes.data, flags, object_size, head_bytes,
                                                   heads.ctypes.data, body.ctypes.data, crcs.ctypes.data,
                                                   status.ctypes.data)
    if rc != 0:
        raise ValueError(f"bsr_fs_read_objects: invalid arguments (n={n}, object_size={object_size})")
    del buf  # kept alive until here: the library read the paths from it
    return heads, crcs, status


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
