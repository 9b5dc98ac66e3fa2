"""The LMCache integration's configurations are checked where they enter, one schema each: the
LMCache tier's knobs from the config file, LMCACHE_* variables and overrides (LMCache's own loader logs a
bad value and falls back, and ignores unknown keys: LMCACHE_PROBE_ONLY=ture silently meant False,
LMCACHE_INSTALL_BACKEND=bogus and a misspelt file key were accepted), the L2 plugins' parameters
(an unknown FS plugin key was ignored) and the LMCache tier specs."""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")

from bsr_kernels import presets  # noqa: E402
from bsr_runtime.integrations.lmcache import (  # noqa: E402
    BSRLMCacheConfig,
    fs_l2_config,
    load_adapter_config,
    mooncake_l2_config,
)

REG = presets.llama_like(layers=1, kv_heads=1, head_dim=16, block_size=16)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("PREFETCH_WINDOW_CHUNKS", "PROBE_ONLY", "FS_LOAD_CONCURRENCY", "PREFETCH_TIMEOUT_S",
                 "INSTALL_BACKEND", "EVICT_RETAINED", "BSR_CONFIG_FILE"):
        monkeypatch.delenv(f"LMCACHE_{name}", raising=False)


@pytest.mark.parametrize("var,value", [
    ("PROBE_ONLY", "ture"), ("EVICT_RETAINED", "maybe"), ("INSTALL_BACKEND", "bogus"),
    ("PREFETCH_WINDOW_CHUNKS", "8.5"), ("PREFETCH_WINDOW_CHUNKS", "-1"), ("PREFETCH_WINDOW_CHUNKS", "99999999"),
    ("PREFETCH_TIMEOUT_S", "inf"), ("PREFETCH_TIMEOUT_S", "0"), ("FS_LOAD_CONCURRENCY", "0"),
    ("FS_LOAD_CONCURRENCY", "two"),
])
def test_bad_environment_values_are_errors_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(f"LMCACHE_{var}", value)
    with pytest.raises(ValueError, match=f"{var.lower()} \\(from \\$LMCACHE_{var}\\)"):
        load_adapter_config()
    with pytest.raises(ValueError, match=var.lower()):
        BSRLMCacheConfig.from_env()


def test_good_environment_values(monkeypatch):
    for var, value in (("FS_LOAD_CONCURRENCY", " 7 "), ("PREFETCH_TIMEOUT_S", "2.5"), ("EVICT_RETAINED", "0")):
        monkeypatch.setenv(f"LMCACHE_{var}", value)
    c = load_adapter_config()
    assert (c.fs_load_concurrency, c.prefetch_timeout_s, c.evict_retained) == (7, 2.5, False)
    c.validate()


@pytest.mark.parametrize("knob,where", [("prefetch_window_chunks", "window_chunks"), ("probe_only", "probe"),
                                        ("install_backend", "backend")])
def test_knobs_of_the_retired_adapter_road_are_refused_with_where_to_set_them(monkeypatch, tmp_path, knob, where):
    """W, the backend and the probe are the restore's (as for every tier): a value the LMCacheAdapter road
    read is refused from every source, never ignored, naming where it goes now."""
    value = {"prefetch_window_chunks": "8", "probe_only": "true", "install_backend": "torch"}[knob]
    monkeypatch.setenv(f"LMCACHE_{knob.upper()}", value)
    with pytest.raises(ValueError, match=f"{knob} \\(from \\$LMCACHE_{knob.upper()}\\): no longer an LMCache knob"
                                         f" \\(.*{where}"):
        load_adapter_config()
    monkeypatch.delenv(f"LMCACHE_{knob.upper()}")
    f = tmp_path / "bsr.yaml"
    f.write_text(f"{knob}: {value}\n")
    with pytest.raises(ValueError, match=f"{knob} \\(from file {re.escape(str(f))}\\): no longer an LMCache knob"):
        load_adapter_config(str(f))
    with pytest.raises(ValueError, match=f"{knob} \\(from overrides\\): no longer an LMCache knob"):
        load_adapter_config(**{knob: value})


def test_config_file_typo_and_bad_values_are_one_error(tmp_path, monkeypatch):
    f = tmp_path / "bsr.yaml"
    f.write_text("prefech_window_chunks: 4\nprobe_only: 'yes'\nprefetch_timeout_s: -3\n")
    monkeypatch.setenv("LMCACHE_INSTALL_BACKEND", "bogus")
    with pytest.raises(ValueError) as ei:
        load_adapter_config(str(f))
    msg = str(ei.value)
    assert "4 bad keys" in msg and "\n" not in msg, msg
    for part in ("prefech_window_chunks (from file", "probe_only (from file", "prefetch_timeout_s (from file",
                 "install_backend (from $LMCACHE_INSTALL_BACKEND)"):
        assert part in msg, (part, msg)
    f.write_text("prefetch_timeout_s: 4\nevict_retained: false\n")
    monkeypatch.setenv("LMCACHE_BSR_CONFIG_FILE", str(f))
    monkeypatch.delenv("LMCACHE_INSTALL_BACKEND")
    c = load_adapter_config()
    assert (c.prefetch_timeout_s, c.evict_retained) == (4, False)
    f.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_adapter_config()


