"""Preset registrations.

`dsv4_flash` is the registration vLLM 0.32 makes for DeepSeek-V4-Flash's 43-layer pattern (MTP off),
tensor for tensor: the same names, order, groups, dtypes, entry widths, token ratios, block sizes,
sliding windows and window tails as the vLLM connector's registration of the engine
(bsr_runtime.integrations.vllm.registration), so the same fingerprint and c: the synthetic sweeps, the
demo and the engine agree. `tests/unit/test_dsv4_registration.py` checks it against vLLM's own
KV-cache objects for that layer pattern (no forward pass). `llama_like` is a plain K/V-per-layer model.
Both are geometry only: no weights, no model code.

DeepSeek-V4-Flash in vLLM 0.32 (MTP off: 167 tensors in 5 KV-cache groups, one allocation laid out
block by block):

| grp | tensor (per layer)             | layers         | dtype   | entry | ratio | block e/t | window, tail |
| --- | ------------------------------ | -------------- | ------- | ----- | ----- | --------- | ------------ |
| 0   | swa_cache (sliding-window KV)  | 0,2,..,42 (22) | uint8   | 584 B | 1     | 64 / 64   | 128, 128     |
| 1   | swa_cache                      | 1,3,..,41 (21) | uint8   | 584 B | 1     | 64 / 64   | 128, 128     |
| 2   | indexer.k_cache (indexer keys) | 2,4,..,42 (21) | uint8   | 132 B | 4     | 64 / 256  |              |
| 2   | (C4 compressed KV)             | 2,4,..,42 (21) | uint8   | 584 B | 4     | 64 / 256  |              |
| 2   | (C128 compressed KV)           | 3,5,..,41 (20) | uint8   | 584 B | 128   | 2 / 256   |              |
| 3   | indexer.compressor.state_cache | 2,4,..,42 (21) | float32 | 512   | 1     | 4 / 4     | 8, 8         |
| 3   | compressor.state_cache (C4)    | 2,4,..,42 (21) | float32 | 2048  | 1     | 4 / 4     | 8, 8         |
| 4   | compressor.state_cache (C128)  | 3,5,..,41 (20) | float32 | 1024  | 1     | 8 / 8     | 128, 128     |

(names: `model.layers.N.attn` + the tensor; 584 B rows are fp8_ds_mla; block e/t: entries / tokens per block.)

A chunk's object holds every compressed-KV and indexer entry and, of the sliding-window and
compressor-state caches, only the tail a prefix ending at the chunk needs (the blocks vLLM keeps
resident): c = 16,406,080 B per 256-token chunk against the paper's 16,408,576 B (-0.015%); every
entry of every tensor would be 83,436,096 B. MTP on (`mtp=True`, 170 tensors) adds one layer's
sliding-window KV (group 1), C4 compressed KV (group 2) and C4 compressor state (group 3): our choice,
not checked against an engine (vLLM CPU 0.32's DeepSeekV4MTP raises NotImplementedError).

`scale` shrinks every entry width (bytes * scale, rounded to a multiple of 8 bytes, at least 8)
and keeps the tensor count, dtype mix, ratios, block sizes, windows and groups. A width that was not
a multiple of 16 stays an odd multiple of 8, so scaled runs still exercise the narrow-access path
of the kernels.
"""

from __future__ import annotations

import torch

from .registration import Registration, TensorSpec

PAPER_DSV4_CHUNK_BYTES = 16_408_576
PAPER_DSV4_TENSORS = {False: 167, True: 170}
DSV4_CHUNK_BYTES = 16_406_080  # vLLM 0.32's registration of the Flash layout (what a chunk ending a prefix needs)
DSV4_EVERY_ENTRY_BYTES = 83_436_096  # every entry of every tensor, per chunk
DSV4_LAYERS = 43
DSV4_SWA_WINDOW = 128
DSV4_RATIOS = (0, 0) + (4, 128) * 20 + (4,)  # compress ratio per layer (0: sliding window only)


def scaled_width(width_bytes: int, scale: float) -> int:
    """Entry width in bytes after scaling; see the module docstring for the rule."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    if scale == 1:
        return width_bytes
    w = max(8, int(round(width_bytes * scale / 8)) * 8)
    if width_bytes % 16 and w % 16 == 0:
        w += 8
    return w


def _spec(name: str, dtype: torch.dtype, width_bytes: int, block: int, ratio: int, group: int,
          scale: float, window: int | None = None, tail: int | None = None) -> TensorSpec:
    w = scaled_width(width_bytes, scale)
    itemsize = dtype.itemsize
    if w % itemsize:
        w += itemsize - w % itemsize
    return TensorSpec(name, dtype, (w // itemsize,), block, ratio, group, window, tail)


def dsv4_flash(mtp: bool = False, scale: float = 1.0) -> Registration:
    """DeepSeek-V4-Flash as vLLM 0.32 registers it: 167 tensors (mtp=False) or 170 (mtp=True, ours)."""
    u8, f32 = torch.uint8, torch.float32
    groups: list[list[TensorSpec]] = [[] for _ in range(5)]
    layers = [(f"model.layers.{i}.attn", r) for i, r in enumerate(DSV4_RATIOS)]
    if mtp:
        layers.append(("model.mtp.0.attn", -4))  # sliding window, C4 compressed KV and state, no indexer

    def swa(prefix: str, group: int) -> TensorSpec:
        return _spec(f"{prefix}.swa_cache", u8, 584, 64, 1, group, scale, DSV4_SWA_WINDOW, DSV4_SWA_WINDOW)

    for i, (prefix, _) in enumerate(layers):
        g = 0 if i % 2 == 0 and i < DSV4_LAYERS else 1  # vLLM's two sliding-window groups: even, odd layers
        groups[g].append(swa(prefix, g))
    for prefix, ratio in layers:
        if abs(ratio) == 4:
            if ratio > 0:
                groups[2].append(_spec(f"{prefix}.indexer.k_cache", u8, 132, 64, 4, 2, scale))
            groups[2].append(_spec(prefix, u8, 584, 64, 4, 2, scale))
            if ratio > 0:
                groups[3].append(_spec(f"{prefix}.indexer.compressor.state_cache", f32, 512 * 4, 4, 1, 3, scale, 8, 8))
            groups[3].append(_spec(f"{prefix}.compressor.state_cache", f32, 2048 * 4, 4, 1, 3, scale, 8, 8))
        elif ratio == 128:
            groups[2].append(_spec(prefix, u8, 584, 2, 128, 2, scale))
            groups[4].append(_spec(f"{prefix}.compressor.state_cache", f32, 1024 * 4, 8, 1, 4, scale, 128, 128))
    name = "dsv4-flash-mtp" if mtp else "dsv4-flash"
    if scale != 1:
        name += f"@{scale:g}"
    reg = Registration(tuple(s for g in groups for s in g), name=name)
    assert reg.num_tensors == PAPER_DSV4_TENSORS[mtp], reg.num_tensors
    return reg


def llama_like(layers: int = 4, kv_heads: int = 2, head_dim: int = 64, block_size: int = 16,
               dtype: torch.dtype = torch.bfloat16) -> Registration:
    """A plain decoder: one K and one V cache per layer, all in group 0."""
    specs = []
    for layer in range(layers):
        for kind in ("k", "v"):
            specs.append(TensorSpec(f"layers.{layer}.{kind}_cache", dtype, (kv_heads, head_dim), block_size))
    return Registration(tuple(specs), name=f"llama-like-{layers}x{kv_heads}x{head_dim}")
