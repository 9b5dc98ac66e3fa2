"""The Tier contract, the same tests against every tier: memory, filesystem and Mooncake (a real
mooncake_master on 127.0.0.1), a toy tier opened only by its registered type name (tests/toy_tier.py:
what a new tier registered in one place gets), and every FaultyTier fault against each of them.

The LMCache tier (LMCacheTier over LMCache's StorageManager) is not in this suite yet;
tests/integration/lmcache/test_lmcache_tier.py and test_tier_overwrite.py cover it.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch
import toy_tier

from bsr_harness.faulty_tier import FaultyTier
from bsr_harness.memory_tier import MemoryTier
from bsr_kernels import StagingArena
from bsr_runtime.keys import KeySpace, PrefixKeys
from bsr_runtime.tiers import (
    FETCH_HEADROOM,
    CorruptObjectError,
    FetchTimeoutError,
    FilesystemTier,
    MissingObjectError,
    Tier,
    TierError,
    TierUnavailableError,
)
from bsr_runtime.tiers.registry import open_tier

FP = "0123456789abcdef0123456789abcdef"
FP_OTHER = "fedcba9876543210fedcba9876543210"
C = 4096 + 16 * 5  # not a power of two on purpose

_MOONCAKE = [pytest.mark.mooncake, pytest.mark.timeout(300)]
# Mooncake's three read paths, each under the whole contract (tiers/mooncake.py):
# "mooncake": objects in the client's own segment by one checksumming copy (mooncake_local.py);
# "mooncake-landed": every object by a whole-object get into a landing buffer + checksumming copy;
# "mooncake-in-place": every object in place (header in the bytes before its payload: the room a
# restore's staging leaves, else the tail of the view before)
MOONCAKE_PATHS = {"mooncake": {}, "mooncake-landed": {"local_reads": False, "land_whole": True},
                  "mooncake-in-place": {"local_reads": False, "land_whole": False}}
KINDS = ["memory", "filesystem", "registered", *(pytest.param(k, marks=_MOONCAKE) for k in MOONCAKE_PATHS)]


def payloads(n: int, chunk_bytes: int = C, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (chunk_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def zeros(n: int, chunk_bytes: int = C) -> list[torch.Tensor]:
    return [torch.zeros(chunk_bytes, dtype=torch.uint8) for _ in range(n)]


def deadline(s: float = 20.0) -> float:
    return time.monotonic() + s


@pytest.fixture(scope="module")
def mooncake_clients(request):
    """Mooncake clients shared by the module, one per (chunk_bytes, fingerprint): a client
    takes 1-2 s to close. Tests keep apart by their keys (see Store.keys). The master and the
    clients' factory are asked for at the first Mooncake case (the others start no master), so
    they are torn down before this fixture: the clients close while their master still runs."""
    made: dict[tuple[int, str, str], Tier] = {}

    def get(chunk_bytes: int, fingerprint: str, kind: str) -> Tier:
        if (chunk_bytes, fingerprint, kind) not in made:
            make = request.getfixturevalue("mooncake_module_tier_factory")
            made[chunk_bytes, fingerprint, kind] = make(chunk_bytes, fingerprint, global_segment_size=128 << 20,
                                                        **MOONCAKE_PATHS[kind])
        return made[chunk_bytes, fingerprint, kind]

    yield get


class Store:
    """One store of one kind for a test: every tier opened on it sees the same objects."""

    def __init__(self, kind: str, request, tmp_path) -> None:
        self.kind = kind
        self._request = request
        self._root = tmp_path
        self._dict: dict = {}
        self._owned: list[Tier] = []
        self._salt = uuid.uuid4().hex

    def keys(self, n: int, prefix: str = "k") -> list[str]:
        """Keys of this test only (a Mooncake store is shared by the module)."""
        return [f"{self._salt}/{prefix}{i}" for i in range(n)]

    def tier(self, chunk_bytes: int = C, fingerprint: str = FP, own: bool = False) -> Tier:
        """A tier on this store; `own`: a fresh one the test may close (closed at teardown anyway)."""
        if self.kind in MOONCAKE_PATHS and not own:
            return self._request.getfixturevalue("mooncake_clients")(chunk_bytes, fingerprint, self.kind)
        if self.kind in MOONCAKE_PATHS:
            t = self._request.getfixturevalue("mooncake_tier_factory")(chunk_bytes, fingerprint,
                                                                        **MOONCAKE_PATHS[self.kind])
        elif self.kind == "filesystem":
            t = FilesystemTier(self._root, chunk_bytes, fingerprint, load_concurrency=2)
        elif self.kind == "registered":  # by its type's name alone, as a connector's tier list opens it
            reg = SimpleNamespace(chunk_bytes=chunk_bytes, fingerprint=fingerprint)
            t = open_tier(reg, {"type": toy_tier.TOY.name, "store": self._salt}).__enter__()
        else:
            t = MemoryTier(chunk_bytes, fingerprint, store=self._dict)
        self._owned.append(t)
        return t

    def close(self) -> None:
        for t in self._owned:
            t.close()


@pytest.fixture(scope="module")
def toy_registered():
    with toy_tier.registered():
        yield


@pytest.fixture(params=KINDS)
def store(request, tmp_path):
    if request.param == "registered":
        request.getfixturevalue("toy_registered")
    s = Store(request.param, request, tmp_path)
    yield s
    s.close()


@pytest.fixture
def tier(store):
    return store.tier()


@pytest.fixture
def faulty(store):
    """A FaultyTier around the store's tier (which it leaves open: it may be shared)."""
    t = FaultyTier(store.tier(), close_inner=False)
    yield t
    t.clear()
    t.close()


