"""Soak (issue 7, item 5): many restore/fail cycles in one process on the filesystem tier.

Each cycle restores one of a few stored prefixes with a fresh BoundedRestorer (random W and
depth) and, in most cycles, one random fault: a corrupt object, a missing object (deleted, put
back after), an eviction race (drop_after_probe), an unavailable tier, a failing fetch hook, a
failing install, a slow fetch (every fetch completes DELAY_S late, well within the timeout: must
still commit) or a fetch timeout (completions LATE_S late against a fetch timeout of TIMEOUT_S:
fails closed with FetchTimeoutError; the late completion lands after the restore returned and
must not leak a slot, a thread or a byte). Healthy cycles must commit with the stored state
hash, faulted ones must fail closed (ok=False, committed_tokens == 0). After a warm-up, resident
memory, open file descriptors, threads (Python and native) and staging live bytes are recorded
and must return to that baseline at the end (RSS within +64 MiB; Python threads exactly, fds and
native threads no more than at the start); no warning may be emitted. The figures are printed
(run with -s to see them).
"""

from __future__ import annotations

import gc
import random
import threading
import time
import warnings

import pytest

from bsr_harness.experiments import Destinations, make_source, store_source
from bsr_harness.faulty_installer import InstallFault
from bsr_harness.faulty_tier import FaultyTier
from bsr_kernels import WindowInstaller, presets
from bsr_runtime.keys import PrefixKeys
from bsr_runtime.plan import count_windows
from bsr_runtime.probe import probe_prefix
from bsr_runtime.restore import BoundedRestorer, RestoreConfig, RestoreRequest
from bsr_runtime.state_hash import state_hash
from bsr_runtime.tiers import FilesystemTier
from bsr_runtime.tiers.base import MissingObjectError

psutil = pytest.importorskip("psutil")

CYCLES = 1000  # issue 7 asked for 500 cycles
WARMUP = 20
RSS_MARGIN = 64 << 20
FAULTS = [None, None, "corrupt", "missing", "drop_after_probe", "unavailable", "fail_fetch", "install", "delay",
          "timeout"]
DELAY_S = 0.02
TIMEOUT_S = 0.005
# A timed-out fetch completes this late: far past the deadline even when a loaded machine (xdist workers
# > cores) deschedules the restoring thread for tens of ms, so the completion cannot land before it waits.
LATE_S = 0.25
SETTLE_S = 10.0  # late completions (timer threads) of the last cycles finish well within this


def _snapshot(proc) -> dict:
    gc.collect()
    return dict(rss=proc.memory_info().rss, fds=proc.num_fds(), threads=proc.num_threads(),
                py_threads=threading.active_count())


def _late_completions_done() -> None:
    """Wait (at most SETTLE_S) for FaultyTier's timer threads of late completions to finish."""
    settle = time.monotonic() + SETTLE_S
    while any(t.name == "bsr-fault-delay" for t in threading.enumerate()) and time.monotonic() < settle:
        time.sleep(0.01)


