"""Reads into views with header room (StagingArena(headroom=...), Tier.fetch(headroom=...)) from a
real master and a real holder client: every object lands whole, by one transfer, its header in the
scratch before its view, all of a window in one get, CRCs in place, no landing copy. Checked on
poisoned views laid out as a pool lays them out, between guard bytes: the right bytes in every view,
nothing written outside the views and their header room, damage at every position refused (the
others intact), a missing object, an object of the wrong size, the deadline, and a headroom too
small for a header (then the other paths, unchanged)."""

from __future__ import annotations

import time

import pytest
import torch
from mooncake_util import GuardedViews, as_new, assert_same, fetch, flipped, payloads, segment_address
from mooncake_util import stored as put_payloads

from bsr_harness.testdata import POISON
from bsr_kernels import host_crc
from bsr_kernels.staging_arena import StagingArena
from bsr_runtime.tiers.base import FETCH_HEADROOM, CorruptObjectError, FetchTimeoutError, MissingObjectError

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300),
              pytest.mark.skipif(not host_crc.available(), reason="libbsr_cpu.so not built")]

pytest.importorskip("mooncake.store", reason="mooncake.store cannot be imported (no Mooncake wheel)")

from bsr_runtime.tiers.mooncake_object import HEADER_SIZE as H  # noqa: E402

FP = "h3adr00m" * 5
C = 64 * 1024 + 80  # not a power of two on purpose
SLOTS = 6
ROOM = FETCH_HEADROOM
STRIDE = ROOM + C


def RoomyViews(reader) -> GuardedViews:  # noqa: N802 - reads as the class it makes
    """SLOTS views of C bytes, each after ROOM bytes of header room, between two guards, poisoned."""
    return GuardedViews(reader, SLOTS, C, room=ROOM)


@pytest.fixture(scope="module")
def holder(mooncake_module_tier_factory):
    """The module's only long-lived client with a segment (objects are put under tags of each test's own)."""
    return mooncake_module_tier_factory(C, FP, global_segment_size=64 << 20)


@pytest.fixture(scope="module")
def shared_reader(mooncake_module_tier_factory):
    return mooncake_module_tier_factory(C, FP, global_segment_size=0)


@pytest.fixture
def reader(shared_reader):
    """A pure client (no segment) with the tcp default (land_whole None): every object crosses tcp.
    Shared by the module, as new for each test."""
    as_new(shared_reader)
    return shared_reader


@pytest.fixture
def views(reader):
    v = RoomyViews(reader)
    yield v
    v.close()


def stored(holder, tag: str, n: int, seed: int) -> tuple[list[str], list[torch.Tensor]]:
    return put_payloads(holder, tag, n, seed, C)


def read(reader, keys, ptrs, *, collect: bool, deadline: float | None = None, headroom: int = ROOM):
    return reader._reads.read(reader.codec, keys, ptrs, [C] * len(keys),
                              time.monotonic() + 20 if deadline is None else deadline, collect=collect,
                              headroom=headroom)


def no_leftovers(reader) -> bool:
    r = reader._reads
    return not r.landing._free and not r.landing._busy and not r.headers._busy and not reader._registrations.temp


@pytest.mark.parametrize("slots", [[0], [0, 1], [0, 1, 2, 3, 4, 5], [4, 1, 3], [5, 0]])
def test_each_object_lands_whole_in_one_get(holder, reader, views, slots):
    """Small reads too (the tcp default would land these whole and copy them): one get, no landing
    buffer, nothing written outside the views and their room."""
    keys, data = stored(holder, f"one-get{len(slots)}{slots[0]}", len(slots), seed=len(slots))
    reader.fetch(keys, [views.slot(j) for j in slots], time.monotonic() + 20, headroom=ROOM).wait()
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots)
    assert reader.stats["get_calls"] == 1 and no_leftovers(reader)


