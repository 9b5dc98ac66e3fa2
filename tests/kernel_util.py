"""Shared helpers for kernel tests: random registrations, poisoned destinations, a naive oracle."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from bsr_harness.testdata import POISON, poisoned, window_tables
from bsr_kernels import Registration, TensorSpec

__all__ = ["POISON", "poisoned"]  # re-exported for the kernel tests

# tokens per block of a group -> the ratios that fit with block sizes 1..64
_TPB_CHOICES = [4, 16, 64, 256, 512, 8192]
_RATIOS = [1, 4, 128]
_WIDTH_BYTES = [8, 12, 16, 20, 24, 48, 132, 584]
_DTYPES = [torch.uint8, torch.float16, torch.float32]


@st.composite
def registrations(draw, max_tensors: int = 6, max_groups: int = 3) -> Registration:
    num_groups = draw(st.integers(1, max_groups))
    group_tpb = [draw(st.sampled_from(_TPB_CHOICES)) for _ in range(num_groups)]
    # -1 blocks are legal only in groups with a sliding window: give some groups one
    group_window = [draw(st.sampled_from([None, 128])) for _ in range(num_groups)]
    # a windowed group whose blocks are smaller than a chunk may keep only each chunk's tail in the objects
    group_tail = [draw(st.sampled_from([None] + [tpb * k for k in range(1, 256 // tpb)]))
                  if w and tpb < 256 else None for w, tpb in zip(group_window, group_tpb)]
    n = draw(st.integers(num_groups, max(num_groups, max_tensors)))
    specs = []
    for i in range(n):
        g = i if i < num_groups else draw(st.integers(0, num_groups - 1))
        tpb = group_tpb[g]
        ratios = [r for r in _RATIOS if tpb % r == 0 and 1 <= tpb // r <= 64]
        ratio = draw(st.sampled_from(ratios))
        dtype = draw(st.sampled_from(_DTYPES))
        width = draw(st.sampled_from([w for w in _WIDTH_BYTES if w % dtype.itemsize == 0]))
        entry_shape = (width // dtype.itemsize,)
        if draw(st.booleans()) and entry_shape[0] % 2 == 0:
            entry_shape = (2, entry_shape[0] // 2)
        specs.append(TensorSpec(f"t{i}", dtype, entry_shape, tpb // ratio, ratio, g, group_window[g], group_tail[g]))
    return Registration(tuple(specs), name="random")


def windowed_groups(reg: Registration) -> set[int]:
    return {s.group for s in reg.specs if s.sliding_window}


@dataclass
class Case:
    reg: Registration
    num_blocks: list[int]
    tables: list[torch.Tensor]
    first_chunk: int
    num_chunks: int
    staging: torch.Tensor


def make_case(reg: Registration, first_chunk: int, num_chunks: int, seed: int, hole_frac: float = 0.15,
              spare_blocks: int = 3) -> Case:
    """Block tables covering chunks 0..first_chunk+num_chunks-1, shuffled, some -1 in groups with a
    sliding window, and random staging."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = window_tables(reg, 0, first_chunk + num_chunks, gen, hole_frac, spare=spare_blocks)
    staging = random_bytes(num_chunks * reg.chunk_bytes, gen)
    return Case(reg, num_blocks, tables, first_chunk, num_chunks, staging)


def random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    """Fresh random bytes, never all zero, never the poison value."""
    out = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
    out[out == POISON] = POISON + 1
    return out


def random_kv(reg: Registration, num_blocks: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = reg.allocate(num_blocks)
    for t in kv:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(random_bytes(flat.numel(), gen))
    return kv


def _staged_entries(case: Case):
    """(tensor index, spec, byte range in the staging, block, slot) of every resident entry of the
    window, walked entry by entry from the registration alone."""
    reg = case.reg
    for i, spec in enumerate(reg.specs):
        per_chunk = reg.chunk_tokens // spec.token_ratio
        # an object holds only the entries of the chunk's last tail_tokens tokens, when the spec says so
        skip = per_chunk - (spec.tail_tokens or reg.chunk_tokens) // spec.token_ratio
        eb = spec.entry_bytes
        table = case.tables[spec.group].tolist()
        for c in range(case.num_chunks):
            base = c * reg.chunk_bytes + reg.segment_offsets[i]
            for j in range(skip, per_chunk):
                e = (case.first_chunk + c) * per_chunk + j
                blk = table[e // spec.block_size]
                if blk >= 0:
                    k = j - skip
                    yield i, spec, slice(base + k * eb, base + (k + 1) * eb), blk, e % spec.block_size


def naive_install(case: Case, kv: list[torch.Tensor]) -> None:
    """Entry-by-entry oracle, written independently of bsr_kernels: each staged entry (canonical,
    row-major in entry_shape) is written through torch's logical indexing `kv[i][block, slot]`,
    so any strided destination layout is handled by torch's own view semantics."""
    for i, spec, staged, blk, slot in _staged_entries(case):
        kv[i][blk, slot] = case.staging[staged].clone().view(spec.dtype).view(spec.entry_shape)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], reg: Registration, what: str) -> None:
    for spec, x, y in zip(reg.specs, a, b):
        xb, yb = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)  # logical, any layout
        if not torch.equal(xb, yb):
            diff = (xb != yb).nonzero()
            raise AssertionError(
                f"{what}: tensor {spec.name} differs at {diff.shape[0]} bytes, first {diff[0].tolist()}")


