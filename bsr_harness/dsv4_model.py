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


class _Weights:
    """The checkpoint's tensors, drawn in order from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.t: dict[str, torch.Tensor] = {}

    def w(self, name: str, *shape: int, std: float = 0.05, dtype=torch.bfloat16) -> None:
        self.t[name] = (torch.randn(*shape, generator=self.g) * std).to(dtype)

    def ones(self, name: str, *shape: int, dtype=torch.bfloat16) -> None:
        self.t[name] = torch.ones(*shape, dtype=dtype)

    def compressor(self, prefix: str, ratio: int, head: int, hidden: int) -> None:
        coff = 2 if ratio == 4 else 1
        self.w(f"{prefix}.ape", ratio, coff * head, std=0.05, dtype=torch.float32)
        self.ones(f"{prefix}.norm.weight", head)
        self.w(f"{prefix}.wkv.weight", coff * head, hidden, std=0.08)
        self.w(f"{prefix}.wgate.weight", coff * head, hidden, std=0.08)


def _attention(ws: _Weights, cfg: dict, a: str, ratio: int) -> None:
    """One layer's compressed MLA attention: its projections, its compressor (ratio > 1) and, at ratio
    4, its indexer."""
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, ql, ol, og = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ihd, inh = cfg["index_head_dim"], cfg["index_n_heads"]
    ws.w(f"{a}.attn_sink", nh, std=0.5, dtype=torch.float32)
    ws.ones(f"{a}.q_norm.weight", ql)
    ws.ones(f"{a}.kv_norm.weight", hd)
    ws.w(f"{a}.wq_a.weight", ql, H, std=0.08)
    ws.w(f"{a}.wq_b.weight", nh * hd, ql, std=0.08)
    ws.w(f"{a}.wkv.weight", hd, H, std=0.08)
    ws.w(f"{a}.wo_a.weight", og * ol, nh * hd // og, std=0.03)
    ws.w(f"{a}.wo_b.weight", H, og * ol, std=0.05)
    if ratio > 1:
        ws.compressor(f"{a}.compressor", ratio, hd, H)
    if ratio == 4:
        ws.compressor(f"{a}.indexer.compressor", ratio, ihd, H)
        ws.w(f"{a}.indexer.weights_proj.weight", inh, H, std=0.08)
        ws.w(f"{a}.indexer.wq_b.weight", inh * ihd, ql, std=0.08)


def _ffn(ws: _Weights, cfg: dict, f: str, hash_layer: bool) -> None:
    """One layer's MoE: the gate (a hash layer's token-to-expert table), the routed and shared experts."""
    H, E = cfg["hidden_size"], cfg["n_routed_experts"]
    mi, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    ws.w(f"{f}.gate.weight", E, H, std=0.08)
    if hash_layer:
        ws.t[f"{f}.gate.tid2eid"] = torch.stack(
            [torch.randperm(E, generator=ws.g)[:k] for _ in range(VOCAB)]).to(torch.int64)
    else:
        ws.w(f"{f}.gate.bias", E, std=0.05, dtype=torch.float32)
    for e in [*(f"experts.{e}" for e in range(E)), "shared_experts"]:
        ws.w(f"{f}.{e}.w1.weight", mi, H, std=0.08)
        ws.w(f"{f}.{e}.w2.weight", H, mi, std=0.08)
        ws.w(f"{f}.{e}.w3.weight", mi, H, std=0.08)


def _build(path: str | Path, seed: int = 0, weights: bool = True, **kw) -> str:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(**kw)
    if weights:  # else the geometry alone (vLLM's KV-cache objects need no weights)
        save_file({n: v.contiguous() for n, v in _weights(cfg, seed).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(path)


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    H, hc, f32 = cfg["hidden_size"], cfg["hc_mult"], torch.float32
    mix = (2 + hc) * hc
    ws = _Weights(seed)
    ws.w("embed.weight", VOCAB, H, std=1.0)
    ws.w("head.weight", VOCAB, H, std=0.08)
    ws.ones("norm.weight", H)
    ws.w("hc_head_fn", hc, hc * H, std=0.02, dtype=f32)
    ws.w("hc_head_base", hc, std=0.1, dtype=f32)
    ws.ones("hc_head_scale", 1, dtype=f32)
    for i, ratio in enumerate(cfg["compress_ratios"][: cfg["num_hidden_layers"]]):
        p = f"layers.{i}"
        _attention(ws, cfg, f"{p}.attn", ratio)
        _ffn(ws, cfg, f"{p}.ffn", i < cfg["num_hash_layers"])
        ws.ones(f"{p}.attn_norm.weight", H)
        ws.ones(f"{p}.ffn_norm.weight", H)
        for kind in ("attn", "ffn"):  # the hyper-connections' mixing
            ws.w(f"{p}.hc_{kind}_fn", mix, hc * H, std=0.02, dtype=f32)
            ws.w(f"{p}.hc_{kind}_base", mix, std=0.1, dtype=f32)
            ws.ones(f"{p}.hc_{kind}_scale", 3, dtype=f32)
    return ws.t


# DeepSeek-V4-Flash's layer pattern (43 layers: 0, 0, then 4/128 alternating, ending on 4; 3 hash
# layers), as in third-party copies of its config.json found with the search tools
FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)


def build_tiny_dsv4(path: str | Path, seed: int = 0, *, flash_layers: bool = False, weights: bool = True) -> str:
    """The tiny DeepSeek-V4 in `path` (4 layers, or Flash's 43 with `flash_layers`); returns the path.
    Same seed, same weights. `weights=False` writes config.json alone (enough for vLLM's KV-cache objects)."""
    if flash_layers:  # positions for the benchmark's long prompts (Flash's real context is longer still)
        return _build(path, seed, weights, layers_ratios=FLASH_RATIOS, hash_layers=3, max_positions=131072)
    return _build(path, seed, weights)
