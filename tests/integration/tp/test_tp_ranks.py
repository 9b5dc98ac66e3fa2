"""The commit rule across TP ranks: 2 real processes in a gloo group on 127.0.0.1, each with its
own Mooncake client on a real mooncake_master of the module's own, its own objects and its own blocks.

- both healthy: committed on both, each rank's state hash equal to what it stored
- one rank's restore faults (fetch on rank 1; install on rank 0), the other succeeds locally:
  nothing committed on either, every block of the request invalid on both, markers on both
- a rank that hangs: the other's agreement fails within the timeout, and the late rank, although
  its own restore succeeded, does not commit either; the next agreement succeeds on both
- a rank that dies mid-restore: the survivor's agreement returns False within the timeout
"""

from __future__ import annotations

import pytest
import tp_worker
from tp_util import run_ranks

from bsr_harness.mooncake_launcher import free_port

AGREE_TIMEOUT_S = 2.0
JOIN_S = 120

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def store_host(module_mooncake_master):
    """The external store host holding every rank's objects (ranks mount no segment)."""
    from bsr_harness.mooncake_store_host import MooncakeStoreHost

    with MooncakeStoreHost(module_mooncake_master, 64 << 20, wait_forgotten=False) as host:
        yield host


def _spawn(mode: str, master, tmp_path, world: int = 2) -> tuple[dict[int, dict], list[int]]:
    port = free_port()
    args = (world, port, mode, master.master_address, master.metadata_server, str(tmp_path), AGREE_TIMEOUT_S)
    return run_ranks(tp_worker.rank_main, lambda r: (r, *args), world, tmp_path, JOIN_S, mode)


def test_commit_needs_every_rank(module_mooncake_master, store_host, tmp_path):
    res, codes = _spawn("faults", module_mooncake_master, tmp_path)
    assert codes == [0, 0] and set(res) == {0, 1}
    for r in (0, 1):
        h = res[r]["healthy"]
        assert h["committed"] and h["hash_ok"] and h["served_by"] == "mooncake"
        assert h["exposed_tokens"] == h["tokens"] == tp_worker.REQ_CHUNKS * 256 and h["invalid_blocks"] == 0
        assert not h["marker_set"] and h["failed_recving"] == []

    for name, faulty in (("rank1_fetch", 1), ("rank0_install", 0)):
        for r in (0, 1):
            o = res[r][name]
            assert o["tokens"] == tp_worker.REQ_CHUNKS * 256  # the plan was advertised on both ranks
            assert not o["committed"] and o["exposed_tokens"] == 0 and o["served_by"] == "local", (name, r, o)
            assert o["invalid_is_every_block"] and o["invalid_blocks"] == o["total_blocks"] > 0
            assert o["marker_set"] and o["marker_cleared"] and o["failed_recving"] == [name]
            if r == faulty:
                assert not o["local_ok"] and not o["first_attempt_ok"]
                assert o["first_error"].startswith("InjectedFault" if name == "rank1_fetch" else "InjectedInstallError")
            else:  # its own restore succeeded (the bytes are all there), yet nothing is committed
                assert o["local_ok"] and o["first_attempt_ok"] and o["hash_ok"]
                assert "commit rule" in o["error"]

    for r in (0, 1):  # the group is still usable: a healthy request commits afterwards
        a = res[r]["after"]
        assert a["committed"] and a["hash_ok"] and not res[r]["poisoned"]


def test_hung_rank_reads_as_invalid_on_both(module_mooncake_master, store_host, tmp_path):
    res, codes = _spawn("hang", module_mooncake_master, tmp_path)
    assert codes == [0, 0] and set(res) == {0, 1}
    on_time, late = res[0]["late"], res[1]["late"]
    assert on_time["local_ok"] and late["local_ok"]  # both restores succeeded locally ...
    assert not on_time["committed"] and not late["committed"]  # ... and neither rank commits
    for o in (on_time, late):
        assert o["exposed_tokens"] == 0 and o["invalid_is_every_block"] and o["marker_set"]
    # rank 0 waited for its agreement no longer than the timeout (plus slack), not for rank 1
    assert on_time["seconds"] < AGREE_TIMEOUT_S + 1.5
    assert "timed out" in res[0]["why"] or "not completed" in res[0]["why"]
    # the late rank's reduction may pair with rank 0's abandoned one and "succeed": the deadline
    # check (or its own timeout) is what keeps it from committing alone
    assert any(w in res[1]["why"] for w in ("deadline", "timed out", "not completed")), res[1]["why"]
    # a timed-out agreement fails that decision only: the group stays aligned (the late rank's reduction
    # paired with the one rank 0 gave up on), so the next decision agrees afresh on both ranks
    for r in (0, 1):
        assert not res[r]["poisoned"] and not res[r]["poisoned_after"], res[r]
        assert res[r]["agree_after"] is True, res[r].get("why_after")
        assert res[r]["agree_after_s"] < AGREE_TIMEOUT_S


def test_dead_rank_reads_as_invalid(module_mooncake_master, store_host, tmp_path):
    res, codes = _spawn("die", module_mooncake_master, tmp_path)
    assert codes[1] == 3 and 1 not in res  # rank 1 died in its restore
    assert codes[0] == 0
    o = res[0]["late"]
    assert o["local_ok"] and not o["committed"] and o["exposed_tokens"] == 0
    assert o["invalid_is_every_block"] and o["marker_set"]
    assert o["seconds"] < AGREE_TIMEOUT_S + 5  # the survivor's agreement ended within its timeout
