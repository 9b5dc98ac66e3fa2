"""Shared helpers for kernel tests: random registrations, poisoned destinations, a naive oracle."""

from __future__ import annotations

from dataclasses import dataclass

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
        specs.append(TensorSpec(f"t{i}", dtype, entry_shape, tpb // ratio, ratio, g))
    return Registration(tuple(specs), name="random")


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
    """Block tables covering chunks 0..first_chunk+num_chunks-1, shuffled, some -1, and random staging."""
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


def naive_install(case: Case, kv: list[torch.Tensor]) -> None:
    """Entry-by-entry oracle, written independently of bsr_kernels.install_torch."""
    reg = case.reg
    for i, spec in enumerate(reg.specs):
        per_chunk = reg.chunk_tokens // spec.token_ratio
        eb = spec.entry_bytes
        dst = kv[i].view(torch.uint8).reshape(kv[i].shape[0], spec.block_size, eb)
        table = case.tables[spec.group].tolist()
        for c in range(case.num_chunks):
            base = c * reg.chunk_bytes + reg.segment_offsets[i]
            for j in range(per_chunk):
                e = (case.first_chunk + c) * per_chunk + j
                blk = table[e // spec.block_size]
                if blk < 0:
                    continue
                dst[blk, e % spec.block_size] = case.staging[base + j * eb : base + (j + 1) * eb]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], reg: Registration, what: str) -> None:
    for spec, x, y in zip(reg.specs, a, b):
        xb, yb = x.view(torch.uint8), y.view(torch.uint8)
        if not torch.equal(xb, yb):
            diff = (xb != yb).nonzero()
            raise AssertionError(
                f"{what}: tensor {spec.name} differs at {diff.shape[0]} bytes, first {diff[0].tolist()}")


def snapshot(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in kv]
