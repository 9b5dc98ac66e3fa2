"""Every configuration a user writes is checked where it enters, by one schema each, with one error
naming every bad key (bsr_runtime/config_schema.py): the tier factory's specs, the LMCache tier's
knobs (file, LMCACHE_* variables, overrides), the LMCache L2 plugins' parameters and tier specs, the
`bsr` command's registration files and options. (The vLLM connector's: test_connector_config.py.)"""

from __future__ import annotations

import json
import math
import re

import pytest

from bsr_kernels import presets
from bsr_runtime.config_schema import ConfigError, Count, Schema, parse, problems
from bsr_runtime.tiers.factory import make_tier

REG = presets.llama_like(layers=1, kv_heads=1, head_dim=16, block_size=16)
MC = {"type": "mooncake", "master_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:1/metadata"}


# -- the schema helper ---------------------------------------------------------------------------
class _Knobs(Schema):
    workers: Count = 1
    name: str = "x"


def test_parse_names_every_bad_key_on_one_line():
    with pytest.raises(ConfigError) as ei:
        parse(_Knobs, {"workers": "2", "name": 5, "colour": "red"}, "thing")
    msg = str(ei.value)
    assert msg.startswith("thing: 3 bad keys: ") and "\n" not in msg
    assert "workers: input should be a valid integer (got '2')" in msg
    assert "name:" in msg and "colour: unknown key (known: workers, name)" in msg
    assert problems(_Knobs, {"workers": 3}) == [] and parse(_Knobs, {"workers": 3}, "thing").workers == 3
    assert problems(_Knobs, ["workers"]) == ["the config: expected a mapping of keys, got list"]



def test_an_error_is_one_line_whatever_the_key():
    """Issue 35 item 8: a key containing a newline made a two-line error. Such a key is quoted."""
    with pytest.raises(ConfigError) as ei:
        parse(_Knobs, {"a\nb": 1, "c\u2028d": 2, "e:f": 3, "x" * 10_000: 4}, "thing")
    msg = str(ei.value)
    assert len(msg.splitlines()) == 1 and len(msg) < 600, msg
    assert "'a\\nb': unknown key" in msg and "'c\\u2028d': unknown key" in msg and "'e:f': unknown key" in msg


def test_a_value_is_cut_before_it_is_formatted():
    """Issue 35 item 9: the error repr()'d the whole value, then cut it: a value of shared lists (what
    YAML aliases make) costs 2**levels to format; an integer over 4300 digits cannot be formatted."""
    import tracemalloc

    nested: object = ["x"]
    for _ in range(20):
        nested = [nested, nested]  # 2**20 strings in 21 lists
    tracemalloc.start()
    try:
        bad = problems(_Knobs, {"workers": nested, "name": 10 ** 5000})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # was about 10 MB: the whole repr
    assert bad[0].startswith("workers: input should be a valid integer (got [[[[") and len(bad[0]) < 200, bad
    assert bad[1] == "name: input should be a valid string (got <an integer of 16610 bits>)", bad


