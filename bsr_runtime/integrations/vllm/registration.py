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

MLA-kind caches (vLLM's MLAAttentionSpec and SlidingWindowMLASpec: DeepSeek-V4's sliding-window KV,
compressed KV, indexer keys and compressor states) have no K/V pair: one destination per layer, the
layer's own cache `[num_blocks, (1,) states per block, state bytes]`, entry = one state (a row of
`state_content_bytes`, or head_size elements), `token_ratio` = tokens per state, the layer's own spec
from UniformTypeKVCacheSpecs.kv_cache_specs (one group may mix entry widths, dtypes and ratios). A
sliding-window tensor's objects hold only the tail of each chunk that a prefix ending there needs:
the blocks vLLM keeps resident (`sliding_window - 1 + extra_retained_tokens` tokens back, in whole
blocks; `tail_tokens`). vLLM lays the groups' caches out block by block in one allocation (every
layer at its own offset inside each block, a block id owned by one group at a time): the overlap
check accepts that (bsr_kernels/overlap.py) and each request's tables must keep the groups' resident
ids disjoint. Their in-block layout is the writer's (e.g. fp8_ds_mla), tagged in the key space too.

The model identity (model_identity.py: a digest of the weights, or the configured `model_id`, plus
this layout tag) goes into the key space, so two models of one geometry never share objects.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bsr_kernels import Registration, TensorSpec

NULL_BLOCK_ID = 0  # vLLM's BlockPool reserves block 0 as the null block (a hole, e.g. outside a window)

KV_PAIR_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")  # a K and a V destination per layer
STATE_SPECS = ("MLAAttentionSpec", "SlidingWindowMLASpec")  # one destination per layer: its states
SUPPORTED_SPECS = KV_PAIR_SPECS + STATE_SPECS


def _layer_specs(group) -> list[tuple[str, object]]:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return [(name, per_layer[name] if per_layer else spec) for name in group.layer_names]


def resolve_layer_specs(kv_cache_config, vllm_config=None) -> list[list[tuple[str, object]]]:
    """Per KV-cache group, (layer, that layer's own KV-cache spec).

    A worker's config keeps each layer's spec (UniformTypeKVCacheSpecs.kv_cache_specs: one group may mix
    entry widths, dtypes and token ratios). The scheduler's config does not: vLLM 0.32's
    generate_scheduler_kv_cache_config replaces a UniformTypeKVCacheSpecs by its first layer's spec. There
    the layers' own specs come from the model's layers in this process (`get_kv_cache_spec`, as the model
    runner asks them), so scheduler and workers build one registration (keys, object size). A group of
    several layers whose own specs cannot be found is refused (its layers may differ)."""
    out = []
    layers = {}
    if vllm_config is not None:
        layers = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if getattr(spec, "kv_cache_specs", None) or len(group.layer_names) == 1:
            out.append(_layer_specs(group))
            continue
        own = []
        for name in group.layer_names:
            layer = layers.get(name)
            mine = layer.get_kv_cache_spec(vllm_config) if hasattr(layer, "get_kv_cache_spec") else None
            own.append((name, mine))
        if all(m is not None for _, m in own):
            out.append(own)
        elif type(spec).__name__ in STATE_SPECS:
            raise NotImplementedError(
                f"KV-cache group {g} ({type(spec).__name__}, {len(group.layer_names)} layers): vLLM's scheduler "
                "config holds one spec for all its layers and the model's layers are not in this process to ask "
                "for their own; the BSR connector needs them here (one engine process, TP=1)")
        else:  # K/V attention: vLLM merges a group's layers into one spec only when they are the same
            out.append(_layer_specs(group))
    return out


