"""benchmarks/gpu_check.py's copy-engine baselines move the kernel's runs: the (dst, src) pairs it builds
for them, applied as plain copies on the CPU, must write exactly what the torch reference install writes
(poisoned destinations, tail groups narrowed as an engine's sliding windows leave them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from bsr_harness.testdata import POISON, poisoned
from bsr_kernels import presets
from bsr_kernels.torch_backend import install_torch
from bsr_kernels.validate import check_window

ROOT = Path(__file__).resolve().parents[2]


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("num", [1, 3])
def test_block_copies_write_what_the_reference_install_writes(mtp, num):
    gc = gpu_check_module()
    reg = presets.dsv4_flash(mtp=mtp, scale=1 / 64)
    gen = torch.Generator().manual_seed(7 + num)
    tables, nblocks = [], []
    for g in range(reg.num_groups):
        need = reg.blocks_needed(g, num * reg.chunk_tokens)
        tables.append(torch.randperm(need + 3, generator=gen)[:need].to(torch.int64))
        nblocks.append(need + 3)
    tables = reg.without_heads(tables)
    staging = torch.randint(1, 256, (num * reg.chunk_bytes,), dtype=torch.uint8, generator=gen)

    ref = poisoned(reg, nblocks, "cpu")
    args = check_window(staging, reg, ref, tables, 0, num)
    install_torch(reg, args)

    kv = poisoned(reg, nblocks, "cpu")
    pairs = gc.block_copies(reg, kv, list(args.block_tables), staging, num)
    assert pairs
    for d, s in pairs:
        d.copy_(s)
    assert gc.same(kv, ref), gc.differing(kv, ref)
    untouched = sum(int((t.view(torch.uint8) == POISON).sum()) for t in ref)
    assert untouched > 0  # blocks outside the window (and narrowed heads) stay poisoned in both


def test_differing_names_the_tensors_and_bytes():
    gc = gpu_check_module()
    a = [torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    b = [torch.zeros(8, dtype=torch.uint8), torch.tensor([0, 1, 1, 0], dtype=torch.uint8)]
    assert gc.differing(a, b) == "1 of 2 tensors, 2 bytes (first: #1 2 B)"
