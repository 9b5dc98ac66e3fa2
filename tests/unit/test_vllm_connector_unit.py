"""The vLLM connector's parts without an engine: config parsing, the registration built from a
vLLM KVCacheConfig, the CPU cache layout (checked against vLLM's own reshape_and_cache op), and
metadata that pickles."""

from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("vllm")

from bsr_runtime.connector_config import ConnectorConfig  # noqa: E402
from bsr_runtime.integrations.vllm.metadata import BSRConnectorMetadata, SaveSpec  # noqa: E402
from bsr_runtime.integrations.vllm.registration import (  # noqa: E402
    block_lists,
    cpu_kv_views,
    destinations,
    registration_from_kv_cache_config,
)
from bsr_runtime.plan import LoadSpec  # noqa: E402


def test_config_parsing_and_errors():
    cfg = ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"},
                                                {"type": "mooncake", "master_address": "h:1",
                                                 "metadata_server": "http://h:2/metadata", "save": True}],
                                      "window_chunks": 4})
    assert [t.type for t in cfg.tiers] == ["filesystem", "mooncake"]
    assert cfg.tiers[1].options["global_segment_size"] == 0  # engines mount no segment by default
    assert cfg.save_tiers == [0, 1] and cfg.window_chunks == 4
    assert cfg.load_async and cfg.load_mode == "async"  # loads off the step thread by default
    sync = ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}], "load_mode": "sync"})
    assert not sync.load_async
    for bad in ({"load_mode": "auto"}, {"save_window_chunks": 6},  # earlier spellings: never released
                {"restore_budget_bytes": 0}, {"restore_budget_bytes": "1GiB"},
                {"tuning": {"max_concurrent_restores": 0}}, {"tuning": {"save_staging_chunks": -1}},
                {"timeouts": {"shutdown_s": -1}}, {"load_mode": "lazy"}, {"window_chunks": 0}):
        key = next(iter(bad))
        if key in ("tuning", "timeouts"):
            key = f"{key}.{next(iter(bad[key]))}"
        with pytest.raises(ValueError, match=key):
            ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}], **bad})
    with pytest.raises(ValueError, match="kv_connector_extra_config: window: unknown key"):
        ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}], "window": 4})
    with pytest.raises(ValueError, match="needs 'tiers'"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="unknown tier type"):
        ConnectorConfig.from_extra({"tiers": [{"type": "s3"}]})
    with pytest.raises(ValueError, match="load_mode"):
        ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}], "load_mode": "lazy"})


def test_the_bounds_of_probes_and_staging_waits_are_checked_where_they_enter(tmp_path):
    """Issue 35: timeouts.probe_s (a lookup past it is a miss) and timeouts.staging_wait_s (a load's wait for
    staging), each with a default, each refused when it is no finite positive number of seconds."""
    from bsr_harness.memory_tier import MemoryTier

    tiers = [{"type": "filesystem", "root": "/x"}]
    cfg = ConnectorConfig.from_extra({"tiers": tiers})
    assert cfg.timeouts.probe_s == 5.0 and cfg.timeouts.staging_wait_s == 30.0
    cfg = ConnectorConfig.from_extra({"tiers": tiers, "timeouts": {"probe_s": 0.5, "staging_wait_s": 2.0}})
    tier = MemoryTier(1024, "fp")
    assert cfg.restore_config([tier]).admission_timeout_s == 2.0  # the loader's wait for staging
    for key in ("probe_s", "staging_wait_s"):
        for bad in (0, -1, float("inf"), "5", None):
            with pytest.raises(ValueError, match=f"timeouts.{key}"):
                ConnectorConfig.from_extra({"tiers": tiers, "timeouts": {key: bad}})
    assert cfg.tuning.max_staging_retirements == 2  # replacements of staging lost to reads that never land
    one = ConnectorConfig.from_extra({"tiers": tiers, "tuning": {"max_staging_retirements": 0}})
    assert one.tuning.max_staging_retirements == 0
    for bad in (-1, 65, 1.0, "2", None):
        with pytest.raises(ValueError, match="tuning.max_staging_retirements"):
            ConnectorConfig.from_extra({"tiers": tiers, "tuning": {"max_staging_retirements": bad}})


