"""MooncakeTier's local reads (tiers/mooncake_local.py) against a real master and real clients:
objects in the fetching client's own segment are copied and checksummed in one pass; damage made
in the segment's memory itself, swapped objects and missing keys still fail closed; a window whose
objects are spread over two clients' segments is served by both paths at once."""

from __future__ import annotations

import ctypes

import mooncake_util
import pytest
import torch
from mooncake_util import assert_same, fetch, flipped

from bsr_kernels import host_crc
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.tiers.base import CorruptObjectError, MissingObjectError

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300),
              pytest.mark.skipif(not host_crc.available(), reason="libbsr_cpu.so not built")]

pytest.importorskip("mooncake.store", reason="mooncake.store cannot be imported (no Mooncake wheel)")

from bsr_runtime.tiers.mooncake_object import HEADER_SIZE  # noqa: E402

FP = "10ca1" * 8
C = 96 * 1024 + 48  # not a power of two on purpose


def payloads(n: int, seed: int) -> list[torch.Tensor]:
    return mooncake_util.payloads(n, seed, C)


def segment_address(tier, key: str) -> int:
    return mooncake_util.segment_address(tier, key, C)


@pytest.fixture
def pool():
    return StagingArena(C, 32)


@pytest.fixture(scope="module")
def holder(mooncake_module_tier_factory):
    """The module's long-lived client with a segment (objects are put under keys of each test's own)."""
    return mooncake_module_tier_factory(C, FP, global_segment_size=64 << 20)


@pytest.fixture
def tier(holder, pool):
    t = holder
    t.register_staging(pool.buffer)
    yield t
    t.unregister_staging(pool.buffer)


def test_local_objects_take_one_checksumming_copy(tier, pool):
    n = 8
    keys = [f"local/{i}" for i in range(n)]
    data = payloads(n, seed=1)
    tier.put(keys, data)
    before = dict(tier.stats)
    assert_same(fetch(tier, keys, pool), data)
    assert tier.stats["local_reads"] - before["local_reads"] == n
    assert tier.stats["get_calls"] == before["get_calls"]  # no get: the copy served all


def test_the_get_path_serves_when_local_reads_are_off(mooncake_tier_factory, pool):
    t = mooncake_tier_factory(C, FP, global_segment_size=64 << 20, local_reads=False)
    t.register_staging(pool.buffer)
    keys = [f"off/{i}" for i in range(4)]
    data = payloads(4, seed=2)
    t.put(keys, data)
    assert_same(fetch(t, keys, pool), data)
    t.unregister_staging(pool.buffer)
    # a read that fits one landing buffer lands whole over tcp: one get
    assert t.stats["local_reads"] == 0 and t.stats["get_calls"] == 1


def test_a_pure_client_has_no_local_reader(mooncake_tier_factory):
    assert mooncake_tier_factory(C, FP, global_segment_size=0)._reads.local is None


