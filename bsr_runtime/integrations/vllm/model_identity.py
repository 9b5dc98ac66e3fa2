"""The model identity of a vLLM engine in BSR's key space: what makes objects saved by one model
invisible to every other model, including the same path after its weights were rewritten.

Without a configured `model_id` it is a digest of the checkpoint's weights (bsr_runtime.weights_digest:
headers, sizes and sampled bytes of every tensor, config.json), not its path: a checkpoint rewritten
in place misses, the same checkpoint opened again or copied elsewhere hits. A model given as a hub
name is digested in the local snapshot vLLM loaded it from. Where no local checkpoint can be found
(another load format, a remote store) the connector refuses to start and asks for a `model_id`,
rather than binding objects to a name whose weights may change. The engine's in-block KV layout
(registration.kv_layout_tag) is appended either way.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ...weights_digest import checkpoint_digest
from .registration import kv_layout_tag

log = logging.getLogger(__name__)


def model_identity(vllm_config, kv_cache_config, override: str | None = None) -> str:
    """`override` (kv_connector_extra_config model_id) or the weights digest of the served checkpoint,
    plus the engine's in-block KV layout."""
    layout = kv_layout_tag(kv_cache_config, vllm_config)
    if override:
        return f"{override}#{layout}"
    mc = vllm_config.model_config
    path = checkpoint_path(mc.model, mc.revision, getattr(vllm_config.load_config, "download_dir", None))
    t0 = time.perf_counter()
    try:
        digest = checkpoint_digest(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"BSR connector: cannot digest the weights of {mc.model!r} at {str(path)!r} ({e}); "
                         "name the model in kv_connector_extra_config 'model_id'") from e
    log.info("BSR: model identity weights:%s (%s, %.3f s)", digest, path, time.perf_counter() - t0)
    return f"weights:{digest}#{layout}"


def checkpoint_path(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local checkpoint of `model`: the path itself, or the hub cache's snapshot of that name."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any lookup failure means: no local checkpoint
        raise ValueError(f"BSR connector: no local checkpoint of {model!r} to digest ({type(e).__name__}: {e}); "
                         "name the model in kv_connector_extra_config 'model_id'") from e