def test_pipeline_depth_is_the_first_tiers_unless_configured(tmp_path):
    from bsr_harness.memory_tier import MemoryTier
    from bsr_runtime.tiers import FilesystemTier

    class PrefersOne(MemoryTier):  # stands for Mooncake over tcp or LMCache (tested in test_tier_contract.py)
        asked: list[int] = []

        def preferred_pipeline_depth(self, window_bytes: int) -> int:
            self.asked.append(window_bytes)
            return 1

    fs = FilesystemTier(tmp_path, 4096, "f" * 16)
    one = PrefersOne(4096, "f" * 16)
    try:
        cfg = ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}], "window_chunks": 8})
        assert cfg.tuning.pipeline_depth is None
        assert cfg.restore_config([fs, one]).pipeline_depth == 2
        assert cfg.restore_config([one, fs]).pipeline_depth == 1
        assert PrefersOne.asked == [8 * 4096]  # asked for its windows: W * c
        rc = cfg.restore_config([fs])
        assert (rc.window_chunks, rc.fetch_timeout_s, rc.backend) == (8, cfg.timeouts.fetch_s, cfg.tuning.backend)
        set_one = ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}],
                                              "tuning": {"pipeline_depth": 1}})
        assert set_one.restore_config([fs]).pipeline_depth == 1
        with pytest.raises(ValueError, match="tuning.pipeline_depth"):  # refused where it enters, not at the first load
            ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}],
                                        "tuning": {"pipeline_depth": 3}})
    finally:
        fs.close()
        one.close()


def _kv_cache_config():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=320)
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["l0", "l2"], swa), KVCacheGroupSpec(["l1"], full)])


def test_registration_from_kv_cache_config():
    reg = registration_from_kv_cache_config(_kv_cache_config())
    assert [s.name for s in reg.specs] == ["l0.k", "l0.v", "l2.k", "l2.v", "l1.k", "l1.v"]
    assert [s.group for s in reg.specs] == [0, 0, 0, 0, 1, 1]
    assert [s.sliding_window for s in reg.specs] == [320] * 4 + [None] * 2
    assert all(s.entry_shape == (2, 32) and s.block_size == 64 and s.dtype == torch.float32 for s in reg.specs)
    assert reg.chunk_bytes == 6 * 256 * 2 * 32 * 4


