"""Reads in place (tiers/mooncake_reads.py, ReadPaths._in_place) from a real master and a real
holder client: each object lands whole where its payload goes, its header in the 128 bytes before
it (inside a run of adjacent views: the tail of the view before, borrowed by the odd phase and put
back). Checked on poisoned views with guard bytes: the right bytes in every view, nothing written
outside the views, damage at every position refused (the others intact), a missing object in
either phase, an exception in the second phase, and the deadline between the phases."""

from __future__ import annotations

import time

import pytest
import torch
from mooncake_util import GuardedViews, as_new, assert_same, flipped, segment_address
from mooncake_util import stored as put_payloads

from bsr_harness.testdata import POISON
from bsr_kernels import host_crc
from bsr_runtime.tiers.base import CorruptObjectError, FetchTimeoutError, MissingObjectError

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300),
              pytest.mark.skipif(not host_crc.available(), reason="libbsr_cpu.so not built")]

pytest.importorskip("mooncake.store", reason="mooncake.store cannot be imported (no Mooncake wheel)")

from bsr_runtime.tiers.mooncake_object import HEADER_SIZE as H  # noqa: E402
from bsr_runtime.tiers.mooncake_reads import run_positions  # noqa: E402

FP = "1n91ace" * 5
C = 64 * 1024 + 80  # not a power of two on purpose
SLOTS = 8


def Views(reader) -> GuardedViews:  # noqa: N802 - reads as the class it makes
    """SLOTS adjacent views of C bytes between two guards in one registered buffer, poisoned."""
    return GuardedViews(reader, SLOTS, C)


@pytest.fixture(scope="module")
def holder(mooncake_module_tier_factory):
    """The module's only client with a segment (objects are put under tags of each test's own)."""
    return mooncake_module_tier_factory(C, FP, global_segment_size=64 << 20)


@pytest.fixture(scope="module")
def shared_reader(mooncake_module_tier_factory):
    return mooncake_module_tier_factory(C, FP, global_segment_size=0, land_whole=False)


@pytest.fixture
def reader(shared_reader):
    """A pure client (no segment): every object crosses tcp, in place (land_whole=False). Shared by
    the module, as new for each test."""
    as_new(shared_reader)
    return shared_reader


@pytest.fixture
def views(reader):
    v = Views(reader)
    yield v
    v.close()


def stored(holder, tag: str, n: int, seed: int) -> tuple[list[str], list[torch.Tensor]]:
    return put_payloads(holder, tag, n, seed, C)


def read(reader, keys, ptrs, *, collect: bool, deadline: float | None = None):
    return reader._reads.read(reader.codec, keys, ptrs, [C] * len(keys),
                              time.monotonic() + 20 if deadline is None else deadline, collect=collect)


def test_run_positions():
    assert run_positions([0, C, 2 * C, 5 * C, 6 * C], [C] * 5) == [0, 1, 2, 0, 1]
    assert run_positions([2 * C, C, 0], [C] * 3) == [0, 0, 0]  # adjacent only in the other order
    assert run_positions([0, 64, 64 + H], [64, H, H]) == [0, 0, 1]  # a view smaller than a header hosts none
    assert run_positions([], []) == []


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_adjacent_views_land_in_place_with_nothing_written_outside(holder, reader, views, n):
    keys, data = stored(holder, f"run{n}", n, seed=n)
    slots = list(range(n))
    reader.fetch(keys, [views.slot(j) for j in slots], time.monotonic() + 20).wait()
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots)
    assert reader.stats["get_calls"] == (1 if n == 1 else 2)  # even positions, then odd ones
    assert not reader._reads.landing._free and not reader._reads.landing._busy  # no landing copy
    assert not reader._reads.headers._busy and not reader._registrations.temp


@pytest.mark.parametrize("n, adjacent, lands_whole", [(2, True, True), (5, True, False), (5, False, True)])
def test_the_tcp_default_lands_small_or_scattered_reads_whole(holder, mooncake_tier_factory, n, adjacent,
                                                              lands_whole):
    """land_whole None over tcp (verify_batch_bytes of three objects here): a read that fits one
    landing buffer lands whole (one get and a copy), as does one whose views are never adjacent;
    a larger read of adjacent views lands in place."""
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, verify_batch_bytes=3 * (H + C))
    assert reader._reads.land_whole is None
    views = Views(reader)
    keys, data = stored(holder, f"default{n}{adjacent}", n, seed=80 + n)
    slots = list(range(n)) if adjacent else [0, 2, 4, 6, 1][:n]  # 6 then 1: not adjacent either
    assert read(reader, keys, views.ptrs(slots), collect=False) == {}
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots)
    assert bool(reader._reads.landing._free) == lands_whole
    views.close()


