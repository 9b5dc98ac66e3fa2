"""Store restart (issue 7, item 6): the Mooncake master restarts between restores, and during one.

A prefix is stored through a MooncakeTier client with a segment of its own and restored once
(state hash equal). Then the master is restarted (every object and registration is lost) and:
- the next probe (retried while the client re-registers) reports a miss, and a restore of the
  whole prefix anyway (the caller's probe predates the restart) fails closed;
- right after a second restart, without waiting for re-registration, a restore either fails
  closed or succeeds with the stored hash;
- once the prefix is stored again, it restores with the stored hash.
For every restore: ok => state hash equal, not ok => committed_tokens == 0 and the poisoned
destination blocks are untouched (nothing stale or partial is exposed).
"""

from __future__ import annotations

import time

import pytest
import torch

from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.testdata import POISON
from bsr_kernels import presets
from bsr_runtime.keys import PrefixKeys
from bsr_runtime.probe import probe_prefix
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers.base import TierError

pytestmark = pytest.mark.mooncake

N = 5
RETRY_S = 30.0  # generous: clients re-register within ~2 s of a restart


def _retry(op, what: str):
    end = time.monotonic() + RETRY_S
    while True:
        try:
            return op()
        except TierError:
            if time.monotonic() > end:
                raise AssertionError(f"{what} still failing {RETRY_S}s after the master restart") from None
            time.sleep(0.2)


def _untouched(dst: Destinations) -> bool:
    return all(bool((t.view(torch.uint8) == POISON).all()) for t in dst.kv)


@pytest.mark.parametrize("w,depth", [(2, 2), (0, 1)])
def test_master_restart_between_restores(w, depth):
    from conftest import _require_mooncake

    _require_mooncake()
    from bsr_harness.mooncake_launcher import MooncakeMaster
    from bsr_runtime.tiers.mooncake import MooncakeTier

    reg = presets.dsv4_flash(scale=1 / 64)
    src = make_source(reg, N, seed=77 + w)
    keys = PrefixKeys(src.keyspace, src.tokens, reg.chunk_tokens)
    dst = Destinations(reg, N, seed=78)
    outcomes = []

    master = MooncakeMaster()
    master.start()
    tier = None
    restorer = BoundedRestorer(reg, RestoreConfig(window_chunks=w, pipeline_depth=depth,
                                                  fetch_timeout_s=15.0))
    try:
        tier = MooncakeTier(reg.chunk_bytes, reg.fingerprint, master.master_address, master.metadata_server,
                            global_segment_size=64 << 20, rpc_timeout_s=3)
        expected = store_source(src, tier, window_chunks=4)

        def restore(label: str, n: int):
            dst.poison()
            rep = restorer.restore(RestoreRequest(label, src.tokens, src.keyspace, dst.kv, dst.tables), tier, n)
            if rep.ok:
                assert rep.committed_tokens == n * reg.chunk_tokens
                if n:
                    assert state_hash(reg, dst.kv, dst.tables, n) == expected, f"{label}: ok with a wrong hash"
            else:
                assert rep.committed_tokens == 0, f"{label}: partial commit"
                # a failed restore may have installed windows before it failed, but commits none;
                # with W = 0 nothing is installed unless every object landed
                if w == 0:
                    assert _untouched(dst), f"{label}: whole plan wrote into destinations"
            outcomes.append((label, rep.ok, rep.error))
            return rep

        assert restore("before", N).ok

        master.restart()
        probed = _retry(lambda: probe_prefix(tier, keys), "probe").prefix_chunks
        assert probed == 0  # objects died with the master: a miss, not stale data
        assert restore("probed-prefix", probed).ok  # zero chunks: nothing to restore
        assert not restore("stale-probe", N).ok  # a probe from before the restart: fails closed

        master.restart()
        restore("right-after-restart", N)  # not waiting for re-registration: ok=>hash, else closed

        _retry(lambda: store_source(src, tier, window_chunks=4), "put")
        probed = _retry(lambda: probe_prefix(tier, keys), "probe").prefix_chunks
        assert probed == N
        assert restore("re-stored", N).ok
    finally:
        restorer.close()
        if tier is not None:
            tier.close()  # can take a few seconds when the master was gone
        master.stop()
        print(f"\nW={w} depth={depth}: " + "; ".join(f"{lbl}: ok={ok}" + (f" ({err})" if err else "")
                                                   for lbl, ok, err in outcomes))
    assert not master.running()