def test_config_file_aliases_are_bounded(tmp_path):
    """Issue 35 item 9, the LMCache config file: 24 nested aliases (600 bytes) cost seconds and
    hundreds of MB to refuse, the error formatting the whole value; refused at once now, in one line."""
    lines = ['l0: &l0 ["xxxxxxxx", "xxxxxxxx"]']
    lines += [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, 24)]
    f = tmp_path / "bsr.yaml"
    f.write_text("\n".join(lines) + "\nfs_load_concurrency: *l23\n")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="aliases expand it to more than") as ei:
        load_adapter_config(str(f))
    assert time.monotonic() - t0 < 2.0 and "\n" not in str(ei.value)
    f.write_text("a: [1, b\nc: {")
    with pytest.raises(ValueError, match=re.escape("bsr.yaml: expected ',' or ']', but got ':' (line 2, column 2)")):
        load_adapter_config(str(f))


@pytest.mark.parametrize("overrides,needle", [
    ({"prefetch_window_chunks": -1}, "prefetch_window_chunks (from overrides)"),  # W = -1 where it enters
    ({"prefetch_window_chunks": "8"}, "prefetch_window_chunks"),
    ({"prefetch_windows": 8}, "prefetch_windows (from overrides): unknown key"),
    ({"probe_only": 1}, "probe_only"),
    ({"install_backend": "gpu"}, "install_backend"),
    ({"prefetch_timeout_s": -1}, "prefetch_timeout_s (from overrides)"),
    ({"evict_retained": "no"}, "evict_retained (from overrides)"),
])
def test_bad_overrides_are_errors(overrides, needle):
    with pytest.raises(ValueError) as ei:
        load_adapter_config(**overrides)
    assert needle in str(ei.value)


def test_a_mutated_config_is_refused_by_validate():
    c = load_adapter_config()
    c.prefetch_timeout_s = -1
    with pytest.raises(ValueError, match="prefetch_timeout_s"):
        c.validate()


@pytest.mark.parametrize("kw,needle", [
    ({"load_concurency": 2}, "load_concurency: unknown key"),
    ({"load_concurrency": 0}, "load_concurrency"),
    ({"load_concurrency": "4"}, "load_concurrency"),
    ({"read_ahead_size": -1}, "read_ahead_size"),
    ({"use_odirect": "no"}, "use_odirect"),
])
def test_fs_plugin_parameters(tmp_path, kw, needle):
    with pytest.raises(ValueError, match=needle):
        fs_l2_config(str(tmp_path), **kw)
    from bsr_runtime.integrations.lmcache.fs_l2 import ConcurrentFSL2AdapterConfig

    with pytest.raises(ValueError, match=needle):  # as LMCache's plugin loader builds it from a JSON config
        ConcurrentFSL2AdapterConfig.from_dict({"base_path": str(tmp_path), **kw})


@pytest.mark.parametrize("kw,needle", [
    ({"num_workers": "2"}, "num_workers"), ({"num_workers": 0}, "num_workers"),
    ({"register_l1": "ture"}, "register_l1"), ({"verify_batch_bytes": -1}, "verify_batch_bytes"),
    ({"key_prefix": "a@b"}, "key_prefix"), ({"protocoll": "tcp"}, "protocoll: unknown key"),
    ({"connect_timeout_s": float("nan")}, "connect_timeout_s"),
])
def test_mooncake_plugin_parameters(kw, needle):
    with pytest.raises(ValueError, match=needle):
        mooncake_l2_config("127.0.0.1:1", "http://127.0.0.1:1/metadata", **kw)
    from bsr_runtime.integrations.lmcache.mooncake_l2 import BSRMooncakeL2AdapterConfig

    with pytest.raises(ValueError, match=needle):
        BSRMooncakeL2AdapterConfig.from_dict({"master_address": "127.0.0.1:1",
                                              "metadata_server": "http://127.0.0.1:1/metadata", **kw})


def test_lmcache_tier_spec_is_checked_before_anything_opens(tmp_path):
    from bsr_runtime.integrations.lmcache.tier import open_lmcache_tier

    root = tmp_path / "l2"
    with pytest.raises(ValueError) as ei:
        with open_lmcache_tier(REG, "lmcache-filesystem", {"root": str(root), "load_concurency": 2, "l1_bytes": "256"}):
            pass
    assert "load_concurency: unknown key" in str(ei.value) and "l1_bytes" in str(ei.value)
    assert not root.exists()  # nothing was created
    options = {"root": str(root), "load_concurrency": 2, "l1_bytes": 8 << 20}
    with open_lmcache_tier(REG, "lmcache-filesystem", options) as t:
        assert t.sm.l2_adapters()[0][1].load_concurrency == 2


def test_the_lmcache_filesystem_tier_opens_and_other_names_are_refused(tmp_path):
    from bsr_runtime.integrations.lmcache.tier import open_lmcache_tier

    options = {"root": str(tmp_path / "l2"), "l1_bytes": 8 << 20}
    with open_lmcache_tier(REG, "lmcache-filesystem", options) as t:
        assert type(t.sm.l2_adapters()[0][1]).__name__ == "ConcurrentFSL2Adapter"
    with pytest.raises(ValueError, match="'lmcache-fs' is not an LMCache tier"):  # an earlier, unreleased name
        with open_lmcache_tier(REG, "lmcache-fs", options):
            pass
    with pytest.raises(ValueError, match="'lmcache-filesytem' is not an LMCache tier "
                                         r"\(lmcache-filesystem \| lmcache-mooncake\)"):
        with open_lmcache_tier(REG, "lmcache-filesytem", options):
            pass
