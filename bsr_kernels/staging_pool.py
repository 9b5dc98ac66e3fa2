"""StagingPool: the only staging memory a bounded restore uses.

A fixed buffer of W chunks, allocated once, split into 1 or 2 slots. A slot is leased for
one window, filled by the tier, read by the install kernel, and released. Release is
synchronize-then-release: the bytes stay counted as live until the install that read them
has completed (its event fired), and a slot is handed out again only after that.

`headroom` > 0 leaves that many bytes of scratch before each chunk (chunk i of a slot starts at
headroom + i * chunk_stride, chunk_stride = headroom + chunk_bytes). A tier whose objects carry
a header lands each object whole there, header in the scratch, by one transfer (tiers/mooncake.py).
A lease's `view` is then a 2-D (num_chunks, chunk_bytes) view with row stride chunk_stride, which
every install backend takes. The meters count chunk bytes (the paper's W*c); the room,
`room_bytes` = capacity * headroom, is auxiliary state (the A of RWS <= W*c + A, docs/design.md).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


class StagingWaitTimeout(TimeoutError):
    """No staging for a window within the wait's bound (a pool's slot, an arena's run, a byte budget)."""


class CompletionEvent:
    """Completion of the work that reads or writes a slot.

    On a GPU a CUDA event recorded on the install stream. On CPU the kernels are synchronous,
    so recording marks completion, unless the work ran on a host stream: any object with a
    `synchronize()` that returns once the work submitted to it is done (a CPU worker thread).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = torch.cuda.Event() if device.type == "cuda" else None
        self._host_stream = None
        self._recorded = False

    def record(self, stream=None) -> None:
        if self._cuda is not None:
            self._cuda.record(stream if stream is not None else torch.cuda.current_stream())
        else:
            self._host_stream = stream if hasattr(stream, "synchronize") else None
        self._recorded = True

    def query(self) -> bool:
        if self._cuda is not None and self._recorded:
            return self._cuda.query()
        return self._host_stream is None

    def synchronize(self) -> None:
        if self._cuda is not None and self._recorded:
            self._cuda.synchronize()
        elif self._host_stream is not None:
            self._host_stream.synchronize()
            self._host_stream = None


@dataclass
class Slot:
    index: int
    offset: int  # byte offset in the pool buffer
    capacity_chunks: int
    event: CompletionEvent
    leased_chunks: int = 0  # chunks counted live (held by a lease or draining)
    leased: bool = False
    pending: bool = False  # released with an install in flight


class LeasedChunks:
    """What every staging lease offers the window loop: its chunks' views, and the completion of the
    work on them (`pool.chunk_bytes`, `view`, `num_chunks`, `event` come from the lease)."""

    def chunk(self, i: int) -> torch.Tensor:
        if self.view.dim() == 2:
            return self.view[i]
        c = self.pool.chunk_bytes
        return self.view[i * c : (i + 1) * c]

    def chunks(self) -> list[torch.Tensor]:
        return [self.chunk(i) for i in range(self.num_chunks)]

    def record(self, stream=None) -> None:
        """Record the completion of the work just launched on this lease's bytes."""
        self.event.record(stream)
        self.recorded, self.synchronized = True, False

    def synchronize(self) -> None:
        """Wait until the recorded work completed."""
        self.event.synchronize()
        self.synchronized = True


@dataclass
class SlotLease(LeasedChunks):
    """A leased slot: `view` is the window's staging bytes (num_chunks * chunk_bytes; with
    headroom a (num_chunks, chunk_bytes) view whose rows are chunk_stride apart).

    The lease owns the completion of the work on its bytes: `record(stream)` after launching
    the install (or gather) that uses them, `synchronize()` before anything else reads or
    reuses them, then `release()`. Releasing recorded work that was never synchronized is an
    error (it would hand out a slot a kernel may still read)."""

    pool: StagingPool
    slot: Slot
    num_chunks: int
    view: torch.Tensor = field(repr=False)
    recorded: bool = False
    synchronized: bool = False

    @property
    def event(self) -> CompletionEvent:
        return self.slot.event

    def release(self) -> None:
        self.pool.release(self)