def pool_threads(t: Tier) -> list[threading.Thread]:
    pool = getattr(t, "_pool", None)
    return list(getattr(pool, "_threads", ())) if pool is not None else []


def delay_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "bsr-fault-delay"]


# -- the contract ------------------------------------------------------------------------------
@pytest.mark.parametrize("headroom", [0, FETCH_HEADROOM])
@pytest.mark.parametrize("chunk_bytes", [4096, C, 1 << 20])
def test_roundtrip_into_staging_pool(store, chunk_bytes, headroom):
    """Into a pool's slot, as a restore fetches (with header room before each chunk: the tier may
    use it, the chunks hold exactly what was put, the pool's spare capacity stays untouched)."""
    n = 5
    t = store.tier(chunk_bytes)
    data = payloads(n, chunk_bytes, seed=chunk_bytes)
    keys = store.keys(n)
    pool = StagingArena(chunk_bytes, n + 1, headroom=headroom)
    t.register_staging(pool.buffer)
    try:
        t.put(keys, data)
        assert t.probe(keys) == [True] * n
        pool.buffer.fill_(0x5A)
        lease = pool.acquire(n)
        views = [lease.chunk(i) for i in range(n)]
        h = t.fetch(keys, views, deadline(), headroom=pool.headroom)
        assert h.wait() == n * chunk_bytes and h.done() and h.quiesce(0)
        assert all(torch.equal(v, d) for v, d in zip(views, data, strict=True))
        spare = pool.buffer[n * pool.chunk_stride :]  # the sixth chunk and its room
        assert spare.numel() == pool.chunk_stride and bool((spare == 0x5A).all())
        pool.release(lease)
    finally:
        t.unregister_staging(pool.buffer)


@pytest.mark.parametrize("headroom", [0, FETCH_HEADROOM])
def test_put_from_a_staging_pool(store, headroom):
    """put() from a pool's slot, as a store does (with header room before each chunk: the tier may
    write there, never into the chunks), then read back into plain views."""
    n = 4
    t = store.tier(C)
    data = payloads(n, C, seed=77)
    keys = store.keys(n)
    pool = StagingArena(C, n, headroom=headroom)
    t.register_staging(pool.buffer)
    try:
        lease = pool.acquire(n)
        for v, d in zip(lease.chunks(), data, strict=True):
            v.copy_(d)
        staged = []  # Mooncake: objects staged in its own buffer (a copy) instead of sent from the slot
        if hasattr(t, "_staging"):
            acquire = t._staging.acquire
            t._staging.acquire = lambda nbytes: staged.append(nbytes) or acquire(nbytes)
        t.put(keys, lease.chunks(), headroom=pool.headroom)
        assert all(torch.equal(v, d) for v, d in zip(lease.chunks(), data, strict=True))  # views untouched
        pool.release(lease)
    finally:
        t.unregister_staging(pool.buffer)
    out = zeros(n)
    t.fetch(keys, out, deadline()).wait()
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))
    if hasattr(t, "_staging"):
        assert bool(staged) == (not headroom)


