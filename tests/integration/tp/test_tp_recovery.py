"""Recovery of the TP agreement (issue 35, items 3 and 4): 2 real processes in a gloo group on 127.0.0.1,
each running the worker's Loader with its agreement on a gloo group of its own over a real filesystem
tier of its own objects (tests/tp_recovery_worker.py). No Mooncake: the ranks' objects are files.

- one rank restores late, past the agreement timeout: that load fails closed on both ranks, counted as
  a failed agreement (not the commit rule), and the next load agrees afresh and commits on both
- a submit refused (the request is already loading) takes nothing: the next load still finishes
"""

from __future__ import annotations

import json
import time

import pytest
import torch.multiprocessing as mp
import tp_recovery_worker

from bsr_harness.mooncake_launcher import free_port

JOIN_S = 60


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    """Both ranks run every scenario once (one spawn for the module's tests)."""
    outdir = tmp_path_factory.mktemp("tp-recovery")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=tp_recovery_worker.rank_main, args=(r, 2, port, str(outdir)), daemon=False)
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(10)
    assert not hung, f"ranks still running after {JOIN_S}s"
    results = {}
    for r in range(2):
        results[r] = json.loads((outdir / f"rank{r}.json").read_text())
        assert "exception" not in results[r], results[r]["exception"]
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
