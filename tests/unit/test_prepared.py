"""The cache of prepared destinations behind install_window / gather_window (bsr_kernels/prepared.py).

A hit must give the bytes a fresh preparation gives; every change of what the validation proved
(block table contents, a destination's address, shape, strides or dtype, the registration, the
backend) must miss; bad input must still be refused before any byte moves; the cache is bounded and
never keeps destination memory alive. Expected bytes come from the entry-by-entry oracle
(kernel_util.naive_install), never from the code under test.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from kernel_util import (
    Case,
    assert_same,
    make_case,
    naive_gather,
    naive_install,
    poisoned,
    random_bytes,
    random_kv,
    snapshot,
    untouched_outside_window,
)

from bsr_kernels import TensorSpec, gather_window, install_window, prepared, presets
from bsr_kernels.backends import available_backends, resolve_backend
from bsr_kernels.registration import Registration

BACKENDS = available_backends("cpu")


@pytest.fixture(autouse=True)
def _empty_cache():
    prepared.clear_cache()
    yield
    prepared.clear_cache()


def _prepared_for(reg, kv, backend):
    """The cached preparation for (reg, kv, backend), or None (looks, never inserts)."""
    layout = prepared.layout_key(tuple(kv))
    key = (reg.fingerprint, resolve_backend(backend, kv[0].device), layout[0])
    entry = prepared._ENTRIES.get(key)
    return entry[1].prepared if entry is not None and entry[0] == layout[1] else None


def _expect(case: Case, kv_before: list[torch.Tensor]) -> list[torch.Tensor]:
    expect = [t.clone() for t in kv_before]
    naive_install(case, expect)
    return expect


@pytest.mark.parametrize("backend", BACKENDS)
def test_hits_write_what_a_fresh_preparation_writes(backend):
    """Windows of one request through the one-shot call, the destinations prepared once: each
    window's bytes are the oracle's, blocks outside the windows stay poisoned."""
    reg = presets.dsv4_flash(scale=1 / 64)
    case = make_case(reg, 0, 6, seed=21)
    kv = poisoned(reg, case.num_blocks)
    expect = poisoned(reg, case.num_blocks)
    c = reg.chunk_bytes
    seen = None
    for first, n in [(0, 2), (2, 1), (3, 3)]:
        window = Case(reg, case.num_blocks, case.tables, first, n, case.staging[first * c : (first + n) * c].clone())
        assert install_window(window.staging, reg, kv, case.tables, first, n, backend=backend) == backend
        naive_install(window, expect)
        cached = _prepared_for(reg, kv, backend)
        assert cached is not None and (seen is None or cached is seen), "the second window did not hit"
        seen = cached
    assert_same(kv, expect, reg, f"{backend} one-shot windows on a warm cache vs oracle")
    untouched_outside_window(case, kv)
    assert prepared.cached_entries() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_hits_read_what_the_oracle_reads(backend):
    reg = presets.llama_like(layers=2, kv_heads=2, head_dim=8, block_size=16)
    case = make_case(reg, 0, 4, seed=5)
    src = random_kv(reg, case.num_blocks, 6)
    c = reg.chunk_bytes
    for first, n in [(0, 2), (2, 2), (1, 3)]:
        out = torch.full((n * c,), 0xA5, dtype=torch.uint8)
        gather_window(out, reg, src, case.tables, first, n, backend=backend)
        want = naive_gather(Case(reg, case.num_blocks, case.tables, first, n, out), src)
        assert torch.equal(out, want), f"{backend} gather of chunks {first}..{first + n - 1}"
    assert prepared.cached_entries() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_changed_table_contents_are_used(backend):
    """The tables are not part of the key: a table edited in place between two calls routes the
    second call's bytes by its new contents."""
    reg = presets.llama_like(layers=2, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 2, seed=8, spare_blocks=6)
    kv = poisoned(reg, case.num_blocks)
    install_window(case.staging, reg, kv, case.tables, 0, 2, backend=backend)
    table = case.tables[0]
    unused = sorted(set(range(case.num_blocks[0])) - set(table.tolist()))
    table[: len(unused)] = torch.tensor(unused[: table.numel()])  # same tensor, other blocks
    staging = random_bytes(2 * reg.chunk_bytes, torch.Generator().manual_seed(9))
    moved = Case(reg, case.num_blocks, case.tables, 0, 2, staging)
    expect = _expect(moved, kv)
    install_window(staging, reg, kv, case.tables, 0, 2, backend=backend)
    assert_same(kv, expect, reg, f"{backend} after the table changed")


