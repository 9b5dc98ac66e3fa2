"""DeepSeek-V4 in the vLLM connector without a forward pass: the registration, the destinations, the
objects and the install, built from vLLM 0.32's own objects for the tiny DeepSeek-V4 (every layer kind
of Flash): its layers' KV-cache specs, the workers' and the scheduler's KVCacheConfig and the KV-cache
tensors as vLLM's worker allocates them (bsr_harness.dsv4_engine.kv_cache_objects: the model built on
the meta device in a process of its own). No AVX-512 op is called: these run on AVX2 machines too.

Block tables follow vLLM's SlidingWindowManager: a sliding-window group's blocks before
`computed - sliding_window + 1` are the null block (-1 here); block ids come from one pool shared by
every group (the groups' caches share each block's bytes)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

from bsr_harness import dsv4_engine  # noqa: E402
from bsr_harness.dsv4_model import build_tiny_dsv4  # noqa: E402
from bsr_harness.memory_tier import MemoryTier  # noqa: E402
from bsr_harness.testdata import POISON  # noqa: E402
from bsr_kernels import WindowInstaller, available_backends  # noqa: E402
from bsr_kernels.validate import check_destination_tensors  # noqa: E402
from bsr_runtime.integrations.vllm.registration import (  # noqa: E402
    destinations,
    kv_layout_tag,
    registration_from_kv_cache_config,
)
from bsr_runtime.keys import KeySpace  # noqa: E402
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest  # noqa: E402
from bsr_runtime.saver import resident_chunks_end  # noqa: E402
from bsr_runtime.store import store_prefix  # noqa: E402

CHUNK = 256
SWA, C4, C128 = 128, 8, 128  # sliding windows (tokens): SWA KV, C4 compressor states, C128 compressor states


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """vLLM's objects for the tiny model and for Flash's 43-layer pattern (its config alone), one process."""
    tiny = build_tiny_dsv4(tmp_path_factory.mktemp("tiny-dsv4"))
    flash = build_tiny_dsv4(tmp_path_factory.mktemp("flash-dsv4"), flash_layers=True, weights=False)
    return dsv4_engine.kv_cache_objects_of([(tiny, dict(max_model_len=2048, memory_bytes=48 << 20)),
                                            (flash, dict(max_model_len=1024, memory_bytes=1 << 30))])


@pytest.fixture(scope="module")
def objs(both):
    return both[0]


@pytest.fixture(scope="module")
def reg(objs):
    return registration_from_kv_cache_config(objs.worker_config)


def _expected_stored_bytes() -> int:
    """Bytes per chunk a prefix ending at the chunk needs, written out apart from the code: per layer kind,
    entries x entry bytes (fp8_ds_mla rows 584 B, indexer keys 132 B, fp32 compressor states)."""
    swa = 4 * SWA * 584  # 4 layers: the last 128 tokens' sliding-window KV
    c4 = CHUNK // 4 * 584 + CHUNK // 4 * 132  # layer 2: compressed KV and indexer keys, all of them
    c128 = CHUNK // 128 * 584  # layer 3: compressed KV, all of it
    states = C4 * 2048 * 4 + C4 * 512 * 4 + C128 * 1024 * 4  # the windows of the compressor states
    return swa + c4 + c128 + states


def test_registration_from_vllms_own_specs(objs, reg):
    groups = objs.worker_config.kv_cache_groups
    assert reg.num_groups == len(groups) == 7
    assert reg.num_tensors == 10 == sum(len(g.layer_names) for g in groups)
    by = {s.name: s for s in reg.specs}
    for layer in range(4):
        s = by[f"model.layers.{layer}.attn.swa_cache"]
        assert (s.dtype, s.entry_bytes, s.token_ratio, s.tokens_per_block, s.sliding_window, s.tail_tokens) == \
            (torch.uint8, 584, 1, 64, SWA, SWA)
    c4kv, c128kv = by["model.layers.2.attn"], by["model.layers.3.attn"]
    assert (c4kv.entry_bytes, c4kv.token_ratio, c4kv.block_size, c4kv.tail_tokens) == (584, 4, 64, None)
    assert (c128kv.entry_bytes, c128kv.token_ratio, c128kv.block_size) == (584, 128, 2)
    idx = by["model.layers.2.attn.indexer.k_cache"]
    assert (idx.dtype, idx.entry_bytes, idx.token_ratio) == (torch.uint8, 132, 4)
    assert c4kv.group == c128kv.group == idx.group  # one group mixes widths and token ratios
    st = {n: by[f"model.layers.{n}.compressor.state_cache"] for n in ("2.attn", "2.attn.indexer", "3.attn")}
    assert [(s.dtype, s.entry_shape, s.block_size, s.sliding_window, s.tail_tokens) for s in st.values()] == [
        (torch.float32, (2048,), 4, C4, C4), (torch.float32, (512,), 4, C4, C4),
        (torch.float32, (1024,), 8, C128, C128)]
    # each layer's own spec: entry widths as vLLM's per-layer specs say
    for s in reg.specs:
        spec = objs.layer_specs[s.name]
        assert s.entry_bytes == spec.state_content_size_bytes and s.token_ratio == spec.tokens_per_state
    assert reg.chunk_bytes == _expected_stored_bytes() == 952_208
    every = sum(CHUNK // s.token_ratio * s.entry_bytes for s in reg.specs)
    assert every == 4_315_024 and reg.chunk_bytes < every / 4


def test_scheduler_config_gives_the_same_registration(objs, reg):
    """vLLM's scheduler config keeps one spec per merged group (its first layer's): the scheduler side asks
    the model's layers (here stand-ins answering with vLLM's specs) and gets the workers' registration
    and layout tag; without them, a group of several MLA-kind layers is refused, never guessed."""
    sched = objs.scheduler_config
    assert any(type(g.kv_cache_spec).__name__ == "MLAAttentionSpec" and len(g.layer_names) > 1
               for g in sched.kv_cache_groups)

    class Layer:
        def __init__(self, spec):
            self.spec = spec

        def get_kv_cache_spec(self, vllm_config):
            return self.spec

    class Config:
        class compilation_config:  # noqa: N801 - the attribute vLLM's config has
            static_forward_context = {n: Layer(s) for n, s in objs.layer_specs.items()}

    got = registration_from_kv_cache_config(sched, vllm_config=Config)
    assert got.fingerprint == reg.fingerprint and got.chunk_bytes == reg.chunk_bytes
    assert kv_layout_tag(sched, Config) == kv_layout_tag(objs.worker_config)
    assert "mla:fp8_ds_mla/deepseek_v4" in kv_layout_tag(objs.worker_config)
    with pytest.raises(NotImplementedError, match="KV-cache group 4 .* not in this process"):
        registration_from_kv_cache_config(sched)


def test_a_spec_bsr_does_not_know_is_refused_in_one_line(objs):
    import copy

    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    cfg = copy.deepcopy(objs.worker_config)
    group = cfg.kv_cache_groups[4]
    name = group.layer_names[0]
    base = group.kv_cache_spec.kv_cache_specs[name]
    group.kv_cache_spec.kv_cache_specs[name] = HiddenStateCacheSpec(
        block_size=base.block_size, num_kv_heads=1, head_size=base.head_size, dtype=base.dtype)
    with pytest.raises(NotImplementedError) as e:
        registration_from_kv_cache_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg and f"layer {name}: KV-cache spec HiddenStateCacheSpec is not supported" in msg


def test_destinations_are_vllms_caches_packed_block_by_block(objs, reg):
    kv = objs.kv_caches()
    dst = destinations(reg, kv)
    storage = {t.untyped_storage().data_ptr() for t in dst}
    assert len(storage) == 1  # one allocation, laid out block by block
    assert len({t.stride(0) * t.element_size() for t in dst}) == 1
    _, layout = check_destination_tensors(reg, dst)
    pairs = {tuple(sorted((reg.specs[i].group, reg.specs[j].group))) for i, j in layout.aliases}
    assert (0, 1) in pairs and (4, 5) in pairs  # groups share each block's bytes
    # the same allocation read other than block for block (a view one block on) is refused
    shifted = list(dst)
    t = dst[1]
    shifted[1] = t.as_strided((t.shape[0] - 1, *t.shape[1:]), t.stride(), t.storage_offset() + t.stride(0) // 2)
    with pytest.raises(ValueError, match="other than block for block"):
        check_destination_tensors(reg, shifted)
    # two tensors of one group on the same bytes are refused
    same = list(dst)
    i, j = (k for k, s in enumerate(reg.specs) if s.group == 5)
    same[j] = dst[j].as_strided(dst[j].shape, dst[j].stride(), dst[i].storage_offset() * 4 // dst[j].element_size())
    with pytest.raises(ValueError, match="overlap in memory"):
        check_destination_tensors(reg, same)


def _windows(objs) -> list[int]:
    """Per group, the tokens its sliding window keeps behind the next one (vLLM: window - 1 + retained), or 0."""
    out = []
    for g in objs.worker_config.kv_cache_groups:
        spec = next(iter(g.kv_cache_spec.kv_cache_specs.values())) if hasattr(g.kv_cache_spec, "kv_cache_specs") \
            else g.kv_cache_spec
        w = getattr(spec, "sliding_window", None)
        out.append(w - 1 + spec.extra_retained_tokens if w else 0)
    return out


def vllm_tables(objs, reg, computed: int, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Block tables of a request with `computed` tokens, as vLLM's managers hold them: ids from one pool
    (block 0 is the null block), a sliding-window group's blocks before the window -1."""
    pool = list(range(1, num_blocks))
    random.Random(seed).shuffle(pool)
    tables = []
    for g, back in enumerate(_windows(objs)):
        tpb = reg.group_tokens_per_block(g)
        n = -(-computed // tpb)
        skipped = max(0, computed - back) // tpb if back else 0
        tables.append(torch.tensor([-1] * skipped + [pool.pop() for _ in range(n - skipped)], dtype=torch.int64))
    return tables


def _random_fill(kv) -> None:
    st = kv[0].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(st)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))


