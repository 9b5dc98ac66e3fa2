"""Worker side (one per TP rank): the registered destinations, the windowed restore before the
forward pass, the store path after it.

Loads run synchronously in start_load_kv (the scheduler marks the step as having synchronous
loads, so vLLM calls it before the forward): the core connector's Retriever restores the plan
window by window (W chunks of staging), falls back to the next tier holding the same prefix, and
agrees on q[r][g] with the other TP ranks over the TP group's CPU (gloo) group. A failed load
reports every block of the request in every group through get_block_ids_with_load_errors().

Saves run in wait_for_save, after the step's forward pass wrote the KV: the complete prompt
chunks are gathered from the destination blocks and put into each saving tier, window by window
(store_prefix: staging bounded by the save window), skipping the prefix the tier already holds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import torch

from ...connector import BSRConnector as CoreConnector
from ...keys import PrefixKeys
from ...store import store_prefix
from ...tiers.base import Tier, TierError
from .config import ConnectorConfig, write_report
from .metadata import BSRConnectorMetadata, SaveSpec
from .metrics import LoadSaveStats
from .registration import destinations

log = logging.getLogger(__name__)
RECORDS = 4096


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, reg, tiers: list[Tier], model: str, tp_rank: int, tp_world: int,
                 agree=None) -> None:
        self.cfg = cfg
        self.reg = reg
        self.tiers = tiers
        self.tp_rank = tp_rank
        self.restore_config = cfg.restore_config(tiers)
        self.core = CoreConnector(reg, tiers, config=self.restore_config, tp_rank=tp_rank, tp_world=tp_world,
                                  salt=cfg.salt, model=model, agree=agree, agree_plan=False,
                                  agree_timeout_s=cfg.agree_timeout_s)
        self.kv: list[torch.Tensor] | None = None
        self.load_async = cfg.load_async(reg.num_groups)
        self._failed_this_step: set[str] = set()
        self._recv_done: set[str] = set()  # async mode: loads finished (committed or failed) since last asked
        self._recv_failed: set[str] = set()
        self.loads: deque[dict] = deque(maxlen=RECORDS)  # the latest load records (tests, demo)
        self.saves: deque[dict] = deque(maxlen=RECORDS)
        self.stats = LoadSaveStats(reg.chunk_bytes)  # vLLM's metrics (get_kv_connector_stats)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = destinations(self.reg, kv_caches)
        self.core.register_kv_caches(self.kv)

    # -- load ------------------------------------------------------------------------------
    def start_load(self, meta: BSRConnectorMetadata) -> None:
        self._failed_this_step = set()
        for outcome in self.core.start_load(meta.loads):
            att = outcome.attempts[-1] if outcome.attempts else None
            rec = {"role": "worker", "rank": self.tp_rank, "event": "load", "request_id": outcome.request_id,
                   "committed": outcome.committed, "num_chunks": outcome.num_chunks,
                   "exposed_tokens": outcome.exposed_tokens, "served_by": outcome.served_by,
                   "tiers_tried": outcome.tiers_tried, "invalid_blocks": outcome.invalid_blocks,
                   "total_blocks": outcome.total_blocks,
                   "peak_staging_bytes": max((a.peak_staging_bytes for a in outcome.attempts), default=0),
                   "window_chunks": self.cfg.window_chunks, "pipeline_depth": self.restore_config.pipeline_depth,
                   "chunk_bytes": self.reg.chunk_bytes,
                   "seconds": sum(a.seconds for a in outcome.attempts), "windows": att.windows if att else 0,
                   "valid_per_group": outcome.valid_per_group, "agreed": outcome.agreed,
                   "fingerprint": self.reg.fingerprint, "model": self.core.keyspace.model, "error": outcome.error}
            self.loads.append(rec)
            self.stats.record_load(rec)
            write_report(self.cfg.report_path, rec)
            if self.load_async:
                self._recv_done.add(outcome.request_id)
                if not outcome.committed:
                    self._recv_failed.add(outcome.request_id)
            self.core.request_finished(outcome.request_id)  # the worker keeps no per-request state
            if not outcome.committed:
                self._failed_this_step.add(outcome.request_id)
                log.warning("BSR: load of %s failed closed (%d blocks invalid): %s", outcome.request_id,
                            outcome.invalid_blocks, outcome.error)

        self.core.get_finished()  # drained: what vLLM hears comes from transfer_results / load errors

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Sync mode: every block of every failed request. Async mode: none (vLLM maps block ids to
        requests only with one KV-cache group; failures go out as failed_recving)."""
        errors = self.core.get_block_ids_with_load_errors()
        return set() if self.load_async else errors

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """Async mode: (finished receiving, failed among them) since the last call."""
        done, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return done, failed

    # -- save ------------------------------------------------------------------------------
    def save(self, meta: BSRConnectorMetadata) -> None:
        for spec in meta.saves:
            if spec.request_id in self._failed_this_step:
                continue  # its blocks hold a failed load; the scheduler saves it again after the recompute
            for i in self.cfg.save_tiers:
                self._save_one(spec, self.tiers[i])

    def _save_one(self, spec: SaveSpec, tier: Tier) -> None:
        assert self.kv is not None, "save before register_kv_caches"
        keyspace = dataclasses.replace(self.core.keyspace, salt=spec.salt)
        end = self._resident_end(spec)
        rec = {"role": "worker", "rank": self.tp_rank, "event": "save", "request_id": spec.request_id,
               "tier": tier.name, "first_chunk": spec.first_chunk, "num_chunks": spec.num_chunks,
               "resident_chunks": end, "overwrite": spec.overwrite}
        t0 = time.perf_counter()
        try:
            first = spec.first_chunk
            if not spec.overwrite and first < end:
                keys = PrefixKeys(keyspace, spec.tokens, self.reg.chunk_tokens).window(first, end - first)
                held = tier.probe(keys)
                first += held.index(False) if False in held else len(held)
            rec["already_held"] = first - spec.first_chunk
            if first < end:
                tables = [torch.tensor(b, dtype=torch.int64) for b in spec.block_ids]
                w = self.cfg.save_window_chunks or self.cfg.window_chunks or 32
                rep = store_prefix(self.reg, tier, keyspace, spec.tokens, self.kv, tables, end,
                                   window_chunks=w, backend=self.cfg.backend, first_chunk=first)
                rec.update(stored=rep.num_chunks, peak_staging_bytes=rep.peak_staging_bytes)
            else:
                rec.update(stored=0, peak_staging_bytes=0)
            rec["ok"] = True
        except (TierError, ValueError, RuntimeError, OSError) as e:  # a failed save is a future miss, not an error
            rec.update(ok=False, error=f"{type(e).__name__}: {e}")
            log.warning("BSR: save of %s into %s failed: %s", spec.request_id, tier.name, rec["error"])
        rec["seconds"] = time.perf_counter() - t0
        self.saves.append(rec)
        self.stats.record_save(rec)
        write_report(self.cfg.report_path, rec)

    def _resident_end(self, spec: SaveSpec) -> int:
        """The end of the run of chunks from first_chunk whose blocks are resident in every group
        (a sliding-window group's blocks that left the window are -1: such a chunk is not stored)."""
        reg = self.reg
        for k in range(spec.first_chunk, spec.num_chunks):
            for g, ids in enumerate(spec.block_ids):
                tpb = reg.group_tokens_per_block(g)
                lo, hi = k * reg.chunk_tokens // tpb, -(-(k + 1) * reg.chunk_tokens // tpb)
                if len(ids) < hi or any(b < 0 for b in ids[lo:hi]):
                    return k
        return spec.num_chunks

    def close(self) -> None:
        self.core.close()