def tail_tokens(spec, block_size: int, chunk_tokens: int) -> int | None:
    """The tokens at a chunk's end a prefix ending there needs of a sliding-window cache: the whole
    blocks (of the group's `block_size` tokens) vLLM keeps resident (its SlidingWindowManager frees every
    block before `num_computed - sliding_window + 1 - extra_retained_tokens`); None when that is the
    whole chunk (or the cache has no window)."""
    window = getattr(spec, "sliding_window", None)
    if not window:
        return None
    back = window - 1 + getattr(spec, "extra_retained_tokens", 0)
    tail = -(-back // block_size) * block_size
    return tail if 0 < tail < chunk_tokens else None


def _unsupported(layer: str, kind: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"layer {layer}: KV-cache spec {kind} is not supported by the BSR connector "
                               f"({why}; supported: {', '.join(SUPPORTED_SPECS)})")


def _state_spec(layer: str, spec, block_size: int, group: int, chunk_tokens: int) -> TensorSpec:
    """One destination for an MLA-kind layer: entry = one stored state of every head slot; `block_size`
    tokens per block (the group's)."""
    kind = type(spec).__name__
    ratio = spec.tokens_per_state
    if int(ratio) != ratio or ratio < 1:
        raise _unsupported(layer, kind, f"tokens_per_state {ratio} is not a whole number of tokens")
    ratio = int(ratio)
    if block_size % ratio:
        raise _unsupported(layer, kind, f"block of {block_size} tokens is not whole states of {ratio}")
    itemsize = spec.dtype.itemsize
    cell = spec.state_content_size_bytes
    if cell % itemsize:
        raise _unsupported(layer, kind, f"state of {cell} B is not whole {spec.dtype} elements")
    heads = spec.num_heads
    entry = (cell // itemsize,) if heads == 1 else (heads, cell // itemsize)
    return TensorSpec(layer, spec.dtype, entry, block_size // ratio, ratio, group,
                      getattr(spec, "sliding_window", None), tail_tokens(spec, block_size, chunk_tokens))


def registration_from_kv_cache_config(kv_cache_config, chunk_tokens: int = 256, name: str = "vllm",
                                      vllm_config=None) -> Registration:
    """The registration of vLLM's KV-cache groups, in vLLM's order: two TensorSpecs (`<layer>.k`,
    `<layer>.v`) per attention layer, one (`<layer>`) per MLA-kind layer (its states), each from the
    layer's own spec (resolve_layer_specs; `vllm_config` for the scheduler's merged groups) and its
    group's block size. A spec BSR does not know is refused with one line naming it."""
    specs: list[TensorSpec] = []
    groups = kv_cache_config.kv_cache_groups
    for g, layers in enumerate(resolve_layer_specs(kv_cache_config, vllm_config)):
        block_size = groups[g].kv_cache_spec.block_size
        for layer, spec in layers:
            kind = type(spec).__name__
            if kind not in SUPPORTED_SPECS:
                raise _unsupported(layer, kind, "not a cache BSR knows how to restore")
            if chunk_tokens % block_size:
                raise ValueError(f"layer {layer}: chunk of {chunk_tokens} tokens is not a whole number of "
                                 f"{block_size}-token blocks")
            if kind in STATE_SPECS:
                specs.append(_state_spec(layer, spec, block_size, g, chunk_tokens))
                continue
            head_v = getattr(spec, "head_size_v", None) or spec.head_size
            if head_v != spec.head_size:
                raise NotImplementedError(f"layer {layer}: K head size {spec.head_size} != V head size {head_v}")
            window = getattr(spec, "sliding_window", None)
            tail = tail_tokens(spec, block_size, chunk_tokens)
            for part in ("k", "v"):
                specs.append(TensorSpec(f"{layer}.{part}", spec.dtype, (spec.num_kv_heads, spec.head_size),
                                        block_size, group=g, sliding_window=window, tail_tokens=tail))
    return Registration(tuple(specs), chunk_tokens=chunk_tokens, name=name)


def cpu_kv_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views (num_blocks, block_size, H, D) of one CPU attention layer cache
    `[num_blocks, H, block_size, 2 * D]`."""
    if cache.dim() != 4 or cache.shape[2] != block_size or cache.shape[3] % 2:
        raise ValueError(f"expected a CPU attention cache [num_blocks, H, {block_size}, 2*D], got {tuple(cache.shape)}")
    nb, h, bs, d2 = cache.shape
    c4 = cache.view(nb, h, 2 * bs, d2 // 2)
    return c4[:, :, :bs, :].permute(0, 2, 1, 3), c4[:, :, bs:, :].permute(0, 2, 1, 3)


def state_view(cache: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """An MLA-kind layer's cache `[num_blocks, H, states, C]` (vLLM's) or `[num_blocks, states, C]` as
    the destination (num_blocks, states, *entry)."""
    t = cache
    if t.dim() == 4:
        t = t.squeeze(1) if t.shape[1] == 1 else t.permute(0, 2, 1, 3)
    if t.dtype != spec.dtype and t.dim() >= 1 and t.stride(-1) == 1:
        t = t.view(spec.dtype)
    if len(spec.entry_shape) == 1 and t.dim() == 4 and t.shape[2] == 1:
        t = t.squeeze(2)
    return t


def destinations(reg: Registration, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The registered destination tensors, in registration order, from vLLM's `kv_caches`
    (layer name -> cache tensor)."""
    out: list[torch.Tensor] = []
    i = 0
    while i < reg.num_tensors:
        spec = reg.specs[i]
        if spec.name in kv_caches:  # an MLA-kind layer: its cache is the destination
            pairs = [(state_view(kv_caches[spec.name], spec), spec)]
            i += 1
        else:
            layer = spec.name[: -len(".k")]
            if layer not in kv_caches:
                raise ValueError(f"vLLM registered no KV cache for layer {layer!r}")
            k, v = cpu_kv_views(kv_caches[layer], spec.block_size)
            pairs = [(k, spec), (v, reg.specs[i + 1])]
            i += 2
        for t, s in pairs:
            if tuple(t.shape[1:]) != (s.block_size, *s.entry_shape) or t.dtype != s.dtype:
                raise ValueError(f"{s.name}: engine cache {tuple(t.shape)} {t.dtype} does not match the "
                                 f"registration ({s.block_size}, {s.entry_shape}) {s.dtype}")
            out.append(t)
    return out


def kv_layout_tag(kv_cache_config, vllm_config=None) -> str:
    """The engine's in-block KV layout: on the CPU, the attention ISA of each K/V group (vLLM's choice
    from dtype, block size, head size and the machine), e.g. "cpu-attn:vec"; an MLA-kind group adds
    its layers' cache formats (e.g. "mla:fp8_ds_mla/deepseek_v4"), whose in-block layout their writer
    decides."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return current_platform.device_name if hasattr(current_platform, "device_name") else "device"
    isas = []
    groups = kv_cache_config.kv_cache_groups
    for g, layers in enumerate(resolve_layer_specs(kv_cache_config, vllm_config)):
        spec = layers[0][1]
        if type(spec).__name__ in STATE_SPECS:
            kinds = sorted({f"{getattr(s, 'cache_dtype_str', None) or s.dtype}/{getattr(s, 'model_version', None)}"
                            for _, s in layers})
            isas.append("mla:" + "+".join(kinds))
            continue
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isas.append(_get_attn_isa(spec.dtype, groups[g].kv_cache_spec.block_size, spec.head_size))
    return "cpu-attn:" + ",".join(isas)


def block_lists(blocks) -> list[list[int]]:
    """Per-group block ids (vLLM's null block -> -1: not resident, skipped by install and gather)."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    return [[-1 if int(b) == NULL_BLOCK_ID else int(b) for b in ids] for ids in blocks]