def test_cpu_views_against_vllm_reshape_and_cache():
    """Where vLLM's CPU attention writes K and V of token t (its own op, this machine's ISA): V is
    token-major in the V view; K, with the "vec" ISA, is transposed inside the block, so the K view's
    rows are block-internal rows. A chunk covers whole blocks, so restores move every K region whole."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, h, bs, d = 4, 2, 64, 32
    isa = _get_attn_isa(torch.float32, bs, d)
    cache = torch.zeros(nb, h, bs, 2 * d)
    key_cache, value_cache = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    n = 100
    key, value = torch.randn(n, h, d), torch.randn(n, h, d)
    slots = torch.tensor([(3 * bs + i) if i < bs else (1 * bs + i - bs) for i in range(n)], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    k, v = cpu_kv_views(cache, bs)
    assert k.shape == v.shape == (nb, bs, h, d) and k.stride(-1) == v.stride(-1) == 1
    for t in range(n):
        b, s = divmod(int(slots[t]), bs)
        assert torch.equal(v[b, s], value[t])
        if isa == "vec":  # K block of one head: (d, bs), element (j, s) at j*bs + s
            assert torch.equal(k[b].permute(1, 0, 2).reshape(h, d, bs)[:, :, s], key[t])
    # a block-granular copy through the views reproduces the cache exactly, whatever the K layout
    other = torch.zeros_like(cache)
    k2, v2 = cpu_kv_views(other, bs)
    k2[[3, 1]] = k[[3, 1]]
    v2[[3, 1]] = v[[3, 1]]
    assert torch.equal(other, cache)


def test_destinations_order_and_null_block():
    reg = registration_from_kv_cache_config(_kv_cache_config())
    caches = {name: torch.zeros(10, 2, 64, 64) for name in ("l0", "l1", "l2")}
    kv = destinations(reg, caches)
    assert len(kv) == 6 and kv[4].data_ptr() == caches["l1"].data_ptr()
    assert block_lists(([0, 5, 6], [7])) == [[-1, 5, 6], [7]]  # vLLM's null block is not resident


def test_metadata_pickles():
    meta = BSRConnectorMetadata([LoadSpec("r", [1, 2], 1, 0, [[3, 4]], "s")],
                                [SaveSpec("r", [1, 2], 1, [[3, 4]], "s", False, 0)])
    back = pickle.loads(pickle.dumps(meta))
    assert back.loads[0].block_ids == [[3, 4]] and back.saves[0].salt == "s"


def test_background_loads_shorten_the_switch_interval_while_the_worker_lives():
    import sys

    from bsr_harness.memory_tier import MemoryTier
    from bsr_kernels import presets
    from bsr_runtime.integrations.vllm.worker import WorkerSide

    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=16, block_size=16)
    tier = MemoryTier(reg.chunk_bytes, reg.fingerprint)
    outer = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default, whatever an earlier test in this process left
    before = sys.getswitchinterval()
    cases = [({}, 0.0005), ({"tuning": {"gil_switch_interval_s": 0.002}}, 0.002),
             ({"tuning": {"gil_switch_interval_s": None}}, before), ({"load_mode": "sync"}, before),
             ({"tuning": {"gil_switch_interval_s": 0.05}}, before)]  # never made longer
    try:
        for extra, expected in cases:
            cfg = ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}], "save": False, **extra})
            worker = WorkerSide(cfg, reg, [tier], "m", 0, 1)
            assert sys.getswitchinterval() == pytest.approx(expected), extra
            worker.close()
            assert sys.getswitchinterval() == pytest.approx(before), extra
    finally:
        sys.setswitchinterval(outer)
        tier.close()
    for bad in (0, 0.5, "fast", float("nan")):
        with pytest.raises(ValueError, match="tuning.gil_switch_interval_s"):
            ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": "/x"}],
                                        "tuning": {"gil_switch_interval_s": bad}})


def test_shutdown_is_bounded_by_shutdown_timeout_s_in_total(tmp_path):
    """Issue 35, item 6: a load whose read never lands and a put held in flight at shutdown: close() returns
    within shutdown_timeout_s in all (one deadline shared by the loader and the saver), not one timeout each."""
    import threading
    import time

    from bsr_harness.faulty_tier import FaultyTier
    from bsr_harness.testdata import block_tables
    from bsr_kernels import presets
    from bsr_runtime.integrations.vllm.worker import WorkerSide
    from bsr_runtime.tiers import FilesystemTier

    reg = presets.llama_like(layers=1, kv_heads=1, head_dim=16, block_size=16)
    tier = FaultyTier(FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint))
    cfg = ConnectorConfig.from_extra({"tiers": [{"type": "filesystem", "root": str(tmp_path)}], "window_chunks": 2,
                                      "timeouts": {"shutdown_s": 1.0}, "tuning": {"gil_switch_interval_s": None}})
    blocks, tables = block_tables(reg, [2, 2], 3, holes="none")
    worker = WorkerSide(cfg, reg, [tier], "m", 0, 1)
    kv = reg.allocate(blocks)
    worker.loader.register_kv_caches(kv)
    worker.saver.kv = kv
    read_gate, put_gate = threading.Event(), threading.Event()
    try:
        tier.plan.read_gate, tier.plan.put_gate = read_gate, put_gate
        tokens = list(range(2 * reg.chunk_tokens))
        worker.loader.submit(LoadSpec("load", tokens, 2, 0, [t.tolist() for t in tables[0]]))
        worker.saver.save("save", tokens, 0, 2, [t.tolist() for t in tables[1]], "")
        time.sleep(0.2)  # the read and the put are both held
        t0 = time.monotonic()
        worker.close()
        elapsed = time.monotonic() - t0
        assert elapsed < 1.5, f"shutdown took {elapsed:.2f} s with shutdown_timeout_s = 1"
    finally:
        read_gate.set()
        put_gate.set()
        tier.close()
