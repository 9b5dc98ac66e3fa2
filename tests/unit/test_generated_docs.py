"""The generated pages (docs/performance.md, the README's results table) against the records in
benchmarks/results, the records' provenance, and the links of the README and docs/."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bsr_harness import records, report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_generated_pages_are_up_to_date_with_the_records():
    stale = report.stale_pages()
    assert not stale, (f"{[str(p.relative_to(ROOT)) for p in stale]} out of date with benchmarks/results: "
                       "run `python -m bsr_harness.report` and commit the result")


def test_a_new_record_makes_the_pages_stale(tmp_path):
    """The check above can fail: one more sweep record (other figures) changes both pages."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    readme, performance = tmp_path / "README.md", tmp_path / "performance.md"
    shutil.copy(report.README, readme)
    shutil.copy(report.PERFORMANCE, performance)
    assert report.stale_pages(results, readme, performance) == []
    fs = [r for r in records.load_records(results / "bsr_sweep.jsonl")
          if r["settings"]["tier"] == "filesystem" and r["settings"]["baseline"]][-1]
    fs["figures"]["rows"] = [row | {"seconds": row["seconds"] * 3} if row["window_chunks"] else row
                             for row in fs["figures"]["rows"]]
    fs["commit"] = "f" * 40
    with (results / "bsr_sweep.jsonl").open("a") as f:
        f.write(json.dumps(fs) + "\n")
    assert set(report.stale_pages(results, readme, performance)) == {readme, performance}
    assert report.main(["--check", "--results", str(results)]) == 1  # the repository's pages, against these


@pytest.mark.parametrize(("earlier", "current"), [("fs", "filesystem"), ("lmcache-fs", "lmcache-filesystem")])
def test_the_sweep_headline_reads_records_under_either_tier_name(earlier, current):
    """Records before the rename say fs / lmcache-fs, later ones the current name: the README's sweep
    headline takes the latest record under either."""
    recs = {k: list(v) for k, v in records.all_records().items()}
    latest = [r for r in recs["bsr_sweep"] if r["settings"]["tier"] in (earlier, current)][-1]
    before = report.render_readme_table(recs)
    assert f"`{latest['commit'][:12]}" in before  # (a record made from a changed tree says -dirty)
    for name, commit in ((earlier, "e" * 40), (current, "f" * 40)):  # a newer record under each name is read
        newer = json.loads(json.dumps(latest))
        newer["settings"]["tier"], newer["commit"] = name, commit
        for row in newer["figures"]["rows"]:
            row["tier"] = name
            if row["window_chunks"]:
                row["seconds"] *= 3
        recs["bsr_sweep"].append(newer)
        after = report.render_readme_table(recs)
        (line,) = [line for line in after.splitlines() if f"`{commit[:12]}`" in line]
        assert "BSR / whole plan" in line and after != before


def test_the_sweep_headline_keeps_a_line_per_chunk_scale():
    """A newer record at scale 1/16 does not hide the 1/64 one (the chunk size decides how much the per-window
    costs weigh): each gets the line naming its c; a record without the setting ran at bsr's default, 1/64."""
    recs = {k: list(v) for k, v in records.all_records().items()}
    from bsr_harness.report_sections import fair_whole_plan

    base = next(r for r in recs["bsr_sweep"] if r["settings"]["tier"] == "mooncake" and r["settings"]["baseline"]
                and fair_whole_plan(r))
    for scale, commit in ((1 / 64, "a" * 40), (1 / 16, "b" * 40), (None, "c" * 40)):
        rec = json.loads(json.dumps(base))
        rec["commit"] = commit
        if scale is None:
            rec["settings"].pop("scale", None)
        else:
            rec["settings"]["scale"] = scale
        recs["bsr_sweep"].append(rec)
        lines = report.render_readme_table(recs).splitlines()
        (line,) = [line for line in lines if f"`{commit[:12]}`" in line]
        assert ("c = 1 MB (scale 1/16)" if scale == 1 / 16 else "c = 256 KB (scale 1/64)") in line
        assert "Mooncake store host over tcp" in line
    table = report.render_readme_table(recs)
    assert "`" + "b" * 12 + "`" in table and "`" + "c" * 12 + "`" in table  # the newest of each scale
    assert "`" + "a" * 12 + "`" not in table  # replaced by the newer 1/64 record