def _poison(kv) -> torch.Tensor:
    raw = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())
    raw.fill_(POISON)
    return raw


def _written_mask(reg, kv, tables, num_chunks: int) -> torch.Tensor:
    """Every byte of the allocation that a restore of chunks 0..num_chunks-1 may write: the resident
    blocks of each tensor, whole."""
    raw = torch.empty(0, dtype=torch.uint8).set_(kv[0].untyped_storage())
    mask = torch.zeros(raw.numel(), dtype=torch.bool)
    for s, t in zip(reg.specs, kv):
        n = reg.blocks_needed(s.group, num_chunks * reg.chunk_tokens)
        ids = [b for b in tables[s.group][:n].tolist() if b >= 0]
        b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        for blk in ids:
            view = b[blk]
            off = view.storage_offset()
            span = (view.shape[0] - 1) * view.stride(0) + view.shape[-1]
            mask[off: off + span] = True
    return mask


@pytest.mark.parametrize("backend", [b for b in ("cpu", "torch") if b in available_backends()])
def test_restore_installs_exactly_the_blocks_vllm_allocated(objs, reg, backend):
    """Save 3 chunks of a request from one engine cache (random bytes), restore them with W=2 into another
    (poisoned): every resident block of every group equals the source, no other byte of the allocation
    changed (a sliding-window group's blocks before its window, the null block, other groups' blocks),
    each object is c bytes (the window tails only) and the peak staging is W*c."""
    n, w = 3, 2
    src, dst = destinations(reg, objs.kv_caches()), destinations(reg, objs.kv_caches())
    nb = src[0].shape[0]
    _random_fill(src)
    tables = vllm_tables(objs, reg, n * CHUNK, nb, seed=7)
    assert [int((t >= 0).sum()) for t in tables] == [2, 2, 2, 2, 3, 2, 16]  # the windows at a prefix end
    space = KeySpace(reg.fingerprint)
    tokens = list(range(5, 5 + n * CHUNK + 17))
    tier = MemoryTier(reg.chunk_bytes, reg.fingerprint)
    store_prefix(reg, tier, space, tokens, src, tables, num_chunks=n, window_chunks=w, backend=backend)
    assert len(tier) == n
    raw = _poison(dst)
    rep = BoundedRestorer(reg, RestoreConfig(window_chunks=w, backend=backend)).restore(
        RestoreRequest("r", tokens, space, dst, tables), tier, n)
    assert rep.ok, rep.error
    assert rep.peak_staging_bytes == w * reg.chunk_bytes
    assert rep.bytes_moved == n * reg.chunk_bytes
    written = _written_mask(reg, dst, tables, n)
    src_raw = torch.empty(0, dtype=torch.uint8).set_(src[0].untyped_storage())
    assert torch.equal(raw[written], src_raw[written])  # every resident block, whole
    assert bool((raw[~written] == POISON).all())  # nothing else
    assert 0 < int(written.sum()) < raw.numel() // 20