def test_a_staging_pool_with_headroom(holder, reader):
    """Through a StagingArena(headroom=FETCH_HEADROOM) lease, as the restore does: 2-D rows of C bytes
    FETCH_HEADROOM + C apart, one get."""
    pool = StagingArena(C, 5, headroom=ROOM)
    assert pool.chunk_stride == STRIDE and pool.capacity_bytes == 5 * C and pool.room_bytes == 5 * ROOM
    assert pool.buffer.numel() == 5 * STRIDE
    reader.register_staging(pool.buffer)
    keys, data = stored(holder, "pool", 5, seed=11)
    lease = pool.acquire(5)
    assert lease.view.shape == (5, C) and lease.view.stride() == (STRIDE, 1)
    lease.view.fill_(POISON)
    reader.fetch(keys, lease.chunks(), time.monotonic() + 20, headroom=pool.headroom).wait()
    assert_same(lease.chunks(), data) and reader.stats["get_calls"] == 1
    pool.release(lease)
    assert no_leftovers(reader)
    # without headroom the same views are not adjacent: the tcp default lands them whole and copies
    assert_same(fetch(reader, keys, pool), data)
    assert reader.stats["get_calls"] == 2 and reader._reads.landing._free
    reader.unregister_staging(pool.buffer)


def test_several_gets_when_the_read_exceeds_a_batch(holder, mooncake_tier_factory):
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, in_place_batch_bytes=2 * (H + C))
    views = RoomyViews(reader)
    keys, data = stored(holder, "batches", 5, seed=21)
    slots = list(range(5))
    assert read(reader, keys, views.ptrs(slots), collect=False) == {}
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots) and reader.stats["get_calls"] == 3  # [0], [1, 2], [3, 4]
    views.close()


@pytest.mark.parametrize("bad", range(5))
@pytest.mark.parametrize("where", ["key digest", "first byte", "last byte"])
def test_damage_at_any_position_is_refused_and_the_others_are_intact(holder, reader, views, bad, where):
    keys, data = stored(holder, f"dmg{bad}{where[0]}", 5, seed=30 + bad)
    offset = {"key digest": 40, "first byte": H, "last byte": H + C - 1}[where]
    slots = list(range(5))
    with flipped(segment_address(holder, keys[bad], C) + offset, 0x10):
        problems = read(reader, keys, views.ptrs(slots), collect=True)
        assert set(problems) == {bad} and isinstance(problems[bad], CorruptObjectError)
        assert_same([views.slot(j) for j in slots if j != bad], [d for j, d in enumerate(data) if j != bad])
        with pytest.raises(CorruptObjectError, match=keys[bad]):
            read(reader, keys, views.ptrs(slots), collect=False)
    assert read(reader, keys, views.ptrs(slots), collect=False) == {}  # the byte restored: read whole
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots) and no_leftovers(reader)


def test_a_missing_object(holder, reader, views):
    keys, data = stored(holder, "missing", 4, seed=50)
    holder.delete([keys[2]])
    slots = list(range(4))
    problems = read(reader, keys, views.ptrs(slots), collect=True)
    assert set(problems) == {2} and isinstance(problems[2], MissingObjectError)
    assert_same([views.slot(j) for j in (0, 1, 3)], [data[0], data[1], data[3]])
    with pytest.raises(MissingObjectError, match=keys[2]):
        reader.fetch(keys, [views.slot(j) for j in slots], time.monotonic() + 20, headroom=ROOM).wait()
    assert views.untouched(slots)


@pytest.mark.parametrize("extra", [100, -100, -C])
def test_an_object_of_the_wrong_size_writes_nothing_outside_its_view(holder, reader, views, extra):
    keys, data = stored(holder, f"size{extra}", 4, seed=60)
    holder.delete([keys[1]])
    assert holder._store.put(keys[1], bytes(H + C + extra)) == 0
    slots = list(range(4))
    problems = read(reader, keys, views.ptrs(slots), collect=True)
    assert set(problems) == {1} and isinstance(problems[1], CorruptObjectError)
    assert f"{H + C + extra:,} B" in str(problems[1])
    assert_same([views.slot(j) for j in (0, 2, 3)], [data[0], data[2], data[3]])
    assert views.untouched(slots)


