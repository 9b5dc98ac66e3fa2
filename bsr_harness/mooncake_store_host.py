"""A standalone Mooncake store host: the wheel's `mooncake_client` program mounting a segment on a
master (MooncakeMaster, bsr_harness.mooncake_launcher), like the paper's external store host."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from bsr_harness.mooncake_launcher import (
    HOST,
    MooncakeMaster,
    MooncakeMasterError,
    _check_port,
    _check_seconds,
    free_port,
    port_answers,
)
from bsr_harness.process_spawner import Spawner, kill_quietly, stop_process


class MooncakeStoreHost:
    """A standalone store host: the wheel's `mooncake_client` program mounting a segment of
    `segment_bytes` on a master, like the paper's external store host. Objects put by clients
    without a segment of their own land here, so every restored byte crosses TCP.

        with MooncakeMaster() as m, MooncakeStoreHost(m, 2 << 30, wait_forgotten=False):
            tier = MooncakeTier(c, fp, m.master_address, m.metadata_server, global_segment_size=0)

    `wait_forgotten=False` where the master stops right after the host (a master of the caller's own):
    no client can meet the dead segment then, and stop() need not wait out the master's client TTL.
    """

    def __init__(self, master: MooncakeMaster, segment_bytes: int, *, port: int | None = None,
                 start_timeout_s: float = 20.0, settle_s: float = 0.5, forget_timeout_s: float = 20.0,
                 wait_forgotten: bool = True) -> None:
        beside = Path(sys.executable).parent / "mooncake_client"
        self.binary = str(beside) if beside.is_file() else shutil.which("mooncake_client")
        if not self.binary:
            raise MooncakeMasterError("mooncake_client not found next to the Python interpreter or on PATH")
        self.master = master
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1 << 20:
            raise ValueError(f"segment_bytes must be an integer of at least 1 MiB, got {segment_bytes!r}")
        self.segment_bytes = segment_bytes
        self.port = _check_port("port", port) or free_port()
        self.start_timeout_s = _check_seconds("start_timeout_s", start_timeout_s)
        self.settle_s = settle_s
        self.forget_timeout_s = _check_seconds("forget_timeout_s", forget_timeout_s)
        if not isinstance(wait_forgotten, bool):
            raise ValueError(f"wait_forgotten must be True or False, got {wait_forgotten!r}")
        self.wait_forgotten = wait_forgotten
        self.segments: set[str] = set()  # what this host mounted on the master (learnt at start)
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._workdir: Path | None = None

    def start(self) -> MooncakeStoreHost:
        if self.segments:  # restarted after kill(): the master must have forgotten the lost segment first
            self._wait_forgotten()
        before = self._master_segments()
        self._workdir = Path(tempfile.mkdtemp(prefix="bsr-mooncake-host-"))
        args = [
            self.binary, f"--global_segment_size={self.segment_bytes // (1 << 20)}MB", f"--host={HOST}",
            f"--master_server_address={self.master.master_address}",
            f"--metadata_server={self.master.metadata_server}", "--protocol=tcp", f"--port={self.port}",
            "--logtostderr=true",
        ]
        log = open(self._workdir / "mooncake_client.log", "ab")  # noqa: SIM115 - owned by the child
        self._proc = Spawner.popen(args, cwd=self._workdir, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        log.close()
        self._finalizer = weakref.finalize(self, kill_quietly, self._proc)
        deadline = time.monotonic() + self.start_timeout_s
        while not port_answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = (self._workdir / "mooncake_client.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise MooncakeMasterError(f"mooncake_client store host did not start\n{tail}")
            time.sleep(0.05)
        time.sleep(self.settle_s)  # the segment is mounted right after the service port opens
        after = self._master_segments()
        self.segments = after - before if before is not None and after is not None else set()
        return self

    def _master_segments(self) -> set[str] | None:
        try:
            return self.master.segments()
        except (OSError, ValueError):  # a master without the HTTP endpoint, or not answering
            return None

    def _wait_forgotten(self) -> None:
        """Wait (at most forget_timeout_s) until the master no longer lists this host's segment. A host
        that exits does not unmount: the master keeps the segment until its client TTL (10 s by default)
        passes, and a put it places there meanwhile fails (TRANSFER_FAIL). So a client of the same
        master that starts after stop() returned never meets the dead segment."""
        deadline = time.monotonic() + self.forget_timeout_s
        while self.segments and time.monotonic() < deadline:
            now = self._master_segments()
            if now is None or not (self.segments & now):
                break
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the host, then (wait_forgotten) wait until the master forgot its segment (_wait_forgotten)."""
        exited = self._reap()
        if exited and self.wait_forgotten and self.master.running():
            self._wait_forgotten()
        self.segments = set()

    def _reap(self) -> bool:
        """SIGTERM (SIGKILL after 10 s) and reap the process; remove its directory. Whether there was one."""
        exited = self._proc is not None
        if self._proc is not None:
            self.resume()  # a paused host takes SIGTERM only once it runs again
            stop_process(self._proc, 10.0)
            self._proc = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return exited

    def kill(self) -> None:
        """SIGKILL, as a host lost to a crash: its segment's objects go with it, and the master lists them
        until its client TTL passes (nothing waits for that here). start() brings a new host up on the
        same port once the master forgot this one (wait_forgotten)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()  # self.segments stay: what the master may still list (start() waits until it forgot them)

    def pause(self) -> None:
        """SIGSTOP: the host hangs (its connections stay open, nothing answers) until kill() or resume()."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> MooncakeStoreHost:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False
