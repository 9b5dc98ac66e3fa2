"""Results with provenance (bsr_harness.records): the commit, the command line, the record file, and
that every benchmark script and `bsr --record` append through it."""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bsr_cli import main
from bsr_harness import records
from bsr_kernels import presets

ROOT = Path(__file__).resolve().parents[2]
C = presets.dsv4_flash(scale=1 / 64).chunk_bytes


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository with a tracked code file, a tracked result and a tracked doc."""
    root = tmp_path / "repo"
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "code.py").write_text("x = 1\n")
    (root / "benchmarks" / "results" / "b.jsonl").write_text("")
    (root / "docs" / "page.md").write_text("page\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def test_commit_is_head_and_dirty_only_for_code(repo, monkeypatch):
    monkeypatch.delenv("BSR_COMMIT", raising=False)
    head = _git(repo, "rev-parse", "HEAD")
    assert len(head) == 40
    assert records.source_commit(repo) == head
    (repo / "untracked.py").write_text("y = 2\n")  # untracked files do not count
    (repo / "benchmarks" / "results" / "b.jsonl").write_text("{}\n")  # nor the results
    (repo / "docs" / "page.md").write_text("changed\n")  # nor the pages generated from them
    assert records.source_commit(repo) == head
    (repo / "code.py").write_text("x = 2\n")
    assert records.source_commit(repo) == head + "-dirty"


def test_commit_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("BSR_COMMIT", raising=False)
    assert records.source_commit(tmp_path) == "unknown"
    monkeypatch.setenv("BSR_COMMIT", "0123abc")
    assert records.source_commit(tmp_path) == "0123abc"


def test_command_line_is_quoted_with_the_settings_environment():
    env = {"BSR_CPU_SPREAD": "0", "HOME": "/root", "LMCACHE_LOG_LEVEL": "WARNING", "BSR_DEBUG": "1",
           "TRITON_CACHE_AUTOTUNING": "1", "LMCACHE_FS_LOAD_CONCURRENCY": "4"}
    got = records.command_line(["bsr"], ["sweep", "--tokens", "1024,2048", "--root", "/tmp/a b"], env)
    assert got == "BSR_CPU_SPREAD=0 LMCACHE_FS_LOAD_CONCURRENCY=4 bsr sweep --tokens 1024,2048 --root '/tmp/a b'"
    script = records.script_command([str(ROOT / "benchmarks" / "pool_spread.py"), "--reps", "3"])
    assert script.endswith("python benchmarks/pool_spread.py --reps 3")


def test_record_round_trip(tmp_path):
    path = records.record("demo_bench", {"rows": [{"s": 0.5, "ratio": float("nan")}], "n": 3},
                          command="python x.py", results_dir=tmp_path, settings={"scale": (1, 64)}, notes="n")
    records.record("demo_bench", {"n": 4}, command="python x.py --n 4", results_dir=tmp_path)
    assert path == tmp_path / "demo_bench.jsonl"
    first, second = records.load_records(path)
    assert set(records.REQUIRED) <= set(first) and first["notes"] == "n"
    assert first["figures"] == {"rows": [{"s": 0.5, "ratio": None}], "n": 3}  # NaN is not JSON
    assert first["settings"] == {"scale": [1, 64]}
    assert dt.datetime.fromisoformat(first["date"]).utcoffset() == dt.timedelta(0)
    assert {"cpu", "cores", "memory_gib", "gpu", "python", "torch"} <= set(first["machine"])
    assert first["machine"]["cores"] >= 1 and first["machine"]["torch"]
    assert second["command"] == "python x.py --n 4" and second["settings"] == {}
    assert records.record("demo_bench", {"n": 5}, command="c", results_dir=None) is None
    assert len(path.read_text().splitlines()) == 2


def test_bad_records_are_refused(tmp_path):
    with pytest.raises(ValueError, match="benchmark name"):
        records.make_record("../x", {"n": 1}, command="c")
    with pytest.raises(ValueError, match="figures"):
        records.make_record("x", {}, command="c")
    good = records.make_record("x", {"n": 1}, command="c")
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "commit"}) + "\n")
    with pytest.raises(ValueError, match=r"x\.jsonl:2: record without commit"):
        records.load_records(bad)
    other = tmp_path / "y.jsonl"
    other.write_text(json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="another benchmark's file"):
        records.load_records(other)


def test_latest_is_per_settings_in_order_of_the_newest_run():
    recs = [{"settings": {"tier": "fs"}, "n": 1}, {"settings": {"tier": "mooncake"}, "n": 2},
            {"settings": {"tier": "fs"}, "n": 3}]
    assert [r["n"] for r in records.latest(recs)] == [2, 3]


def test_latest_keeps_each_kind_of_machine():
    """An Intel (AVX-512) run of a configuration does not hide the AMD (AVX2) one: goals must hold on both."""
    amd, intel = {"cpu": "AMD EPYC"}, {"cpu": "Intel(R) Xeon(R) Processor", "isa": "AVX-512"}
    recs = [{"settings": {"tier": "fs"}, "machine": amd, "n": 1},
            {"settings": {"tier": "fs"}, "machine": intel, "n": 2},
            {"settings": {"tier": "fs"}, "machine": amd, "n": 3},
            {"settings": {"tier": "fs"}, "machine": {"cpu": "Intel(R) Xeon(R) Processor"}, "n": 4}]  # before `isa`
    assert [r["n"] for r in records.latest(recs)] == [3, 4]


@pytest.mark.parametrize(("flags", "isa"), [("fpu sse2 avx avx2 avx512f avx512bw", "AVX-512"),
                                            ("fpu sse2 avx avx2 fma", "AVX2"), ("fpu sse2", "x86-64")])
def test_cpu_isa_is_the_widest_vector_isa_the_flags_name(flags, isa):
    cpuinfo = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    assert records.cpu_isa(cpuinfo) == isa
    assert records.cpu_isa("") not in {"AVX-512", "AVX2"}  # no flags line (not x86): the machine's name


def test_the_machine_line_names_the_isa_when_recorded():
    from bsr_harness.report_format import machine_summary

    m = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "memory_gib": 23.5, "python": "3.11.7", "torch": "2.13.0"}
    assert machine_summary(m).startswith("Intel(R) Xeon(R) Processor, 2 cores")
    assert machine_summary(m | {"isa": "AVX-512"}).startswith("Intel(R) Xeon(R) Processor (AVX-512), 2 cores")


def test_bsr_record_option(tmp_path, capsys, monkeypatch):
    for name in [k for k in os.environ if k.startswith(records.ENV_PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BSR_CPU_SPREAD", "1")  # the default: named in the command, changes nothing here
    rc = main(["wlaw", "--tokens", "1024", "--windows", "1,2", "--quiet", "--record", str(tmp_path),
               "--json", str(tmp_path / "rows.json")])
    assert rc == 0
    (rec,) = records.load_records(tmp_path / "bsr_wlaw.jsonl")
    assert rec["command"] == (f"BSR_CPU_SPREAD=1 bsr wlaw --tokens 1024 --windows 1,2 --quiet --record {tmp_path} "
                              f"--json {tmp_path / 'rows.json'}")
    assert rec["settings"]["tokens"] == 1024 and rec["settings"]["windows"] == [1, 2]
    assert not {"record", "json", "quiet", "func", "argv", "environ"} & set(rec["settings"])
    assert [r["peak_staging_bytes"] for r in rec["figures"]["rows"]] == [C, 2 * C]
    assert main(["wlaw", "--tokens", "1024", "--windows", "1", "--quiet"]) == 0  # no --record: no record
    assert len(records.load_records(tmp_path / "bsr_wlaw.jsonl")) == 1
    with pytest.raises(SystemExit) as stop:  # refused before anything runs
        main(["wlaw", "--record", str(tmp_path / "missing")])
    assert stop.value.code == 2
    assert "--record needs an existing directory" in capsys.readouterr().err


def test_a_benchmark_script_appends_its_record(tmp_path):
    subprocess.run([sys.executable, "benchmarks/thread_handoff.py", "--trips", "20", "--reps", "1",
                    "--record", str(tmp_path)], cwd=ROOT, check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    (rec,) = records.load_records(tmp_path / "thread_handoff.jsonl")
    assert rec["command"] == f"python benchmarks/thread_handoff.py --trips 20 --reps 1 --record {tmp_path}"
    assert rec["settings"] == {"trips": 20, "reps": 1, "chunks": 2047, "window": 32}
    assert {r["hand_off"] for r in rec["figures"]["rows"]} == {"eventfd + poll", "threading.Event", "thread-pool job"}


def test_every_benchmark_script_records():
    """Each runnable script in benchmarks/ takes --record (add_record_options) and appends its figures
    (record_script), so no benchmark's results live outside benchmarks/results/*.jsonl."""
    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        runnable = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
        if runnable and not {"add_record_options", "record_script"} <= calls:
            missing.append(path.name)
    assert not missing, f"benchmark scripts that do not append a record: {missing}"


