"""A C-ABI library of this package (libbsr_cpu.so, libbsr_cuda.so), loaded with ctypes on first use.

Loaded once per process under a lock; where it came from, or why it could not be loaded, is kept
for `available_backends`, error messages and the one-line fallback notice.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable


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
