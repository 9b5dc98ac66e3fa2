"""Optional: BSRConnector wrapped as a vLLM v1 KV connector (`KVConnectorBase_V1` + `SupportsHMA`).

vLLM is imported lazily, only when the class is built, so importing this module never needs
vLLM. Written against the interface in vllm/distributed/kv_transfer/kv_connector/v1/base.py
(three-argument __init__ with kv_cache_config; `SupportsHMA.request_finished_all_groups`).

    from bsr_runtime.integrations.vllm.legacy_connector import register_with_vllm
    register_with_vllm()            # KVConnectorFactory name "BSRConnector"
    # --kv-transfer-config '{"kv_connector": "BSRConnector", "kv_role": "kv_consumer",
    #   "kv_connector_extra_config": {"bsr_preset": "dsv4_flash", "bsr_tiers": [
    #       {"type": "mooncake", "master_address": "H:P", "metadata_server": "http://H:P/metadata"},
    #       {"type": "filesystem", "root": "/ssd/bsr"}], "bsr_window_chunks": 32}}'

How the roles split the core (bsr_runtime.connector.BSRConnector):
- scheduler process: one core with no destination tensors; it probes every TP rank's keys
  (`probe_all_ranks`), so N is the prefix every rank holds, and ships LoadSpecs to the
  workers in the step's connector metadata. Force-local markers live here: a load whose
  blocks come back in `invalid_block_ids` sets the marker (update_connector_output); a
  request admitted RUNNING (scheduled_new_reqs) or finished clears it.
- each worker: one core per TP rank holding the registered kv caches; start_load_kv runs the
  step's loads synchronously (windowed restore, tier fallback) and agrees on q[r][g] over
  the TP group's CPU (gloo) process group. A failed load reports every block of the request
  in every group through get_block_ids_with_load_errors(); vLLM then recomputes.
Saving (the store path) is not wired into save_kv_layer here.
"""

from __future__ import annotations

import functools
from typing import Any

CONNECTOR_NAME = "BSRConnector"
_CLASS = None


def build_tiers(reg, specs: list[dict]) -> list:
    """Tiers from config dicts: {"type": "mooncake", ...MooncakeTier kwargs} or
    {"type": "filesystem", "root": ..., ...FilesystemTier kwargs}."""
    from bsr_runtime.tiers import FilesystemTier

    tiers = []
    for spec in specs:
        spec = dict(spec)
        kind = spec.pop("type")
        if kind == "mooncake":
            from bsr_runtime.tiers.mooncake import MooncakeTier

            tiers.append(MooncakeTier(reg.chunk_bytes, reg.fingerprint, spec.pop("master_address"),
                                      spec.pop("metadata_server"), **spec))
        elif kind == "filesystem":
            tiers.append(FilesystemTier(spec.pop("root"), reg.chunk_bytes, reg.fingerprint, **spec))
        else:
            raise ValueError(f"unknown tier type {kind!r} (mooncake | filesystem)")
    return tiers


def registration_from_config(extra: dict):
    from bsr_kernels import Registration, presets

    if "bsr_registration" in extra:
        return Registration.from_dict(extra["bsr_registration"])
    name = extra.get("bsr_preset", "dsv4_flash")
    return getattr(presets, name)(**extra.get("bsr_preset_args", {}))


def make_vllm_connector_class():
    """Build (once) and return the vLLM connector class. Needs vLLM installed."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    from bsr_runtime import commit
    from bsr_runtime.connector import BSRConnector
    from bsr_runtime.restore import RestoreConfig

    class BSRConnectorMetadata(KVConnectorMetadata):
        def __init__(self, loads: list) -> None:
            self.loads = loads

    class BSRVllmConnector(KVConnectorBase_V1, SupportsHMA):
        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            self._reg = registration_from_config(extra)
            self._tiers = build_tiers(self._reg, extra.get("bsr_tiers", []))
            self._layer_names = extra.get("bsr_layer_names")
            config = RestoreConfig(prefetch_window_chunks=int(extra.get("bsr_window_chunks", 32)),
                                   pipeline_depth=int(extra.get("bsr_pipeline_depth", 1)),
                                   fetch_timeout_s=float(extra.get("bsr_fetch_timeout_s", 30.0)))
            world = vllm_config.parallel_config.tensor_parallel_size
            common = dict(config=config, tp_world=world, salt=str(extra.get("bsr_salt", "")),
                          agree_timeout_s=float(extra.get("bsr_agree_timeout_s", commit.DEFAULT_TIMEOUT_S)))
            if role == KVConnectorRole.SCHEDULER:
                self._core = BSRConnector(self._reg, self._tiers, tp_rank=0, probe_all_ranks=True, **common)
                self._inflight: dict[str, set[int]] = {}
            else:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

                group = get_tp_group().cpu_group if world > 1 else None
                agree = functools.partial(commit.agree, group=group)
                self._core = BSRConnector(self._reg, self._tiers, tp_rank=get_tensor_model_parallel_rank(),
                                          agree=agree, agree_plan=False, **common)

        # -- scheduler side --------------------------------------------------------------
        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            return self._core.get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            self._core.update_state_after_alloc(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
            loads = self._core.take_pending_loads()
            load_ids = {spec.request_id for spec in loads}
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                if new.req_id not in load_ids:  # admitted RUNNING without an external load
                    self._core.on_request_running(new.req_id)
            for spec in loads:
                self._inflight[spec.request_id] = {b for ids in spec.block_ids for b in ids if b >= 0}
            return BSRConnectorMetadata(loads)

        def update_connector_output(self, connector_output) -> None:
            invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
            for rid, blocks in list(self._inflight.items()):
                if blocks & invalid:
                    self._core.markers.set(rid, "external load failed (invalid blocks)")
                del self._inflight[rid]  # loads are synchronous: settled in this step

        def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
            self._inflight.pop(request.request_id, None)
            return self._core.request_finished(request, block_ids)

        def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
            self._inflight.pop(request.request_id, None)
            return self._core.request_finished_all_groups(request, block_ids)

        # -- worker side -----------------------------------------------------------------
        def register_kv_caches(self, kv_caches: dict) -> None:
            names = self._layer_names or [s.name for s in self._reg.specs]
            self._core.register_kv_caches([kv_caches[n] for n in names])

        def start_load_kv(self, forward_context, **kwargs) -> None:
            meta = self._get_connector_metadata()
            self._core.start_load(getattr(meta, "loads", []))

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None  # loads complete inside start_load_kv

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

        def get_finished(self, finished_req_ids):
            self._core.get_finished(finished_req_ids)  # drain: loads are synchronous
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self._core.get_block_ids_with_load_errors()

        def shutdown(self) -> None:
            self._core.close()
            for tier in self._tiers:
                tier.close()

    _CLASS = BSRVllmConnector
    return _CLASS


def register_with_vllm(name: str = CONNECTOR_NAME) -> None:
    """Register the connector with vLLM's KVConnectorFactory under `name`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory.register_connector(name, __name__, "BSRVllmConnector")


def __getattr__(name: str):
    if name == "BSRVllmConnector":
        return make_vllm_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