def test_put_copies(store, tier):
    [d] = payloads(1)
    keys = store.keys(1)
    tier.put(keys, [d])
    expect = d.clone()
    d.zero_()
    out = zeros(1)
    tier.fetch(keys, out, deadline()).wait()
    assert torch.equal(out[0], expect)


def test_put_overwrites(store, tier):
    keys = store.keys(1)
    a, b = payloads(2, seed=3)
    tier.put(keys, [a])
    tier.put(keys, [b])
    out = zeros(1)
    tier.fetch(keys, out, deadline()).wait()
    assert torch.equal(out[0], b)


def test_probe_delete_missing(store, tier):
    a, b, c = keys = store.keys(3)
    tier.put([a, c], payloads(2))
    assert tier.probe(keys) == [True, False, True]
    with pytest.raises(MissingObjectError):
        tier.fetch(keys, zeros(3), deadline()).wait()
    tier.delete([a])
    assert tier.probe(keys) == [False, False, True]
    tier.delete(keys)  # absent keys are fine
    assert tier.probe(keys) == [False, False, False]


def test_empty_batches(tier):
    assert tier.probe([]) == []
    tier.put([], [])
    assert tier.fetch([], [], deadline()).wait() == 0


def test_bad_views_rejected(store, tier):
    keys = store.keys(2)
    with pytest.raises(ValueError):
        tier.put(keys[:1], [torch.zeros(C + 16, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        tier.fetch(keys[:1], [torch.zeros(C, dtype=torch.float32)], deadline())
    with pytest.raises(ValueError):
        tier.fetch(keys[:1], [torch.zeros(C - 16, dtype=torch.uint8)], deadline())
    with pytest.raises(ValueError):
        tier.fetch(keys, zeros(1), deadline())


def test_registration_mismatch_is_corrupt(store, tier):
    keys = store.keys(1)
    tier.put(keys, payloads(1))
    other = store.tier(fingerprint=FP_OTHER, own=True)
    with pytest.raises(CorruptObjectError):
        other.fetch(keys, zeros(1), deadline()).wait()


def test_tenant_salts_never_see_each_other(store, tier):
    tokens = list(range(256 * 3))
    salt = store.keys(1)[0]
    ka = PrefixKeys(KeySpace(FP, salt=salt + "a"), tokens, 256).window(0, 3)
    kb = PrefixKeys(KeySpace(FP, salt=salt + "b"), tokens, 256).window(0, 3)
    assert not set(ka) & set(kb)
    da, db = payloads(3, seed=1), payloads(3, seed=2)
    tier.put(ka, da)
    assert tier.probe(kb) == [False] * 3
    with pytest.raises(MissingObjectError):
        tier.fetch(kb, zeros(3), deadline()).wait()
    tier.put(kb, db)
    out = zeros(3)
    tier.fetch(ka, out, deadline()).wait()
    assert all(torch.equal(v, d) for v, d in zip(out, da, strict=True))


def test_close_is_final(store):
    t = store.tier(own=True)
    keys = store.keys(4)
    t.put(keys, payloads(4))
    t.fetch(keys, zeros(4), deadline()).wait()
    threads = pool_threads(t)
    t.close()
    t.close()  # idempotent
    assert not any(th.is_alive() for th in threads)
    with pytest.raises(TierUnavailableError):
        t.probe(keys)
    with pytest.raises(TierUnavailableError):
        t.fetch(keys, zeros(4), deadline())


# -- every FaultyTier fault against every tier -------------------------------------------------
def test_fault_unavailable(store, faulty):
    keys = store.keys(1)
    faulty.put(keys, payloads(1))
    faulty.plan.unavailable = True
    out = zeros(1)
    for op in (
        lambda: faulty.probe(keys),
        lambda: faulty.fetch(keys, out, deadline()),
        lambda: faulty.put(keys, out),
        lambda: faulty.delete(keys),
        lambda: faulty.register_staging(torch.zeros(C, dtype=torch.uint8)),
    ):
        with pytest.raises(TierUnavailableError):
            op()
    faulty.clear()
    assert faulty.probe(keys) == [True]


def test_fault_drop_after_probe(store, faulty):
    a, b, gone = keys = store.keys(3)
    faulty.put([a, b], payloads(2))
    faulty.fetch([a, b], zeros(2), deadline()).wait()  # a read may leave a lease (Mooncake): still evicted
    faulty.plan.drop_after_probe = {a, gone}
    assert faulty.probe(keys) == [True, True, False]
    with pytest.raises(MissingObjectError):
        faulty.fetch([a], zeros(1), deadline()).wait()
    assert faulty.probe([a, b]) == [False, True]
    assert faulty.inner.probe([a, b]) == [False, True]  # evicted from the store itself


def test_fault_delay(store, faulty):
    keys = store.keys(1)
    [d] = payloads(1)
    faulty.put(keys, [d])
    faulty.plan.delay_s = 0.3
    out = zeros(1)
    h = faulty.fetch(keys, out, time.monotonic() + 0.05)
    with pytest.raises(FetchTimeoutError):
        h.wait()
    assert h.quiesce(2.0) and not h.done()  # the bytes landed; only the completion is late
    assert torch.equal(out[0], d)
    t0 = time.monotonic()
    out[0].zero_()
    assert faulty.fetch(keys, out, deadline()).wait() == C
    assert time.monotonic() - t0 >= 0.25
    assert torch.equal(out[0], d)


def test_fault_corrupt_keys_damages_the_stored_object(store, faulty):
    a, b = keys = store.keys(2)
    data = payloads(2)
    faulty.put(keys, data)
    faulty.plan.corrupt_keys = {b}
    out = zeros(2)
    faulty.fetch([a], out[:1], deadline()).wait()
    with pytest.raises(CorruptObjectError):
        faulty.fetch(keys, out, deadline()).wait()
    assert faulty.probe(keys) == [True, True]  # present: only reading it shows the damage
    with pytest.raises(CorruptObjectError):  # really damaged in the store, not in the views
        faulty.inner.fetch([b], zeros(1), deadline()).wait()
    faulty.clear()  # puts the original back
    faulty.fetch(keys, out, deadline()).wait()
    assert all(torch.equal(v, x) for v, x in zip(out, data, strict=True))


def test_fault_fail_fetch(store, faulty):
    keys = store.keys(1)
    faulty.put(keys, payloads(1))
    seen = []

    def boom(ks):
        seen.append(tuple(ks))
        raise ValueError("injected")

    faulty.plan.fail_fetch = boom
    out = zeros(1)
    with pytest.raises(TierError) as ei:
        faulty.fetch(keys, out, deadline()).wait()
    assert seen == [tuple(keys)] and isinstance(ei.value.__cause__, ValueError)
    faulty.plan.fail_fetch = lambda ks: (_ for _ in ()).throw(MissingObjectError("gone"))
    with pytest.raises(MissingObjectError):
        faulty.fetch(keys, out, deadline()).wait()
    faulty.plan.fail_fetch = seen.append  # a hook that returns lets the fetch run
    assert faulty.fetch(keys, out, deadline()).wait() == C


def test_faulty_close_fails_late_completions(store):
    inner = store.tier(own=True)
    t = FaultyTier(inner)
    keys = store.keys(4)
    t.put(keys, payloads(4))
    out = zeros(4)
    t.fetch(keys, out, deadline()).wait()
    t.plan.delay_s = 5.0
    pending = t.fetch(keys, out, deadline(30))  # completion parked for 5 s
    assert delay_threads()
    threads = pool_threads(inner)
    t0 = time.monotonic()
    t.close()  # closes the inner tier too
    assert time.monotonic() - t0 < 4.5
    assert delay_threads() == [] and not any(th.is_alive() for th in threads)
    with pytest.raises(TierUnavailableError):
        pending.wait()
    t.close()  # idempotent
    with pytest.raises(TierUnavailableError):
        t.probe(keys)
    with pytest.raises(TierUnavailableError):
        inner.probe(keys)


@pytest.mark.parametrize("window_mib,mooncake_depth", [(8, 1), (31, 1), (32, 2), (1024, 2)])
def test_preferred_pipeline_depth(store, faulty, window_mib, mooncake_depth):
    """Mooncake over tcp restores windows below 32 MiB (half windows below 16 MiB) at depth 1 when the caller
    does not choose (its fetch keeps the host's cores busy: depth 2's half windows pay their fixed costs twice),
    larger ones at 2; the filesystem and memory tiers at 2 always. A FaultyTier reports its inner tier's."""
    want = mooncake_depth if store.kind in MOONCAKE_PATHS else 2
    window_bytes = window_mib << 20
    assert store.tier().preferred_pipeline_depth(window_bytes) == want
    assert faulty.preferred_pipeline_depth(window_bytes) == want