@pytest.mark.parametrize("w,depth", [(1, 1), (2, 2)])
def test_master_restart_while_restore_in_flight(w, depth):
    """The master restarts while a restore has a fetch in flight (the fetch worker is held at its
    second window until the restart completed). The restore fails closed and leaks nothing: the
    restorer's staging is back to zero. A restore right after the restart works
    (state hash equal) or fails closed; once the prefix is stored again it restores."""
    import threading

    from conftest import _require_mooncake

    _require_mooncake()
    from bsr_harness.faulty_tier import FaultyTier
    from bsr_harness.mooncake_launcher import MooncakeMaster
    from bsr_runtime.tiers.mooncake import MooncakeTier

    reg = presets.dsv4_flash(scale=1 / 64)
    n = 6
    src = make_source(reg, n, seed=91 + w)
    keys = PrefixKeys(src.keyspace, src.tokens, reg.chunk_tokens)
    dst = Destinations(reg, n, seed=92)
    master = MooncakeMaster().start()
    tier = None
    restorer = BoundedRestorer(reg, RestoreConfig(window_chunks=w, pipeline_depth=depth,
                                                  fetch_timeout_s=20.0))
    try:
        tier = MooncakeTier(reg.chunk_bytes, reg.fingerprint, master.master_address, master.metadata_server,
                            global_segment_size=64 << 20, rpc_timeout_s=3)
        expected = store_source(src, tier, window_chunks=4)
        faulty = FaultyTier(tier, close_inner=False)  # holds the restore at its second window's fetch
        fetches, held, go = [], threading.Event(), threading.Event()

        def hold_second_fetch(ks) -> None:
            fetches.append(list(ks))
            if len(fetches) == 2:
                held.set()
                go.wait(60)

        faulty.plan.fail_fetch = hold_second_fetch
        dst.poison()
        box = {}
        req = RestoreRequest("in-flight", src.tokens, src.keyspace, dst.kv, dst.tables)
        t = threading.Thread(target=lambda: box.setdefault("rep", restorer.restore(req, faulty, n)))
        t.start()
        try:
            assert held.wait(60), "the second window's fetch never started"
            master.restart()
        finally:
            go.set()
            t.join(120)
        faulty.plan.fail_fetch = None
        assert not t.is_alive(), "restore hung after the master restart"
        rep = box["rep"]
        assert not rep.ok and rep.committed_tokens == 0, f"committed across a master restart: {rep}"
        assert rep.error, rep
        print(f"\nW={w} depth={depth}: restore in flight across the restart: {rep.error}")
        assert restorer.staging.live_bytes == 0, "staging leaked"

        dst.poison()  # right after the restart: works (hash equal) or fails closed
        rep = restorer.restore(RestoreRequest("after", src.tokens, src.keyspace, dst.kv, dst.tables), faulty, n)
        assert (rep.ok and state_hash(reg, dst.kv, dst.tables, n) == expected) or \
            (not rep.ok and rep.committed_tokens == 0)
        assert restorer.staging.live_bytes == 0

        _retry(lambda: store_source(src, tier, window_chunks=4), "put")
        assert _retry(lambda: probe_prefix(tier, keys), "probe").prefix_chunks == n
        dst.poison()
        rep = restorer.restore(RestoreRequest("re-stored", src.tokens, src.keyspace, dst.kv, dst.tables), faulty, n)
        assert rep.ok, rep.error
        assert state_hash(reg, dst.kv, dst.tables, n) == expected
        assert restorer.staging.live_bytes == 0
    finally:
        restorer.close()
        if tier is not None:
            tier.close()
        master.stop()
    assert not master.running()
