"""What the scheduler-side connector ships to the workers each step. Module-level dataclasses
only, so the metadata pickles (the engine core may run in another process than the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...plan import LoadSpec


@dataclass
class SaveSpec:
    """Store prompt chunks first_chunk..num_chunks-1 of a request: the complete chunks whose prefill
    ran in this step (saved while every group's blocks of those tokens are resident, also the
    sliding-window groups' blocks that vLLM frees once they fall out of the window)."""

    request_id: str
    tokens: list[int]  # the tokens of chunks 0..num_chunks-1 (the key chain starts at chunk 0)
    num_chunks: int
    block_ids: list[list[int]]  # per group, from token 0 (-1: not resident)
    salt: str
    overwrite: bool = False  # the request's load failed: rewrite the chunks (repairs damaged objects)
    first_chunk: int = 0
    features: tuple[tuple[int, int, str], ...] = ()  # KeySpace.features of the request
    partial_tokens: int = 0  # chunk num_chunks-1 is the prompt's partial chunk of this many tokens (Saver.save)


@dataclass
class BSRConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)  # started this step (sync: before its forward)
    saves: list[SaveSpec] = field(default_factory=list)  # gathered after its forward (wait_for_save)
    idle: bool = False  # nothing scheduled this step: the workers may wait a little for loads to finish