def _sweep_record(command: str, caps: list[int]) -> dict:
    """A `bsr sweep --baseline` record of two lengths (4 and 8 chunks of 100 B): W = 0's staging capacity per row."""
    rows = []
    for n, cap in zip((4, 8), caps):
        for w in (2, 0):
            rows.append({"tier": "filesystem", "tokens": n * 256, "chunks": n, "window_chunks": w, "pipeline_depth": 2,
                         "windows": 1, "chunk_bytes": 100, "staging_capacity_bytes": cap if w == 0 else 200,
                         "peak_staging_bytes": 100, "bytes_moved": n * 100, "seconds": 0.5 if w else 0.25,
                         "gbps": 1.0, "state_hash_ok": True})
    return {"command": command, "commit": "0" * 40, "date": "2026-12-03T00:00:00+00:00",
            "machine": {"cpu": "x", "cores": 2, "memory_gib": 1, "gpu": None}, "figures": {"rows": rows},
            "settings": {"tier": "filesystem", "baseline": True, "command": command}}


def test_the_sweep_section_shows_only_the_whole_plan_at_its_best():
    """A record whose whole plan got a fresh pool per length (capacity N*c each) is not shown as a ratio, in the
    docs nor in the README's headline; one whose whole plan was sized once for the longest prefix is."""
    from bsr_harness.report import render_section
    from bsr_harness.report_headlines import HEADLINES
    from bsr_harness.report_sections import _SECTIONS

    fair, handicapped = _sweep_record("bsr sweep fair", [800, 800]), _sweep_record("bsr sweep old", [400, 800])
    (section,) = [s for s in _SECTIONS if s.benchmark == "bsr_sweep"]
    text = "\n".join(render_section(section, [handicapped, fair]))
    # BSR s, whole s, 0.5 / 0.25, no tier floor in this record
    assert "\n`bsr sweep fair`\n" in text and "| 0.500 | 0.250 | 2 | - | yes |" in text
    assert "\n`bsr sweep old`\n" not in text and "Left out (1, not this section's measure): `bsr sweep old`" in text
    (headline,) = [h for h in HEADLINES
                   if h.benchmark == "bsr_sweep" and "filesystem" in h.result and "scale 1/64" in h.result]
    assert headline.matches(fair) and not headline.matches(handicapped)


def test_the_sweep_section_shows_the_tiers_own_floor_against_the_whole_plans():
    """A record with the tier's own reads (tier_floor_s, bsr_harness/tier_floor.py) shows their W / whole ratio
    beside BSR's: 0.3 / 0.2 = 1.5 here, not BSR's 0.5 / 0.25 = 2."""
    from bsr_harness.report import render_section
    from bsr_harness.report_sections import _SECTIONS

    rec = _sweep_record("bsr sweep floor", [800, 800])
    for r in rec["figures"]["rows"]:
        r["tier_floor_s"] = 0.3 if r["window_chunks"] else 0.2
    (section,) = [s for s in _SECTIONS if s.benchmark == "bsr_sweep"]
    text = "\n".join(render_section(section, [rec]))
    assert "| 0.500 | 0.250 | 2 | 1.5 | yes |" in text