# -- the tier factory --------------------------------------------------------------------------
@pytest.mark.parametrize("spec,needle", [
    ({"type": "filesystem", "root": ""}, "root:"),
    ({"type": "filesystem", "root": 5}, "root:"),
    ({"type": "filesystem", "root": "/tmp", "load_concurrency": 0}, "load_concurrency:"),
    ({"type": "filesystem", "root": "/tmp", "load_concurrency": "2"}, "load_concurrency:"),
    ({"type": "filesystem", "root": "/tmp", "load_concurrency": True}, "load_concurrency:"),
    ({"type": "filesystem", "root": "/tmp", "fsync": "no"}, "fsync:"),
    ({"type": "filesystem", "root": "/tmp", "checksum": "md5"}, "checksum:"),
    (MC | {"master_address": "nohost"}, "master_address: expected HOST:PORT"),
    (MC | {"master_address": "h:0"}, "master_address:"),
    (MC | {"master_address": "h:99999"}, "master_address:"),
    (MC | {"metadata_server": ""}, "metadata_server:"),
    (MC | {"protocol": 5}, "protocol:"),
    # issue 35 item 8: these passed and failed in the client's setup with only "returned -1"
    (MC | {"protocol": "tpc"}, "protocol: input should be 'tcp' or 'rdma' (got 'tpc')"),
    (MC | {"protocol": "TCP"}, "protocol: input should be 'tcp' or 'rdma' (got 'TCP')"),
    (MC | {"global_segment_size": 1 << 50}, "global_segment_size: more than this machine's physical memory"),
    (MC | {"local_buffer_size": 1 << 50}, "local_buffer_size: more than this machine's physical memory"),
    (MC | {"tenant_id": None}, "tenant_id:"),
    (MC | {"local_buffer_size": "16M"}, "local_buffer_size:"),
    (MC | {"tuning": {"in_place_batch_bytes": 0}}, "tuning.in_place_batch_bytes:"),
    (MC | {"tuning": {"put_batch_bytes": -1}}, "tuning.put_batch_bytes:"),
    (MC | {"tuning": {"verify_batch_bytes": 1.5}}, "tuning.verify_batch_bytes:"),
    (MC | {"fetch_workers": 2}, "fetch_workers: unknown key"),  # a tuning key belongs in "tuning"
    (MC | {"tuning": 2}, "tuning:"),
    (MC | {"replica_num": 0}, "replica_num: input should be greater than or equal to 1 (got 0)"),
    (MC | {"replica_num": True}, "replica_num: input should be a valid integer (got True)"),
])
def test_tier_spec_keys_are_checked_before_anything_opens(spec, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as ei:
        make_tier(REG, spec)  # 127.0.0.1:1 is never contacted: the spec is refused first
    assert "\n" not in str(ei.value)


def test_tier_spec_error_names_every_bad_key():
    with pytest.raises(ValueError) as ei:
        make_tier(REG, MC | {"tuning": {"fetch_workers": 0, "verify": "yes"}, "colour": 1, "rpc_timeout_s": math.inf})
    msg = str(ei.value)
    assert "4 bad keys" in msg and all(k in msg for k in ("tuning.fetch_workers", "tuning.verify", "colour",
                                                          "rpc_timeout_s"))


def test_restore_config_refuses_an_unknown_backend():
    """The restore's own config: a typo used to pass and fail every window's install."""
    from bsr_runtime.restore import RestoreConfig

    with pytest.raises(ValueError, match="backend"):
        RestoreConfig(backend="bogus")
    assert RestoreConfig(backend="torch").backend == "torch"


def test_mooncake_tier_options_are_one_schema():
    from bsr_runtime.tiers.mooncake import MooncakeTier
    from bsr_runtime.tiers.mooncake_options import MooncakeConnection, MooncakeTierOptions, MooncakeTuning
    from bsr_runtime.tiers.specs import MooncakeTierSpec

    # the spec: the connection's keys at the top, the tuning's under "tuning"; the tier's options: both, flat
    assert set(MooncakeTierSpec.model_fields) == set(MooncakeConnection.model_fields) | {
        "type", "master_address", "metadata_server", "tuning"}
    assert set(MooncakeTierOptions.model_fields) == set(MooncakeConnection.model_fields) | set(
        MooncakeTuning.model_fields)
    assert not set(MooncakeConnection.model_fields) & set(MooncakeTuning.model_fields)
    spec = MooncakeTierSpec(master_address="h:1", metadata_server="m", replica_num=2,
                            tuning=MooncakeTuning(fetch_workers=5, land_whole=False))
    o = spec.options()
    assert (o.replica_num, o.fetch_workers, o.land_whole, o.verify) == (2, 5, False, True)
    with pytest.raises(ValueError, match="fetch_workers"):  # built directly: pydantic's ValidationError
        MooncakeTierOptions(fetch_workers=0)
    with pytest.raises(ConfigError, match="^Mooncake tier options: fetch_workers: input should be greater"):
        MooncakeTier(1, "f", "h:1", "m", fetch_workers=0)  # the tier's keyword options: one line, before connecting


# -- the `bsr` command -------------------------------------------------------------------------
TENSOR = {"name": "a", "dtype": "uint8", "entry_shape": [8], "block_size": 16}


def _reg_file(tmp_path, data) -> str:
    p = tmp_path / "reg.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_registration_file_top_level_typo_is_refused(tmp_path):
    """`"chunk_token": 128` used to be ignored: the registration silently had 256-token chunks."""
    from bsr_cli.args import CliError, load_registration

    with pytest.raises(CliError, match="chunk_token: unknown key"):
        load_registration(_reg_file(tmp_path, {"chunk_token": 128, "tensors": [TENSOR]}), 1.0)
    assert load_registration(_reg_file(tmp_path, {"chunk_tokens": 128, "tensors": [TENSOR]}), 1.0).chunk_tokens == 128


def test_registration_file_error_names_every_bad_field(tmp_path):
    from bsr_cli.args import CliError, load_registration

    bad = [TENSOR | {"block_size": 16.0}, TENSOR | {"name": "b", "dtype": "uint9"}, TENSOR | {"name": "c", "group": -1}]
    with pytest.raises(CliError) as ei:
        load_registration(_reg_file(tmp_path, {"tensors": bad, "chunk_tokens": "256"}), 1.0)
    msg = str(ei.value)
    for key in ("tensors.0.block_size", "tensors.1.dtype", "tensors.2.group", "chunk_tokens"):
        assert key in msg, (key, msg)
    assert "4 bad keys" in msg and "\n" not in msg


def test_registration_file_that_is_a_fifo_or_a_link_to_one_never_blocks(tmp_path):
    import os
    import threading

    from bsr_cli.args import CliError, load_registration

    fifo = tmp_path / "reg.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "reg.json"
    link.symlink_to(fifo)
    result = []

    def load():
        try:
            load_registration(str(link), 1.0)
        except CliError as e:
            result.append(str(e))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO registration file blocked"
    assert result and ("neither" in result[0] or "cannot parse" in result[0])


@pytest.mark.parametrize("args,needle", [
    (["sweep", "--json", "/nonexistent-dir/rows.json"], "does not exist"),
    (["sweep", "--plot", "/nonexistent-dir/peak.png"], "does not exist"),
    (["sweep", "--json", "/tmp"], "is a directory"),
    (["demo", "--engine-tokens", "-5"], "must be >= 1"),
    (["demo", "--engine-window-chunks", "0"], "must be >= 1"),
    (["demo", "--engine-log", "/nonexistent-dir/e.log"], "does not exist"),
    (["bench", "--device", "gpu"], "invalid choice"),
    (["sweep", "--tier", "filesystem,tape"], "unknown tier 'tape'"),
    (["sweep", "--window-chunks", "-1"], "must be >= 0"),  # W = -1 where it enters the command
])
def test_options_are_refused_where_they_enter(args, needle, capsys):
    """Refused by the parser, before any work: `--json` into a missing directory used to fail after the run."""
    from bsr_cli import build_parser

    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_json_output_that_is_a_fifo_is_refused_not_blocked_on(tmp_path, capsys):
    import os

    from bsr_cli import build_parser
    from bsr_cli.output import write_json

    fifo = tmp_path / "rows.json"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "--json", str(fifo)])
    assert "not a regular file" in capsys.readouterr().err
    with pytest.raises(OSError):  # a FIFO put there during the run: an error (one line from the CLI), no hang
        write_json(str(fifo), [{"a": 1}])


