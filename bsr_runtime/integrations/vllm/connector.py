"""BSRConnector: the vLLM v1 KV connector (KVConnectorBase_V1 + SupportsHMA) over BSR.

vLLM builds one per role: the scheduler's (SchedulerSide) and one per worker (WorkerSide); this
class only dispatches. Load it by name and module path:

    kv_transfer_config={"kv_connector": "BSRConnector",
                        "kv_connector_module_path": "bsr_runtime.integrations.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"tiers": [{"type": "filesystem", "root": "/ssd/bsr"}],
                                                      "window_chunks": 32}}
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ... import commit
from ...connector_config import ConnectorConfig, open_tiers
from .metadata import BSRConnectorMetadata
from .metrics import BSRConnectorStats, BSRPromMetrics
from .model_identity import model_identity
from .registration import registration_from_kv_cache_config
from .scheduler import SchedulerSide
from .worker import WorkerSide

log = logging.getLogger(__name__)


class BSRConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("the BSR connector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        self.config = cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.registration = reg = registration_from_kv_cache_config(kv_cache_config, cfg.tuning.chunk_tokens,
                                                                         vllm_config=vllm_config)
        if not cfg.load_async and reg.num_groups > 1:
            raise ValueError(f'BSR connector: load_mode "sync" reports failures by block id, which vLLM supports '
                             f'only with one KV-cache group; this model has {reg.num_groups}: use "async"')
        self.model_id = model_identity(vllm_config, kv_cache_config, cfg.model_id)
        world = vllm_config.parallel_config.tensor_parallel_size
        self._stack = contextlib.ExitStack()
        try:
            tiers = open_tiers(cfg, reg, self._stack)
            self.scheduler: SchedulerSide | None = None
            self.worker: WorkerSide | None = None
            if role == KVConnectorRole.SCHEDULER:
                self.scheduler = SchedulerSide(cfg, reg, tiers, self.model_id, world, self._block_ids_of,
                                               kv_cache_config, self._block_pool)
            else:
                rank, agree = 0, None
                if world > 1:
                    rank, group = _agreement_group()
                    agree = functools.partial(commit.agree, group=group)
                per_step = -(-vllm_config.scheduler_config.max_num_batched_tokens // cfg.tuning.chunk_tokens)
                self.worker = WorkerSide(cfg, reg, tiers, self.model_id, rank, world, agree, chunks_per_step=per_step)
        except BaseException:
            self._stack.close()
            raise

    # -- scheduler side --------------------------------------------------------------------
    def _block_ids_of(self, request_id: str):
        assert self._kv_cache_manager is not None, "vLLM bound no KV cache manager to the connector"
        return self._kv_cache_manager.get_block_ids(request_id)

    def _block_pool(self):
        return None if self._kv_cache_manager is None else self._kv_cache_manager.block_pool

    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache() if self.scheduler is not None else True

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """vLLM's first call into the worker's connector in a step, before it prepares the step's inputs:
        background loads start here, a whole forward sooner than in start_load_kv, which vLLM 0.32 calls
        after the step's forward when the step has no sync loads (no forward reads their blocks before vLLM
        hears they finished). Sync loads wait for start_load_kv, which then comes before the forward."""
        if self.worker is not None and self.worker.load_async and isinstance(kv_connector_metadata,
                                                                             BSRConnectorMetadata):
            self.worker.start_load(kv_connector_metadata, hook="handle_preemptions")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, BSRConnectorMetadata)
        self.worker.start_load(meta, hook="start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # async loads are waited for by the scheduler; sync ones complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # saves run once per step in wait_for_save, after every layer wrote its KV

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, BSRConnectorMetadata)
        if meta.saves:
            self.worker.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, BSRConnectorMetadata) and meta.idle
        done, failed = self.worker.transfer_results(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    # -- vLLM's metrics (Prometheus, the periodic log line) ---------------------------------
    def get_kv_connector_stats(self) -> BSRConnectorStats | None:
        if self.worker is not None:
            return self.worker.stats.take(self.worker.levels())
        return self.scheduler.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> BSRConnectorStats:
        return BSRConnectorStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues) -> BSRPromMetrics | None:
        return BSRPromMetrics.create(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()
        self._stack.close()


def _agreement_group():
    """(TP rank, a gloo group of the TP ranks for BSR alone): agreements run on the loader's thread, never
    on the engine's own groups, whose collectives the step thread issues."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

    tp = get_tp_group()
    group = dist.new_group(ranks=list(tp.ranks), backend="gloo", use_local_synchronization=True)
    return get_tensor_model_parallel_rank(), group