def test_object_holds_the_tail_of_each_window(objs, reg):
    """The staged chunk's segment of a sliding-window tensor is the chunk's last `tail_tokens` tokens."""
    from bsr_kernels import gather_window

    src = destinations(reg, objs.kv_caches())
    _random_fill(src)
    tables = vllm_tables(objs, reg, 2 * CHUNK, src[0].shape[0], seed=3)
    out = torch.empty(2 * reg.chunk_bytes, dtype=torch.uint8)
    gather_window(out, reg, src, tables, 0, 2, backend="torch")
    i = next(k for k, s in enumerate(reg.specs) if s.name == "model.layers.2.attn.compressor.state_cache")
    s = reg.specs[i]
    seg = out[reg.chunk_bytes + reg.segment_offsets[i]:][: reg.segment_bytes(i)]
    last = tables[s.group][(2 * CHUNK - s.tail_tokens) // s.tokens_per_block:].tolist()
    expect = torch.cat([src[i][b].reshape(-1).view(torch.uint8) for b in last])
    assert reg.segment_bytes(i) == C4 * 2048 * 4 and torch.equal(seg, expect)


def test_resident_blocks_before_a_window_are_refused(objs, reg):
    """A block table with a resident block before a sliding-window group's tail: the objects do not hold
    it, so the install refuses (the load fails closed) instead of leaving it unwritten."""
    dst = destinations(reg, objs.kv_caches())
    tables = vllm_tables(objs, reg, 2 * CHUNK, dst[0].shape[0], seed=5)
    WindowInstaller(reg, dst, tables, 2)
    bad = [t.clone() for t in tables]
    bad[0][1] = max(int(t.max()) for t in tables) + 1  # chunk 0 of a SWA group, outside its window
    with pytest.raises(ValueError, match="resident in chunk 0 before the last 128 tokens"):
        WindowInstaller(reg, dst, bad, 2)


def test_chunks_with_their_tails_resident_are_saved(objs, reg):
    """A chunk is saveable when the blocks its object holds are resident in every group (a window's head
    may be gone already); one whose tail left the window is not."""
    tables = [t.tolist() for t in vllm_tables(objs, reg, 3 * CHUNK, 400, seed=2)]
    assert resident_chunks_end(reg, tables, 2, 3) == 3
    assert resident_chunks_end(reg, tables, 0, 3) == 0  # chunk 0's SWA tail was freed


def test_the_dsv4_flash_preset_is_what_vllm_registers(both):
    """The sweeps' and the demo's registration (bsr_kernels.presets.dsv4_flash) is vLLM's for the Flash
    layout: 167 tensors in 5 groups, tensor for tensor (the same fingerprint), c = 16,406,080 B."""
    from bsr_kernels import presets

    engine = registration_from_kv_cache_config(both[1].worker_config)
    preset = presets.dsv4_flash()
    assert (engine.num_tensors, engine.num_groups) == (preset.num_tensors, preset.num_groups) == (167, 5)
    assert engine.specs == preset.specs and engine.fingerprint == preset.fingerprint
    assert engine.chunk_bytes == preset.chunk_bytes == presets.DSV4_CHUNK_BYTES
    assert abs(engine.chunk_bytes / presets.PAPER_DSV4_CHUNK_BYTES - 1) < 0.01
    every = sum(CHUNK // s.token_ratio * s.entry_bytes for s in engine.specs)
    assert every == presets.DSV4_EVERY_ENTRY_BYTES
