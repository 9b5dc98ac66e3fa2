"""Destinations that alias across KV-cache groups (vLLM's hybrid allocator).

vLLM's HMA gives one layer of each KV-cache group one shared tensor per layer position and draws
every group's block ids from one block pool. Here a two-group registration (group 0 with a sliding
window, group 1 full attention) registers, for group 1, fresh views with the very geometry of
group 0's (the same memory block for block), laid out like engines lay out their caches. With
disjoint block tables every backend here installs and gathers exactly what an entry-by-entry
oracle (kernel_util.naive_install / naive_gather) does; one block id resident in both groups, an
alias inside one group, or an overlap across groups other than block for block is a one-line
ValueError before any byte moves.
"""

from __future__ import annotations

import pytest
import torch
from kernel_util import KV_LAYOUTS, POISON, Case, kv_pair_layout, naive_gather, naive_install, random_bytes, same_bytes

from bsr_kernels import Registration, TensorSpec, WindowInstaller, gather_window, install_window
from bsr_kernels.install import available_backends

BACKENDS = available_backends("cpu")
CHUNK = 64
BS = 16  # 4 blocks per chunk and group
WINDOW = 96
NB = 40


def _registration(window1: int | None = None) -> Registration:
    windows = (WINDOW, window1)
    specs = [TensorSpec(f"layers.{layer}.{kind}", torch.bfloat16, (2, 8), BS, 1, layer, windows[layer])
             for layer in range(2) for kind in ("k", "v")]
    return Registration(tuple(specs), chunk_tokens=CHUNK, name="hybrid")