def test_the_stall_headline_gives_each_rows_gap_and_ttft_ratios():
    """The README's stall line: per model and exact prompt length (32,576 is not "31K"), A's largest gap over
    resident (async, sync) and B's TTFT over resident + 1.2x its restore where the record has it."""
    from bsr_harness.report_headlines import _stall

    rows = [{"model": "tiny", "tokens": 32576, "gap_ratio_async": 0.9149, "gap_ratio_sync": 1.6,
             "ttft_ratio_in_run": 1.006},
            {"model": "kvheavy", "tokens": 131072, "gap_ratio_async": 0.98, "gap_ratio_sync": 1.75}]  # an older record
    assert _stall({"rows": rows}) == ("kvheavy 131,072: async 0.98, sync 1.75; "
                                      "tiny 32,576: async 0.91, sync 1.60, B's TTFT 1.01")
    assert _stall({"rows": []}) is None


def test_the_w_law_table_gives_each_windows_extra_cost_against_w32():
    """W = 8 restores the same bytes in 4x the windows of W = 32: what the extra windows cost, per window,
    is (T8 - T32) / (n8 - n32); W = 32 itself has none, nor a tier without a W = 32 row."""
    from bsr_harness.report_sections import _wlaw

    def row(tier, w, n, seconds):
        return {"tier": tier, "window_chunks": w, "windows": n, "chunks": 1024, "chunk_bytes": 100,
                "peak_staging_bytes": w * 100, "seconds": seconds}

    rows = _wlaw({"rows": [row("fs", 8, 256, 0.091), row("fs", 32, 64, 0.063), row("fs", 64, 32, 0.061),
                           row("mc", 8, 128, 0.3)]})["rows"]
    extra = [r["extra_per_window_vs_w32_us"] for r in rows]
    assert extra[0] == pytest.approx(28_000 / 192)  # 28 ms over 192 more windows
    assert extra[1] is None and extra[3] is None
    assert extra[2] == pytest.approx(-2_000 / -32)  # 32 fewer windows, 2 ms less
    assert rows[0]["seconds_vs_w32"] == pytest.approx(0.091 / 0.063)


def test_every_record_names_its_commit_command_and_machine():
    found = records.all_records()
    assert found, "no records in benchmarks/results"
    for name, recs in found.items():
        assert recs, f"{name}.jsonl is empty"
        for rec in recs:
            assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", rec["commit"]), (name, rec["commit"])
            assert re.match(r"(\w+=\S+ )*(bsr|python) ", rec["command"]), (name, rec["command"])
            assert rec["machine"]["cores"] and rec["machine"]["cpu"], name


def test_results_hold_only_records_and_what_a_recorded_command_wrote():
    """Nothing in benchmarks/results that no command in the repository regenerates: the .jsonl
    records, and files a recorded command names as its output (the README's picture)."""
    commands = " ".join(r["command"] for recs in records.all_records().values() for r in recs)
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "benchmarks/results"], capture_output=True,
                             text=True).stdout.split()
    for path in tracked or [str(p.relative_to(ROOT)) for p in RESULTS.iterdir()]:
        assert path.endswith(".jsonl") or path in commands, f"{path}: no recorded command writes it"


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_and_docs_links_resolve_and_every_page_is_linked():
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    linked_from_readme = set()
    for page in pages:
        for target, _anchor in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if page.name == "README.md":
                linked_from_readme.add(path)
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked_from_readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_performance_anchors_resolve():
    """Links into docs/performance.md name one of its headings."""
    headings = {report.anchor(line.lstrip("#").strip())
                for line in report.PERFORMANCE.read_text().splitlines() if line.startswith("#")}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in LINK.findall(page.read_text()):
            if target.endswith("performance.md") and anchor:
                assert anchor[1:] in headings, f"{page.name}: {target}{anchor} names no heading"


def test_design_references_resolve():
    """The design is docs/design.md; code and pages cite it by that path."""
    tracked = subprocess.run(["git", "-C", str(ROOT), "grep", "-l", "DESIGN.md"], capture_output=True,
                             text=True).stdout.split()
    assert not [p for p in tracked if p != "tests/unit/test_generated_docs.py"], tracked
    assert (ROOT / "docs" / "design.md").is_file()
