"""The read paths of one Mooncake client, shared by MooncakeTier and the LMCache Mooncake L2 plugin.

`ReadPaths.read(codec, keys, ptrs, sizes, deadline)` lands object i's payload (sizes[i] bytes) at
ptrs[i] and checks it (header against what key i expects, CRC-32C of what landed), in gets of
about `batch_bytes` (landed) or `in_place_batch_bytes` (in place), by one of three paths (see
tiers/mooncake.py for why each exists and which one a read takes):
- local: objects in this client's own segment, one checksumming copy (mooncake_local.py);
- landed: whole objects into one of two registered landing buffers, one checksumming copy each
  sub-batch on a verifier thread while the next lands in the other buffer;
- in place: each object whole, by one transfer, where its payload goes, its header in the H bytes
  before the payload, CRCs in place. With `headroom` >= H (the caller's staging leaves scratch
  before each view, StagingArena(headroom=...); or, per view, the alignment padding of the object
  before it, as LMCache's L1 objects have) every object lands so in one get; otherwise those
  bytes are the tail of the view before it, borrowed and put back (_in_place).
Nothing outside the views and this object's own buffers is ever written.
`collect=False` (the tier) raises the first problem and stops; `collect=True` (the plugin) reads
everything it can and returns {index: TierError} for the objects that must not be used.
Every path returns (or raises) only after every transfer and copy it started has ended.
"""

from __future__ import annotations

import ctypes
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import numpy as np

from bsr_kernels import host_crc

from .base import CorruptObjectError, FetchTimeoutError, TierError
from .mooncake_buffers import StoreRegistrations
from .mooncake_client import per_key
from .mooncake_local import LocalSegmentReader
from .mooncake_object import HEADER_SIZE, ObjectCodec, RegisteredBuffers

Problems = dict[int, TierError]
H = HEADER_SIZE


class _Stop(Exception):
    """The first problem of a raising read (carried out of the sub-batch loop)."""