def test_past_the_deadline_between_gets_nothing_more_lands_and_what_landed_is_checked(
        holder, mooncake_tier_factory, monkeypatch):
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, in_place_batch_bytes=2 * (H + C))
    views = RoomyViews(reader)
    keys, _ = stored(holder, "late", 5, seed=70)
    deadline = time.monotonic() + 0.5
    real = reader._store

    class Slow:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_get_into(self, *args):
            out = real.batch_get_into(*args)
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
            return out

    monkeypatch.setattr(reader._reads, "_store", lambda: Slow())
    # 5 objects in gets of at most 2: [0], [1, 2], [3, 4]
    with flipped(segment_address(holder, keys[0], C) + H + 9, 0x04):
        problems = read(reader, keys, views.ptrs(list(range(5))), collect=True, deadline=deadline)
    assert isinstance(problems[0], CorruptObjectError)  # landed before the deadline, still checked
    assert set(problems) == {0, 1, 2, 3, 4}
    assert all(isinstance(problems[i], FetchTimeoutError) for i in (1, 2, 3, 4))
    assert reader.stats["get_calls"] == 1 and views.untouched([0])
    views.close()


def test_room_smaller_than_a_header_is_not_used(holder, mooncake_tier_factory):
    """headroom < H: the scratch cannot hold a header, so the read takes the paths it takes without
    room (here forced in place: a two-buffer get per view, headers in the header area); the bytes
    before each view are never written."""
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, land_whole=False)
    views = RoomyViews(reader)
    keys, data = stored(holder, "small-room", 3, seed=80)
    slots = [0, 2, 4]
    assert read(reader, keys, views.ptrs(slots), collect=False, headroom=H - 16) == {}
    assert_same([views.slot(j) for j in slots], data)
    assert all(bool((views.room(j) == POISON).all()) for j in range(SLOTS))
    views.close()


def test_sub_batches_are_few_even_and_bounded():
    from bsr_runtime.tiers.mooncake_reads import sub_batches

    c = 256 << 10
    assert sub_batches([c] * 256, 32 << 20) == [(0, 85), (85, 170), (170, 256)]  # not 127 + 127 + 2
    assert sub_batches([c] * 256, 128 << 20) == [(0, 256)]
    assert sub_batches([c] * 4, 2 * (H + c)) == [(0, 2), (2, 4)]
    assert sub_batches([c] * 3, 2 * (H + c)) == [(0, 1), (1, 3)]
    assert sub_batches([5000], 100) == [(0, 1)] and sub_batches([], 100) == []
    for sizes, bound in [([10, 1000, 10, 10], 600), ([100] * 7 + [900] * 3, 1300), ([1, 2, 3] * 50, 64)]:
        got = sub_batches(sizes, bound)  # uneven sizes: every batch within the bound, all covered
        assert [s for s, _ in got] == [0] + [e for _, e in got[:-1]] and got[-1][1] == len(sizes)
        assert all(sum(sizes[s:e]) + H * (e - s) <= bound or e - s == 1 for s, e in got)


def test_a_put_with_headroom_needs_room_before_each_view(holder, mooncake_tier_factory):
    """A view at its buffer's very start has no room before it: refused before any object is
    written, also those of earlier views and batches (puts of one object per batch here)."""
    writer = mooncake_tier_factory(C, FP, global_segment_size=64 << 20, put_batch_bytes=H + C)
    views = GuardedViews(writer, 2, C, room=ROOM)
    keys = ["no-room/0", "no-room/1", "no-room/2"]
    with pytest.raises(ValueError, match="header after its buffer's start"):
        writer.put(keys, [views.slot(0), views.slot(1), torch.zeros(C, dtype=torch.uint8)], headroom=ROOM)
    assert writer.probe(keys) == [False] * 3
    assert views.untouched([])  # not even a header written
    views.close()