def test_a_phase_in_several_gets(holder, mooncake_tier_factory):
    """in_place_batch_bytes of two objects: 7 views take 2 + 2 gets (positions 0,2 | 4,6 then
    1,3 | 5); a damaged object in the last get is still refused, the others intact."""
    reader = mooncake_tier_factory(C, FP, global_segment_size=0, land_whole=False,
                                   in_place_batch_bytes=2 * (H + C))
    views = Views(reader)
    keys, data = stored(holder, "small-gets", 7, seed=70)
    slots = list(range(7))
    assert read(reader, keys, views.ptrs(slots), collect=False) == {}
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots) and reader.stats["get_calls"] == 4
    with flipped(segment_address(holder, keys[5], C) + H + C - 3, 0x80):
        problems = read(reader, keys, views.ptrs(slots), collect=True)
    assert set(problems) == {5} and reader.stats["get_calls"] == 8
    assert_same([views.slot(j) for j in slots if j != 5], [d for j, d in enumerate(data) if j != 5])
    views.close()


def test_runs_gaps_and_order(holder, reader, views):
    """Slots 0,1,2 | 5,6 | 3 (4 and 7 unused): three runs, each started by its own two-buffer get."""
    slots = [0, 1, 2, 5, 6, 3]
    keys, data = stored(holder, "order", len(slots), seed=10)
    assert run_positions(views.ptrs(slots), [C] * len(slots)) == [0, 1, 2, 0, 1, 0]
    assert read(reader, keys, views.ptrs(slots), collect=False) == {}
    assert_same([views.slot(j) for j in slots], data)
    assert views.untouched(slots)


def test_runs_in_two_separate_buffers(holder, reader, views):
    """Views from two allocations (far apart in memory): two runs, each borrowing only its own tails."""
    other = Views(reader)
    try:
        keys, data = stored(holder, "two-buffers", 6, seed=11)
        ptrs = views.ptrs([0, 1, 2]) + other.ptrs([3, 4, 5])
        assert read(reader, keys, ptrs, collect=False) == {}
        assert_same([views.slot(j) for j in (0, 1, 2)] + [other.slot(j) for j in (3, 4, 5)], data)
        assert views.untouched([0, 1, 2]) and other.untouched([3, 4, 5])
    finally:
        other.close()


N = 5  # positions 0, 2, 4 land first, 1 and 3 borrow the tails of views 0 and 2


@pytest.mark.parametrize("where", ["digest", "payload_first", "payload_tail", "payload_last"])
@pytest.mark.parametrize("bad", range(N))
def test_damage_at_any_position_is_refused_and_the_others_are_intact(holder, reader, views, bad, where):
    """A byte flipped in the holder's segment: in the header's key digest, or in the payload's
    first byte, its last 128 bytes (the tail the next object borrows) or its last byte."""
    keys, data = stored(holder, f"dmg{bad}{where}", N, seed=20 + bad)
    offset = {"digest": 60, "payload_first": H, "payload_tail": H + C - H + 5, "payload_last": H + C - 1}[where]
    slots = list(range(N))
    with flipped(segment_address(holder, keys[bad], C) + offset, 0x10):
        problems = read(reader, keys, views.ptrs(slots), collect=True)
        assert set(problems) == {bad} and isinstance(problems[bad], CorruptObjectError)
        assert ("another key's data" if where == "digest" else "checksum") in str(problems[bad])
        assert_same([views.slot(j) for j in slots if j != bad], [d for j, d in enumerate(data) if j != bad])
        assert views.untouched(slots)
        with pytest.raises(CorruptObjectError, match=keys[bad]):
            reader.fetch(keys, [views.slot(j) for j in slots], time.monotonic() + 20).wait()
    read(reader, keys, views.ptrs(slots), collect=False)  # the byte restored: all good again
    assert_same([views.slot(j) for j in slots], data)


@pytest.mark.parametrize("missing", [0, 2, 3, 4])
def test_a_missing_object_in_either_phase(holder, reader, views, missing):
    keys, data = stored(holder, f"miss{missing}", N, seed=30 + missing)
    holder.delete([keys[missing]])
    slots = list(range(N))
    problems = read(reader, keys, views.ptrs(slots), collect=True)
    assert set(problems) == {missing} and isinstance(problems[missing], MissingObjectError)
    assert_same([views.slot(j) for j in slots if j != missing], [d for j, d in enumerate(data) if j != missing])
    assert views.untouched(slots)
    with pytest.raises(MissingObjectError, match=keys[missing]):
        read(reader, keys, views.ptrs(slots), collect=False)