def _same_view(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over the same bytes with the same geometry (what each group gets)."""
    return t.as_strided(t.shape, t.stride(), t.storage_offset())


def _aliased(layout: str, reg: Registration) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Group 0's K/V views of poisoned engine buffers, and group 1's: the same views again."""
    one_layer = Registration(reg.specs[:2], chunk_tokens=CHUNK)
    views, buffers = kv_pair_layout(layout, one_layer, NB)
    return [*views, *(_same_view(v) for v in views)], buffers


def _tables(reg: Registration, end_chunk: int, seed: int, shared: int | None = None) -> list[torch.Tensor]:
    """Disjoint block ids across both groups (one pool), some -1 in the sliding-window group 0;
    with `shared`, group 1's block at that table index is group 0's (resident) block there."""
    gen = torch.Generator().manual_seed(seed)
    need = reg.blocks_needed(0, end_chunk * CHUNK)
    perm = torch.randperm(NB, generator=gen)
    t0, t1 = perm[:need].clone(), perm[need : 2 * need].clone()
    t0[torch.rand(need, generator=gen) < 0.25] = -1
    if shared is not None:
        t0[shared] = perm[2 * need]  # resident in group 0 ...
        t1[shared] = t0[shared]  # ... and in group 1
    return [t0, t1]


def _case(reg, tables, first_chunk, num_chunks, seed) -> Case:
    staging = random_bytes(num_chunks * reg.chunk_bytes, torch.Generator().manual_seed(seed))
    return Case(reg, [NB, NB], tables, first_chunk, num_chunks, staging)


def _written_blocks(case: Case) -> set[int]:
    lo, hi = case.first_chunk * CHUNK // BS, (case.first_chunk + case.num_chunks) * CHUNK // BS
    return {b for t in case.tables for b in t[lo:hi].tolist() if b >= 0}


def _untouched_still_poisoned(case: Case, views: list[torch.Tensor]) -> None:
    written = _written_blocks(case)
    for spec, t in zip(case.reg.specs, views):
        for blk in range(NB):
            if blk not in written:
                assert bool((t[blk].view(torch.uint8) == POISON).all()), f"{spec.name} block {blk} written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("first_chunk,num_chunks", [(0, 1), (1, 2)])
def test_install_into_aliased_groups_matches_oracle(backend, layout, first_chunk, num_chunks):
    reg = _registration()
    tables = _tables(reg, first_chunk + num_chunks, seed=first_chunk)
    case = _case(reg, tables, first_chunk, num_chunks, seed=7)
    views, buffers = _aliased(layout, reg)
    assert install_window(case.staging, reg, views, tables, first_chunk, num_chunks, backend=backend) == backend
    expect_views, expect = _aliased(layout, reg)
    naive_install(case, expect_views)
    same_bytes(buffers, expect, f"{backend} {layout}")
    _untouched_still_poisoned(case, views)
    # both groups were written (the window holds resident blocks of each)
    for g in (0, 1):
        lo, hi = first_chunk * CHUNK // BS, (first_chunk + num_chunks) * CHUNK // BS
        blk = next(b for b in tables[g][lo:hi].tolist() if b >= 0)
        assert not bool((views[2 * g][blk].view(torch.uint8) == POISON).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_gather_from_aliased_groups_matches_oracle(backend, layout):
    reg = _registration()
    tables = _tables(reg, 3, seed=3)
    case = _case(reg, tables, 1, 2, seed=8)
    views, buffers = _aliased(layout, reg)
    gen = torch.Generator().manual_seed(9)
    for b in buffers:
        flat = b.view(torch.uint8).view(-1)
        flat.copy_(random_bytes(flat.numel(), gen))
    out = torch.full((2 * reg.chunk_bytes,), 7, dtype=torch.uint8)
    assert gather_window(out, reg, views, tables, 1, 2, backend=backend) == backend
    assert torch.equal(out, naive_gather(case, views))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_installer_round_trip_over_aliased_groups(backend):
    """Validated once for the request, installed window by window, gathered back."""
    reg = _registration()
    tables = _tables(reg, 3, seed=5)
    case = _case(reg, tables, 0, 3, seed=10)
    views, buffers = _aliased("vllm_cpu", reg)
    inst = WindowInstaller(reg, views, tables, 3, backend=backend)
    for first in range(3):
        inst.install(case.staging[first * reg.chunk_bytes : (first + 1) * reg.chunk_bytes], first, 1)
    expect_views, expect = _aliased("vllm_cpu", reg)
    naive_install(case, expect_views)
    same_bytes(buffers, expect, backend)
    _untouched_still_poisoned(case, views)
    out = torch.zeros(3 * reg.chunk_bytes, dtype=torch.uint8)
    inst.gather(out, 0, 3)
    assert torch.equal(out, naive_gather(case, views))


# -- rejections: a one-line ValueError before any byte moves -----------------------------------

def _rejected(reg, views, buffers, tables, match, first_chunk=0, num_chunks=1, backend="torch") -> str:
    staging = random_bytes(num_chunks * reg.chunk_bytes, torch.Generator().manual_seed(1))
    before = [b.clone() for b in buffers]
    with pytest.raises(ValueError, match=match) as info:
        install_window(staging, reg, views, tables, first_chunk, num_chunks, backend=backend)
    assert "\n" not in str(info.value)
    same_bytes(buffers, before, "destinations after a rejected install")
    with pytest.raises(ValueError, match=match):
        WindowInstaller(reg, views, tables, first_chunk + num_chunks, backend=backend)
    out = torch.full((num_chunks * reg.chunk_bytes,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        gather_window(out, reg, views, tables, first_chunk, num_chunks, backend=backend)
    assert bool((out == 7).all())
    same_bytes(buffers, before, "destinations after a rejected gather")
    return str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_block_id_resident_in_both_groups_is_rejected(backend, layout):
    reg = _registration()
    tables = _tables(reg, 2, seed=11, shared=5)  # table index 5: chunk 1
    blk = int(tables[0][5])
    views, buffers = _aliased(layout, reg)
    msg = _rejected(reg, views, buffers, tables, f"block id {blk} ", first_chunk=0, num_chunks=2, backend=backend)
    assert "'layers.0.k' (group 0)" in msg and "'layers.1.k' (group 1)" in msg, msg


def test_shared_block_id_outside_the_chunks_is_accepted_and_checked_per_request():
    """The block-id check covers the chunks being installed, and runs per request (the geometry
    verdict is cached; the tables are not)."""
    reg = _registration()
    views, buffers = _aliased("vllm_cpu", reg)
    tables = _tables(reg, 2, seed=12, shared=1)  # shared block in chunk 0 only
    case = _case(reg, tables, 1, 1, seed=13)
    install_window(case.staging, reg, views, tables, 1, 1, backend="torch")
    expect_views, expect = _aliased("vllm_cpu", reg)
    naive_install(case, expect_views)
    same_bytes(buffers, expect, "chunk 1")
    before = [b.clone() for b in buffers]
    with pytest.raises(ValueError, match=f"block id {int(tables[0][1])} in chunks 0..1"):
        install_window(random_bytes(2 * reg.chunk_bytes, torch.Generator().manual_seed(2)), reg, views, tables, 0, 2,
                       backend="torch")
    same_bytes(buffers, before, "after the rejected request")
    install_window(case.staging, reg, views, tables, 1, 1, backend="torch")  # the same tensors, accepted again


def test_a_hole_in_both_groups_is_not_a_shared_block():
    reg = _registration(window1=WINDOW)  # both groups with a sliding window: -1 legal in both
    views, _ = _aliased("vllm_cpu", reg)
    tables = _tables(reg, 1, seed=14)
    tables[0][0] = tables[1][0] = -1
    install_window(torch.ones(reg.chunk_bytes, dtype=torch.uint8), reg, views, tables, 0, 1, backend="torch")


def test_aliasing_within_one_group_is_rejected():
    """Group 1's K and V the same view (while each also aliases group 0 legally)."""
    reg = _registration()
    views, buffers = _aliased("vllm_cpu", reg)
    views[3] = _same_view(views[2])
    msg = _rejected(reg, views, buffers, _tables(reg, 1, seed=15), "overlap in memory")
    assert "'layers.1.k'" in msg and "'layers.1.v'" in msg and "group 1" in msg, msg


def test_the_same_view_twice_in_one_group_is_rejected_without_other_groups():
    reg = Registration(_registration().specs[:2], chunk_tokens=CHUNK)
    buf = torch.full((NB, BS, 2, 8), 1.0, dtype=torch.bfloat16)
    _rejected(reg, [buf, _same_view(buf)], [buf], _tables(reg, 1, seed=16)[:1], "'layers.0.k' and 'layers.0.v' overlap")


def test_partial_overlap_across_groups_is_rejected():
    """Group 1's views one block later in the same buffer: block b of group 1 is block b+1 of
    group 0, so disjoint block ids do not keep the writes apart."""
    reg = _registration()
    flat = torch.full((2 * (NB + 1) * BS * 2 * 8,), 1.0, dtype=torch.bfloat16)
    kv0 = flat.view(2, NB + 1, BS, 2, 8)
    k0, v0 = kv0[0, :NB], kv0[1, :NB]
    k1, v1 = kv0[0, 1:], kv0[1, 1:]
    msg = _rejected(reg, [k0, v0, k1, v1], [flat], _tables(reg, 1, seed=17), "overlap in memory other than block")
    assert "(group 0)" in msg and "(group 1)" in msg, msg


def test_overlap_across_groups_with_another_block_geometry_is_rejected():
    """The same first byte, but group 1 sees the buffer slot-major ((bs, nb, entry) as (nb, bs,
    entry)): its block b is slot b of every block of group 0, so disjoint block ids do not keep
    the writes apart."""
    reg = _registration()
    buf = torch.full((NB, BS, 2, 8), 1.0, dtype=torch.bfloat16)
    other = torch.full((NB, BS, 2, 8), 1.0, dtype=torch.bfloat16)
    k1 = buf.view(BS, NB, 2, 8).transpose(0, 1)
    v1 = torch.full((NB, BS, 2, 8), 1.0, dtype=torch.bfloat16)
    msg = _rejected(reg, [buf, other, k1, v1], [buf, other, v1], _tables(reg, 1, seed=18),
                    "overlap in memory other than block")
    assert "'layers.0.k' (group 0)" in msg and "'layers.1.k' (group 1)" in msg, msg
