"""BSR as a vLLM v1 KV connector (the only package of BSR that imports vLLM).

    from vllm import LLM
    llm = LLM(model, kv_transfer_config={
        "kv_connector": "BSRConnector",
        "kv_connector_module_path": "bsr_runtime.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": [{"type": "filesystem", "root": "/ssd/bsr"}], "window_chunks": 32}})

Modules (the configuration, kv_connector_extra_config and its tiers, is engine-neutral:
bsr_runtime/connector_config.py): registration (from the engine's
kv_cache_config and kv_caches), metadata (picklable, scheduler -> workers), scheduler (probe,
markers, save triggers), worker (windowed restore, store path), connector (the vLLM class).
"""

from .connector import BSRConnector
from .metadata import BSRConnectorMetadata, SaveSpec

CONNECTOR_NAME = "BSRConnector"


def register_with_vllm(name: str = CONNECTOR_NAME) -> None:
    """Register with KVConnectorFactory under `name` (this process only; prefer
    kv_connector_module_path, which works in multiprocess mode too)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory.register_connector(name, __name__, "BSRConnector")


__all__ = ["CONNECTOR_NAME", "BSRConnector", "BSRConnectorMetadata", "SaveSpec", "register_with_vllm"]
