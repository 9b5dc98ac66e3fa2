"""The read paths of one Mooncake client, shared by MooncakeTier and the LMCache Mooncake L2 plugin.

`ReadPaths.read(codec, keys, ptrs, sizes, deadline)` lands object i's payload (sizes[i] bytes) at
ptrs[i] and checks it (header against what key i expects, CRC-32C of what landed), in sub-batches
of about `batch_bytes`, by one of three paths (see tiers/mooncake.py for why each exists):
- local: objects in this client's own segment, one checksumming copy (mooncake_local.py);
- landed: whole objects into one of two registered landing buffers, one checksumming copy each
  sub-batch on a verifier thread while the next lands in the other buffer;
- multi: header and payload apart in one multi-buffer get, CRCs in place on a verifier thread.
`collect=False` (the tier) raises the first problem and stops; `collect=True` (the plugin) reads
everything it can and returns {index: TierError} for the objects that must not be used.
Every path returns (or raises) only after every transfer and copy it started has ended.
"""

from __future__ import annotations

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
    """[s, e) ranges of consecutive objects of about batch_bytes (headers included), >= 1 object each."""
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


class ReadPaths:
    def __init__(self, store: Callable[[], object], *, local: LocalSegmentReader | None, land_whole: bool,
                 batch_bytes: int, verifiers: ThreadPoolExecutor, verify_ways: int,
                 registrations: StoreRegistrations, register: Callable[[int, int], None],
                 unregister: Callable[[int], None], error_for: Callable[[str, int, int], TierError],
                 stats: dict[str, int]) -> None:
        self._store = store  # the live client (raises once closed)
        self.local = local
        self.land_whole = land_whole and host_crc.available()
        self.batch_bytes = batch_bytes
        self._verifiers = verifiers
        self._ways = verify_ways
        self._registrations = registrations
        self._error_for = error_for  # (key, code, payload bytes) -> the error of a failed get
        self.stats = stats
        self.headers = RegisteredBuffers(register, unregister)  # header areas
        self.landing = RegisteredBuffers(register, unregister)  # whole objects (landed path)

    def close(self) -> None:
        self.headers.close()
        self.landing.close()

    def read(self, codec: ObjectCodec, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
             deadline: float, *, verify: bool = True, collect: bool = False) -> Problems:
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
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
                path = self._landed if self.land_whole else self._multi
                found: Problems = {}
                try:
                    path(codec, *sub, headers[done * H :], deadline, verify, collect, found)
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
                if self._stopped(s, deadline, pending, collect, problems, len(keys)):
                    break
                offsets = np.cumsum([0] + [H + sizes[i] for i in range(s, e - 1)]).tolist()
                objects = [bufs[k % len(bufs)].data_ptr() + off for off in offsets]
                codes = per_key(self._store().batch_get_into(keys[s:e], objects, [H + sizes[i] for i in range(s, e)]),
                                e - s, "batch_get_into")
                good = self._check_codes(keys, sizes, s, e, codes, collect, problems)
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

    def _multi(self, codec, keys, ptrs, sizes, headers, deadline, verify, collect, problems) -> None:
        taken = self._registrations.take(ptrs, sizes)  # the payloads land straight in the views
        rows = headers[: len(keys) * H].numpy().reshape(len(keys), H)
        base = headers.data_ptr()
        checks: list[Future] = []
        try:
            for s, e in sub_batches(sizes, self.batch_bytes):
                if self._stopped(s, deadline, None, collect, problems, len(keys), checks):
                    break
                bufs = [[base + i * H, ptrs[i]] for i in range(s, e)]
                codes = per_key(self._store().batch_get_into_multi_buffers(
                    keys[s:e], bufs, [[H, sizes[i]] for i in range(s, e)]), e - s, "batch_get_into_multi_buffers")
                good = self._check_codes(keys, sizes, s, e, codes, collect, problems)
                for part in np.array_split(np.asarray(good, dtype=np.int64), min(self._ways, max(1, len(good)))):
                    part = part.tolist()
                    checks.append(self._verifiers.submit(
                        self._check, codec, [keys[i] for i in part], rows[part], [ptrs[i] for i in part],
                        [sizes[i] for i in part], verify, collect, problems, part, None))
        finally:
            wait_all(checks)
            self._registrations.give_back(taken)
        for f in checks:
            f.result()

    # -- steps -------------------------------------------------------------------------------
    def _stopped(self, s, deadline, pending, collect, problems, n, checks=()) -> bool:
        if s == 0:
            return False
        failed = (pending is not None and pending.done() and pending.exception() is not None) or any(
            f.done() and f.exception() is not None for f in checks)
        if failed and not collect:
            return True  # the window already failed
        if time.monotonic() >= deadline:  # the caller stopped waiting: nothing more may land
            late = FetchTimeoutError(f"fetch of {n} objects passed its deadline after {s} had landed")
            for i in range(s, n):
                problems.setdefault(i, late)
            return True
        return False

    def _check_codes(self, keys, sizes, s, e, codes, collect, problems) -> list[int]:
        self.stats["get_calls"] += 1
        good = []
        for i, code in zip(range(s, e), codes, strict=True):
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