def _kv_install(reg, case, kv, backend):
    install_window(case.staging, reg, kv, case.tables, case.first_chunk, case.num_chunks, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reallocated_destination_misses(backend):
    """Same shapes, one tensor re-allocated (another address): its bytes land in the new memory and
    the old memory is not written."""
    reg = presets.llama_like(layers=2, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 2, seed=10)
    kv = poisoned(reg, case.num_blocks)
    _kv_install(reg, case, kv, backend)
    old = kv[1]
    kv[1] = poisoned(reg, case.num_blocks)[1]
    old_before = old.clone()
    expect = _expect(case, [t if i != 1 else kv[1] for i, t in enumerate(kv)])
    _kv_install(reg, case, kv, backend)
    assert_same(kv, expect, reg, f"{backend} re-allocated destination")
    assert torch.equal(old.view(torch.uint8), old_before.view(torch.uint8)), "the freed address was written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_storage_swapped_in_place_misses(backend):
    """The same tensor object given other memory (set_, as a growing resize_ does): a new address;
    the bytes land there and the old memory keeps what it had."""
    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 2, seed=12)
    kv = poisoned(reg, case.num_blocks)
    _kv_install(reg, case, kv, backend)
    old_memory = kv[0].detach()  # another tensor object on the old storage
    old_bytes = old_memory.clone()
    fresh = poisoned(reg, case.num_blocks)[0]
    kv[0].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    assert kv[0].data_ptr() != old_memory.data_ptr()
    expect = _expect(case, kv)
    _kv_install(reg, case, kv, backend)
    assert_same(kv, expect, reg, f"{backend} after set_")
    assert torch.equal(old_memory.view(torch.uint8), old_bytes.view(torch.uint8)), "the old memory was written"


def _two_views(reg: Registration, nb: int):
    """Two destinations for a one-tensor registration at the same address with the same shape but
    other strides: rows of 2x the entry width (the first half), and the packed rows."""
    (d,), bs = reg.specs[0].entry_shape, reg.specs[0].block_size
    buf = torch.empty(nb * bs * 2 * d, dtype=reg.specs[0].dtype)
    wide = buf.view(nb, bs, 2 * d)[..., :d]
    packed = buf[: nb * bs * d].view(nb, bs, d)
    assert wide.data_ptr() == packed.data_ptr() and wide.shape == packed.shape and wide.stride() != packed.stride()
    return buf, wide, packed


def _one_tensor_reg() -> Registration:
    return Registration((TensorSpec("rows", torch.float16, (8,), 16, 1, 0, None),), name="rows")


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_strides_at_the_same_address_miss(backend):
    reg = _one_tensor_reg()
    case = make_case(reg, 0, 2, seed=13)
    nb = case.num_blocks[0]
    buf, wide, packed = _two_views(reg, nb)
    buf.view(torch.uint8).fill_(0x11)
    _kv_install(reg, case, [wide], backend)
    buf.view(torch.uint8).fill_(0x11)
    expect = buf.clone()
    naive_install(case, [expect[: nb * 16 * 8].view(nb, 16, 8)])
    _kv_install(reg, case, [packed], backend)
    assert torch.equal(buf.view(torch.uint8), expect.view(torch.uint8)), "bytes laid out by the stale strides"


