"""Diagnostics (report lines, metrics) that never raise into the engine or a restore.

`ReportWriter(path).write(record)` appends one JSON line per record to `path`. Whatever goes wrong
(the directory removed, the disk full, a FIFO or a symlink where the file should be, a record that
does not serialize) is counted in `failures` and logged once per writer; the caller carries on.
The file is opened per record, the filesystem tier's way (no symlink followed, regular files only,
never blocking: tiers/fs_open.py), and each line is one O_APPEND write, so processes, roles and
ranks can share one file and a file moved away (log rotation) is created again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from .tiers.fs_open import open_regular

log = logging.getLogger(__name__)


class ReportWriter:
    """Appends JSON lines to `path` (a no-op without one); `write` never raises."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.failures = 0  # records that could not be written
        self.written = 0
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if not self.path:
            return
        try:
            line = (json.dumps({"t": time.time(), "pid": os.getpid(), **record}, default=str) + "\n").encode()
            fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                if os.write(fd, line) != len(line):
                    raise OSError(f"short write of a {len(line)} B report line")
            finally:
                os.close(fd)
        except Exception as e:  # noqa: BLE001 - a diagnostic must not stop what it describes
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first:
                log.warning("BSR: cannot write the report %s (%s: %s); this and later failures are counted, "
                            "not raised", self.path, type(e).__name__, e)
            return
        with self._lock:
            self.written += 1


_writers: dict[str, ReportWriter] = {}
_writers_lock = threading.Lock()


def report_writer(path: str | None) -> ReportWriter:
    """The process's one writer for `path` (so a failing file is logged once, not once per caller)."""
    if not path:
        return ReportWriter(None)
    with _writers_lock:
        writer = _writers.get(path)
        if writer is None:
            writer = _writers[path] = ReportWriter(path)
        return writer
