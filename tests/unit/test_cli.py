"""The `bsr` command at tiny sizes: JSON fields, exit codes, bad arguments, unreachable store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from readonly_util import read_only_dir

from bsr_cli import main
from bsr_harness.mooncake_launcher import free_port
from bsr_kernels import presets

SWEEP_FIELDS = {"tokens", "chunks", "window_chunks", "windows", "chunk_bytes", "peak_staging_bytes", "bytes_moved",
                "seconds", "committed_tokens", "state_hash_ok", "tier"}
C = presets.dsv4_flash(scale=1 / 64).chunk_bytes


def run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_sweep_json_rows_and_bound(tmp_path, capsys):
    js, png = tmp_path / "rows.json", tmp_path / "peak.png"
    rc, out, _ = run(["sweep", "--tokens", "1024,3072", "--window-chunks", "2", "--baseline", "--quiet",
                      "--json", str(js), "--plot", str(png)], capsys)
    assert rc == 0
    rows = json.loads(js.read_text())
    assert len(rows) == 4 and all(SWEEP_FIELDS <= set(r) for r in rows)
    for r in rows:
        assert r["state_hash_ok"] and r["committed_tokens"] == r["tokens"] and r["chunk_bytes"] == C
        w, n = r["window_chunks"], r["chunks"]
        assert r["peak_staging_bytes"] == (min(w, n) if w else n) * C
        assert r["pipeline_depth"] == 2  # the filesystem tier's preferred depth (no --depth given)
    assert png.stat().st_size > 1000
    assert "state hash ok" in out


@pytest.mark.parametrize("command", ["sweep", "ladder", "faults", "demo"])
def test_w_is_window_chunks(command, capsys):
    from bsr_cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command, "--window-chunks", "3"]).window == 3
    if command == "demo":
        assert parser.parse_args([command, "--engine-window-chunks", "2"]).engine_window == 2
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--window-chunks", "-1"])
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_tier_names_parse_as_given():
    from bsr_cli import build_parser

    args = build_parser().parse_args(["sweep", "--tier", "lmcache-filesystem,mooncake,filesystem"])
    assert args.tier == "lmcache-filesystem,mooncake,filesystem"
    assert build_parser().parse_args(["sweep"]).tier == "filesystem"


@pytest.mark.parametrize("typo", ["filesytem", "lmcache-filesytem", "fs,lmcache", "fs", "lmcache-fs"])
def test_a_tier_name_typo_is_refused_in_one_line(typo, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["sweep", "--tier", typo, "--quiet"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown tier" in err and "choose from filesystem, mooncake, lmcache-filesystem, lmcache-mooncake" in err


def test_sweep_depth_given_overrides_the_tiers(tmp_path, capsys):
    js = tmp_path / "rows.json"
    rc, _, _ = run(["sweep", "--tokens", "2048", "--window-chunks", "4", "--depth", "1", "--quiet", "--json", str(js)],
                   capsys)
    assert rc == 0
    (row,) = json.loads(js.read_text())
    assert row["pipeline_depth"] == 1 and row["windows"] == 2 and row["state_hash_ok"]


def test_wlaw_peak_is_w_times_c(tmp_path, capsys):
    js = tmp_path / "w.json"
    rc, out, _ = run(["wlaw", "--tokens", "4096", "--windows", "1,2,4", "--quiet", "--json", str(js)], capsys)
    assert rc == 0
    rows = json.loads(js.read_text())
    assert [r["peak_staging_bytes"] for r in rows] == [1 * C, 2 * C, 4 * C]


def test_ladder_rows(tmp_path, capsys):
    js = tmp_path / "l.json"
    rc, _, _ = run(["ladder", "--tokens", "1024,4096", "--window-chunks", "2", "--quiet", "--json", str(js),
                    "--first-rung", str(C)], capsys)
    assert rc == 0
    rows = json.loads(js.read_text())
    for r in rows:
        assert {"tokens", "chunk_bytes", "first_passing_rung_bytes", "bsr_capacity_bytes", "bsr_pass"} <= set(r)
        n = r["tokens"] // 256
        # doubling rungs from c: the first passing rung is the first power-of-two multiple of c >= N*c
        assert r["first_passing_rung_bytes"] >= n * C > r["first_passing_rung_bytes"] // 2
        assert r["bsr_pass"] and r["bsr_capacity_bytes"] == 2 * C


def test_bench_rows(tmp_path, capsys):
    js = tmp_path / "b.json"
    rc, _, _ = run(["bench", "--windows", "1,2", "--rounds", "1", "--json", str(js)], capsys)
    assert rc == 0
    rows = json.loads(js.read_text())
    assert {r["backend"] for r in rows} >= {"torch"} and all(r["gbps"] > 0 for r in rows)


def test_registration_file(tmp_path, capsys):
    spec = {"chunk_tokens": 256, "tensors": [
        {"name": "k", "dtype": "bfloat16", "entry_shape": [2, 8], "block_size": 16},
        {"name": "v", "dtype": "bfloat16", "entry_shape": [2, 8], "block_size": 16},
        {"name": "idx", "dtype": "uint8", "entry_shape": [20], "block_size": 16, "token_ratio": 4, "group": 1},
    ]}
    f = tmp_path / "model.json"
    f.write_text(json.dumps(spec))
    js = tmp_path / "r.json"
    rc, out, _ = run(["sweep", "--registration", str(f), "--tokens", "2048", "--window-chunks", "3", "--quiet",
                      "--json", str(js)], capsys)
    assert rc == 0 and "3 tensors, 2 groups" in out
    assert json.loads(js.read_text())[0]["state_hash_ok"]
    y = tmp_path / "model.yaml"
    y.write_text("tensors:\n  - {name: k, dtype: float16, entry_shape: [4], block_size: 8}\n")
    rc, out, _ = run(["wlaw", "--registration", str(y), "--tokens", "1024", "--windows", "2", "--quiet"], capsys)
    assert rc == 0 and "1 tensors" in out


@pytest.mark.parametrize("args,needle", [
    (["sweep", "--window-chunks", "-1"], "must be >= 0"),
    (["sweep", "--tokens", "abc"], "comma-separated"),
    (["sweep", "--scale", "3"], "(0, 1]"),
    (["sweep", "--tier", "tape", "--tokens", "256"], "unknown tier"),
    (["sweep", "--registration", "missing.json", "--tokens", "256"], "neither one of"),
    (["sweep", "--root", "/nonexistent/bsr", "--tokens", "256", "--quiet"], "does not exist"),
    (["wlaw", "--windows", "0", "--tokens", "256"], "positive window"),
])
def test_bad_arguments_are_one_line_errors(args, needle, capsys):
    try:
        rc = main(args)
    except SystemExit as e:  # argparse rejects it
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err



@pytest.mark.parametrize("option", ["--json", "--record", "--plot"])
def test_output_into_a_read_only_directory_is_refused_before_the_run(option, tmp_path, capsys):
    """Issue 35 item 9: --json and --record into a read-only directory ran the whole sweep, then failed
    and lost its rows. Refused where the option enters now, before anything runs."""
    with read_only_dir(tmp_path / "ro") as ro:
        target = str(ro if option == "--record" else ro / "out")
        t0 = time.monotonic()
        try:
            rc = main(["sweep", "--tokens", "1024", "--window-chunks", "2", "--quiet", option, target])
        except SystemExit as e:  # refused by the parser
            rc = e.code
        out, err = capsys.readouterr()
        assert rc == 2 and "read-only" in err and len(err.strip().splitlines()) == 1, err
        assert "state hash ok" not in out and time.monotonic() - t0 < 5, out  # no sweep ran
        assert os.listdir(ro) == []


def test_unreachable_store_is_one_line_and_bounded(capsys):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "bsr_cli", "sweep", "--tier", "mooncake",
                           "--mooncake-master", f"127.0.0.1:{port}", "--tokens", "512", "--quiet"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "does not answer" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.mooncake
def test_sweep_on_mooncake_starts_and_stops_its_master(tmp_path, capsys):
    psutil = pytest.importorskip("psutil")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    js = tmp_path / "m.json"
    rc, _, _ = run(["sweep", "--tier", "mooncake", "--tokens", "1024", "--window-chunks", "2", "--baseline", "--quiet",
                    "--json", str(js)], capsys)
    assert rc == 0
    rows = json.loads(js.read_text())
    assert {r["tier"] for r in rows} == {"mooncake"} and all(r["state_hash_ok"] for r in rows)
    assert {r["pipeline_depth"] for r in rows} == {1}  # Mooncake over tcp prefers depth 1 for windows below 32 MiB
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_help_explains_each_subcommand():
    for cmd in ("demo", "sweep", "wlaw", "ladder", "faults", "bench"):
        proc = subprocess.run([sys.executable, "-m", "bsr_cli", cmd, "--help"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and "--json" in proc.stdout and "--quiet" in proc.stdout


@pytest.mark.mooncake
def test_faults_rows(tmp_path, capsys):
    js = tmp_path / "f.json"
    rc, out, _ = run(["faults", "--tokens", "1024", "--window-chunks", "2", "--quiet", "--json", str(js),
                      "--scenarios", "healthy,corrupt_object,remote_fails_ssd_serves"], capsys)
    assert rc == 0
    rows = {r["scenario"]: r for r in json.loads(js.read_text())}
    fields = {"scenario", "outcome", "tokens", "exposed_tokens", "invalid_blocks", "total_blocks", "marker_set",
              "marker_cleared", "staging_leaked_bytes", "served_by", "state_hash_ok"}
    assert all(fields <= set(r) for r in rows.values())
    bad = rows["corrupt_object"]
    assert bad["outcome"] == "failed_closed" and bad["exposed_tokens"] == 0
    assert bad["invalid_blocks"] == bad["total_blocks"] > 0 and bad["marker_set"] and bad["marker_cleared"]
    assert rows["healthy"]["outcome"] == "committed" and rows["healthy"]["exposed_tokens"] == 1024
    assert rows["remote_fails_ssd_serves"]["served_by"] == "filesystem"
    assert all(r["staging_leaked_bytes"] == 0 for r in rows.values())


def test_faults_unknown_scenario(capsys):
    rc, _, err = run(["faults", "--scenarios", "nope", "--quiet"], capsys)
    assert rc == 2 and "unknown scenarios" in err


@pytest.mark.parametrize("tier", [pytest.param("lmcache-filesystem", marks=pytest.mark.lmcache),
                                  pytest.param("lmcache-mooncake", marks=[pytest.mark.lmcache, pytest.mark.mooncake])])
def test_sweep_through_lmcache(tier, tmp_path, capsys):
    if tier == "lmcache-mooncake":
        pytest.importorskip("mooncake.store")
    js = tmp_path / "lm.json"
    rc, _, _ = run(["sweep", "--tier", tier, "--tokens", "2048", "--window-chunks", "2", "--baseline", "--quiet",
                    "--json", str(js)], capsys)
    assert rc == 0
    rows = json.loads(js.read_text())
    assert {r["tier"] for r in rows} == {tier} and all(r["state_hash_ok"] for r in rows)
    bsr, whole = sorted(rows, key=lambda r: -r["window_chunks"])
    assert bsr["peak_staging_bytes"] < whole["peak_staging_bytes"]  # LMCache L1: ~2 objects vs 8


@pytest.mark.mooncake
def test_mooncake_native_log_lines_go_to_the_native_log(tmp_path):
    """The Mooncake client's glog lines (written to fd 2 by C++) land in $BSR_NATIVE_LOG, not on
    the terminal: stdout is the table, stderr is empty."""
    log = tmp_path / "native.log"
    env = {**os.environ, "BSR_NATIVE_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-m", "bsr_cli", "sweep", "--tier", "mooncake", "--tokens", "512",
                           "--window-chunks", "1", "--quiet"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "mooncake" in proc.stdout and proc.stderr.strip() == "", proc.stderr[-2000:]
    assert "client" in log.read_text().lower()  # what used to reach the terminal


def test_a_tier_type_registered_in_one_place_is_a_cli_tier(tmp_path, capsys):
    """tests/toy_tier.py registers a tier type once (registry.register_tier_type): `bsr --tier` then knows it,
    and the harness opens it from its spec (`--tier-option`), as the connector does; stores and restores go
    through it with the state hash checked. Unregistered, the name is an unknown tier again."""
    import toy_tier

    js = tmp_path / "rows.json"
    with toy_tier.registered():
        rc, _, err = run(["sweep", "--tier", "toy", "--tier-option", "store=cli", "--tokens", "1024",
                          "--window-chunks", "2", "--registration", "llama-like", "--quiet", "--json", str(js)], capsys)
        assert rc == 0, err
        (row,) = json.loads(js.read_text())
        assert row["tier"] == "toy" and row["state_hash_ok"] and row["peak_staging_bytes"] > 0
        assert toy_tier.STORES["cli"]  # the objects went to the store the option named
        rc, _, err = run(["sweep", "--tier", "toy", "--tokens", "1024", "--quiet"], capsys)
        assert rc == 2 and "store" in err and len(err.strip().splitlines()) == 1  # its schema checked the spec
        rc, _, err = run(["sweep", "--tier", "filesystem", "--tier-option", "store=cli", "--tokens", "1024",
                          "--quiet"], capsys)
        assert rc == 2 and "registered tier types" in err
    with pytest.raises(SystemExit):
        main(["sweep", "--tier", "toy", "--quiet"])
    assert "unknown tier 'toy'" in capsys.readouterr().err
