"""The one tier factory: specs in, ready tiers out; bad specs are one-line ValueErrors."""

from __future__ import annotations

import time

import pytest
import torch

from bsr_kernels import presets
from bsr_runtime.tiers.factory import make_tier
from bsr_runtime.tiers.filesystem import FilesystemTier

REG = presets.llama_like(layers=1, kv_heads=1, head_dim=16, block_size=16)


def test_filesystem_spec_opens_a_working_tier(tmp_path):
    with make_tier(REG, {"type": "filesystem", "root": str(tmp_path), "load_concurrency": 2}) as tier:
        assert isinstance(tier, FilesystemTier)
        data = torch.randint(0, 256, (REG.chunk_bytes,), dtype=torch.uint8)
        tier.put(["k0"], [data])
        out = torch.zeros_like(data)
        tier.fetch(["k0"], [out], deadline=time.monotonic() + 10).wait()
        assert torch.equal(out, data)


@pytest.mark.parametrize("spec,needle", [
    ({"type": "s3"}, "unknown tier type 's3'"),
    ({}, "unknown tier type None"),
    ("filesystem", "must be a mapping"),
    ({"type": "filesystem"}, "filesystem tier spec: root: missing"),
    ({"type": "mooncake", "master_address": "127.0.0.1:1"}, "metadata_server: missing"),
    ({"type": "filesystem", "root": "/tmp", "colour": "red"}, "colour"),
])
def test_bad_specs_are_one_line_errors(spec, needle):
    with pytest.raises(ValueError, match=needle) as ei:
        make_tier(REG, spec)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("option,value", [
    ("connect_timeout_s", float("inf")), ("rpc_timeout_s", float("nan")), ("connect_timeout_s", 0),
    ("fetch_workers", 0), ("verify_threads", 1.5), ("global_segment_size", -1), ("verify", "yes"),
    ("local_reads", 1), ("land_whole", "tcp"),
])
def test_mooncake_options_are_checked_before_connecting(option, value):
    # 127.0.0.1:1 is never contacted: the options are refused first
    from bsr_runtime.tiers.mooncake_options import MooncakeTuning

    where = {"tuning": {option: value}} if option in MooncakeTuning.model_fields else {option: value}
    with pytest.raises(ValueError, match=("tuning." if "tuning" in where else "") + option):
        make_tier(REG, {"type": "mooncake", "master_address": "127.0.0.1:1",
                        "metadata_server": "http://127.0.0.1:1/metadata", **where})


def test_tier_type_names_keep_their_order_whatever_was_loaded():
    """The choices an error lists do not depend on which integration's types a process used first."""
    pytest.importorskip("lmcache")
    from bsr_runtime.tiers.registry import tier_type, tier_type_names

    expected = ("filesystem", "mooncake", "lmcache-filesystem", "lmcache-mooncake")
    assert tier_type_names() == expected
    assert tier_type("lmcache-mooncake").name == "lmcache-mooncake"  # loaded (registered) now
    assert tier_type_names() == expected
