"""Fault injection as a wrapper: `FaultyTier(inner, plan)` injects a `FaultPlan` into any Tier.

The tiers themselves know nothing about faults. A test (or `bsr faults`) wraps the tier it hands
to the runtime and arms faults on the wrapper's plan at any time:

    tier = FaultyTier(FilesystemTier(root, c, fp))
    tier.plan.corrupt_keys = {key}
    ...
    tier.clear()  # disarm every fault and repair the objects the plan damaged

Faults and what the caller observes (the same for every inner tier):

- `unavailable`: every operation (probe, fetch, put, delete, register_staging) raises
  TierUnavailableError before it reaches the inner tier.
- `drop_after_probe`: keys the inner tier probed present are deleted through the inner tier's
  own `delete` right after the probe (an eviction race): the fetch finds them missing
  (MissingObjectError).
- `corrupt_keys`: before the first fetch of such a key, its stored object is really damaged in
  the inner tier (one payload byte flipped, its checksum left as stored), so the inner tier's
  own integrity check fails the fetch (CorruptObjectError). `clear()` puts the original back
  through the inner tier's `put`. No byte is ever altered in the caller's staging views.
- `fail_fetch`: called with the key tuple at the start of each fetch; whatever it raises fails
  that fetch through its handle (a non-TierError becomes a TierError with it as `__cause__`),
  and the inner tier is not asked.
- `delay_s`: each fetch completes this many seconds after the inner fetch completed (past a
  short deadline: FetchTimeoutError). The bytes are not late: `handle.quiesce()` is the inner
  handle's, so it returns as soon as the inner tier stopped writing into the views.
- `read_gate`: a fetch's read into the views starts only once the gate (an Event) is set (a stalled
  device): the handle misses a short deadline, and, unlike `delay_s`, the bytes are really late:
  `handle.quiesce()` returns only after the inner read landed in the views.
- `raise_in_fetch`: raised out of `fetch()` itself, before the inner tier is asked (a library that
  raises through the call, e.g. SystemExit), instead of being delivered through the handle.
- `put_delay_s`, `put_gate`: a put sleeps that long, or waits for the gate (an Event) to be set,
  before it writes (a slow store; a save held in flight).

Damaging a stored object has to bypass the tier's write path (its `put` checksums what it
writes, so a re-put flipped copy would be a valid object); `damage_stored` does it per tier
kind: the memory tier's dict entry, the filesystem tier's object file in place, the Mooncake
object's payload (its in-object header keeps the old checksum).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bsr_runtime.tiers.base import FetchHandle, Tier, TierError, TierUnavailableError

_READ_TIMEOUT_S = 30.0


@dataclass
class FaultPlan:
    """Faults a FaultyTier injects on demand (see the module docstring). All off by default."""

    unavailable: bool = False
    drop_after_probe: set[str] = field(default_factory=set)
    delay_s: float = 0.0
    put_delay_s: float = 0.0  # a put waits this long first (a slow store)
    put_gate: threading.Event | None = None  # a put waits until the gate is set (tests hold saves in flight)
    corrupt_keys: set[str] = field(default_factory=set)
    fail_fetch: Callable[[Sequence[str]], None] | None = None
    read_gate: threading.Event | None = None  # a fetch's read starts once it is set (the bytes land late)
    raise_in_fetch: BaseException | None = None  # raised out of fetch() itself

    def clear(self) -> None:
        self.unavailable = False
        self.drop_after_probe = set()
        self.delay_s = 0.0
        self.put_delay_s = 0.0
        if self.put_gate is not None:
            self.put_gate.set()
        self.put_gate = None
        self.corrupt_keys = set()
        self.fail_fetch = None
        if self.read_gate is not None:
            self.read_gate.set()  # a read held back lands now
        self.read_gate = None
        self.raise_in_fetch = None


# -- late completion (delay_s) -----------------------------------------------------------------
class LateHandle(FetchHandle):
    """A handle completed by LateCompletions; `quiesce` is the inner fetch's (None: nothing runs)."""

    def __init__(self, keys: tuple[str, ...], deadline: float, inner: FetchHandle | None) -> None:
        super().__init__(keys, deadline)
        self._inner = inner

    def quiesce(self, timeout: float | None = None) -> bool:
        return True if self._inner is None else self._inner.quiesce(timeout)


