"""Saves that never stall the engine: the step pays one bounded gather of the chunks it completed into
save staging (memory speed), and the tier puts run on a background thread.

    saver = Saver(reg, save_tiers, staging_chunks=S, keyspace=...)
    saver.save(request_id, tokens, first_chunk, num_chunks, block_ids, salt, overwrite)   # on the step
    saver.take_finished()      one record per save (stored, already held, skipped, failed) since the last call
    saver.forget(request_id)   the request finished: drop its state
    saver.close(timeout_s)     bounded: waits for the puts in flight, then gives up on them

Since the gather reads the destination blocks before `save` returns, no block is read after the step:
the engine may free and reuse a finished request's blocks at once, whatever the puts still do.

Staging: one StagingArena of S chunks. A save that cannot get staging at once is skipped, never
waited for (a future miss, counted); the request's later chunks are then not saved either, since an
object past a gap in the prefix could never be restored.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration, gather_window
from bsr_kernels.staging_arena import ArenaLease, StagingArena

from .keys import KeySpace, PrefixKeys
from .tiers.base import FETCH_HEADROOM, Tier, TierError, put_replacing

log = logging.getLogger(__name__)


def resident_chunks_end(reg: Registration, block_ids: Sequence[Sequence[int]], first_chunk: int,
                        num_chunks: int) -> int:
    """The end of the run of chunks from `first_chunk` whose blocks an object holds are resident in
    every group (a sliding-window group's blocks that left the window are -1: such a chunk cannot be
    saved whole; of a group whose objects hold each chunk's tail only, the tail blocks count)."""
    for k in range(first_chunk, num_chunks):
        for g, ids in enumerate(block_ids):
            lo, hi = reg.chunk_blocks(g, k)
            if len(ids) < hi or any(b < 0 for b in ids[lo:hi]):
                return k
    return num_chunks


@dataclass
class _SaveJob:
    request_id: str
    tokens: Sequence[int]
    first_chunk: int
    num_chunks: int  # chunks gathered, from first_chunk
    keyspace: KeySpace
    overwrite: bool
    lease: ArenaLease
    gather_s: float
    record: dict = field(default_factory=dict)


class Saver:
    def __init__(self, reg: Registration, tiers: Sequence[Tier], *, staging_chunks: int, keyspace: KeySpace,
                 backend: str = "auto") -> None:
        self.reg = reg
        self.tiers = list(tiers)
        self.keyspace = keyspace
        self.backend = backend
        self.kv: list[torch.Tensor] | None = None
        self.arena = StagingArena(reg.chunk_bytes, staging_chunks, headroom=FETCH_HEADROOM)
        for tier in self.tiers:
            tier.register_staging(self.arena.buffer)
        self._next: dict[str, int] = {}  # request -> the next chunk to save (-1: saving stopped)
        self._keys: dict[tuple[str, str], PrefixKeys] = {}  # (request, salt) -> its key chain, walked in order
        self._queue: queue.Queue[_SaveJob | None] = queue.Queue()
        self._done: list[dict] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._thread = threading.Thread(target=self._put_loop, name="bsr-save", daemon=True)
        self._thread.start()

    # -- on the step -----------------------------------------------------------------------
    def save(self, request_id: str, tokens: Sequence[int], first_chunk: int, num_chunks: int,
             block_ids: Sequence[Sequence[int]], salt: str, overwrite: bool = False,
             features: tuple[tuple[int, int, str], ...] = ()) -> dict | None:
        """Gather chunks first_chunk..num_chunks-1 of the request (those resident in every group) into
        save staging and queue their puts. Returns the record of a save that was skipped or had nothing
        to do at once; None when puts were queued (their record comes from take_finished)."""
        assert self.kv is not None, "save before register_kv_caches"
        rec = {"event": "save", "request_id": request_id, "first_chunk": first_chunk, "num_chunks": num_chunks,
               "overwrite": overwrite, "tiers": [t.name for t in self.tiers]}
        nxt = self._next.get(request_id, 0)
        if overwrite and first_chunk == 0:
            nxt = 0  # a rewrite of the request (its load failed): from the start
        if nxt < 0:
            return self._skipped(rec, "saving stopped at an earlier gap")
        first = max(first_chunk, nxt)
        end = resident_chunks_end(self.reg, block_ids, first, num_chunks)
        rec.update(first_chunk=first, resident_chunks=end)
        if end <= first:
            self._next[request_id] = first if end == num_chunks else -1
            return self._skipped(rec, "no resident chunk to save") if end < num_chunks else None
        space = dataclasses.replace(self.keyspace, salt=salt, features=tuple(features))
        tables = [torch.tensor(b, dtype=torch.int64) for b in block_ids]
        at = first
        while at < end:  # in pieces of at most the whole staging
            n = min(end - at, self.arena.capacity_chunks)
            lease = self.arena.try_acquire(n)
            if lease is None:
                self._next[request_id] = -1
                return self._skipped(dict(rec, first_chunk=at), f"no save staging for {n} chunks ("
                                     f"{self.arena.live_bytes:,} of {self.arena.capacity_bytes:,} B in use)")
            self._queue_piece(request_id, tokens, at, n, tables, space, overwrite, lease, dict(rec, first_chunk=at))
            at += n
            self._next[request_id] = at if at == num_chunks else -1
        return None

    def _queue_piece(self, request_id: str, tokens: Sequence[int], first: int, n: int, tables, space: KeySpace,
                     overwrite: bool, lease: ArenaLease, rec: dict) -> None:
        t0 = time.perf_counter()
        try:
            gather_window(lease.view, self.reg, self.kv, tables, first, n, backend=self.backend)
        except BaseException:
            lease.release()
            self._next[request_id] = -1
            raise
        job = _SaveJob(request_id, tokens, first, n, space, overwrite, lease, time.perf_counter() - t0, rec)
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(job)

    def _skipped(self, rec: dict, why: str) -> dict:
        rec.update(ok=True, stored=0, skipped=why, seconds=0.0)
        with self._lock:
            self._done.append(rec)
        return rec

    def forget(self, request_id: str) -> None:
        self._next.pop(request_id, None)
        with self._lock:
            for key in [k for k in self._keys if k[0] == request_id]:
                del self._keys[key]

    def take_finished(self) -> list[dict]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def wait_idle(self, timeout: float) -> bool:
        return self._idle.wait(timeout)

    # -- in the background -----------------------------------------------------------------
    def _put_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._put(job)
            except BaseException as e:  # noqa: BLE001 - a failed save is a future miss, never an engine error
                job.record.update(ok=False, error=f"{type(e).__name__}: {e}")
                log.warning("BSR: save of %s failed: %s", job.request_id, job.record["error"])
            finally:
                job.lease.release()
                with self._lock:
                    self._done.append(job.record)
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def _put(self, job: _SaveJob) -> None:
        t0 = time.perf_counter()
        keys = self._chain(job).window(job.first_chunk, job.num_chunks)
        views = job.lease.chunks()
        stored, held, errors = {}, {}, []
        for tier in self.tiers:
            try:
                todo = list(range(job.num_chunks))
                if not job.overwrite:  # the tier may hold the prefix already (another request saved it)
                    present = tier.probe(keys)
                    todo = [i for i in todo if not present[i]]
                held[tier.name] = job.num_chunks - len(todo)
                if todo:  # replacing whatever is there (a rewrite repairs a damaged object in every tier)
                    put_replacing(tier, [keys[i] for i in todo], [views[i] for i in todo], headroom=self.arena.headroom)
                stored[tier.name] = len(todo)
            except (TierError, ValueError, RuntimeError, OSError) as e:
                errors.append(f"{tier.name}: {type(e).__name__}: {e}")
        job.record.update(ok=not errors, stored=max(stored.values(), default=0), stored_per_tier=stored,
                          already_held=min(held.values(), default=0), gather_s=job.gather_s,
                          put_s=time.perf_counter() - t0, seconds=job.gather_s + time.perf_counter() - t0,
                          staging_bytes=job.num_chunks * self.reg.chunk_bytes)
        if errors:
            job.record["error"] = "; ".join(errors)
            log.warning("BSR: save of %s failed: %s", job.request_id, job.record["error"])

    def _chain(self, job: _SaveJob) -> PrefixKeys:
        """The request's key chain, kept between its saves so each save hashes only its new chunks."""
        key = (job.request_id, job.keyspace.salt)
        with self._lock:
            keys = self._keys.get(key)
            if keys is None or keys.tokens is not job.tokens:
                keys = self._keys[key] = PrefixKeys(job.keyspace, job.tokens, self.reg.chunk_tokens)
        return keys

    # -- shutdown --------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> bool:
        """Let the queued puts finish for up to `timeout_s`, then stop (False: some were still running;
        their staging stays registered, never reused)."""
        done = self.wait_idle(timeout_s)
        self._queue.put(None)
        self._thread.join(max(0.0, timeout_s) if done else 0.0)
        self.arena.close()
        if done:
            for tier in self.tiers:
                tier.unregister_staging(self.arena.buffer)
        else:
            log.warning("BSR saver: puts still running after %.1f s; their staging is left registered", timeout_s)
        return done