@pytest.mark.parametrize("backend", BACKENDS)
def test_strides_changed_in_place_miss(backend):
    """The same tensor object, its strides changed through .data (which bumps no version counter)."""
    reg = _one_tensor_reg()
    case = make_case(reg, 0, 2, seed=14)
    nb = case.num_blocks[0]
    buf, wide, packed = _two_views(reg, nb)
    dest = wide.clone()  # an ordinary tensor object
    dest.data = wide
    _kv_install(reg, case, [dest], backend)
    dest.data = packed
    buf.view(torch.uint8).fill_(0x22)
    expect = buf.clone()
    naive_install(case, [expect[: nb * 16 * 8].view(nb, 16, 8)])
    _kv_install(reg, case, [dest], backend)
    assert torch.equal(buf.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_changed_in_place_is_refused(backend):
    """Same address, shape and strides, another dtype of the same width: the registration's dtype
    check must run again (a hit would accept it), before any byte moves."""
    reg = _one_tensor_reg()
    case = make_case(reg, 0, 2, seed=15)
    kv = poisoned(reg, case.num_blocks)
    _kv_install(reg, case, kv, backend)
    kv[0].data = kv[0].view(torch.int16)
    before = kv[0].clone()
    with pytest.raises(ValueError, match="dtype torch.int16, registration says torch.float16"):
        _kv_install(reg, case, kv, backend)
    assert torch.equal(kv[0], before)


def test_other_registration_or_backend_is_another_entry():
    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=8, block_size=16)
    other = Registration(reg.specs, chunk_tokens=reg.chunk_tokens * 2, name="llama-512")
    case = make_case(other, 0, 1, seed=16)
    kv = poisoned(reg, case.num_blocks)
    staging = case.staging[: reg.chunk_bytes]
    for backend in BACKENDS:
        install_window(staging, reg, kv, case.tables, 0, 1, backend=backend)
    install_window(case.staging, other, kv, case.tables, 0, 1, backend="torch")
    assert prepared.cached_entries() == len(BACKENDS) + 1
    assert {_prepared_for(reg, kv, b).backend for b in BACKENDS} == set(BACKENDS)
    assert _prepared_for(other, kv, "torch").reg is other


BAD_AFTER_A_HIT = {
    "block id out of range": (r"block id 999 out of range", lambda c: c.tables[0].__setitem__(1, 999)),
    "duplicated block ids": (r"duplicated block ids", lambda c: c.tables[0][:2].fill_(c.tables[0][0].item())),
    "-1 without sliding window": (r"block id -1", lambda c: c.tables[0].__setitem__(2, -1)),
    "table too short": (r"too short", lambda c: c.tables.__setitem__(0, c.tables[0][:1])),
    "staging too small": (r"staging too small", lambda c: setattr(c, "staging", c.staging[:-16])),
}


@pytest.mark.parametrize("name", sorted(BAD_AFTER_A_HIT))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_after_a_hit_is_refused_before_any_byte_moves(backend, name):
    match, mutate = BAD_AFTER_A_HIT[name]
    reg = presets.llama_like(layers=2, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 2, seed=17)
    kv = poisoned(reg, case.num_blocks)
    _kv_install(reg, case, kv, backend)
    mutate(case)
    before = snapshot(kv)
    with pytest.raises(ValueError, match=match):
        _kv_install(reg, case, kv, backend)
    assert _prepared_for(reg, kv, backend) is not None, "the destinations were not cached"
    assert_same(kv, before, reg, "destinations after a refused call")


def test_cache_is_bounded_least_recently_used_first():
    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 1, seed=18)
    sets = [poisoned(reg, case.num_blocks) for _ in range(prepared.MAX_ENTRIES + 3)]
    for kv in sets:
        install_window(case.staging, reg, kv, case.tables, 0, 1, backend="torch")
    assert prepared.cached_entries() == prepared.MAX_ENTRIES
    assert all(_prepared_for(reg, kv, "torch") is None for kv in sets[:3])
    assert all(_prepared_for(reg, kv, "torch") is not None for kv in sets[3:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_does_not_keep_destinations_alive(backend):
    """Once the caller drops its destinations, nothing the cache holds refers to their memory:
    the torch backend's views are released with the entry."""
    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=8, block_size=16)
    case = make_case(reg, 0, 1, seed=19)
    kv = poisoned(reg, case.num_blocks)
    install_window(case.staging, reg, kv, case.tables, 0, 1, backend=backend)
    state = _prepared_for(reg, kv, backend).state
    held = [weakref.ref(row[1]) for row in state.rows] if backend == "torch" else []
    del state
    dropped = [weakref.ref(t) for t in kv]
    del kv
    gc.collect()
    assert all(r() is None for r in dropped)
    assert all(r() is None for r in held), "the cache still holds views of freed destinations"
