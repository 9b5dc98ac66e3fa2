"""What BSR's LMCache server module counts, and its gauges on the server's Prometheus output.

LMCache's MP server exports OpenTelemetry instruments through its own Prometheus endpoint
(`--prometheus-port`); the module registers observable gauges there (LMCache's `register_gauge`),
so its figures sit beside LMCache's own:

    bsr_restore_windows            windows transferred by windowed retrieves
    bsr_restore_chunks             chunks (of the request range) restored
    bsr_restores                   retrieves by outcome (label outcome = ok | failed)
    bsr_restore_failures           failed retrieves by cause (label cause)
    bsr_l1_objects_held            L1 objects the module's restores hold (read-locked) now
    bsr_l1_objects_held_peak       the most they held at once since the server started
    bsr_restore_l1_objects_peak    the most one retrieve held at once (the last retrieve's)
    bsr_probe_lookups              probe-only lookups answered (label result = hit | miss | force_local)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

# Why a windowed retrieve failed; the cause label of bsr_restore_failures.
CAUSES = ("missing", "late", "damaged", "transfer", "unregistered", "block_ids", "other")


@dataclass
class ServerStats:
    """Counters shared by the module's lookup and retrieve handlers (thread-safe)."""

    windows: int = 0
    chunks: int = 0
    restores_ok: int = 0
    restores_failed: int = 0
    failures: Counter = field(default_factory=Counter)
    lookups: Counter = field(default_factory=Counter)
    held_objects: int = 0
    peak_held_objects: int = 0
    last_restore_peak: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def windows_done(self, windows: int, chunks: int) -> None:
        with self._lock:
            self.windows += windows
            self.chunks += chunks

    def hold(self, objects: int) -> None:
        with self._lock:
            self.held_objects += objects
            self.peak_held_objects = max(self.peak_held_objects, self.held_objects)

    def drop(self, objects: int) -> None:
        with self._lock:
            self.held_objects -= objects

    def restore_done(self, peak_objects: int, cause: str | None) -> None:
        with self._lock:
            self.last_restore_peak = peak_objects
            if cause is None:
                self.restores_ok += 1
            else:
                self.restores_failed += 1
                self.failures[cause] += 1

    def lookup_answered(self, result: str) -> None:
        with self._lock:
            self.lookups[result] += 1

    def snapshot(self) -> dict:
        """The figures as one dict (the module's report_status, the tests)."""
        with self._lock:
            return {"windows": self.windows, "chunks": self.chunks, "restores_ok": self.restores_ok,
                    "restores_failed": self.restores_failed, "failures": dict(self.failures),
                    "lookups": dict(self.lookups), "l1_objects_held": self.held_objects,
                    "l1_objects_held_peak": self.peak_held_objects,
                    "restore_l1_objects_peak": self.last_restore_peak}

    def register_gauges(self) -> None:
        """The gauges of the module docstring, on LMCache's meter (a no-op without OpenTelemetry)."""
        from lmcache.v1.mp_observability.otel_init import register_gauge

        def gauge(name: str, doc: str, fn) -> None:
            register_gauge("bsr.server_module", name, doc, fn)

        gauge("bsr_restore_windows", "Windows transferred by BSR windowed retrieves", lambda: self.windows)
        gauge("bsr_restore_chunks", "Chunks restored by BSR windowed retrieves", lambda: self.chunks)
        gauge("bsr_restores", "BSR windowed retrieves by outcome",
              lambda: [(self.restores_ok, {"outcome": "ok"}), (self.restores_failed, {"outcome": "failed"})])
        gauge("bsr_restore_failures", "Failed BSR windowed retrieves by cause",
              lambda: [(self.failures[c], {"cause": c}) for c in CAUSES])
        gauge("bsr_l1_objects_held", "L1 objects held by BSR restores now", lambda: self.held_objects)
        gauge("bsr_l1_objects_held_peak", "Most L1 objects held by BSR restores at once",
              lambda: self.peak_held_objects)
        gauge("bsr_restore_l1_objects_peak", "Most L1 objects the last BSR retrieve held at once",
              lambda: self.last_restore_peak)
        gauge("bsr_probe_lookups", "BSR probe-only lookups by result",
              lambda: [(n, {"result": r}) for r, n in sorted(self.lookups.items())])
