"""Recovery of the TP agreement (issue 35, items 3 and 4): 2 real processes in a gloo group on 127.0.0.1,
each running the worker's Loader with its agreement on a gloo group of its own over a real filesystem
tier of its own objects (tests/tp_recovery_worker.py). No Mooncake: the ranks' objects are files.

- one rank restores late, past the agreement timeout: that load fails closed on both ranks, counted as
  a failed agreement (not the commit rule), and the next load agrees afresh and commits on both
- a submit refused (the request is already loading) takes nothing: the next load still finishes
"""

from __future__ import annotations

import pytest
import tp_recovery_worker
from tp_util import run_ranks

from bsr_harness.mooncake_launcher import free_port

JOIN_S = 60


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    """Both ranks run every scenario once (one spawn for the module's tests)."""
    outdir = tmp_path_factory.mktemp("tp-recovery")
    port = free_port()
    results, _ = run_ranks(tp_recovery_worker.rank_main, lambda r: (r, 2, port, str(outdir)), 2, outdir, JOIN_S)
    assert set(results) == {0, 1}, "a rank left no results"
    return results


def test_a_timed_out_agreement_fails_that_load_and_the_next_one_agrees_afresh(ranks):
    for r in (0, 1):
        slow, after = ranks[r]["slow"], ranks[r]["after"]
        assert slow["finished"] and not slow["committed"], (r, slow)
        assert "agree: " in slow["error"] and "commit rule" not in slow["error"], (r, slow)
        assert slow["cause"] == "agreement", (r, slow)  # the metrics label, typed
        assert after["finished"] and after["committed"] and after["agreed"], (r, after)


def test_a_refused_submit_does_not_stall_the_next_load(ranks):
    for r in (0, 1):
        assert ranks[r]["refused"]
        assert ranks[r]["dup"]["finished"] and ranks[r]["dup"]["committed"], (r, ranks[r]["dup"])
        assert ranks[r]["next"]["finished"] and ranks[r]["next"]["committed"], (r, ranks[r]["next"])