def test_soak_restore_fail_cycles(tmp_path):
    reg = presets.llama_like(layers=2, kv_heads=1, head_dim=16, block_size=16)
    rng = random.Random(1234)
    proc = psutil.Process()
    gc.collect()  # earlier tests' garbage (a loop a bounded close abandoned, say) warns here, not in the soak
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier = FaultyTier(FilesystemTier(tmp_path, reg.chunk_bytes, reg.fingerprint, load_concurrency=2))
        try:
            stored = []
            for i in range(6):
                n = rng.randint(2, 4)
                src = make_source(reg, n, seed=500 + i)
                stored.append((src, store_source(src, tier, window_chunks=4), Destinations(reg, n, seed=600 + i)))
            counts = {f: 0 for f in FAULTS}
            base = None
            t0 = time.monotonic()
            for cycle in range(WARMUP + CYCLES):
                if cycle == WARMUP:
                    _late_completions_done()  # a warm-up cycle's timer thread is no part of the baseline
                    base = _snapshot(proc)
                    t0 = time.monotonic()
                src, expected, dst = rng.choice(stored)
                n = src.num_chunks
                keys = PrefixKeys(src.keyspace, src.tokens, reg.chunk_tokens)
                victim = keys.window(rng.randrange(n), 1)[0]
                fault = rng.choice(FAULTS)
                w, depth = rng.choice([1, 2, 3, 4]), rng.choice([1, 2])
                counts[fault] += 1
                make_installer = WindowInstaller
                if fault == "corrupt":
                    tier.plan.corrupt_keys = {victim}
                elif fault == "missing":
                    tier.delete([victim])
                elif fault == "drop_after_probe":
                    tier.plan.drop_after_probe = {victim}
                    assert probe_prefix(tier, keys).prefix_chunks == n  # probed present, then evicted
                elif fault == "unavailable":
                    tier.plan.unavailable = True
                elif fault == "fail_fetch":
                    def fail(ks, victim=victim):
                        if victim in ks:
                            raise MissingObjectError(f"injected: {victim}")
                    tier.plan.fail_fetch = fail
                elif fault == "delay":
                    tier.plan.delay_s = DELAY_S
                elif fault == "timeout":
                    tier.plan.delay_s = LATE_S
                elif fault == "install":
                    bad_window = rng.randrange(count_windows(n, w, depth))  # later windows too: no partial commit

                    make_installer = InstallFault(bad_window, once=False).make
                dst.poison()
                req = RestoreRequest(f"soak-{cycle}", src.tokens, src.keyspace, dst.kv, dst.tables)
                timeout = TIMEOUT_S if fault == "timeout" else 30.0
                with BoundedRestorer(reg, RestoreConfig(window_chunks=w, pipeline_depth=depth,
                                                        fetch_timeout_s=timeout),
                                     make_installer=make_installer) as restorer:
                    rep = restorer.restore(req, tier, n)
                    assert restorer.staging.live_bytes == 0
                tier.clear()
                if fault in ("missing", "drop_after_probe"):
                    store_source(src, tier, window_chunks=4)  # put the evicted object back
                if fault in (None, "delay"):
                    assert rep.ok, f"cycle {cycle} ({fault}): {rep.error}"
                    assert state_hash(reg, dst.kv, dst.tables, n) == expected
                else:
                    assert not rep.ok and rep.committed_tokens == 0, f"cycle {cycle} ({fault}) committed"
                    if fault == "timeout":
                        assert "FetchTimeoutError" in rep.error, f"cycle {cycle}: {rep.error}"
            elapsed = time.monotonic() - t0
            settle = time.monotonic() + SETTLE_S  # the last late completions (timer threads) finish
            while threading.active_count() > base["py_threads"] and time.monotonic() < settle:
                time.sleep(0.01)
            end = _snapshot(proc)
        finally:
            tier.close()
    print(f"\nsoak: {CYCLES} cycles (after {WARMUP} warm-up) in {elapsed:.1f} s; faults {counts}\n"
          f"  RSS {base['rss'] / 2**20:.1f} -> {end['rss'] / 2**20:.1f} MiB; fds {base['fds']} -> {end['fds']}; "
          f"threads (native) {base['threads']} -> {end['threads']}; "
          f"Python threads {base['py_threads']} -> {end['py_threads']}; staging live bytes 0 after every cycle")
    assert [str(w.message) for w in caught] == []
    assert end["py_threads"] == base["py_threads"]
    # equal when run alone (and in every run so far); `<=` because a native thread or socket of a
    # Mooncake client closed by an earlier test module may still go away during the soak: a leak
    # is growth
    assert end["fds"] <= base["fds"]
    assert end["threads"] <= base["threads"]
    assert end["rss"] <= base["rss"] + RSS_MARGIN
