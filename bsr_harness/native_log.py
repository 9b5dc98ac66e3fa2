"""Native libraries' own output (Mooncake's glog lines, vLLM's C++ warnings) to a log file.

Those libraries write to file descriptors 1 and 2 directly, past Python's sys.stdout; the
`bsr` tables must not drown in them. The redirection is process-wide while it lasts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

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
    try:
        with open(path or native_log_path(), "ab") as log:
            for fd in fds:
                os.dup2(log.fileno(), fd)
            try:
                yield real_stdout
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
    finally:
        for copy in saved.values():
            os.close(copy)