class LateCompletions:
    """Completes handles `delay` seconds after their inner fetch completed (the delay_s fault).

    Each pending completion is one short-lived thread; `close()` fails every pending one with
    TierUnavailableError and joins the threads, so none outlive the wrapper.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._closed = threading.Event()

    def schedule(self, outer: FetchHandle, delay: float, inner: FetchHandle | None = None,
                 error: BaseException | None = None) -> None:
        """Complete `outer` like `inner` (or with `error`) `delay` seconds after `inner` completed."""
        th = threading.Thread(target=self._run, args=(outer, delay, inner, error), name="bsr-fault-delay",
                              daemon=True)
        with self._lock:
            if not self._closed.is_set():
                self._threads.add(th)
                th.start()
                return
        outer.set_error(TierUnavailableError("faulty tier closed before the fetch completed"))

    def gated(self, keys: tuple[str, ...], deadline: float, gate: threading.Event,
              start: Callable[[], FetchHandle]) -> FetchHandle:
        """A handle whose read (`start()`) begins once `gate` is set; it completes (and quiesces) only
        after that read landed, so a caller that gave up on it meets a writer that is really late."""
        outer = FetchHandle(keys, deadline)
        th = threading.Thread(target=self._run_gated, args=(outer, gate, start), name="bsr-fault-gate", daemon=True)
        with self._lock:
            if not self._closed.is_set():
                self._threads.add(th)
                th.start()
                return outer
        outer.set_error(TierUnavailableError("faulty tier closed before the fetch started"))
        return outer

    def _run_gated(self, outer: FetchHandle, gate: threading.Event, start: Callable[[], FetchHandle]) -> None:
        try:
            while not gate.wait(0.05):
                if self._closed.is_set():  # nothing was read: nothing can land
                    outer.set_error(TierUnavailableError("faulty tier closed before the fetch started"))
                    return
            try:
                inner = start()
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                outer.set_error(e)
                return
            inner.quiesce()  # the inner tier completes every handle
            _complete_like(outer, inner)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _run(self, outer: FetchHandle, delay: float, inner: FetchHandle | None, error: BaseException | None) -> None:
        try:
            while inner is not None and not inner.wait_done(0.05):  # the inner tier completes every handle
                if self._closed.is_set():
                    break
            if self._closed.wait(delay) or (inner is not None and not inner.done()):
                outer.set_error(TierUnavailableError("faulty tier closed before the fetch completed"))
            elif inner is not None:
                _complete_like(outer, inner)
            else:
                outer.set_error(error)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            threads = list(self._threads)
        for th in threads:
            if th is not threading.current_thread():
                th.join()


def _complete_like(outer: FetchHandle, inner: FetchHandle) -> None:
    try:
        outer.set_result(inner.wait())  # inner is done: wait() returns or raises at once
    except BaseException as e:  # noqa: BLE001 - delivered through the handle
        outer.set_error(e)


# -- real damage to a stored object (corrupt_keys) ---------------------------------------------
def damage_stored(tier: Tier, key: str, damaged: torch.Tensor) -> None:
    """Replace the payload stored under `key` in `tier` by `damaged` (same length) without
    updating the checksum stored with it, so the tier's own integrity check rejects it."""
    from bsr_harness.memory_tier import MemoryTier
    from bsr_runtime.tiers.filesystem import HEADER_SIZE, FilesystemTier
    from bsr_runtime.tiers.mooncake import MooncakeTier

    data = damaged.numpy().tobytes()
    if isinstance(tier, MemoryTier):
        with tier._lock:
            tier._store[key] = dataclasses.replace(tier._store[key], data=data)
    elif isinstance(tier, FilesystemTier):
        with open(tier.path_of(key), "r+b") as f:  # bit rot in place: the header keeps the old crc
            f.seek(HEADER_SIZE)
            f.write(data)
    elif isinstance(tier, MooncakeTier):
        from bsr_runtime.tiers.mooncake_object import HEADER_SIZE as OBJECT_HEADER

        store = tier._live_store()
        stored = store.get(key)  # header + payload; the header keeps the old crc
        if len(stored) != OBJECT_HEADER + len(data):
            raise TierError(f"damaging {key}: stored object of {len(stored)} B, expected {OBJECT_HEADER + len(data)}")
        rc = store.upsert(key, bytes(stored[:OBJECT_HEADER]) + data)
        if rc != 0:
            raise TierError(f"damaging {key} in the Mooncake store failed with code {rc}")
    elif type(tier).__name__ == "LMCacheTier":
        _damage_lmcache(tier, key, data)
    else:
        raise NotImplementedError(f"FaultyTier cannot damage objects of a {type(tier).__name__}")


