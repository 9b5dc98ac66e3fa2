"""The filesystem tier's writes and their options.

Writes are atomic: header+payload go to a temp file `.<hash>.<pid>.<tid>.<rand>.tmp` in the
object's directory (optionally fsync'ed), then `os.replace` onto the final name. A crash leaves
at most a temp file, which probe and fetch never look at (`sweep_temp_files` removes stale ones).
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
import time

import numpy as np

from ._common import CRC32, CRC32C, DEFAULT_CHECKSUM, HAVE_CRC32C
from .base import TierError
from .fs_format import ENV_LOAD_CONCURRENCY, SUFFIX, TMP_FLAGS, io_full


def load_concurrency_option(value: int | None) -> int:
    """The tier's reader/writer threads: `value`, else LMCACHE_FS_LOAD_CONCURRENCY, else 1."""
    if value is None:
        env = os.environ.get(ENV_LOAD_CONCURRENCY)
        if env is None or env.strip() == "":
            return 1
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{ENV_LOAD_CONCURRENCY}={env!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"load_concurrency must be an integer >= 1, got {value!r}")
    return value


def checksum_option(name: str) -> int:
    """The payload checksum algorithm new objects are written with ("auto", "crc32", "crc32c")."""
    if name == "auto":
        return DEFAULT_CHECKSUM
    if name == "crc32":
        return CRC32
    if name == "crc32c":
        if not HAVE_CRC32C:
            raise ValueError("checksum='crc32c' needs the google-crc32c package")
        return CRC32C
    raise ValueError(f"checksum must be 'auto', 'crc32' or 'crc32c', got {name!r}")


def write_object(dfd: int, digest_hex: str, header: bytes, payload: np.ndarray, object_size: int, fsync: bool,
                 key: str) -> None:
    """Write header+payload atomically as `<digest_hex>.bsr` in the directory `dfd` (not closed here)."""
    tmp = f".{digest_hex}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, TMP_FLAGS, 0o644, dir_fd=dfd)
    try:
        try:
            n = io_full(os.pwritev, fd, [header, payload], 0)
            if n != object_size:
                raise TierError(f"filesystem tier: short write of {key} ({n} B)")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, digest_hex + SUFFIX, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    if fsync:
        os.fsync(dfd)


def sweep_temp_files(root_fd: int, older_than_s: float) -> int:
    """Remove temp files under the root directory `root_fd` left by writers that crashed mid-put
    (older than `older_than_s`). Paths are relative to the root's descriptor, as every other I/O of
    the tier: under a root whose path is near PATH_MAX an absolute path to a temp file is too long
    (ENAMETOOLONG) although the tier writes and reads there."""
    cutoff = time.time() - older_than_s
    removed = 0
    for _dirpath, _dirnames, filenames, dfd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        for name in filenames:
            if name.startswith(".") and name.endswith(".tmp"):
                try:
                    st = os.lstat(name, dir_fd=dfd)
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                        os.unlink(name, dir_fd=dfd)
                        removed += 1
                except FileNotFoundError:
                    pass
    return removed
