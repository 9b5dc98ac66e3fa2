"""What the scheduler-side connector ships to the workers each step. Module-level dataclasses
only, so the metadata pickles (the engine core may run in another process than the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...connector import LoadSpec


@dataclass
class SaveSpec:
    """Store the complete prompt chunks 0..num_chunks-1 of a request after its prefill."""

    request_id: str
    tokens: list[int]  # the tokens of those chunks
    num_chunks: int
    block_ids: list[list[int]]  # per group, from token 0 (-1: not resident)
    salt: str
    overwrite: bool = False  # the request's load failed: rewrite every chunk (repairs damaged objects)


@dataclass
class BSRConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)  # run before this step's forward
    saves: list[SaveSpec] = field(default_factory=list)  # run after it (wait_for_save)
