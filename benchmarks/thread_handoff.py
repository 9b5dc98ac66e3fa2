"""What one hand-off between two threads costs on this host: the fixed cost a windowed retrieve through
LMCache pays per window and the whole plan pays once.

A window through LMCache's StorageManager wakes a thread at least four times: ours -> LMCache's
prefetch controller (an eventfd its poll loop watches), the controller -> the L2 plugin's pool (a
job), the pool -> the controller (the plugin's eventfd), the controller -> ours (a condition
variable). This measures each kind as a ping-pong between two threads (half a round trip per
hand-off), the median of `--reps` rounds of `--trips` round trips each, and prints what four
hand-offs per window add to a retrieve of N chunks at W = 32 (N/W windows), against the one set
the whole plan pays. Appends a record to benchmarks/results/thread_handoff.jsonl (bsr_harness.records).

    PYTHONPATH=. python benchmarks/thread_handoff.py [--trips 2000] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bsr_cli.args import add_window_chunks
from bsr_harness.records import add_record_options, record_script


def _eventfd_pair(trips: int) -> float:
    """Two threads, each blocked in poll() on its own eventfd, waking the other (LMCache's controller loop)."""
    a, b = os.eventfd(0), os.eventfd(0)

    def wait(fd: int) -> None:
        p = select.poll()
        p.register(fd, select.POLLIN)
        p.poll()
        os.eventfd_read(fd)

    def echo() -> None:
        for _ in range(trips):
            wait(b)
            os.eventfd_write(a, 1)

    t = threading.Thread(target=echo)
    t.start()
    t0 = time.perf_counter()
    for _ in range(trips):
        os.eventfd_write(b, 1)
        wait(a)
    dt = time.perf_counter() - t0
    t.join()
    os.close(a)
    os.close(b)
    return dt / trips / 2


def _condition_pair(trips: int) -> float:
    """Two threads waking each other through threading.Event (a condition variable: LMCache's result wait)."""
    ping, pong = threading.Event(), threading.Event()

    def echo() -> None:
        for _ in range(trips):
            ping.wait()
            ping.clear()
            pong.set()

    t = threading.Thread(target=echo)
    t.start()
    t0 = time.perf_counter()
    for _ in range(trips):
        ping.set()
        pong.wait()
        pong.clear()
    dt = time.perf_counter() - t0
    t.join()
    return dt / trips / 2


def _pool_job(trips: int) -> float:
    """A job submitted to a thread pool and its result waited for (a plugin's task on its pool)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        pool.submit(int).result()  # the worker exists
        t0 = time.perf_counter()
        for _ in range(trips):
            pool.submit(int).result()
        return (time.perf_counter() - t0) / trips / 2


KINDS = {"eventfd + poll": _eventfd_pair, "threading.Event": _condition_pair, "thread-pool job": _pool_job}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=2000, help="round trips per round")
    ap.add_argument("--reps", type=int, default=7, help="rounds per kind (interleaved), the median is printed")
    ap.add_argument("--chunks", type=int, default=2047, help="N: chunks of the retrieve the estimate is for")
    add_window_chunks(ap, default=32, help="W of that retrieve")
    add_record_options(ap)
    args = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.reps):
        for name, fn in KINDS.items():
            times[name].append(fn(args.trips))
    print(f"{'hand-off':18}{'median_us':>10}{'min_us':>9}{'max_us':>9}")
    for name, ts in times.items():
        print(f"{name:18}{statistics.median(ts) * 1e6:10.1f}{min(ts) * 1e6:9.1f}{max(ts) * 1e6:9.1f}")
    one = statistics.median(times["eventfd + poll"] + times["threading.Event"] + times["thread-pool job"])
    windows = -(-args.chunks // args.window)
    print(f"4 hand-offs per window, {windows} windows (N={args.chunks}, W={args.window}) against 1 set for the whole "
          f"plan: {(windows - 1) * 4 * one * 1e3:.2f} ms more (median hand-off {one * 1e6:.1f} us)")
    record_script(args, "thread_handoff", {
        "rows": [{"hand_off": k, "median_us": round(statistics.median(ts) * 1e6, 1),
                  "min_us": round(min(ts) * 1e6, 1), "max_us": round(max(ts) * 1e6, 1)} for k, ts in times.items()],
        "median_hand_off_us": round(one * 1e6, 1), "windows": windows,
        "windowed_extra_ms": round((windows - 1) * 4 * one * 1e3, 2)})


if __name__ == "__main__":
    main()
