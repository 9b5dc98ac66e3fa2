"""The Mooncake launcher works from any thread.

PR_SET_PDEATHSIG is tied to the thread that forked the child, not to the process: a master
started from a worker thread used to be SIGKILLed as soon as that thread returned. The
launcher now forks every child from one long-lived spawner thread, so the master outlives the
thread that asked for it, and is still stopped by its owner (stop()) and when the process
exits (normally, or killed with SIGKILL).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytestmark = pytest.mark.mooncake

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _require():
    from conftest import _require_mooncake

    _require_mooncake()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_master_started_from_an_exiting_thread_survives_it():
    _require()
    from bsr_harness.mooncake_launcher import MooncakeMaster, port_answers

    box = {}

    def start() -> None:
        box["m"] = MooncakeMaster().start()

    t = threading.Thread(target=start, name="short-lived-starter")
    t.start()
    t.join(60)
    assert not t.is_alive() and "m" in box
    m = box["m"]
    try:
        time.sleep(1.0)  # PDEATHSIG would have fired at once when the thread exited
        assert m.running(), f"master died with the thread that started it\n{m.log_tail()}"
        assert port_answers(m.rpc_port) and m._metadata_answers()
        # a client can use it
        from bsr_runtime.tiers.mooncake import MooncakeTier

        tier = MooncakeTier(4096, "f" * 32, m.master_address, m.metadata_server, global_segment_size=16 << 20)
        tier.close()
        pid = m.pid
    finally:
        m.stop()
    assert not m.running() and _wait_dead(pid)


def test_restart_from_another_thread():
    _require()
    from bsr_harness.mooncake_launcher import MooncakeMaster

    m = MooncakeMaster().start()
    try:
        t = threading.Thread(target=m.restart)
        t.start()
        t.join(60)
        time.sleep(0.5)
        assert m.running() and m._metadata_answers()
    finally:
        m.stop()


_CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    from bsr_harness.mooncake_launcher import MooncakeMaster
    box = {{}}
    t = threading.Thread(target=lambda: box.setdefault("m", MooncakeMaster().start()))
    t.start(); t.join()
    print(box["m"].pid, flush=True)
    if {mode!r} == "hang":
        time.sleep(600)
    # "exit": a normal interpreter exit without stop()
""")


@pytest.mark.parametrize("mode", ["exit", "sigkill"])
def test_master_dies_with_its_process(mode):
    """Started from a worker thread of another process: that process exits (or is SIGKILLed)
    without stopping it, and the master goes too."""
    _require()
    code = _CHILD.format(repo=REPO, mode="exit" if mode == "exit" else "hang")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"child printed {line!r}"
        pid = int(line)
        if mode == "sigkill":
            assert _alive(pid)
            proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        assert _wait_dead(pid), f"mooncake_master {pid} outlived its process ({mode})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("kw", [dict(start_timeout_s=math.inf), dict(stop_timeout_s=math.nan),
                                dict(start_timeout_s=0), dict(rpc_port=70000), dict(http_port=1.5),
                                dict(client_ttl_s=math.nan)])
def test_launcher_knobs_validated(kw):
    _require()
    from bsr_harness.mooncake_launcher import MooncakeMaster

    with pytest.raises(ValueError):
        MooncakeMaster(**kw)