def snapshot(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in kv]


def naive_gather(case: Case, kv: list[torch.Tensor]) -> torch.Tensor:
    """Entry-by-entry gather oracle: staged bytes of the window read through `kv[i][block, slot]`;
    padding and entries of -1 blocks are zero."""
    out = torch.zeros(case.num_chunks * case.reg.chunk_bytes, dtype=torch.uint8)
    for i, _spec, staged, blk, slot in _staged_entries(case):
        out[staged] = kv[i][blk, slot].contiguous().view(torch.uint8).reshape(-1)
    return out


# -- destination layouts: views of engine buffers ------------------------------------------------

def kv_registration(layers: int = 2, heads: int = 2, head_dim: int = 8, block_size: int = 16,
                    dtype: torch.dtype = torch.bfloat16, window: int | None = 128) -> Registration:
    """K and V per layer with (heads, head_dim) entries, one group (a sliding window: -1 is legal)."""
    specs = [TensorSpec(f"layers.{layer}.{kind}", dtype, (heads, head_dim), block_size, 1, 0, window)
             for layer in range(layers) for kind in ("k", "v")]
    return Registration(tuple(specs), name="kv-pairs")


def _poisoned_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype)
    buf.view(torch.uint8).fill_(POISON)
    return buf


def kv_pair_layout(layout: str, reg: Registration, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destination views in registration order, the engine buffers behind them, poisoned) for a
    K/V-pair registration (kv_registration) laid out like an engine lays out its caches."""
    views, buffers = [], []
    for layer in range(reg.num_tensors // 2):
        spec = reg.specs[2 * layer]
        (h, d), bs, nb = spec.entry_shape, spec.block_size, num_blocks
        if layout == "contiguous":
            pair = [_poisoned_buffer((nb, bs, h, d), spec.dtype) for _ in range(2)]
            buffers += pair
            views += pair
            continue
        if layout == "vllm_cpu":  # [nb, H, bs, 2D]: per block and head, K of all slots then V
            buf = _poisoned_buffer((nb, h, bs, 2 * d), spec.dtype)
            c4 = buf.view(nb, h, 2 * bs, d)
            pair = [c4[:, :, :bs, :].permute(0, 2, 1, 3), c4[:, :, bs:, :].permute(0, 2, 1, 3)]
        elif layout == "flash_attn":  # (2, nb, bs, H, D)
            buf = _poisoned_buffer((2, nb, bs, h, d), spec.dtype)
            pair = [buf[0], buf[1]]
        elif layout == "flashinfer_hnd":  # (nb, 2, H, bs, D)
            buf = _poisoned_buffer((nb, 2, h, bs, d), spec.dtype)
            pair = [buf[:, 0].permute(0, 2, 1, 3), buf[:, 1].permute(0, 2, 1, 3)]
        else:
            raise ValueError(layout)
        buffers.append(buf)
        views += pair
    return views, buffers


KV_LAYOUTS = ("contiguous", "vllm_cpu", "flash_attn", "flashinfer_hnd")


def mla_registration(row: int = 584, block_size: int = 8, layers: int = 2, window: int | None = 128) -> Registration:
    specs = [TensorSpec(f"layers.{layer}.mla", torch.uint8, (row,), block_size, 1, 0, window)
             for layer in range(layers)]
    return Registration(tuple(specs), name="mla")


def mla_layout(layout: str, reg: Registration, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """MLA rows (num_blocks, block_size, row) of uint8: plain, or a slice of a wider row buffer."""
    views, buffers = [], []
    for spec in reg.specs:
        (row,), bs = spec.entry_shape, spec.block_size
        if layout == "mla":
            buf = _poisoned_buffer((num_blocks, bs, row), torch.uint8)
            views.append(buf)
        elif layout == "mla_sliced":  # 584 bytes at offset 8 of 656-byte rows, one spare block in front
            buf = _poisoned_buffer((num_blocks + 1, bs, row + 72), torch.uint8)
            views.append(buf[1:, :, 8 : 8 + row])
        else:
            raise ValueError(layout)
        buffers.append(buf)
    return views, buffers


def strided_like(reg: Registration, num_blocks: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For any registration: each destination a random strided view (padded rows and blocks, an
    offset, slots outside blocks, or the outer entry dim outside the slots) of a poisoned buffer."""
    gen = torch.Generator().manual_seed(seed)
    views, buffers = [], []
    for spec in reg.specs:
        nb, bs, shape = num_blocks[spec.group], spec.block_size, spec.entry_shape
        style = int(torch.randint(0, 4, (1,), generator=gen))
        if style == 1:  # padded rows, a spare block and a byte offset
            buf = _poisoned_buffer((nb + 1, bs, *shape[:-1], shape[-1] + 3), spec.dtype)
            view = buf[1:, ..., 2 : 2 + shape[-1]]
        elif style == 2:  # slot-major: (bs, nb, *entry) seen as (nb, bs, *entry)
            buf = _poisoned_buffer((bs, nb, *shape), spec.dtype)
            view = buf.transpose(0, 1)
        elif style == 3 and len(shape) == 2:  # heads outside slots: (nb, H, bs, D)
            buf = _poisoned_buffer((nb, shape[0], bs, shape[1]), spec.dtype)
            view = buf.permute(0, 2, 1, 3)
        else:
            buf = _poisoned_buffer((nb, bs, *shape), spec.dtype)
            view = buf
        views.append(view)
        buffers.append(buf)
    return views, buffers


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    """Whole engine buffers byte for byte (bytes outside the views included)."""
    for k, (x, y) in enumerate(zip(a, b)):
        xb, yb = x.view(torch.uint8), y.view(torch.uint8)
        if not torch.equal(xb, yb):
            diff = (xb != yb).nonzero()
            raise AssertionError(f"{what}: buffer {k} differs at {diff.shape[0]} bytes, first {diff[0].tolist()}")


