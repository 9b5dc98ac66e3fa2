"""A tiny random-weight DeepSeek-V4 (Flash-shaped) checkpoint for the real-engine tests and the engine
benchmark: config.json + model.safetensors, checkpoint tensor names as in deepseek-ai/DeepSeek-V4-Flash
(embed/head/layers.N.attn.wq_a/...), unquantized bf16 (fp32 where the real checkpoint and vLLM keep
fp32). No tokenizer (engines run with skip_tokenizer_init=True). Nothing is downloaded.

`build_tiny_dsv4(path)`: four layers with every layer kind of DeepSeek-V4-Flash, compress_ratios
[0, 0, 4, 128] (two sliding-window-only layers, one C4A layer with the lightning indexer, one C128A
layer); MoE on every layer, the first `hash_layers` hash-routed; MTP off (num_nextn_predict_layers 0).
`flash_layers=True`: Flash's 43-layer pattern (0, 0, then 4/128 alternating, ending on 4; 3 hash
layers): 167 KV-cache tensors in vLLM 0.32, the paper's MTP-off registration.
Fixed by vLLM CPU's kernels: head_dim 512, qk_rope_head_dim 64, index_head_dim 128, index_topk 512;
its routing kernels accept only 64/128/256/384 experts with top-k 6 or 8.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 2048


def config(layers_ratios=(0, 0, 4, 128), hidden=256, heads=8, experts=64, topk=6, hash_layers=2, max_positions=16384):
    # experts/topk: the CPU routing kernels (hash_topk_cpu/biased_topk_cpu, sgl topk.cpp) accept only
    # num_experts in {64,128,256,384} with topk in {6,8} ("unsupported num_experts 8")
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": 512,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 512,
        "initializer_range": 0.02,
        "max_position_embeddings": max_positions,
        "moe_intermediate_size": 128,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": heads,
        "num_experts_per_tok": topk,
        "num_hidden_layers": len(layers_ratios),
        "num_hash_layers": hash_layers,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 0,
        "o_groups": 4,
        "o_lora_rank": 128,
        "q_lora_rank": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                         "original_max_position_embeddings": 1024, "type": "yarn", "rope_type": "yarn"},
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": 128,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
        "compress_rope_theta": 160000,
        "compress_ratios": list(layers_ratios) + [0],
    }


def _build(path: str | Path, seed: int = 0, weights: bool = True, **kw) -> str:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(**kw)
    if not weights:  # the geometry alone (vLLM's KV-cache objects need no weights)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        return str(path)
    g = torch.Generator().manual_seed(seed)
    bf, f32 = torch.bfloat16, torch.float32
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, ql, ol, og = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ihd, inh = cfg["index_head_dim"], cfg["index_n_heads"]
    E, mi, k = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    hc = cfg["hc_mult"]
    mix = (2 + hc) * hc
    t: dict[str, torch.Tensor] = {}

    def w(name, *shape, std=0.05, dtype=bf):
        t[name] = (torch.randn(*shape, generator=g) * std).to(dtype)

    def ones(name, n, dtype=bf):
        t[name] = torch.ones(n, dtype=dtype)

    w("embed.weight", VOCAB, H, std=1.0)
    w("head.weight", VOCAB, H, std=0.08)
    ones("norm.weight", H)
    w("hc_head_fn", hc, hc * H, std=0.02, dtype=f32)
    w("hc_head_base", hc, std=0.1, dtype=f32)
    t["hc_head_scale"] = torch.ones(1, dtype=f32)

    def compressor(prefix, ratio, head):
        coff = 2 if ratio == 4 else 1
        w(f"{prefix}.ape", ratio, coff * head, std=0.05, dtype=f32)
        ones(f"{prefix}.norm.weight", head)
        w(f"{prefix}.wkv.weight", coff * head, H, std=0.08)
        w(f"{prefix}.wgate.weight", coff * head, H, std=0.08)

    for i, ratio in enumerate(cfg["compress_ratios"][: cfg["num_hidden_layers"]]):
        p = f"layers.{i}"
        a = f"{p}.attn"
        w(f"{a}.attn_sink", nh, std=0.5, dtype=f32)
        ones(f"{a}.q_norm.weight", ql)
        ones(f"{a}.kv_norm.weight", hd)
        w(f"{a}.wq_a.weight", ql, H, std=0.08)
        w(f"{a}.wq_b.weight", nh * hd, ql, std=0.08)
        w(f"{a}.wkv.weight", hd, H, std=0.08)
        w(f"{a}.wo_a.weight", og * ol, nh * hd // og, std=0.03)
        w(f"{a}.wo_b.weight", H, og * ol, std=0.05)
        if ratio > 1:
            compressor(f"{a}.compressor", ratio, hd)
        if ratio == 4:
            compressor(f"{a}.indexer.compressor", ratio, ihd)
            w(f"{a}.indexer.weights_proj.weight", inh, H, std=0.08)
            w(f"{a}.indexer.wq_b.weight", inh * ihd, ql, std=0.08)
        f = f"{p}.ffn"
        w(f"{f}.gate.weight", E, H, std=0.08)
        if i < cfg["num_hash_layers"]:
            t[f"{f}.gate.tid2eid"] = torch.stack(
                [torch.randperm(E, generator=g)[:k] for _ in range(VOCAB)]).to(torch.int64)
        else:
            w(f"{f}.gate.bias", E, std=0.05, dtype=f32)
        for e in range(E):
            w(f"{f}.experts.{e}.w1.weight", mi, H, std=0.08)
            w(f"{f}.experts.{e}.w2.weight", H, mi, std=0.08)
            w(f"{f}.experts.{e}.w3.weight", mi, H, std=0.08)
        w(f"{f}.shared_experts.w1.weight", mi, H, std=0.08)
        w(f"{f}.shared_experts.w2.weight", H, mi, std=0.08)
        w(f"{f}.shared_experts.w3.weight", mi, H, std=0.08)
        ones(f"{p}.attn_norm.weight", H)
        ones(f"{p}.ffn_norm.weight", H)
        for kind in ("attn", "ffn"):
            w(f"{p}.hc_{kind}_fn", mix, hc * H, std=0.02, dtype=f32)
            w(f"{p}.hc_{kind}_base", mix, std=0.1, dtype=f32)
            t[f"{p}.hc_{kind}_scale"] = torch.ones(3, dtype=f32)
    save_file({n: v.contiguous() for n, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(path)


# DeepSeek-V4-Flash's layer pattern (43 layers: 0, 0, then 4/128 alternating, ending on 4; 3 hash
# layers), as in third-party copies of its config.json found with the search tools
FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)


def build_tiny_dsv4(path: str | Path, seed: int = 0, *, flash_layers: bool = False, weights: bool = True) -> str:
    """The tiny DeepSeek-V4 in `path` (4 layers, or Flash's 43 with `flash_layers`); returns the path.
    Same seed, same weights. `weights=False` writes config.json alone (enough for vLLM's KV-cache objects)."""
    if flash_layers:  # positions for the benchmark's long prompts (Flash's real context is longer still)
        return _build(path, seed, weights, layers_ratios=FLASH_RATIOS, hash_layers=3, max_positions=131072)
    return _build(path, seed, weights)
