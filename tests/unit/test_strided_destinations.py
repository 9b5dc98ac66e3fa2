"""Strided destinations: every backend here against an independent entry-by-entry oracle.

Destinations are views of engine buffers laid out the way engines lay out their caches (vLLM
CPU, FlashAttention, FlashInfer HND, MLA rows and sliced MLA rows, random strided views). The
buffers are poisoned first; after an install they must equal, byte for byte, buffers the oracle
(kernel_util.naive_install: torch logical indexing, one entry at a time) wrote, so bytes outside
the views and blocks outside the window stay poisoned. The CUDA library's host emulation runs the
same cases in tests/unit/test_cuda_lib.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_util import (
    KV_LAYOUTS,
    POISON,
    kv_pair_layout,
    kv_registration,
    make_case,
    mla_layout,
    mla_registration,
    naive_gather,
    naive_install,
    random_bytes,
    registrations,
    same_bytes,
    strided_like,
    untouched_outside_window,
)

from bsr_kernels import WindowInstaller, gather_window, install_window
from bsr_kernels.install import available_backends

BACKENDS = available_backends("cpu")


def _layout(name: str):
    """(registration, allocate(num_blocks) -> (views, buffers))."""
    if name.startswith("mla"):
        reg = mla_registration()
        return reg, lambda nb: mla_layout(name, reg, nb)
    reg = kv_registration(layers=2, heads=3, head_dim=8, block_size=16)
    return reg, lambda nb: kv_pair_layout(name, reg, nb)


LAYOUTS = (*KV_LAYOUTS, "mla", "mla_sliced")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("first_chunk,num_chunks", [(0, 1), (1, 2)])
def test_install_matches_oracle(backend, layout, first_chunk, num_chunks):
    reg, alloc = _layout(layout)
    case = make_case(reg, first_chunk, num_chunks, seed=hash((layout, first_chunk)) % 1000, hole_frac=0.2)
    views, buffers = alloc(case.num_blocks[0])
    assert install_window(case.staging, reg, views, case.tables, first_chunk, num_chunks, backend=backend) == backend
    expect_views, expect = alloc(case.num_blocks[0])
    naive_install(case, expect_views)
    same_bytes(buffers, expect, f"{backend} {layout}")
    untouched_outside_window(case, views)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_oracle(backend, layout):
    reg, alloc = _layout(layout)
    case = make_case(reg, 1, 2, seed=3, hole_frac=0.2)
    views, buffers = alloc(case.num_blocks[0])
    gen = torch.Generator().manual_seed(4)
    for b in buffers:
        b.view(torch.uint8).copy_(random_bytes(b.numel() * b.element_size(), gen).view(b.view(torch.uint8).shape))
    out = torch.full((2 * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    assert gather_window(out, reg, views, case.tables, 1, 2, backend=backend) == backend
    assert torch.equal(out, naive_gather(case, views))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_layout,dst_layout", [("flash_attn", "vllm_cpu"), ("vllm_cpu", "flashinfer_hnd"),
                                                   ("flashinfer_hnd", "contiguous")])
def test_gather_install_round_trip_across_layouts(backend, src_layout, dst_layout):
    """An object gathered from one layout installs into another: the staged layout is canonical."""
    reg, src_alloc = _layout(src_layout)
    _, dst_alloc = _layout(dst_layout)
    case = make_case(reg, 0, 2, seed=21, hole_frac=0.2)
    src, src_bufs = src_alloc(case.num_blocks[0])
    gen = torch.Generator().manual_seed(22)
    for b in src_bufs:
        flat = b.view(torch.uint8).view(-1)
        flat.copy_(random_bytes(flat.numel(), gen))
    staged = torch.empty(2 * reg.chunk_bytes, dtype=torch.uint8)
    gather_window(staged, reg, src, case.tables, 0, 2, backend=backend)
    dst, _ = dst_alloc(case.num_blocks[0])
    install_window(staged, reg, dst, case.tables, 0, 2, backend=backend)
    resident = case.tables[0][case.tables[0] >= 0]
    for spec, s, d in zip(reg.specs, src, dst):
        assert torch.equal(d[resident].view(torch.uint8), s[resident].view(torch.uint8)), spec.name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["vllm_cpu", "mla_sliced"])
def test_window_installer_strided(backend, layout):
    reg, alloc = _layout(layout)
    case = make_case(reg, 0, 3, seed=8, hole_frac=0.2)
    views, buffers = alloc(case.num_blocks[0])
    inst = WindowInstaller(reg, views, case.tables, 3, backend=backend)
    c = reg.chunk_bytes
    inst.install(case.staging[: 2 * c].clone(), 0, 2)
    inst.install(case.staging[2 * c :].clone(), 2, 1)
    expect_views, expect = alloc(case.num_blocks[0])
    naive_install(case, expect_views)
    same_bytes(buffers, expect, f"{backend} WindowInstaller {layout}")


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registrations(max_tensors=4), first_chunk=st.integers(0, 2), num_chunks=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_random_strided_views_match_oracle(backend, reg, first_chunk, num_chunks, seed):
    case = make_case(reg, first_chunk, num_chunks, seed)
    views, buffers = strided_like(reg, case.num_blocks, seed)
    install_window(case.staging, reg, views, case.tables, first_chunk, num_chunks, backend=backend)
    expect_views, expect = strided_like(reg, case.num_blocks, seed)
    naive_install(case, expect_views)
    same_bytes(buffers, expect, f"{backend} random strided")
    out = torch.full((num_chunks * reg.chunk_bytes,), POISON, dtype=torch.uint8)
    gather_window(out, reg, views, case.tables, first_chunk, num_chunks, backend=backend)
    assert torch.equal(out, naive_gather(case, views))


# -- rejections: a one-line ValueError before any byte moves -----------------------------------

def _rejected(reg, views, buffers, tables, match, num_chunks=1):
    staging = torch.zeros(num_chunks * reg.chunk_bytes, dtype=torch.uint8)
    before = [b.clone() for b in buffers]
    with pytest.raises(ValueError, match=match) as info:
        install_window(staging, reg, views, tables, 0, num_chunks, backend="torch")
    assert "\n" not in str(info.value)
    same_bytes(buffers, before, "destinations after a rejected call")
    return str(info.value)


def _tables(reg, nb):
    need = reg.blocks_needed(0, reg.chunk_tokens)
    return [torch.randperm(nb, generator=torch.Generator().manual_seed(0))[:need]]


def test_same_tensor_twice_is_rejected():
    reg = kv_registration(layers=1)
    views, buffers = kv_pair_layout("contiguous", reg, 20)
    msg = _rejected(reg, [views[0], views[0]], buffers, _tables(reg, 20), "overlap")
    assert "layers.0.k" in msg and "layers.0.v" in msg


def test_overlapping_views_are_rejected():
    """V shifted one slot into K's slots of the vLLM CPU layout: the views share bytes."""
    reg = kv_registration(layers=1, heads=2, head_dim=8, block_size=16)
    nb, h, bs, d = 20, 2, 16, 8
    buf = torch.full((nb, h, 2 * bs, d), 1.0, dtype=torch.bfloat16)
    c4 = buf.view(nb, h, 2 * bs, d)
    k = c4[:, :, :bs].permute(0, 2, 1, 3)
    v = c4[:, :, bs - 1 : 2 * bs - 1].permute(0, 2, 1, 3)
    msg = _rejected(reg, [k, v], [buf], _tables(reg, nb), "overlap")
    assert "'layers.0.k'" in msg and "'layers.0.v'" in msg


