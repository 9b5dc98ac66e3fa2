"""What a vLLM request's keys cover beyond its token ids: every input vLLM's own prefix cache keys a
block on (vLLM 0.32, `v1/core/kv_cache_utils.generate_block_hash_extra_keys`), so a hit is the
same state or nothing.

    cache_salt       the request's tenant: added to the connector's salt (keys.request_salt)
    LoRA adapter     vLLM keys on its name and path; BSR also on a digest of the adapter's files
                     (adapter_config.json whole, its weights as the model's are digested), since
                     objects outlive the engine: an adapter rewritten in place must miss
    multimodal items per chunk, as vLLM per block: each item's content hash and its offset
                     relative to the chunk (KeySpace.features)
    prompt embeds    not keyed: a request with prompt embeddings is neither saved nor restored

A request BSR cannot key (prompt embeddings, an adapter whose files cannot be read) is refused:
`KeyInputs.refused` names why, the scheduler neither probes nor saves it and counts it
(`vllm:bsr_requests_unkeyed_total{reason}`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from ...keys import KeyInputs, request_salt
from ...weights_digest import checkpoint_digest

ADAPTER_CONFIG = "adapter_config.json"


class AdapterDigests:
    """Digests of LoRA adapters by path, computed once per version of the files: a cached digest is
    reused while the directory's files keep their names, sizes, inodes and modification times (one
    stat per file per request), and computed again when any of them changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple, str]] = {}

    def digest(self, path: str) -> str:
        sig = _signature(path)
        with self._lock:
            hit = self._cache.get(path)
        if hit is not None and hit[0] == sig:
            return hit[1]
        digest = _adapter_digest(path)
        with self._lock:
            self._cache[path] = (sig, digest)
        return digest


def _signature(path: str) -> tuple:
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_ino, st.st_mtime_ns))
    return tuple(out)


def _adapter_digest(path: str) -> str:
    h = hashlib.sha256(b"bsr-adapter-1")
    config = Path(path) / ADAPTER_CONFIG
    if config.is_file():  # rank, alpha and target modules change the computation
        h.update(config.read_bytes())
    h.update(checkpoint_digest(path).encode())
    return h.hexdigest()


class VllmKeyInputs:
    """planner.Planner's `key_inputs` for vLLM requests (see the module docstring)."""

    def __init__(self) -> None:
        self.adapters = AdapterDigests()

    def __call__(self, base_salt: str, request) -> KeyInputs:
        salt = request_salt(base_salt, request)
        if getattr(request, "prompt_embeds", None) is not None:
            return KeyInputs(salt, refused="prompt_embeds")
        lora = getattr(request, "lora_request", None)
        if lora:
            try:
                digest = self.adapters.digest(lora.lora_path)
            except (OSError, ValueError):  # unreadable or no weight file: cannot be bound
                return KeyInputs(salt, refused="adapter")
            salt = f"{salt}\0lora\0{lora.lora_name}\0{os.fspath(lora.lora_path)}\0{digest}"
        features = tuple((f.mm_position.offset, f.mm_position.length, str(f.identifier))
                         for f in (getattr(request, "mm_features", None) or ()))
        return KeyInputs(salt, tuple(sorted(features)))
