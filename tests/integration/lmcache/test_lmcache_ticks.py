"""The suite's patch of LMCache's eviction ticks (tests/lmcache_ticks.py, installed by conftest.py): a
stopped controller's thread ends at once instead of finishing its one-second sleep, and a sleep in any
other thread is a plain sleep."""

from __future__ import annotations

import threading
import time

import pytest

ec = pytest.importorskip("lmcache.v1.distributed.storage_controllers.eviction_controller",
                         reason="lmcache 0.5.6 is not installed")

import lmcache_ticks  # noqa: E402


def test_stop_ends_the_tick_at_once():
    """Unpatched, stop() 50 ms after start() waits out the rest of the 1 s tick (~0.95 s)."""
    assert lmcache_ticks.install() and lmcache_ticks.install()  # installed by conftest; idempotent
    controller = ec.L2EvictionController([])  # no adapters: its loop only ticks
    controller.start()
    time.sleep(0.05)  # inside its first tick
    t0 = time.monotonic()
    controller.stop()
    took = time.monotonic() - t0
    assert not controller._thread.is_alive()
    assert took < 0.5, f"stop() took {took:.2f} s: the tick was not ended by the stop flag"


def test_a_sleep_outside_a_controller_is_a_plain_sleep():
    slept = []

    def run():
        t0 = time.monotonic()
        ec.time.sleep(0.2)
        slept.append(time.monotonic() - t0)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert slept[0] >= 0.2
