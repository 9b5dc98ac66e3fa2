"""Native libraries' own output (Mooncake's glog lines, vLLM's C++ warnings) to a log file.

Those libraries write to file descriptors 1 and 2 directly, past Python's sys.stdout; the
`bsr` tables must not drown in them. The redirection is process-wide while it lasts. A log file
that cannot be opened (an unwritable directory, a FIFO in its place) never stops the run: the
output goes to os.devnull instead, with one warning on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

from bsr_runtime.tiers.fs_open import open_regular

DEFAULT_LOG = "bsr_native.log"


def native_log_path() -> str:
    return os.environ.get("BSR_NATIVE_LOG") or DEFAULT_LOG


@contextlib.contextmanager
def redirected(path: str | None = None, fds: Sequence[int] = (2,)) -> Iterator[int | None]:
    """Send `fds` to `path` (appending; default $BSR_NATIVE_LOG or bsr_native.log) while inside;
    yields a duplicate of the real stdout when fd 1 is redirected, else None."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in fds}
    real_stdout = os.dup(saved[1]) if 1 in saved else None
    log = _open_log(path or native_log_path())
    try:
        for fd in fds:
            os.dup2(log, fd)
        try:
            yield real_stdout
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
    finally:
        os.close(log)
        for copy in saved.values():
            os.close(copy)


_warned: set[str] = set()


def _open_log(path: str) -> int:
    """fd of `path` for appending (the filesystem tier's way), or of os.devnull when it cannot be opened."""
    try:
        return open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except OSError as e:
        if path not in _warned:
            _warned.add(path)
            print(f"bsr: note: native log {path} cannot be written ({e.strerror or e}); its output is dropped",
                  file=sys.stderr, flush=True)
        return os.open(os.devnull, os.O_WRONLY)