def test_cli_tier_names_are_the_harness_tiers_and_the_registry():
    from bsr_cli.args import TIER_CHOICES
    from bsr_harness.tier_setup import TIER_NAMES, known_tier_names
    from bsr_runtime.tiers.registry import tier_type_names

    assert TIER_CHOICES == TIER_NAMES == ("filesystem", "mooncake", "lmcache-filesystem", "lmcache-mooncake")
    assert set(known_tier_names()) == set(tier_type_names()) >= set(TIER_NAMES)


def test_the_harness_opens_tiers_by_their_names_only():
    from bsr_harness.tier_setup import TierOptions, open_tier
    from bsr_kernels import presets

    reg = presets.llama_like()
    with open_tier(TierOptions(name="filesystem"), reg) as tier:
        assert type(tier).__name__ == "FilesystemTier"
    with pytest.raises(ValueError, match="unknown tier type 'fs'; choose one of filesystem, mooncake"):
        with open_tier(TierOptions(name="fs"), reg):
            pass
    with pytest.raises(ValueError, match="unknown tier type 'filesytem'; choose one of filesystem, mooncake"):
        with open_tier(TierOptions(name="filesytem"), reg):
            pass


def test_cli_backend_choices_are_the_backend_registry():
    from bsr_cli.args import BACKEND_CHOICES
    from bsr_kernels.backends import backend_names

    assert BACKEND_CHOICES == ("auto", *backend_names()) == ("auto", "torch", "triton", "cuda", "cpu")


def test_the_restore_phases_are_spelled_once():
    """Every record and label of a restore's phases comes from restore.RESTORE_PHASES (the CLI's copy, kept for a
    fast --help, equal to it): the loop's timed phases, a restore's and a sweep row's fields, a load's timings."""
    import dataclasses

    from bsr_cli.output import PHASES
    from bsr_harness.experiments import SweepRow
    from bsr_runtime.integrations.vllm.metrics import LOAD_PHASES
    from bsr_runtime.restore import RESTORE_PHASES, RestoreReport
    from bsr_runtime.window_loop import LoopStats

    assert PHASES == RESTORE_PHASES == ("prepare", "admit", "submit", "fetch", "install", "sync")
    fields = [f"{p}_s" for p in RESTORE_PHASES]
    assert set(fields[1:]) <= {f.name for f in dataclasses.fields(LoopStats)}
    for record in (RestoreReport, SweepRow):
        assert set(fields) <= {f.name for f in dataclasses.fields(record)}, record
    assert [k for k in LOAD_PHASES if k in fields] == fields