def test_a_put_with_headroom_writes_only_the_room_and_reads_back(holder, reader):
    """put(headroom=...) writes each header into the room before its view (nothing else), and the
    objects read back through every path."""
    views = GuardedViews(holder, SLOTS, C, room=ROOM)
    data = payloads(3, 91, C)
    for j, d in zip((0, 2, 4), data, strict=True):
        views.slot(j).copy_(d)
    keys = [f"put-room/{i}" for i in range(3)]
    holder.put(keys, [views.slot(j) for j in (0, 2, 4)], headroom=ROOM)
    assert_same([views.slot(j) for j in (0, 2, 4)], data)  # the payloads as they were
    assert views.untouched([0, 2, 4]) and all(not bool((views.room(j) == POISON).all()) for j in (0, 2, 4))
    views.close()
    back = GuardedViews(reader, SLOTS, C, room=ROOM)
    assert read(reader, keys, back.ptrs([1, 3, 5]), collect=False) == {}
    assert_same([back.slot(j) for j in (1, 3, 5)], data)
    back.close()


# -- per-view room: the alignment padding of the object before (LMCache's L1 objects) ---------------
PAD = 4800  # align_up(c, 4096) - c for the sweep's 249,152 B chunks


def test_padding_rooms():
    from bsr_runtime.integrations.lmcache.mooncake_l2 import padding_rooms

    phys = C + PAD
    ptrs = [0, phys, 2 * phys, 5 * phys, 6 * phys, 3 * phys]
    assert padding_rooms(ptrs, [C] * 6, [phys] * 6) == [0, PAD, PAD, 0, PAD, 0]  # runs, gaps, order
    assert padding_rooms([0, C], [C, C], [C, C]) == [0, 0]  # no padding: adjacent, no room
    assert padding_rooms([], [], []) == []


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [0, 1, 2, 4, 5], [3, 4, 1]])
def test_objects_land_whole_in_the_padding_of_the_object_before(holder, mooncake_tier_factory, slots):
    """Views as LMCache lays out its L1 objects (C bytes each, PAD bytes of padding after each): where
    a view follows the one before's padding, its object lands whole with its header in that padding;
    the first of each run takes a two-buffer get. One get, no landing copy, nothing written before
    the first view of a run nor into unused slots, the right bytes in every view."""
    from bsr_runtime.integrations.lmcache.mooncake_l2 import padding_rooms

    reader = mooncake_tier_factory(C, FP, global_segment_size=0)  # the tcp default: land_whole None
    views = GuardedViews(reader, SLOTS + 1, C, room=PAD)  # slot j's room is slot j-1's padding
    try:
        keys, data = stored(holder, "pad" + "".join(map(str, slots)), len(slots), seed=90 + len(slots))
        ptrs = [views.slot(j + 1).data_ptr() for j in slots]  # slot 0 unused: its padding guards slot 1
        rooms = padding_rooms(ptrs, [C] * len(slots), [C + PAD] * len(slots))
        assert rooms == [PAD if i and slots[i] == slots[i - 1] + 1 else 0 for i in range(len(slots))]
        assert read(reader, keys, ptrs, collect=False, headroom=rooms) == {}
        assert_same([views.slot(j + 1) for j in slots], data)
        used = [j + 1 for j in slots]
        assert views.untouched(used)  # unused slots with their rooms, and the guards
        firsts = [j + 1 for i, j in enumerate(slots) if not rooms[i]]
        assert all(bool((views.room(j) == POISON).all()) for j in firsts)  # not this read's bytes
        assert reader.stats["get_calls"] == 1 and no_leftovers(reader)
        with flipped(segment_address(holder, keys[-1], C) + H + 7, 0x04):  # damage is still refused
            problems = read(reader, keys, ptrs, collect=True, headroom=rooms)
        assert set(problems) == {len(slots) - 1} and isinstance(problems[len(slots) - 1], CorruptObjectError)
    finally:
        views.close()
