"""A random-weight tiny Llama built locally (transformers, saved with safetensors): the model of
the real-engine tests, the `bsr demo` engine part and the engine benchmark. Nothing is downloaded.
Same seed, same weights; other seed, same geometry (a second model that must never share objects)."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 2048


def build_tiny_llama(path: str | Path, seed: int = 0, *, hidden: int = 128, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, head_dim: int = 32, vocab: int = VOCAB, max_pos: int = 32768,
                     sliding_window: int | None = None, layer_types: list[str] | None = None) -> str:
    """A random-weight Llama (float32, safetensors) in `path`; returns the path. Same seed, same weights.
    With `sliding_window` and `layer_types` a Mistral-style hybrid (sliding + full attention) is built."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      vocab_size=vocab, max_position_embeddings=max_pos, torch_dtype="float32",
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init: logits that actually depend on the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    if sliding_window is not None:
        c = json.loads((path / "config.json").read_text())
        c["sliding_window"] = sliding_window
        if layer_types:
            c["layer_types"] = layer_types
        (path / "config.json").write_text(json.dumps(c))
    return str(path)


def build_tiny_lora(path: str | Path, seed: int = 0, *, rank: int = 8, hidden: int = 128, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, head_dim: int = 32, scale: float = 0.5) -> str:
    """A random PEFT LoRA adapter for build_tiny_llama's default geometry, on q_proj, k_proj and v_proj
    (written by hand: no peft needed); returns the path. Same seed, same weights. `scale` sizes B so
    the adapter changes the model's KV and greedy tokens."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    outs = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    tensors = {}
    for i in range(layers):
        for mod, out in outs.items():
            base = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{base}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": list(outs), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "base_model_name_or_path": None}))
    return str(path)
