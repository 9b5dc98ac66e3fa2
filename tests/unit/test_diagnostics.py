"""Diagnostics never raise into what they describe: the report writer (bsr_runtime.diagnostics) and
the native log of the `bsr` command, against real files, a removed directory, a FIFO, a symlink."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading

from bsr_runtime.diagnostics import ReportWriter, report_writer


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_records_are_json_lines_with_time_and_pid(tmp_path):
    path = tmp_path / "report.jsonl"
    w = ReportWriter(str(path))
    w.write({"event": "load", "ok": True})
    w.write({"event": "save", "tier": object()})  # not JSON: written as its str()
    got = _lines(path)
    assert [r["event"] for r in got] == ["load", "save"] and got[0]["ok"] is True
    assert all(r["pid"] == os.getpid() and r["t"] > 0 for r in got)
    assert (w.written, w.failures) == (2, 0)


def test_no_path_writes_nothing(tmp_path):
    w = ReportWriter(None)
    w.write({"event": "load"})
    assert (w.written, w.failures) == (0, 0) and os.listdir(tmp_path) == []


def test_removed_directory_is_counted_and_logged_once(tmp_path, caplog):
    d = tmp_path / "reports"
    d.mkdir()
    path = d / "r.jsonl"
    w = ReportWriter(str(path))
    w.write({"n": 0})
    shutil.rmtree(d)
    with caplog.at_level(logging.WARNING, logger="bsr_runtime.diagnostics"):
        for i in range(3):
            w.write({"n": i + 1})  # must not raise
    assert (w.written, w.failures) == (1, 3)
    assert sum("cannot write the report" in r.getMessage() for r in caplog.records) == 1
    d.mkdir()  # the directory is back (rotation, a remount): lines are written again
    w.write({"n": 4})
    assert [r["n"] for r in _lines(path)] == [4] and w.written == 2


def test_fifo_never_blocks(tmp_path):
    fifo = tmp_path / "r.jsonl"
    os.mkfifo(fifo)
    w = ReportWriter(str(fifo))
    done = threading.Event()
    t = threading.Thread(target=lambda: (w.write({"event": "load"}), done.set()), daemon=True)
    t.start()
    assert done.wait(5), "a FIFO without a reader blocked the report writer"
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with a reader: still refused (not a regular file)
    try:
        w.write({"event": "load"})
        assert os.read(reader, 1) == b""  # nothing was written into the pipe
    finally:
        os.close(reader)
    assert (w.written, w.failures) == (0, 2)


def test_symlink_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("untouched\n")
    link = tmp_path / "r.jsonl"
    link.symlink_to(target)
    w = ReportWriter(str(link))
    w.write({"event": "load"})
    assert target.read_text() == "untouched\n" and w.failures == 1


def test_a_record_that_cannot_serialize_is_counted(tmp_path):
    loop: dict = {}
    loop["self"] = loop
    w = ReportWriter(str(tmp_path / "r.jsonl"))
    w.write(loop)
    assert w.failures == 1


def test_one_writer_per_path():
    assert report_writer("/nonexistent/x.jsonl") is report_writer("/nonexistent/x.jsonl")
    report_writer("/nonexistent/x.jsonl").write({"a": 1})
    assert report_writer("/nonexistent/x.jsonl").failures >= 1


def test_native_log_that_cannot_be_opened_does_not_stop_the_command(tmp_path):
    """bsr_harness.native_log.redirected: an unwritable log sends the native output to /dev/null
    with one note, instead of failing the command that wanted it."""
    code = (
        "import os, sys\n"
        "from bsr_harness.native_log import redirected\n"
        "with redirected(sys.argv[1], fds=(2,)):\n"
        "    os.write(2, b'native line\\n')\n"
        "print('carried on')\n"
    )
    missing = tmp_path / "no-such-dir" / "native.log"
    r = subprocess.run([sys.executable, "-c", code, str(missing)], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and r.stdout.strip() == "carried on", r.stderr
    assert "cannot be written" in r.stderr and "native line" not in r.stderr