def _check_count(name: str, value: object, *, multiple: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value % multiple:
        raise ValueError(f"{name} must be an integer >= {least}, a multiple of {multiple}, got {value!r}")


class StagingBuffer:
    """One staging allocation: `capacity_chunks` chunks of `chunk_bytes`, each after `headroom`
    bytes of header room (rows `chunk_stride` apart); host memory is pinned on a CUDA machine so
    the install can read it directly. The pool (slots) and the arena (runs) lease it out."""

    def __init__(self, kind: str, chunk_bytes: int, capacity_chunks: int, headroom: int,
                 device: str | torch.device, pin_memory: bool | None) -> None:
        _check_count("chunk_bytes", chunk_bytes, multiple=16, least=16)
        if isinstance(capacity_chunks, bool) or not isinstance(capacity_chunks, int) or capacity_chunks < 1:
            raise ValueError(f"a {kind} needs at least one chunk, got {capacity_chunks!r}")
        _check_count("headroom", headroom, multiple=16, least=0)
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.headroom = headroom
        self.chunk_stride = headroom + chunk_bytes
        self.capacity_chunks = capacity_chunks
        if pin_memory is None:
            pin_memory = self.device.type == "cpu" and torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        self.buffer = torch.empty(capacity_chunks * self.chunk_stride, dtype=torch.uint8, device=self.device,
                                  pin_memory=self.pinned)

    def prefault(self) -> None:
        """Touch host memory now (a long-lived buffer, at start-up): else the first restore that uses it
        pays a page fault per page. Pinned and device memory are resident already."""
        if self.device.type == "cpu" and not self.pinned:
            self.buffer.zero_()

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_chunks * self.chunk_bytes

    @property
    def room_bytes(self) -> int:
        """The header room before the chunks (allocated with them, never counted as staged bytes)."""
        return self.capacity_chunks * self.headroom


class StagingPool(StagingBuffer):
    """A fixed staging buffer of `capacity_chunks` chunks of `chunk_bytes`, in 1 or 2 slots.

    Two slots split the capacity ceil(W/2) + floor(W/2), so the pool never exceeds W chunks.
    On a CUDA machine host staging is pinned so the install can read it directly.
    """

    def __init__(
        self,
        chunk_bytes: int,
        capacity_chunks: int,
        num_slots: int = 1,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
        headroom: int = 0,
    ) -> None:
        if num_slots not in (1, 2):
            raise ValueError(f"num_slots must be 1 or 2, got {num_slots}")
        super().__init__("staging pool", chunk_bytes, capacity_chunks, headroom, device, pin_memory)
        if num_slots == 2 and capacity_chunks < 2:
            num_slots = 1  # one chunk cannot be split; depth 2 degrades to depth 1
        sizes = [capacity_chunks] if num_slots == 1 else [-(-capacity_chunks // 2), capacity_chunks // 2]
        self.slots: list[Slot] = []
        off = 0
        for i, n in enumerate(sizes):
            self.slots.append(Slot(i, off, n, CompletionEvent(self.device)))
            off += n * self.chunk_stride
        self._cond = threading.Condition()
        self._next = 0
        self._live_chunks = 0
        self._peak_chunks = 0

    # -- meters ----------------------------------------------------------------------------
    @property
    def slot_chunks(self) -> list[int]:
        return [s.capacity_chunks for s in self.slots]

    @property
    def live_bytes(self) -> int:
        with self._cond:
            self._reap()
            return self._live_chunks * self.chunk_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak_chunks * self.chunk_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.live_bytes

    def reset_peak(self) -> None:
        with self._cond:
            self._reap()
            self._peak_chunks = self._live_chunks

    # -- leasing ---------------------------------------------------------------------------
    def acquire(self, num_chunks: int, timeout: float | None = None) -> SlotLease:
        """Lease the next slot (round-robin) for `num_chunks` chunks, waiting for its previous
        install to complete. Raises ValueError if no slot can ever hold `num_chunks`."""
        if num_chunks <= 0:
            raise ValueError(f"num_chunks must be positive, got {num_chunks}")
        if num_chunks > max(self.slot_chunks):
            raise ValueError(
                f"window of {num_chunks} chunks exceeds the staging slot capacity "
                f"({max(self.slot_chunks)} chunks of {self.chunk_bytes:,} B)"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                slot = self._pick(num_chunks)
                if slot is not None:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise StagingWaitTimeout(f"no staging slot free for {num_chunks} chunks within {timeout}s")
                self._cond.wait(0.01 if remaining is None else min(0.01, remaining))
            slot.leased = True
            slot.leased_chunks = num_chunks
            self._live_chunks += num_chunks
            self._peak_chunks = max(self._peak_chunks, self._live_chunks)
            return SlotLease(self, slot, num_chunks, self._view(slot, num_chunks))

    def _view(self, slot: Slot, num_chunks: int) -> torch.Tensor:
        if not self.headroom:
            return self.buffer[slot.offset : slot.offset + num_chunks * self.chunk_bytes]
        rows = self.buffer[slot.offset : slot.offset + num_chunks * self.chunk_stride].view(num_chunks, -1)
        return rows[:, self.headroom :]

    def _pick(self, num_chunks: int) -> Slot | None:
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self._next + k) % n]
            if slot.leased or slot.capacity_chunks < num_chunks:
                continue
            if slot.pending:
                slot.event.synchronize()  # synchronize-then-reuse
                self._finish(slot)
            self._next = (slot.index + 1) % n
            return slot
        return None

    def _finish(self, slot: Slot) -> None:
        self._live_chunks -= slot.leased_chunks
        slot.leased_chunks = 0
        slot.pending = False

    def _reap(self) -> None:
        for slot in self.slots:
            if slot.pending and slot.event.query():
                self._finish(slot)

    def release(self, lease: SlotLease, *, deferred: bool = False) -> None:
        """Give the slot back. Its recorded work must have been synchronized, unless `deferred`:
        then its bytes stay live until the event fires or the slot is next acquired."""
        with self._cond:
            slot = lease.slot
            if not slot.leased:
                raise RuntimeError(f"slot {slot.index} released twice")
            if lease.recorded and not lease.synchronized and not deferred:
                raise RuntimeError(f"slot {slot.index} released before the work recorded on it was synchronized")
            slot.leased = False
            slot.pending = True
            if not deferred:
                self._finish(slot)
            else:
                self._reap()
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait for every pending install and return all bytes not held by a lease."""
        with self._cond:
            for slot in self.slots:
                if slot.pending:
                    slot.event.synchronize()
                    self._finish(slot)
            self._cond.notify_all()
