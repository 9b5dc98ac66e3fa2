"""The registration of a vLLM engine, built from the engine itself.

From `kv_cache_config` (the scheduler and every worker get the same one): one KV-cache group per
HMA group, in vLLM's order; for every attention layer of a group two destination tensors, the
layer's K and V caches, entry shape (num_kv_heads, head_size), the group's block size, dtype and
sliding window. From the registered `kv_caches` (workers): the destinations themselves, as the
engine lays them out. The CPU attention backend keeps one tensor per layer,
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, read as
`[num_blocks, H, 2 * block_size, D]`: per block and head, a K region of block_size*D elements,
then V. K and V are registered as strided views of logical shape (num_blocks, block_size, H, D)
with a contiguous innermost dimension, which the install kernels accept as destinations.

V is token-major (row s = slot s). K is not, on every ISA: with the "vec" ISA (x86 without AMX,
fp32/fp16) vLLM's reshape_and_cache writes K transposed within the block (element (d, s) at
d*block_size + s), so "row s" of the K view is a block-internal row, not token s. Restores are
still exact: a chunk (256 tokens) always covers whole blocks, so every K region is moved whole,
byte for byte. But the objects hold the engine's K layout, which depends on the attention ISA
the machine picks (AMX, vec, vec16, NEON, ...): the ISA is part of the model identity in the key
space (`kv_layout_tag`), so a machine with another K layout never reads these objects.

The model identity (model_identity.py: a digest of the weights, or the configured `model_id`, plus
this layout tag) goes into the key space, so two models of one geometry never share objects.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bsr_kernels import Registration, TensorSpec

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block (a hole, e.g. outside a window)


def _layer_specs(group) -> list[tuple[str, object]]:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return [(name, per_layer[name] if per_layer else spec) for name in group.layer_names]


def registration_from_kv_cache_config(kv_cache_config, chunk_tokens: int = 256, name: str = "vllm") -> Registration:
    """Two TensorSpecs (`<layer>.k`, `<layer>.v`) per attention layer, grouped like vLLM's KV-cache groups."""
    specs: list[TensorSpec] = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        for layer, spec in _layer_specs(group):
            kind = type(spec).__name__
            if kind not in ("FullAttentionSpec", "SlidingWindowSpec"):
                raise NotImplementedError(f"layer {layer}: KV-cache spec {kind} is not supported by the BSR "
                                          "connector (full and sliding-window attention are)")
            head_v = getattr(spec, "head_size_v", None) or spec.head_size
            if head_v != spec.head_size:
                raise NotImplementedError(f"layer {layer}: K head size {spec.head_size} != V head size {head_v}")
            if spec.block_size % 1 or chunk_tokens % spec.block_size:
                raise ValueError(f"layer {layer}: chunk of {chunk_tokens} tokens is not a whole number of "
                                 f"{spec.block_size}-token blocks")
            window = getattr(spec, "sliding_window", None)
            for part in ("k", "v"):
                specs.append(TensorSpec(f"{layer}.{part}", spec.dtype, (spec.num_kv_heads, spec.head_size),
                                        spec.block_size, group=g, sliding_window=window))
    return Registration(tuple(specs), chunk_tokens=chunk_tokens, name=name)


def cpu_kv_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views (num_blocks, block_size, H, D) of one CPU attention layer cache
    `[num_blocks, H, block_size, 2 * D]`."""
    if cache.dim() != 4 or cache.shape[2] != block_size or cache.shape[3] % 2:
        raise ValueError(f"expected a CPU attention cache [num_blocks, H, {block_size}, 2*D], got {tuple(cache.shape)}")
    nb, h, bs, d2 = cache.shape
    c4 = cache.view(nb, h, 2 * bs, d2 // 2)
    return c4[:, :, :bs, :].permute(0, 2, 1, 3), c4[:, :, bs:, :].permute(0, 2, 1, 3)


def destinations(reg: Registration, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The registered destination tensors, in registration order, from vLLM's `kv_caches`
    (layer name -> cache tensor)."""
    out: list[torch.Tensor] = []
    for i in range(0, reg.num_tensors, 2):
        spec = reg.specs[i]
        layer = spec.name[: -len(".k")]
        if layer not in kv_caches:
            raise ValueError(f"vLLM registered no KV cache for layer {layer!r}")
        k, v = cpu_kv_views(kv_caches[layer], spec.block_size)
        for t, s in ((k, spec), (v, reg.specs[i + 1])):
            if tuple(t.shape[1:]) != (s.block_size, *s.entry_shape) or t.dtype != s.dtype:
                raise ValueError(f"{s.name}: engine cache {tuple(t.shape)} {t.dtype} does not match the "
                                 f"registration ({s.block_size}, {s.entry_shape}) {s.dtype}")
            out.append(t)
    return out


def kv_layout_tag(kv_cache_config) -> str:
    """The engine's in-block KV layout: on the CPU, the attention ISA of each group (vLLM's choice
    from dtype, block size, head size and the machine), e.g. "cpu-attn:vec"."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return current_platform.device_name if hasattr(current_platform, "device_name") else "device"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isas = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        isas.append(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size))
    return "cpu-attn:" + ",".join(isas)


def block_lists(blocks) -> list[list[int]]:
    """Per-group block ids (vLLM's null block -> -1: not resident, skipped by install and gather)."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    return [[-1 if int(b) == NULL_BLOCK_ID else int(b) for b in ids] for ids in blocks]
