"""Force-local markers: requests whose external restore failed prefill locally next time.

After a failed external restore the request carries a marker; the next admission pass
reports zero external tokens for it without a new lookup against the faulty tier, and the
request prefills locally. The marker is removed when the request is admitted RUNNING or
torn down (finished, aborted). The table is bounded: when full, the oldest marker is evicted
(counted in `evictions`, logged as a warning) — an evicted request may be probed again,
which costs a lookup, never correctness: a failed restore still fails closed. With `ttl_s` a marker
also expires that long after it was set (a caller that never tears a request down: LMCache's server
module, whose clients may never end their session).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

log = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 4096


class ForceLocalMarkers:
    """A bounded, thread-safe table of request ids that must prefill locally."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float | None = None) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._table: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (set at, reason)
        self._lock = threading.Lock()
        self.evictions = 0  # markers dropped because the table was full (each one logged)
        self.cleared_running = 0
        self.cleared_teardown = 0

    def set(self, request_id: str, reason: str = "") -> None:
        with self._lock:
            if request_id in self._table:
                self._table.move_to_end(request_id)
            self._table[request_id] = (time.monotonic(), reason)
            while len(self._table) > self.max_entries:
                old, _ = self._table.popitem(last=False)
                self.evictions += 1
                log.warning("force-local marker table full (%d): evicted the oldest marker, request %s",
                            self.max_entries, old)

    def is_set(self, request_id: str) -> bool:
        with self._lock:
            entry = self._table.get(request_id)
            if entry is not None and self.ttl_s is not None and time.monotonic() - entry[0] >= self.ttl_s:
                del self._table[request_id]  # expired
                return False
            return entry is not None

    def reason(self, request_id: str) -> str | None:
        with self._lock:
            entry = self._table.get(request_id)
            return None if entry is None else entry[1]

    def clear_on_running(self, request_id: str) -> bool:
        """The request was admitted RUNNING (it prefills locally now): drop its marker."""
        with self._lock:
            found = self._table.pop(request_id, None) is not None
            self.cleared_running += found
            return found

    def clear_on_teardown(self, request_id: str) -> bool:
        """The request finished or was aborted: drop its marker."""
        with self._lock:
            found = self._table.pop(request_id, None) is not None
            self.cleared_teardown += found
            return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._table
