"""Requests' lookups on probe threads (the planner's background lookups).

Every lookup is isolated: each runs on a probe thread of its own (up to MAX_PROBE_THREADS at once;
beyond that a lookup waits for a free one), so a tier probe that hangs for one request never holds
another request's lookup. The thread of a probe stuck in a tier stays with it until the tier returns
(a daemon thread: it never holds the process at exit, and `close()` does not wait for it). How long a
lookup may take, and what its answer means, is the planner's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

# lookups probing at once: each on a thread of its own, so a hung probe holds only its own request; the
# cap bounds the threads that probes stuck in a dead tier can hold (later lookups wait, within their bound)
MAX_PROBE_THREADS = 32


@dataclass
class Lookup:
    """One request's lookup: asked for at `started` (time.monotonic()), answered through `future`."""

    request: object
    started: float
    future: Future = field(default_factory=Future)
    waited_in_step: bool = False  # the step thread waited for it once (Planner.probe_wait_s)


class LookupThreads:
    """The lookups asked for and not yet taken, by request id; `run(request)` is a lookup's work."""

    def __init__(self, run: Callable[[object], object]) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._by_request: dict[str, Lookup] = {}  # request -> its lookup, queued or on a probe thread
        self._queue: deque[Lookup] = deque()  # lookups waiting for a probe thread
        self._threads = 0
        self._closed = False

    def start(self, rid: str, request) -> Lookup | None:
        """The request's lookup, started now unless it runs already; None once closed."""
        with self._lock:
            if self._closed:
                return None
            lookup = self._by_request.get(rid)
            if lookup is not None:
                return lookup
            lookup = self._by_request[rid] = Lookup(request, time.monotonic())
            self._queue.append(lookup)
            if self._threads < MAX_PROBE_THREADS:
                self._threads += 1
                threading.Thread(target=self._loop, name="bsr-probe", daemon=True).start()
        return lookup

    def get(self, rid: str) -> Lookup | None:
        with self._lock:
            return self._by_request.get(rid)

    def forget(self, rid: str, lookup: Lookup) -> None:
        """The request's lookup was taken (answered, timed out, or made moot): no longer the request's."""
        with self._lock:
            if self._by_request.get(rid) is lookup:
                del self._by_request[rid]

    def drop(self, rid: str | None = None) -> None:
        """Cancel the request's lookup (every lookup when None): a queued one never probes, a running
        one's answer is never read."""
        with self._lock:
            if rid is None:
                dropped, self._by_request = list(self._by_request.values()), {}
            else:
                dropped = [lk for lk in (self._by_request.pop(rid, None),) if lk is not None]
        for lookup in dropped:
            lookup.future.cancel()

    def close(self) -> None:
        """Drop the queued lookups; a probe thread ends after its current probe (never waited for)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        for lookup in queued:
            lookup.future.cancel()

    def _loop(self) -> None:
        """A probe thread: queued lookups until none is left (one answered meanwhile is skipped)."""
        while True:
            with self._lock:
                if not self._queue or self._closed:
                    self._threads -= 1
                    return
                lookup = self._queue.popleft()
            if not lookup.future.set_running_or_notify_cancel():  # answered as a miss, or dropped
                continue
            try:
                lookup.future.set_result(self._run(lookup.request))
            except BaseException as e:  # noqa: BLE001 - bad input: match() raises it, in the background a miss
                lookup.future.set_exception(e)