@pytest.mark.parametrize("bad, extra", [(3, 100), (4, 100), (3, -100), (2, -C)])
def test_an_object_of_the_wrong_size_writes_nothing_outside_its_view(holder, reader, views, bad, extra):
    """An object under one key of the window whose stored size is not H + C (larger, smaller, or
    payload-only as in the old format): refused with its size named, the neighbours intact and
    nothing written past the views (position 3 lands after 4; 4 is the last view)."""
    keys, data = stored(holder, f"size{bad}{extra}", N, seed=90 + bad)
    holder.delete([keys[bad]])
    assert holder._store.put(keys[bad], bytes(H + C + extra)) == 0
    slots = list(range(N))
    problems = read(reader, keys, views.ptrs(slots), collect=True)
    assert set(problems) == {bad} and isinstance(problems[bad], CorruptObjectError)
    assert f"{H + C + extra:,} B" in str(problems[bad])
    assert_same([views.slot(j) for j in slots if j != bad], [d for j, d in enumerate(data) if j != bad])
    assert views.untouched(slots)


class _Store:
    """The reader's client, with an action after the get number `after` (1-based) has landed."""

    def __init__(self, store, after: int, action) -> None:
        self._real, self._after, self._action, self.calls = store, after, action, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _counted(self, out):
        self.calls += 1
        if self.calls == self._after:
            self._action()
        return out

    def batch_get_into_multi_buffers(self, *args):
        return self._counted(self._real.batch_get_into_multi_buffers(*args))

    def batch_get_into(self, *args):  # a phase whose objects all land whole
        return self._counted(self._real.batch_get_into(*args))


def test_an_exception_in_the_second_phase_puts_the_borrowed_tails_back(holder, reader, views, monkeypatch):
    keys, data = stored(holder, "raise", N, seed=40)
    store = _Store(reader._store, 2, lambda: (_ for _ in ()).throw(RuntimeError("injected after the odd phase")))
    monkeypatch.setattr(reader._reads, "_store", lambda: store)
    slots = list(range(N))
    with pytest.raises(RuntimeError, match="injected"):
        read(reader, keys, views.ptrs(slots), collect=False)
    # views 0 and 2 lent their tails to the headers of objects 1 and 3: whole again
    assert_same([views.slot(j) for j in (0, 2, 4)], [data[0], data[2], data[4]])
    assert views.untouched(slots)
    assert not reader._reads.headers._busy and not reader._registrations.temp


def test_the_deadline_between_the_phases_starts_no_more_transfers(holder, reader, views, monkeypatch):
    keys, data = stored(holder, "late", N, seed=50)
    deadline = time.monotonic() + 0.5
    store = _Store(reader._store, 1, lambda: time.sleep(max(0.0, deadline - time.monotonic()) + 0.05))
    monkeypatch.setattr(reader._reads, "_store", lambda: store)
    slots = list(range(N))
    problems = read(reader, keys, views.ptrs(slots), collect=True, deadline=deadline)
    assert store.calls == 1  # the odd phase never started
    assert set(problems) == {1, 3} and all(isinstance(e, FetchTimeoutError) for e in problems.values())
    assert_same([views.slot(j) for j in (0, 2, 4)], [data[0], data[2], data[4]])
    # views 1 and 3 hold only the headers of objects 2 and 4 in their tails
    assert all(bool((views.slot(j)[: C - H] == POISON).all()) for j in (1, 3))


def test_what_landed_before_the_deadline_is_still_checked(holder, reader, views, monkeypatch):
    """Past the deadline after the even phase: the even objects that landed are verified all the
    same (a damaged one is refused), not handed on unchecked."""
    keys, _ = stored(holder, "late-dmg", N, seed=60)
    deadline = time.monotonic() + 0.5
    store = _Store(reader._store, 1, lambda: time.sleep(max(0.0, deadline - time.monotonic()) + 0.05))
    monkeypatch.setattr(reader._reads, "_store", lambda: store)
    with flipped(segment_address(holder, keys[2], C) + H + 7, 0x02):
        problems = read(reader, keys, views.ptrs(list(range(N))), collect=True, deadline=deadline)
    assert set(problems) == {1, 2, 3} and isinstance(problems[2], CorruptObjectError)
