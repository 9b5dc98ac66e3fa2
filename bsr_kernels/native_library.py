"""A C-ABI library of this package (libbsr_cpu.so, libbsr_cuda.so), loaded with ctypes on first use.

Loaded once per process under a lock; where it came from, or why it could not be loaded, is kept
for `available_backends`, error messages and the one-line fallback notice.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path


class LibraryNotLoaded(RuntimeError):
    """Raised by a finder: every place to load the library from failed (the message says why)."""


class LazyLibrary:
    def __init__(self, find: Callable[[], tuple[ctypes.CDLL, str]]) -> None:
        self._find = find  # -> (library, path it was loaded from); raises LibraryNotLoaded
        self._lock = threading.Lock()
        self._loaded = False
        self._lib: ctypes.CDLL | None = None
        self._path: str | None = None
        self._error: str | None = None

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (`error` says why). Loads on the first call."""
        with self._lock:
            if not self._loaded:
                self._loaded = True
                try:
                    self._lib, self._path = self._find()
                except LibraryNotLoaded as e:
                    self._error = str(e)
            return self._lib

    def path(self) -> str | None:
        """Where the library was loaded from (None if it was not)."""
        self.get()
        return self._path

    def error(self) -> str | None:
        """Why the library could not be loaded (None if it was)."""
        self.get()
        return self._error


def cache_dir() -> Path:
    """Where first-use builds go: $BSR_CACHE_DIR or ~/.cache/bsr."""
    return Path(os.environ.get("BSR_CACHE_DIR") or Path.home() / ".cache" / "bsr")


def sources_digest(sources: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for f in sources:
        digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()[:16]


def build_atomically(out: Path, command: Callable[[Path], list[str]], what: str) -> Path:
    """Run `command(tmp)` to build a library into a temporary file next to `out`, then rename it
    into place (concurrent first uses never load a half-written file); `out` if it exists."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = command(tmp)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"first-use {what} build failed: {' '.join(cmd)}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out