# -- chunk-strided staging: chunk c at headroom + c * chunk_stride of a larger buffer ------------

@dataclass
class StridedStaging:
    """A staging buffer whose chunks are rows `chunk_stride` bytes apart, with scratch bytes
    (`headroom` before each row, `tail` after it) that no install or gather may touch."""

    buf: torch.Tensor  # the whole buffer, gaps included
    view: torch.Tensor  # (rows, chunk_bytes) with strides (chunk_stride, 1): what the installer gets
    rows: torch.Tensor  # bool over buf: True on the bytes of a row
    saved: torch.Tensor  # the gap bytes as they were filled in

    def gaps_unchanged(self) -> bool:
        return torch.equal(self.buf[~self.rows], self.saved)


# (headroom, tail): the chunk stride is headroom + chunk_bytes + tail
STRIDES = {"h16": (16, 0), "h128": (128, 0), "h128-tail48": (128, 48), "tail32": (0, 32), "dense2d": (0, 0)}


def strided_staging(reg: Registration, rows: int, headroom: int, tail: int, gen: torch.Generator,
                    chunks: torch.Tensor | None = None, fill: int | None = None,
                    as_strided: bool = False) -> StridedStaging:
    """`rows` chunks of reg.chunk_bytes at headroom + c * (headroom + chunk_bytes + tail) of a fresh
    buffer whose gap bytes are random (never POISON). Rows hold `chunks` (num_chunks * chunk_bytes,
    chunk-major) in their first rows, and `fill` (default: random bytes) elsewhere. The view is
    `buf.view(rows, stride)[:, headroom : headroom + chunk_bytes]`, or the same made with as_strided."""
    cb = reg.chunk_bytes
    stride = headroom + cb + tail
    buf = random_bytes(rows * stride, gen)
    mask = torch.zeros(rows * stride, dtype=torch.bool)
    mask.view(rows, stride)[:, headroom : headroom + cb] = True
    if as_strided:
        view = buf.as_strided((rows, cb), (stride, 1), buf.storage_offset() + headroom)
    else:
        view = buf.view(rows, stride)[:, headroom : headroom + cb]
    if fill is not None:
        view.fill_(fill)
    if chunks is not None:
        view[: chunks.numel() // cb].copy_(chunks.view(-1, cb))
    assert view.data_ptr() % 16 == 0 and view.stride() == (stride, 1)
    return StridedStaging(buf, view, mask, buf[~mask].clone())


def untouched_outside_window(case: Case, kv: list[torch.Tensor]) -> None:
    """Blocks no table entry of the window points at are still fully poisoned."""
    reg = case.reg
    lo_tok, hi_tok = case.first_chunk * reg.chunk_tokens, (case.first_chunk + case.num_chunks) * reg.chunk_tokens
    for spec, t in zip(reg.specs, kv):
        tpb = spec.tokens_per_block
        window = case.tables[spec.group][lo_tok // tpb : -(-hi_tok // tpb)]
        touched = set(window[window >= 0].tolist())
        for blk in range(t.shape[0]):
            if blk not in touched:
                assert bool((t[blk].view(torch.uint8) == POISON).all()), f"{spec.name} block {blk} written"


@contextlib.contextmanager
def first_use_on_sm90(cache_dir: Path):
    """The CUDA backend as on a GPU machine of compute capability 9.0 without an installed library:
    its first-use build compiles csrc/ into `cache_dir` (BSR_CACHE_DIR)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BSR_CACHE_DIR", str(cache_dir))
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        yield
