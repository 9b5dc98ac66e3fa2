"""The weights digest of the model identity (bsr_runtime/weights_digest.py): a checkpoint rewritten in
place with other values misses, one opened again or copied elsewhere hits. Which bytes the samples
cover is written out here from the documented rule (first, middle and last 1 KiB of every tensor),
not taken from the module."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from bsr_runtime.weights_digest import checkpoint_digest

SAMPLE = 1024


def _checkpoint(path, seed: int, *, shards: int = 2) -> str:
    """A small sharded safetensors checkpoint: per shard a large tensor (sampled) and two small ones."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for s in range(shards):
        save_file({f"layers.{s}.big": torch.randn(64, 1024, generator=g),  # 256 KiB: three samples
                   f"layers.{s}.norm": torch.randn(128, generator=g),  # 512 B: whole
                   f"layers.{s}.bias": torch.randn(700, generator=g)},  # 2800 B: whole (< 3 samples)
                  str(path / f"model-{s:05d}-of-{shards:05d}.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 128}))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def _tensor_span(file, name: str) -> tuple[int, int]:
    """Absolute byte range of a tensor in a safetensors file (parsed here, independently)."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    b, e = header[name]["data_offsets"]
    return 8 + n + b, 8 + n + e


def _flip(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_reopened_and_copied_checkpoints_hit(tmp_path):
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    d = checkpoint_digest(ckpt)
    assert len(d) == 32 and int(d, 16) >= 0
    assert checkpoint_digest(ckpt) == d  # opened again
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(ckpt, copy)  # new path, new modification times
    os.utime(copy / "config.json", (1, 1))
    assert checkpoint_digest(copy) == d
    assert checkpoint_digest(_checkpoint(tmp_path / "c", seed=1)) == d  # the same weights written again


def test_rewritten_in_place_misses(tmp_path):
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    d = checkpoint_digest(ckpt)
    _checkpoint(tmp_path / "a", seed=2)  # same path, names, shapes and offsets; other values
    assert checkpoint_digest(ckpt) != d


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_sampled_byte_of_a_large_tensor_misses(tmp_path, where):
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    d = checkpoint_digest(ckpt)
    file = tmp_path / "a" / "model-00001-of-00002.safetensors"
    b, e = _tensor_span(file, "layers.1.big")
    offset = {"first": b, "middle": (b + e) // 2, "last": e - 1}[where]
    _flip(file, offset)
    assert checkpoint_digest(ckpt) != d


@pytest.mark.parametrize("name", ["layers.0.norm", "layers.0.bias"])
def test_any_byte_of_a_small_tensor_misses(tmp_path, name):
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    d = checkpoint_digest(ckpt)
    file = tmp_path / "a" / "model-00000-of-00002.safetensors"
    b, e = _tensor_span(file, name)
    _flip(file, b + (e - b) * 2 // 5)  # inside no 1 KiB sample of a large tensor, but the tensor is whole
    assert checkpoint_digest(ckpt) != d


def test_unsampled_bytes_are_not_seen(tmp_path):
    """The documented limit: a change between the samples of a large tensor is not detected."""
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    d = checkpoint_digest(ckpt)
    file = tmp_path / "a" / "model-00000-of-00002.safetensors"
    b, e = _tensor_span(file, "layers.0.big")
    _flip(file, b + SAMPLE + 100)  # after the first sample, far before the middle one
    assert checkpoint_digest(ckpt) == d


def test_header_config_and_files(tmp_path):
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    d = checkpoint_digest(ckpt)
    cfg = tmp_path / "a" / "config.json"
    cfg.write_text(cfg.read_text().replace("128", "129"))
    assert checkpoint_digest(ckpt) != d
    ckpt = _checkpoint(tmp_path / "b", seed=1)
    (tmp_path / "b" / "tokenizer.json").write_text('{"other": 1}')  # not part of the weights
    assert checkpoint_digest(ckpt) == d
    # same bytes, another shape (64x1024 read as 1024x64): the header differs
    file = tmp_path / "b" / "model-00000-of-00002.safetensors"
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(b"[64,1024]", b"[1024,64]")
    assert len(header) == n and header != raw[8:8 + n]
    file.write_bytes(raw[:8] + header + raw[8 + n:])
    assert checkpoint_digest(ckpt) != d
    ckpt = _checkpoint(tmp_path / "c", seed=1)
    shutil.copy(tmp_path / "c" / "model-00000-of-00002.safetensors", tmp_path / "c" / "extra.safetensors")
    assert checkpoint_digest(ckpt) != d  # one more weight file


def test_other_weight_files_and_bad_input(tmp_path):
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    torch.save({"w": torch.randn(300_000, generator=torch.Generator().manual_seed(1))}, ckpt / "pytorch_model.bin")
    d = checkpoint_digest(ckpt)
    assert checkpoint_digest(ckpt / "pytorch_model.bin") == d  # the file alone: the same content
    torch.save({"w": torch.randn(300_000, generator=torch.Generator().manual_seed(2))}, ckpt / "pytorch_model.bin")
    assert checkpoint_digest(ckpt) != d
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\xff" * 5000)  # not safetensors: sampled like any file
    assert len(checkpoint_digest(junk)) == 32
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight file"):
        checkpoint_digest(empty)
    with pytest.raises(FileNotFoundError):
        checkpoint_digest(tmp_path / "missing")


def _rewrite_header(file, tensor: str, data_offsets) -> None:
    """`file` with one tensor's data_offsets replaced (the header re-framed; the data kept)."""
    raw = open(file, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[tensor]["data_offsets"] = data_offsets
    text = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("offsets", [["0", "4"], "04", [0.0, 512.0], [0, 1 << 40], [512, 0], [True, 4], None])
def test_an_invalid_safetensors_header_is_a_value_error_naming_the_tensor(tmp_path, offsets):
    """Issue 35 item 8: string or float data_offsets raised a raw TypeError from the digest, where the
    model identity's message asks for a model_id on a ValueError."""
    ckpt = _checkpoint(tmp_path / "a", seed=1)
    _rewrite_header(tmp_path / "a" / "model-00000-of-00002.safetensors", "layers.0.norm", offsets)
    with pytest.raises(ValueError, match=r"^'model-00000-of-00002.safetensors' is not valid safetensors: tensor "
                                         r"'layers.0.norm' has data_offsets .*, expected \[begin, end\]"):
        checkpoint_digest(ckpt)


def test_the_model_identity_asks_for_a_model_id_on_an_invalid_header(tmp_path):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from bsr_runtime.integrations.vllm.model_identity import model_identity

    ckpt = tmp_path / "one"
    ckpt.mkdir()
    save_file({"w": torch.randn(300)}, str(ckpt / "model.safetensors"))  # one tensor: nothing sorted
    _rewrite_header(ckpt / "model.safetensors", "w", ["0", "4"])
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(ckpt), revision=None),
                                  load_config=SimpleNamespace(download_dir=None))
    with pytest.raises(ValueError) as ei:
        model_identity(vllm_config, SimpleNamespace(kv_cache_groups=[]))
    msg = str(ei.value)
    assert "tensor 'w' has data_offsets ['0', '4']" in msg and "model_id" in msg and "\n" not in msg, msg
    assert model_identity(vllm_config, SimpleNamespace(kv_cache_groups=[]), "m").startswith("m#")