def _damage_lmcache(tier, key: str, data: bytes) -> None:
    """The object of `key` in each L2 adapter of an LMCacheTier (the BSR FS and Mooncake plugins), its
    payload replaced, its header (and the checksum in it) kept."""
    from bsr_runtime.integrations.lmcache.fs_l2 import ConcurrentFSL2Adapter
    from bsr_runtime.integrations.lmcache.fs_l2_object import HEADER_SIZE as FS_HEADER
    from bsr_runtime.integrations.lmcache.mooncake_l2 import BSRMooncakeL2Adapter, _key_string
    from bsr_runtime.tiers.mooncake_object import HEADER_SIZE as OBJECT_HEADER

    (okey,) = tier._object_keys([key])
    for _desc, l2 in tier.sm.l2_adapters():
        if isinstance(l2, ConcurrentFSL2Adapter):
            with open(l2._key_to_path(okey), "r+b") as f:
                f.seek(FS_HEADER)
                f.write(data)
        elif isinstance(l2, BSRMooncakeL2Adapter):
            name = _key_string(l2.config.key_prefix, okey)
            store = l2._tier._live_store()
            stored = store.get(name)
            rc = store.upsert(name, bytes(stored[:OBJECT_HEADER]) + data)
            if rc != 0:
                raise TierError(f"damaging {key} in the Mooncake store failed with code {rc}")
        else:
            raise NotImplementedError(f"FaultyTier cannot damage objects of LMCache's {type(l2).__name__}")


