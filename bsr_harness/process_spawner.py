"""Child processes of the Mooncake launcher: forked from one long-lived thread, so they die
with this process and not with the thread that asked for them (PR_SET_PDEATHSIG is tied to
the forking thread)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent (thread: the spawner)
    except Exception:  # pragma: no cover - non-Linux
        pass


class Spawner:
    """One daemon thread per process that forks every child, so that PR_SET_PDEATHSIG (tied to
    the forking thread) fires only when the process itself goes. Restarted after os.fork()."""

    _lock = threading.Lock()
    _queue: queue.SimpleQueue | None = None
    _pid: int | None = None

    @classmethod
    def popen(cls, args: list[str], **kw) -> subprocess.Popen:
        if not sys.platform.startswith("linux"):  # pragma: no cover - no death signal elsewhere
            return subprocess.Popen(args, **kw)
        done: queue.SimpleQueue = queue.SimpleQueue()
        cls._started().put((args, kw, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    @classmethod
    def _started(cls) -> queue.SimpleQueue:
        with cls._lock:
            if cls._queue is None or cls._pid != os.getpid():
                cls._queue, cls._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=cls._serve, args=(cls._queue,), name="bsr-mooncake-spawner",
                                 daemon=True).start()
            return cls._queue

    @staticmethod
    def _serve(requests: queue.SimpleQueue) -> None:
        while True:
            args, kw, done = requests.get()
            try:
                proc = subprocess.Popen(args, preexec_fn=_set_pdeathsig, **kw)  # noqa: PLW1509
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.put((False, e))
            else:
                done.put((True, proc))


def kill_quietly(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a server's clean shutdown path), SIGKILL if it is still there after `timeout_s`; reaped."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait(timeout=timeout_s)
    else:
        proc.wait()