@pytest.mark.parametrize("offset", [0, 30, 60, 100, 124, HEADER_SIZE, HEADER_SIZE + C // 2, HEADER_SIZE + C - 1])
def test_damage_in_the_segment_memory_is_refused(tier, pool, offset):
    """A byte flipped in the store's own memory (header field, payload checksum or payload)."""
    keys = [f"dmg{offset}/{i}" for i in range(3)]
    data = payloads(3, seed=3)
    tier.put(keys, data)
    with flipped(segment_address(tier, keys[1]) + offset, 0x40), pytest.raises(CorruptObjectError, match=keys[1]):
        fetch(tier, keys, pool)
    assert_same(fetch(tier, keys, pool), data)  # the byte restored: read back intact


def test_swapped_objects_in_the_segment_are_refused(tier, pool):
    keys = ["swap/a", "swap/b"]
    tier.put(keys, payloads(2, seed=4))
    a, b = (segment_address(tier, k) for k in keys)
    size = HEADER_SIZE + C
    tmp = ctypes.create_string_buffer(size)
    ctypes.memmove(tmp, a, size)
    ctypes.memmove(a, b, size)
    ctypes.memmove(b, tmp, size)
    with pytest.raises(CorruptObjectError, match="another key's data"):
        fetch(tier, keys, pool)


def test_a_missing_key_among_local_ones_is_missing(tier, pool):
    keys = ["miss/0", "miss/1", "miss/2"]
    tier.put([keys[0], keys[2]], payloads(2, seed=5))
    with pytest.raises(MissingObjectError, match="miss/1"):
        fetch(tier, keys, pool)


def test_a_window_over_two_segments_uses_both_paths(tier, mooncake_tier_factory, pool):
    """The master places each object in a random segment: with two clients' segments a window
    of 24 objects has some in each (the chance of all in one is 2^-23)."""
    other = mooncake_tier_factory(C, FP, global_segment_size=64 << 20)
    n = 24
    keys = [f"mixed/{i}" for i in range(n)]
    data = payloads(n, seed=6)
    tier.put(keys, data)
    local = len(tier._reads.local.addresses(keys, [C] * n))
    assert 0 < local < n and local + len(other._reads.local.addresses(keys, [C] * n)) == n
    before = dict(tier.stats)
    assert_same(fetch(tier, keys, pool), data)
    assert tier.stats["local_reads"] - before["local_reads"] == local
    assert tier.stats["get_calls"] - before["get_calls"] >= 1


@pytest.mark.parametrize("land_whole", [True, False])
def test_damage_in_another_clients_segment_is_refused_by_both_get_paths(tier, mooncake_tier_factory, pool,
                                                                        land_whole):
    """A pure client reads what `tier` holds: whole objects into a landing buffer + copy, or in
    place (tiers/mooncake_reads.py); a byte flipped in the holder's segment fails the window either way."""
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, land_whole=land_whole)
    reader.register_staging(pool.buffer)
    keys = [f"remote{land_whole}/{i}" for i in range(6)]
    data = payloads(6, seed=7)
    tier.put(keys, data)
    assert_same(fetch(reader, keys, pool), data)
    with flipped(segment_address(tier, keys[4]) + HEADER_SIZE + 1000, 0x01), \
            pytest.raises(CorruptObjectError, match="checksum"):
        fetch(reader, keys, pool)
    reader.unregister_staging(pool.buffer)
    assert reader.stats["local_reads"] == 0


def test_landing_buffers_are_two_and_reused(tier, mooncake_tier_factory, pool):
    """Sub-batches of 2 objects: a 20-object window takes 10 gets through two landing buffers."""
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, land_whole=True,
                                   verify_batch_bytes=2 * (HEADER_SIZE + C))
    reader.register_staging(pool.buffer)
    keys = [f"ring/{i}" for i in range(20)]
    data = payloads(20, seed=8)
    tier.put(keys, data)
    for _ in range(3):
        assert_same(fetch(reader, keys, pool), data)
    reader.unregister_staging(pool.buffer)
    assert reader.stats["get_calls"] == 30
    assert not reader._reads.landing._busy and len(reader._reads.landing._free) == 2


def test_without_the_cpu_library_the_in_place_path_serves_with_google_crc32c(mooncake_tier_factory, pool,
                                                                           monkeypatch):
    """No libbsr_cpu.so (no compiler at install): no local copy, no landing copy; the tier reads
    in place and checks CRCs one by one, and damage is still refused."""
    monkeypatch.setattr(host_crc, "available", lambda: False)
    t = mooncake_tier_factory(C, FP, global_segment_size=64 << 20)
    assert t._reads.local is None and not t._reads.land_whole
    t.register_staging(pool.buffer)
    keys = [f"nolib/{i}" for i in range(5)]
    data = payloads(5, seed=9)
    t.put(keys, data)
    assert_same(fetch(t, keys, pool), data)
    assert t.stats["local_reads"] == 0 and t.stats["get_calls"] == 2  # no landing copy: in place, two phases
    (replica,) = t._store.batch_get_replica_desc([keys[2]])[keys[2]][:1]  # (this tier reads no segment)
    address = replica.get_memory_descriptor().buffer_descriptor.buffer_address
    with flipped(address + HEADER_SIZE + 77, 0x10), pytest.raises(CorruptObjectError, match="checksum"):
        fetch(t, keys, pool)
    t.unregister_staging(pool.buffer)
