"""Saves that never stall the engine: the step pays one bounded gather of the chunks it completed into
save staging (memory speed), and the tier puts run on a background thread.

    saver = Saver(reg, save_tiers, staging_chunks=S, keyspace=...)
    saver.save(request_id, tokens, first_chunk, num_chunks, block_ids, salt, overwrite)   # on the step
    saver.take_finished()      one record per save (stored, already held, skipped, failed) since the last call
    saver.forget(request_id)   the request finished: drop its state
    saver.close(timeout_s)     bounded: waits for the puts in flight, then gives up on them

Since the gather reads the destination blocks before `save` returns, no block is read after the step:
the engine may free and reuse a finished request's blocks at once, whatever the puts still do.

Partial chunks: a save with `partial_tokens` stores the prompt's partial chunk (its whole blocks past
its last whole chunk, PrefixKeys') as the object of chunk num_chunks-1, the blocks past it read as
zeros. A partial chunk is dead once a longer prompt stores that chunk whole: the first chunk a request
stores is where an earlier turn's partial chunk would hang, so the saver deletes every partial chunk
that chunk's tokens could have had there, on tiers that can delete (a growing conversation leaves at
most one per stored prompt, not one per turn; a repeat of the shorter prompt recomputes its part).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bsr_kernels import Registration, gather_window
from bsr_kernels.staging_arena import ArenaLease, StagingArena, work_stream

from .keys import KeySpace, PrefixKeys
from .load_blocks import block_align, only_blocks_of
from .tiers.base import FETCH_HEADROOM, Tier, TierError, put_replacing

log = logging.getLogger(__name__)


def resident_chunks_end(reg: Registration, block_ids: Sequence[Sequence[int]], first_chunk: int,
                        num_chunks: int, end_tokens: int | None = None) -> int:
    """The end of the run of chunks from `first_chunk` whose blocks an object holds are resident in
    every group (a sliding-window group's blocks that left the window are -1: such a chunk cannot be
    saved whole; of a group whose objects hold each chunk's tail only, the tail blocks count); the
    last chunk's blocks only up to `end_tokens` (a partial chunk)."""
    for k in range(first_chunk, num_chunks):
        stop = (k + 1) * reg.chunk_tokens if end_tokens is None else min((k + 1) * reg.chunk_tokens, end_tokens)
        for g, ids in enumerate(block_ids):
            lo, hi = reg.chunk_blocks(g, k)
            hi = min(hi, -(-stop // reg.group_tokens_per_block(g)))
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
    partial_tokens: int = 0  # the job's one chunk is the prompt's partial chunk
    sweep_partials: bool = False  # the request's first stored chunk: delete the dead partial chunks there


class Saver:
    def __init__(self, reg: Registration, tiers: Sequence[Tier], *, staging_chunks: int, keyspace: KeySpace,
                 backend: str = "auto", stream=None, zero_gaps: bool = False,
                 on_staged: Callable[[torch.Tensor], None] | None = None) -> None:
        self.reg = reg
        # called on the put thread with each piece's staged bytes, in prefix order, before its puts
        # (store_prefix hashes what it stores); an engine's saver has none
        self.on_staged = on_staged
        # a block not resident (-1) reads as zeros instead of ending the save at its chunk: for states built
        # whole elsewhere (the harness's, store.store_prefix), never an engine's, whose gaps are blocks a
        # sliding window dropped (a chunk saved with zeros there would be served wrong)
        self.zero_gaps = zero_gaps
        self.tiers = list(tiers)
        self.keyspace = keyspace
        self.backend = backend
        # the gathers' stream (None: the destinations' current CUDA stream; on CPU they are synchronous)
        self.stream = stream
        self.kv: list[torch.Tensor] | None = None
        self.arena = StagingArena(reg.chunk_bytes, staging_chunks, headroom=FETCH_HEADROOM)
        for tier in self.tiers:
            tier.register_staging(self.arena.buffer)
        self._next: dict[str, int] = {}  # request -> the next chunk to save (-1: saving stopped)
        self._swept: set[str] = set()  # requests whose first stored chunk's dead partial chunks were deleted
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
             features: tuple[tuple[int, int, str], ...] = (), partial_tokens: int = 0) -> dict | None:
        """Gather chunks first_chunk..num_chunks-1 of the request (those resident in every group) into
        save staging and queue their puts. Returns the record of a save that was skipped or had nothing
        to do at once; None when puts were queued (their record comes from take_finished).
        `partial_tokens`: chunk num_chunks-1 is the prompt's partial chunk of that many tokens (module docstring)."""
        assert self.kv is not None, "save before register_kv_caches"
        rec = {"event": "save", "request_id": request_id, "first_chunk": first_chunk, "num_chunks": num_chunks,
               "overwrite": overwrite, "tiers": [t.name for t in self.tiers], "partial_tokens": partial_tokens}
        end_tokens = None
        if partial_tokens:
            end_tokens = (num_chunks - 1) * self.reg.chunk_tokens + partial_tokens
            block_ids = only_blocks_of(self.reg, [list(b) for b in block_ids], 0, end_tokens, num_chunks)
        nxt = self._next.get(request_id, 0)
        if overwrite and first_chunk == 0:
            nxt = 0  # a rewrite of the request (its load failed): from the start
        if nxt < 0:
            return self._skipped(rec, "saving stopped at an earlier gap")
        first = max(first_chunk, nxt)
        end = num_chunks if self.zero_gaps else resident_chunks_end(self.reg, block_ids, first, num_chunks, end_tokens)
        rec.update(first_chunk=first, resident_chunks=end)
        if end <= first:
            self._next[request_id] = first if end == num_chunks else -1
            return self._skipped(rec, "no resident chunk to save") if end < num_chunks else None
        space = dataclasses.replace(self.keyspace, salt=salt, features=tuple(features))
        tables = [torch.as_tensor(b, dtype=torch.int64) for b in block_ids]  # a tensor's (int64) is not copied
        at = first
        while at < end:  # in pieces of at most the whole staging
            n = min(end - at, self.arena.capacity_chunks)
            lease = self.arena.try_acquire(n)
            if lease is None:
                self._next[request_id] = -1
                return self._skipped(dict(rec, first_chunk=at), f"no save staging for {n} chunks ("
                                     f"{self.arena.live_bytes:,} of {self.arena.capacity_bytes:,} B in use)")
            self._queue_piece(request_id, tokens, at, n, tables, space, overwrite, lease, dict(rec, first_chunk=at),
                              partial_tokens if at + n == num_chunks else 0, end_tokens)
            at += n
            self._next[request_id] = at if at == num_chunks else -1
        return None

    def _queue_piece(self, request_id: str, tokens: Sequence[int], first: int, n: int, tables, space: KeySpace,
                     overwrite: bool, lease: ArenaLease, rec: dict, partial_tokens: int = 0,
                     end_tokens: int | None = None) -> None:
        t0 = time.perf_counter()
        stream = work_stream(self.kv, self.stream)
        try:
            gather_window(lease.view, self.reg, self.kv, tables, first, n, backend=self.backend, stream=stream,
                          end_tokens=end_tokens)
            # on a GPU the gather may still be writing the staging when it returns: the put thread waits for
            # it (the step thread does not: it goes on with the next step)
            lease.record(stream)
        except BaseException:
            if lease.recorded:
                lease.synchronize()
            lease.release()
            self._next[request_id] = -1
            raise
        job = _SaveJob(request_id, tokens, first, n, space, overwrite, lease, time.perf_counter() - t0, rec,
                       partial_tokens, sweep_partials=request_id not in self._swept)
        self._swept.add(request_id)
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
        self._swept.discard(request_id)
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
                job.lease.synchronize()  # the gather landed: the puts read what it wrote
                self._put(job)
            except BaseException as e:  # noqa: BLE001 - a failed save is a future miss, never an engine error
                error = f"{type(e).__name__}: {e}"
                job.record.update(ok=False, error=error, stored=0, stored_per_tier={},
                                  failed_per_tier={t.name: error for t in self.tiers})
                log.warning("BSR: save of %s failed: %s", job.request_id, job.record["error"])
            finally:
                if not job.lease.synchronized:  # never hand the run out again while a gather may write it
                    log.error("BSR: save staging of %s could not be synchronized; it stays leased", job.request_id)
                else:
                    job.lease.release()
                with self._lock:
                    self._done.append(job.record)
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def _put(self, job: _SaveJob) -> None:
        """The job's chunks into every save tier. The record is per tier (`stored_per_tier`: chunks each
        stored, `failed_per_tier`: why each failed); one tier down does not hide what the others stored."""
        t0 = time.perf_counter()
        chain = self._chain(job)
        keys = chain.window(job.first_chunk, job.num_chunks)
        if job.sweep_partials and not job.partial_tokens:
            self._delete_dead_partials(chain, job.first_chunk)
        if self.on_staged is not None:
            self.on_staged(job.lease.view)
        views = job.lease.chunks()
        stored: dict[str, int] = {}
        held: dict[str, int] = {}  # chunks a tier held already
        failed: dict[str, str] = {}  # a put stores every key or raises: a failed tier stored none of them
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
                failed[tier.name] = f"{type(e).__name__}: {e}"
        job.record.update(ok=not failed, stored=max(stored.values(), default=0), stored_per_tier=stored,
                          failed_per_tier=failed, already_held=min(held.values(), default=0), gather_s=job.gather_s,
                          put_s=time.perf_counter() - t0, seconds=job.gather_s + time.perf_counter() - t0,
                          staging_bytes=job.num_chunks * self.reg.chunk_bytes)
        if failed:
            job.record["error"] = "; ".join(f"{name}: {error}" for name, error in failed.items())
            log.warning("BSR: save of %s failed: %s", job.request_id, job.record["error"])

    def _chain(self, job: _SaveJob) -> PrefixKeys:
        """The request's key chain, kept between its saves so each save hashes only its new chunks."""
        key = (job.request_id, job.keyspace.salt, job.partial_tokens)
        with self._lock:
            keys = self._keys.get(key)
            if keys is None or keys.tokens is not job.tokens:
                keys = self._keys[key] = PrefixKeys(job.keyspace, job.tokens, self.reg.chunk_tokens, job.partial_tokens)
        return keys

    def _delete_dead_partials(self, chain: PrefixKeys, chunk: int) -> None:
        """Chunk `chunk` is stored whole: a partial chunk an earlier, shorter prompt stored there is dead."""
        keys = chain.partial_candidates(chunk, block_align(self.reg))
        for tier in self.tiers:
            try:
                tier.delete(keys)
            except NotImplementedError:
                pass  # a tier that cannot delete ages them out as any object
            except (TierError, OSError, ValueError, RuntimeError) as e:  # a future waste, never a failed save
                log.warning("BSR: dead partial chunks at chunk %d not deleted from %s: %s", chunk, tier.name, e)

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