def sub_batches(sizes: Sequence[int], batch_bytes: int) -> list[tuple[int, int]]:
    """[s, e) ranges of consecutive objects of at most batch_bytes (headers included; an object
    larger than that alone), >= 1 object each. As few as fit, of about equal counts: a get costs
    a round trip however small, so no short batch is left at the end (256 objects of 256 KB in
    32 MiB batches: 85 + 85 + 86, not 127 + 127 + 2)."""
    n, total = len(sizes), sum(sizes) + H * len(sizes)
    k = max(1, -(-total // batch_bytes))
    bounds = [n * j // k for j in range(k + 1)]
    even = [(bounds[j], bounds[j + 1]) for j in range(k) if bounds[j] < bounds[j + 1]]
    if all(sum(sizes[s:e]) + H * (e - s) <= batch_bytes or e - s == 1 for s, e in even):
        return even
    return _greedy_batches(sizes, batch_bytes)  # uneven sizes: fill each batch in turn


def _greedy_batches(sizes: Sequence[int], batch_bytes: int) -> list[tuple[int, int]]:
    out, s, acc = [], 0, 0
    for i, size in enumerate(sizes):
        if i > s and acc + H + size > batch_bytes:
            out.append((s, i))
            s, acc = i, 0
        acc += H + size
    if s < len(sizes):
        out.append((s, len(sizes)))
    return out


def copy_and_checksum(objects: Sequence[int], header_ptrs: Sequence[int], ptrs: Sequence[int],
                      sizes: Sequence[int]) -> np.ndarray:
    """One checksumming copy per payload size (header to header_ptrs[i], payload to ptrs[i]);
    the CRC-32C of each payload as it landed."""
    crcs = np.zeros(len(objects), dtype=np.uint32)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, size in enumerate(sizes):
        groups[size].append(i)
    for size, idx in groups.items():
        crcs[idx] = host_crc.copy_crc32c([objects[i] for i in idx], [header_ptrs[i] for i in idx],
                                         [ptrs[i] for i in idx], H, size)
    return crcs


def run_positions(ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """Each view's place in its run of adjacent views (0: the view before it is not adjacent, or is
    smaller than a header)."""
    pos = [0] * len(ptrs)
    for i in range(1, len(ptrs)):
        if ptrs[i] == ptrs[i - 1] + sizes[i - 1] and sizes[i - 1] >= H:
            pos[i] = pos[i - 1] + 1
    return pos


class _Tails:
    """The H bytes before each of the views at ptrs[i] for i in `index` (read as an (n, H) array)."""

    def __init__(self, ptrs: Sequence[int], index: Sequence[int]) -> None:
        starts = np.asarray([ptrs[i] - H for i in index], dtype=np.int64)
        self._lo = int(starts.min()) if len(starts) else 0
        span = int(starts.max()) + H - self._lo if len(starts) else 0
        self._mem = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(self._lo)) if span else None
        self._at = (starts - self._lo)[:, None] + np.arange(H)

    def read(self) -> np.ndarray:
        return self._mem[self._at] if self._mem is not None else np.empty((0, H), dtype=np.uint8)

    def write(self, rows: np.ndarray) -> None:
        if self._mem is not None:
            self._mem[self._at] = rows


def _crcs_into(crcs: np.ndarray, index: Sequence[int], ptrs: Sequence[int], sizes: Sequence[int],
               tails: np.ndarray | None = None, tail_of: dict[int, int] | None = None) -> None:
    """crcs[i] = CRC-32C of payload i for i in `index`; for i in `tail_of`, the last H bytes are
    taken from tails[tail_of[i]] (the view's own tail, saved while another transfer borrows it).
    A few native calls per sub-batch, not one per object (see host_crc.crc32c_extend_many)."""
    tail_of = tail_of or {}
    groups: dict[int, list[int]] = defaultdict(list)
    for i in index:
        groups[sizes[i] - (H if i in tail_of else 0)].append(i)
    for nbytes, idx in groups.items():
        crcs[idx] = host_crc.crc32c_many([ptrs[i] for i in idx], nbytes)
    ext = [i for i in index if i in tail_of]
    if ext:
        rows = tails.ctypes.data + H * np.asarray([tail_of[i] for i in ext], dtype=np.int64)
        crcs[ext] = host_crc.crc32c_extend_many(crcs[ext], rows, H)


class ReadPaths:
    def __init__(self, store: Callable[[], object], *, local: LocalSegmentReader | None, land_whole: bool | None,
                 batch_bytes: int, in_place_batch_bytes: int, verifiers: ThreadPoolExecutor,
                 registrations: StoreRegistrations, register: Callable[[int, int], None],
                 unregister: Callable[[int], None], error_for: Callable[[str, int, int], TierError],
                 stats: dict[str, int]) -> None:
        self._store = store  # the live client (raises once closed)
        self.local = local
        self.can_land = host_crc.available()  # the landed path's copy is the CPU library's
        self.land_whole = land_whole and self.can_land if land_whole is not None else None
        self.batch_bytes = batch_bytes  # landed: the landing buffers' size
        self.in_place_batch_bytes = in_place_batch_bytes  # in place: the gets of a phase
        self._verifiers = verifiers
        self._registrations = registrations
        self._error_for = error_for  # (key, code, payload bytes) -> the error of a failed get
        self.stats = stats
        self.headers = RegisteredBuffers(register, unregister)  # header areas
        self.landing = RegisteredBuffers(register, unregister)  # whole objects (landed path)

    def close(self) -> None:
        self.headers.close()
        self.landing.close()

    def _lands_whole(self, ptrs: Sequence[int], sizes: Sequence[int], room: bool) -> bool:
        """`room`: some views have scratch bytes before them: in place (one get, no copy) unless
        land_whole=True. Without room, land_whole None (tcp): land whole when the read fits one
        landing buffer (one get and one copy, against two gets in place: over tcp the second get cost more
        than the copy, benchmarks/mooncake_tier_throughput.py's get_path beside in_place_path)
        or when no two views are adjacent (nothing to land in place)."""
        if room:
            return self.land_whole is True
        if self.land_whole is None:
            small = sum(sizes) + H * len(sizes) <= self.batch_bytes
            return self.can_land and (small or not any(run_positions(ptrs, sizes)))
        return self.land_whole

    def read(self, codec: ObjectCodec, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
             deadline: float, *, verify: bool = True, collect: bool = False,
             headroom: int | Sequence[int] = 0) -> Problems:
        """`headroom`: bytes before each view (or before view i) that are scratch (the read may
        overwrite them)."""
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        if isinstance(headroom, Sequence) and len(headroom) != len(keys):
            raise ValueError(f"headroom for {len(headroom)} views, the read has {len(keys)}")
        rooms = [h >= H for h in headroom] if isinstance(headroom, Sequence) else [headroom >= H] * len(keys)
        problems: Problems = {}
        headers = self.headers.acquire(max(1, len(keys)) * H)
        try:
            rest = list(range(len(keys)))
            if self.local is not None and keys:
                rest = self._read_local(codec, keys, ptrs, sizes, headers, verify, collect, problems)
            if rest:
                done = len(keys) - len(rest)  # header rows [0, done) hold the local objects' headers
                sub = (keys, ptrs, sizes) = ([keys[i] for i in rest], [ptrs[i] for i in rest],
                                             [sizes[i] for i in rest])
                found: Problems = {}
                try:
                    sub_rooms = [rooms[i] for i in rest]
                    if self._lands_whole(sub[1], sub[2], any(sub_rooms)):
                        self._landed(codec, *sub, headers[done * H :], deadline, verify, collect, found)
                    else:
                        self._in_place(codec, *sub, headers[done * H :], deadline, verify, collect, found,
                                       sub_rooms)
                finally:
                    problems.update({rest[j]: e for j, e in found.items()})
        except _Stop:
            pass
        finally:
            self.headers.release(headers)
        if problems and not collect:
            raise problems[min(problems)]
        return problems

    # -- the paths ---------------------------------------------------------------------------
    def _read_local(self, codec, keys, ptrs, sizes, headers, verify, collect, problems) -> list[int]:
        local = self.local.addresses(keys, sizes)
        if not local:
            return list(range(len(keys)))
        idx = sorted(local)
        self._copy_and_check(codec, [keys[i] for i in idx], [local[i] for i in idx], headers,
                             [ptrs[i] for i in idx], [sizes[i] for i in idx], verify, collect,
                             problems, index=idx)
        self.stats["local_reads"] += len(idx)
        return [i for i in range(len(keys)) if i not in local]

    def _landed(self, codec, keys, ptrs, sizes, headers, deadline, verify, collect, problems) -> None:
        batches = sub_batches(sizes, self.batch_bytes)
        most = max(sum(H + sizes[i] for i in range(s, e)) for s, e in batches)
        bufs = [self.landing.acquire(most) for _ in range(min(2, len(batches)))]
        pending: Future | None = None
        try:
            for k, (s, e) in enumerate(batches):
                if k and self._stopped(deadline, pending, collect, problems, list(range(s, len(keys)))):
                    break
                offsets = np.cumsum([0] + [H + sizes[i] for i in range(s, e - 1)]).tolist()
                objects = [bufs[k % len(bufs)].data_ptr() + off for off in offsets]
                codes = per_key(self._store().batch_get_into(keys[s:e], objects, [H + sizes[i] for i in range(s, e)]),
                                e - s, "batch_get_into")
                good = self._check_codes(keys, sizes, range(s, e), codes, collect, problems)
                if pending is not None:
                    pending.result()  # sub-batch k-1 checked (or the read stops here): its buffer is free
                    pending = None
                args = (codec, [keys[i] for i in good], [objects[i - s] for i in good], headers[s * H :],
                        [ptrs[i] for i in good], [sizes[i] for i in good], verify, collect, problems, good,
                        [(i - s) * H for i in good])
                if k == len(batches) - 1:  # nothing lands after it: copy here, no hand-off
                    self._copy_and_check(*args)
                else:
                    pending = self._verifiers.submit(self._copy_and_check, *args)
        finally:
            if pending is not None:
                wait_all([pending])
            for b in bufs:
                self.landing.release(b)
        if pending is not None:
            pending.result()

    def _in_place(self, codec, keys, ptrs, sizes, headers, deadline, verify, collect, problems,
                  rooms: Sequence[bool]) -> None:
        """Each object lands whole, by one transfer, where its payload goes: its header in the H
        bytes before the payload. Where `rooms[i]`, those bytes are scratch: object i lands so in the
        first phase. Otherwise, inside a run of adjacent views those bytes are the tail of the view
        before, so a run lands in two phases, even positions first, then odd ones; the tails the odd
        phase overwrites (even views, landed) are saved before it and put back after it whatever
        happened. A run's first object then has no bytes of its own before it: its header lands in
        the header area (a two-buffer get). The CRCs of the even views are computed (from the saved
        tails) on a verifier thread while the odd phase lands."""
        pos = run_positions(ptrs, sizes)
        for i, r in enumerate(rooms):  # a view with room borrows no tail: a run starts there
            pos[i] = 0 if r else (pos[i - 1] + 1 if pos[i] else 0)
        whole = [bool(p) or r for p, r in zip(pos, rooms)]  # lands at ptrs[i] - H
        n, base = len(keys), headers.data_ptr()
        hdr = headers[: n * H].numpy().reshape(n, H)
        even = [i for i in range(n) if pos[i] % 2 == 0]
        odd = [i for i in range(n) if pos[i] % 2 == 1]
        crcs = np.zeros(n, dtype=np.uint32) if verify and host_crc.available() else None
        before = [H if r else 0 for r in rooms]  # the room is written too
        taken = self._registrations.take([p - b for p, b in zip(ptrs, before)],
                                         [s + b for s, b in zip(sizes, before)])
        checks: list[Future] = []
        try:
            landed, stopped = self._land(keys, ptrs, sizes, whole, base, hdr, even, odd, True, deadline, collect,
                                         problems, checks)
            if odd and not stopped:
                tails = _Tails(ptrs, odd)  # odd i lands its header in the tail of view i - 1
                saved = tails.read()
                if crcs is not None:
                    after = {i - 1: j for j, i in enumerate(odd)}  # even view -> row of its saved tail
                    checks.append(self._verifiers.submit(_crcs_into, crcs, landed, ptrs, sizes, saved, after))
                    landed = []
                try:
                    more, _ = self._land(keys, ptrs, sizes, whole, base, hdr, odd, [], False, deadline, collect,
                                         problems, checks)
                finally:
                    tails.write(saved)  # the even views whole again
                landed += more
            if crcs is not None:
                _crcs_into(crcs, landed, ptrs, sizes)
            wait_all(checks)
            for f in checks:
                f.result()
            good = [i for i in range(n) if i not in problems]
            self._check(codec, [keys[i] for i in good], hdr[good], [ptrs[i] for i in good],
                        [sizes[i] for i in good], verify, collect, problems, good,
                        None if crcs is None else crcs[good])
        finally:
            wait_all(checks)
            self._registrations.give_back(taken)

    def _land(self, keys, ptrs, sizes, whole, base, hdr, todo, later, first, deadline, collect, problems,
              checks) -> tuple[list[int], bool]:
        """One phase of _in_place: get the objects in `todo` in sub-batches, the headers of those
        landed whole (at ptrs[i] - H) copied to the header area. Returns the ones that landed and
        whether the read stopped early (past the deadline, the objects not started, `later`
        included, are then problems). The first sub-batch of the `first` phase always goes: the fetch checked the
        deadline."""
        landed: list[int] = []
        for s, e in sub_batches([sizes[i] for i in todo], self.in_place_batch_bytes):
            if (s or not first) and self._stopped(deadline, None, collect, problems, todo[s:] + later, checks):
                return landed, True
            part = todo[s:e]
            names = [keys[i] for i in part]
            if all(whole[i] for i in part):  # one buffer per object: the plain get
                codes = per_key(self._store().batch_get_into(names, [ptrs[i] - H for i in part],
                                                             [H + sizes[i] for i in part]), len(part), "batch_get_into")
            else:
                bufs = [[ptrs[i] - H] if whole[i] else [base + i * H, ptrs[i]] for i in part]
                lens = [[H + sizes[i]] if whole[i] else [H, sizes[i]] for i in part]
                codes = per_key(self._store().batch_get_into_multi_buffers(names, bufs, lens),
                                len(part), "batch_get_into_multi_buffers")
            good = self._check_codes(keys, sizes, part, codes, collect, problems)
            inner = [i for i in good if whole[i]]
            hdr[inner] = _Tails(ptrs, inner).read()  # headers that landed in the room or the view before
            landed += good
        return landed, False

    # -- steps -------------------------------------------------------------------------------
    def _stopped(self, deadline, pending, collect, problems, rest, checks=()) -> bool:
        """Whether to start no more transfers: a raising read already failed, or the deadline
        passed (then the objects in `rest`, not started, are FetchTimeoutErrors)."""
        failed = (pending is not None and pending.done() and pending.exception() is not None) or any(
            f.done() and f.exception() is not None for f in checks)
        if failed and not collect:
            return True  # the window already failed
        if time.monotonic() >= deadline:  # the caller stopped waiting: nothing more may land
            late = FetchTimeoutError(f"fetch passed its deadline with {len(rest)} objects not read")
            for i in rest:
                problems.setdefault(i, late)
            return True
        return False

    def _check_codes(self, keys, sizes, part, codes, collect, problems) -> list[int]:
        """The objects of `part` whose get returned their full size; the others become problems."""
        self.stats["get_calls"] += 1
        good = []
        for i, code in zip(part, codes, strict=True):
            if code == H + sizes[i]:
                good.append(i)
                continue
            problems[i] = self._error_for(keys[i], code, sizes[i])
            if not collect:
                raise _Stop
        return good

    def _copy_and_check(self, codec, keys, objects, headers, ptrs, sizes, verify, collect, problems,
                        index, header_offsets=None) -> None:
        n = len(keys)
        base = headers.data_ptr()
        offs = header_offsets if header_offsets is not None else [j * H for j in range(n)]
        crcs = copy_and_checksum(objects, [base + o for o in offs], ptrs, sizes)
        rows = headers.numpy()[np.asarray(offs, dtype=np.int64)[:, None] + np.arange(H)] if n else None
        self._check(codec, keys, rows, ptrs, sizes, verify, collect, problems, index, crcs)

    def _check(self, codec, keys, rows, ptrs, sizes, verify, collect, problems, index, crcs) -> None:
        if not keys:
            return
        bad = codec.problems(keys, rows, ptrs, sizes, verify, first_only=not collect, landed_crcs=crcs)
        for j, reason in bad.items():
            problems[index[j]] = CorruptObjectError(reason)
        self.stats["objects_verified"] += len(keys)
        if bad and not collect:
            raise _Stop