def flipped(payload: torch.Tensor) -> torch.Tensor:
    """A copy of `payload` with its middle byte inverted."""
    out = payload.clone()
    out[len(out) // 2] ^= 0xFF
    return out


# -- the wrapper -------------------------------------------------------------------------------
class FaultyTier(Tier):
    """Wraps `inner` and injects the faults of `plan` (see the module docstring).

    Attributes the wrapper does not define (path_of, stats, ...) are the inner tier's.
    `close()` closes the inner tier too unless `close_inner=False` (a tier shared by several
    wrappers, e.g. one Mooncake client for a whole test module).
    """

    def __init__(self, inner: Tier, plan: FaultPlan | None = None, *, close_inner: bool = True) -> None:
        super().__init__(inner.chunk_bytes, inner.fingerprint)
        self.inner = inner
        self.name = inner.name
        self.plan = plan if plan is not None else FaultPlan()
        self.close_inner = close_inner
        self._late = LateCompletions()
        self._damaged: dict[str, torch.Tensor] = {}  # key -> original payload
        self._lock = threading.Lock()
        self._closed = False

    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def preferred_pipeline_depth(self, window_bytes: int) -> int:
        return self.inner.preferred_pipeline_depth(window_bytes)

    @property
    def overwrites(self) -> bool:
        return self.inner.overwrites

    def _check(self, op: str) -> None:
        if self._closed:
            raise TierUnavailableError(f"{self.name} tier: {op} after close()")
        if self.plan.unavailable:
            raise TierUnavailableError(f"{self.name} tier: {op}: store unavailable (fault)")

    # -- Tier API --------------------------------------------------------------------------
    def probe(self, keys: Sequence[str]) -> list[bool]:
        self._check("probe")
        keys = list(keys)
        present = self.inner.probe(keys)
        drop = self.plan.drop_after_probe
        doomed = [k for k, p in zip(keys, present, strict=True) if p and k in drop]
        if doomed:
            self.inner.delete(doomed)
        return present

    def fetch(self, keys: Sequence[str], views: Sequence[torch.Tensor], deadline: float, *,
              headroom: int = 0) -> FetchHandle:
        self._check("fetch")
        keys = tuple(keys)
        plan = self.plan
        if plan.raise_in_fetch is not None:
            raise plan.raise_in_fetch
        if plan.read_gate is not None:  # the read itself is late (its own deadline: it lands whole)
            return self._late.gated(keys, deadline, plan.read_gate, lambda: self.inner.fetch(
                keys, views, time.monotonic() + _READ_TIMEOUT_S, headroom=headroom))
        if plan.fail_fetch is not None:
            try:
                plan.fail_fetch(keys)
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                return self._failed(keys, deadline, e, plan.delay_s)
        self._damage([k for k in keys if k in plan.corrupt_keys])
        handle = self.inner.fetch(keys, views, deadline, headroom=headroom)
        if plan.delay_s <= 0:
            return handle
        late = LateHandle(keys, deadline, handle)
        self._late.schedule(late, plan.delay_s, inner=handle)
        return late

    def _failed(self, keys: tuple[str, ...], deadline: float, err: BaseException, delay: float) -> FetchHandle:
        handle = LateHandle(keys, deadline, None)
        if delay > 0:
            self._late.schedule(handle, delay, error=err)
        else:
            handle.set_error(err)
        return handle

    def put(self, keys: Sequence[str], views: Sequence[torch.Tensor], *, headroom: int = 0) -> None:
        self._check("put")
        gate = self.plan.put_gate
        if gate is not None and not gate.wait(60):
            raise TierError("put gate never opened")
        if self.plan.put_delay_s:
            time.sleep(self.plan.put_delay_s)
        self.inner.put(keys, views, headroom=headroom)

    def delete(self, keys: Sequence[str]) -> None:
        self._check("delete")
        self.inner.delete(keys)

    def register_staging(self, buffer: torch.Tensor) -> None:
        self._check("register_staging")
        self.inner.register_staging(buffer)

    def unregister_staging(self, buffer: torch.Tensor) -> None:
        self.inner.unregister_staging(buffer)

    def close(self) -> None:
        """Fail pending late completions (joining their threads), then close the inner tier if owned."""
        if self._closed:
            return
        self._closed = True
        self._late.close()
        if self.close_inner:
            self.inner.close()

    # -- faults ----------------------------------------------------------------------------
    def clear(self) -> None:
        """Disarm every fault and put back the objects `corrupt_keys` damaged (those still present)."""
        self.plan.clear()
        with self._lock:
            damaged, self._damaged = self._damaged, {}
        keys = list(damaged)
        if keys and not self._closed:
            back = [k for k, p in zip(keys, self.inner.probe(keys), strict=True) if p]
            if back:
                self.inner.put(back, [damaged[k] for k in back])

    def _damage(self, keys: list[str]) -> None:
        for key in keys:
            with self._lock:
                if key in self._damaged:
                    continue
            original = self._read(key)
            if original is None:  # absent or already unreadable: the fetch fails by itself
                continue
            damage_stored(self._innermost(), key, flipped(original))
            with self._lock:
                self._damaged[key] = original

    def _read(self, key: str) -> torch.Tensor | None:
        buf = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        try:
            self.inner.fetch([key], [buf], time.monotonic() + _READ_TIMEOUT_S).wait()
        except TierError:
            return None
        return buf

    def _innermost(self) -> Tier:
        tier = self.inner
        while isinstance(tier, FaultyTier):
            tier = tier.inner
        return tier


__all__ = ["FaultPlan", "FaultyTier", "LateCompletions", "LateHandle", "damage_stored", "flipped"]
