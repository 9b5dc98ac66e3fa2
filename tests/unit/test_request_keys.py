"""What a key covers beyond token ids, on vLLM's own Request objects: checked against vLLM's own
prefix-cache block hashes (two requests vLLM keeps apart never share a BSR object), the LoRA
adapter bound to its files, requests BSR refuses to key, the cache epoch, and the blocks of a local
prefix-cache hit a load never writes."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from bsr_harness.memory_tier import MemoryTier  # noqa: E402
from bsr_harness.tiny_model import build_tiny_lora  # noqa: E402
from bsr_kernels import Registration, TensorSpec  # noqa: E402
from bsr_runtime.integrations.vllm.request_keys import VllmKeyInputs  # noqa: E402
from bsr_runtime.keys import KeySpace, PrefixKeys  # noqa: E402
from bsr_runtime.load_blocks import without_local_blocks  # noqa: E402
from bsr_runtime.planner import Planner  # noqa: E402

CT = 256
IMAGE = 100  # vLLM puts the same placeholder token at every image position


def _request(rid: str, tokens, *, images=(), lora=None, embeds=None, salt=None) -> Request:
    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                   mm_position=PlaceholderRange(offset=off, length=n), mm_hash=ident)
             for ident, off, n in images]
    init_none_hash(sha256)
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), None, mm_features=feats or None,
                   lora_request=lora, prompt_embeds=embeds, cache_salt=salt,
                   block_hasher=get_request_block_hasher(CT, sha256))


def _keys(req: Request, n: int, inputs=None) -> list[str]:
    inputs = inputs or VllmKeyInputs()
    k = inputs("tenant", req)
    assert k.refused is None
    return PrefixKeys(KeySpace("f" * 16, salt=k.salt, features=k.features), req.prompt_token_ids, CT).window(0, n)


def _tokens(n: int, image_at: int = 300, image_len: int = 150) -> list[int]:
    t = [3 + (i * 7) % 1000 for i in range(n)]
    t[image_at:image_at + image_len] = [IMAGE] * image_len
    return t


@pytest.mark.parametrize("other", [
    {"images": [("cat", 300, 150)]},  # another image at the same place: vLLM's hashes differ from chunk 1 on
    {"images": [("dog", 301, 150)], "shift": 1},  # the same image one token later
])
def test_multimodal_items_key_each_chunk_as_vllms_block_hashes_do(other):
    tokens = _tokens(4 * CT)
    a = _request("a", tokens, images=[("dog", 300, 150)])
    b_tokens = _tokens(4 * CT, image_at=300 + other.get("shift", 0))
    b = _request("b", b_tokens, images=other["images"])
    same = [x == y for x, y in zip(a.block_hashes, b.block_hashes)]
    ka, kb = _keys(a, 4), _keys(b, 4)
    assert [x == y for x, y in zip(ka, kb)] == same  # chunk 0 shared, chunk 1 on kept apart, as by vLLM
    assert same[0] and not any(same[1:])
    plain = PrefixKeys(KeySpace("f" * 16, salt=VllmKeyInputs()("tenant", a).salt), tokens, CT).window(0, 4)
    assert plain[0] == ka[0] and plain[1] != ka[1]  # a chunk without an item keeps the token-only key


def test_an_identical_request_gets_identical_keys():
    tokens = _tokens(3 * CT)
    a = _request("a", tokens, images=[("dog", 300, 150)])
    b = _request("b", tokens, images=[("dog", 300, 150)])
    assert a.block_hashes == b.block_hashes and _keys(a, 3) == _keys(b, 3)


def test_a_lora_adapter_is_keyed_by_its_files(tmp_path):
    path = build_tiny_lora(tmp_path / "lora", seed=1)
    tokens = _tokens(2 * CT)
    inputs = VllmKeyInputs()
    base = _keys(_request("base", tokens), 2, inputs)
    lora = _keys(_request("l", tokens, lora=LoRARequest("tiny", 1, path)), 2, inputs)
    again = _keys(_request("l2", tokens, lora=LoRARequest("tiny", 1, path)), 2, inputs)
    renamed = _keys(_request("l3", tokens, lora=LoRARequest("other", 2, path)), 2, inputs)
    assert base[0] != lora[0] and lora == again and renamed[0] != lora[0]
    build_tiny_lora(tmp_path / "lora", seed=2)  # rewritten in place: same name, path and shapes
    rewritten = _keys(_request("l4", tokens, lora=LoRARequest("tiny", 1, path)), 2, inputs)
    assert rewritten[0] != lora[0], "an adapter rewritten in place kept its keys"
    cfg = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 2 * cfg["lora_alpha"]  # the same weights, scaled otherwise
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(cfg))
    assert _keys(_request("l5", tokens, lora=LoRARequest("tiny", 1, path)), 2, inputs)[0] != rewritten[0]


def _reg() -> Registration:
    return Registration((TensorSpec("k", torch.float32, (8,), 64, group=0),
                         TensorSpec("w", torch.float32, (8,), 32, group=1, sliding_window=128)), chunk_tokens=CT)


def test_requests_bsr_cannot_key_are_neither_probed_nor_saved(tmp_path):
    reg = _reg()
    tier = MemoryTier(reg.chunk_bytes, reg.fingerprint)
    planner = Planner(reg, [tier], key_inputs=VllmKeyInputs())
    embeds = _request("e", _tokens(3 * CT), embeds=torch.zeros(3 * CT, 8))
    gone = _request("g", _tokens(3 * CT), lora=LoRARequest("gone", 1, str(tmp_path / "missing")))
    for req, why in ((embeds, "prompt_embeds"), (gone, "adapter")):
        assert planner.match(req, 0) == 0 and planner.match(req, 0) == 0
        assert planner.refused(req) == why
    assert planner.stats.probes == 0
    assert planner.stats.refused == {"prompt_embeds": 1, "adapter": 1}  # once per request
    tier.close()


def test_a_new_epoch_misses_what_was_stored_before():
    reg = _reg()
    tier = MemoryTier(reg.chunk_bytes, reg.fingerprint)
    planner = Planner(reg, [tier], key_inputs=VllmKeyInputs())
    req = _request("r", _tokens(3 * CT))
    k = planner.inputs(req)
    keys = PrefixKeys(dataclass_replace(planner.keyspace, k), req.prompt_token_ids, CT).window(0, 2)
    tier.put(keys, [torch.zeros(reg.chunk_bytes, dtype=torch.uint8)] * 2)
    assert planner.match(req, 0) == 2 * CT
    planner.new_epoch()
    assert planner.match(_request("r2", _tokens(3 * CT)), 0) == 0
    assert planner.inputs(req).salt != k.salt
    tier.close()


def dataclass_replace(space: KeySpace, inputs) -> KeySpace:
    import dataclasses

    return dataclasses.replace(space, salt=inputs.salt, features=inputs.features)


def test_a_load_records_only_the_blocks_past_the_local_hit():
    reg = _reg()  # group 0: 64-token blocks; group 1: 32-token blocks (sliding window)
    tables = [list(range(10, 18)), list(range(40, 56))]
    assert without_local_blocks(reg, tables, 320) == [[-1] * 5 + list(range(15, 18)), [-1] * 10 + list(range(50, 56))]
    assert without_local_blocks(reg, tables, 0) == tables
    tier = MemoryTier(reg.chunk_bytes, reg.fingerprint)
    planner = Planner(reg, [tier])
    req = _request("r", _tokens(2 * CT + 10))
    keys = PrefixKeys(dataclass_replace(planner.keyspace, planner.inputs(req)), req.prompt_token_ids, CT).window(0, 2)
    tier.put(keys, [torch.zeros(reg.chunk_bytes, dtype=torch.uint8)] * 2)
    assert planner.match(req, 320) == 2 * CT - 320
    spec = planner.allocated(req, tables, 2 * CT - 320)
    assert spec.local_tokens == 320 and spec.num_chunks == 2
    assert spec.block_ids == without_local_blocks(reg, tables, 320)
    tier.close()