def test_partially_overlapping_buffers_are_rejected():
    reg = kv_registration(layers=1, heads=2, head_dim=8, block_size=16)
    flat = torch.zeros(21 * 16 * 2 * 8, dtype=torch.bfloat16)
    k = flat[: 20 * 256].view(20, 16, 2, 8)
    v = flat[256:].view(20, 16, 2, 8)  # one block later: blocks 1.. of k are blocks 0.. of v
    _rejected(reg, [k, v], [flat], _tables(reg, 20), "'layers.0.k' and 'layers.0.v' overlap")


def test_expanded_view_is_rejected():
    reg = kv_registration(layers=1)
    one = torch.zeros(1, 16, 2, 8, dtype=torch.bfloat16)
    other = torch.zeros(20, 16, 2, 8, dtype=torch.bfloat16)
    msg = _rejected(reg, [one.expand(20, 16, 2, 8), other], [one, other], _tables(reg, 20), "overlaps itself")
    assert "layers.0.k" in msg


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_interleaved_disjoint_views_are_accepted(layout):
    reg = kv_registration(layers=1)
    views, _ = kv_pair_layout(layout, reg, 20)
    install_window(torch.zeros(reg.chunk_bytes, dtype=torch.uint8), reg, views, _tables(reg, 20), 0, 1,
                   backend="torch")


def test_innermost_stride_must_be_one():
    reg = kv_registration(layers=1)
    buf = torch.zeros(20, 16, 8, 2, dtype=torch.bfloat16)
    k = buf.transpose(2, 3)  # (20, 16, 2, 8) with innermost stride 2
    v = torch.zeros(20, 16, 2, 8, dtype=torch.bfloat16)
    _rejected(reg, [k, v], [buf, v], _tables(reg, 20), r"'layers\.0\.k': innermost stride is 2")


def test_minus_one_in_a_group_without_sliding_window_is_rejected():
    reg = kv_registration(layers=1, window=None)
    views, buffers = kv_pair_layout("contiguous", reg, 20)
    tables = _tables(reg, 20)
    tables[0][3] = -1
    _rejected(reg, views, buffers, tables, r"group 0: block id -1 .* no tensor of the group has a sliding window")


def test_minus_one_in_a_sliding_window_group_is_legal():
    reg = kv_registration(layers=1, window=128)
    views, buffers = kv_pair_layout("vllm_cpu", reg, 20)
    tables = _tables(reg, 20)
    tables[0][:3] = -1
    install_window(torch.ones(reg.chunk_bytes, dtype=torch.uint8), reg, views, tables, 0, 1, backend="torch")
