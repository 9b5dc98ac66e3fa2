"""Preset registrations.

`dsv4_flash` mirrors the cache kinds vLLM registers for DeepSeek-V4-Flash; `llama_like` is a
plain K/V-per-layer model. Both are geometry only: no weights, no model code.

DeepSeek-V4-Flash (43 layers; MTP off: 167 tensors, MTP on: 170):

| tensor (per layer)          | layers            | dtype   | entry           | ratio | block | group | source  |
| --------------------------- | ----------------- | ------- | --------------- | ----- | ----- | ----- | ------- |
| swa_kv (sliding-window MLA) | all 43            | uint8   | 584 B           | 1     | 64    | 0     | known   |
| compressed_kv (MLA)         | 2,4,..,42 (21)    | uint8   | 584 B           | 4     | 64    | 1     | known   |
| compressor_state            | 2,4,..,42 (21)    | float32 | 1024 (4096 B)   | 4     | 64    | 1     | chosen  |
| indexer_k                   | 2,4,..,42 (21)    | uint8   | 132 B           | 4     | 64    | 1     | known   |
| indexer_compressor_state    | 2,4,..,42 (21)    | float32 | 512 (2048 B)    | 4     | 64    | 1     | chosen  |
| compressed_kv (MLA)         | 3,5,..,41 (20)    | uint8   | 584 B           | 128   | 2     | 2     | known*  |
| compressor_state            | 3,5,..,41 (20)    | float32 | 4096 (16384 B)  | 128   | 2     | 2     | chosen  |
| MTP layer (mtp=True): swa_kv, compressed_kv, compressor_state at ratio 4              | chosen  |

known: the row width, ratio and the 64-token SWA blocks are what vLLM registers for this model
(584-byte fp8_ds_mla rows, 132-byte indexer rows). chosen: the fp32 compressor-state widths
and the ratio-128 block size (2 entries = 256 tokens, so one block per chunk) are our choice;
the paper gives only the total. Layers 0-1 are window-only. With these widths
c = 16,327,232 B per chunk against the paper's 16,408,576 B (-0.50%); `PAPER_DSV4_CHUNK_BYTES`
holds the paper's figure so tools can print both.

`scale` shrinks every entry width (bytes * scale, rounded to a multiple of 8 bytes, at least 8)
and keeps the tensor count, dtype mix, ratios, block sizes and groups. A width that was not a
multiple of 16 stays an odd multiple of 8, so scaled runs still exercise the narrow-access path
of the kernels.
"""

from __future__ import annotations

import torch

from .registration import Registration, TensorSpec

PAPER_DSV4_CHUNK_BYTES = 16_408_576
PAPER_DSV4_TENSORS = {False: 167, True: 170}
DSV4_LAYERS = 43
DSV4_SWA_WINDOW = 128


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
          scale: float, window: int | None = None) -> TensorSpec:
    w = scaled_width(width_bytes, scale)
    itemsize = dtype.itemsize
    if w % itemsize:
        w += itemsize - w % itemsize
    return TensorSpec(name, dtype, (w // itemsize,), block, ratio, group, window)


def dsv4_flash(mtp: bool = False, scale: float = 1.0) -> Registration:
    """DeepSeek-V4-Flash-like registration: 167 tensors (mtp=False) or 170 (mtp=True)."""
    u8, f32 = torch.uint8, torch.float32
    specs: list[TensorSpec] = []

    def ratio4_layer(prefix: str, with_indexer: bool) -> None:
        specs.append(_spec(f"{prefix}.compressed_kv", u8, 584, 64, 4, 1, scale))
        specs.append(_spec(f"{prefix}.compressor_state", f32, 4096, 64, 4, 1, scale))
        if with_indexer:
            specs.append(_spec(f"{prefix}.indexer_k", u8, 132, 64, 4, 1, scale))
            specs.append(_spec(f"{prefix}.indexer_compressor_state", f32, 2048, 64, 4, 1, scale))

    for layer in range(DSV4_LAYERS):
        prefix = f"layers.{layer}.attn"
        specs.append(_spec(f"{prefix}.swa_kv", u8, 584, 64, 1, 0, scale, DSV4_SWA_WINDOW))
        if layer < 2:
            continue
        if layer % 2 == 0:
            ratio4_layer(prefix, with_indexer=True)
        else:
            specs.append(_spec(f"{prefix}.compressed_kv", u8, 584, 2, 128, 2, scale))
            specs.append(_spec(f"{prefix}.compressor_state", f32, 16384, 2, 128, 2, scale))
    if mtp:
        prefix = "mtp.0.attn"
        specs.append(_spec(f"{prefix}.swa_kv", u8, 584, 64, 1, 0, scale, DSV4_SWA_WINDOW))
        ratio4_layer(prefix, with_indexer=False)
    name = "dsv4-flash-mtp" if mtp else "dsv4-flash"
    if scale != 1:
        name += f"@{scale:g}"
    reg = Registration(tuple(specs), name=name)
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
