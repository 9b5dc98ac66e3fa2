"""DeepSeek-V4 in vLLM CPU 0.32, as test support: what the tests, the engine benchmark and the demo need
to run the tiny DeepSeek-V4 (bsr_harness.dsv4_model) in a real engine, and vLLM's own KV-cache objects
for it without a forward pass. The connector itself depends on none of this.

What vLLM CPU 0.32 needs here, and why (`setup()`, before vLLM is imported; `patch_vllm()` after):
- Triton in interpreter mode (TRITON_INTERPRET=1): the DeepSeek-V4 metadata builders launch Triton
  kernels (token -> request mapping, SWA indices, compressor slot mapping), which need triton-cpu; with
  only the GPU triton wheel vLLM disables Triton and those kernels become placeholders ("'function'
  object is not subscriptable"). A stand-in "cpu" backend lets vllm.triton_utils accept Triton at import
  and is removed again afterwards (torch inductor, used by the sampler, trips over it).
- The V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), which vLLM picks on such a machine anyway.
- Speed: the sliding-window slot-index kernel of the metadata builder, interpreted, costs one Python
  program per token and layer; it is replaced by the same integer computation in torch
  (`_SwaIndicesTorch`, checked against the interpreted kernel by `check()`, which the engine test runs).
- vLLM 0.32 bug, `KeyError: 'c1a'`: the CPU sparse-SWA metadata builder's build_tile_scheduler
  (models/deepseek_v4/cpu/cpu_mla.py) returns only the swaonly/c4a/c128a keys, while
  DeepseekSparseSWAMetadataBuilder.build (v1/attention/backends/mla/sparse_swa.py) also reads c1a and
  c2a. Patched to return the base class's all-None sentinel for every layer type.
- AVX-512: vLLM CPU's DeepSeek-V4 path calls ops that only its AVX-512 library (_C_AVX512) has
  (AVX512_OPS); on an AVX2 machine the model fails to load. `missing_ops()` names the absent ones, so
  engine tests skip with one line instead of failing.

Because these patches are process-global (and must precede vLLM's import), engines run in a process
of their own: `python -m bsr_harness.dsv4_engine <command> ...` (`run_scenario`), one JSON line out.

`kv_cache_objects(model)`: vLLM's own objects for the model, as the engine core builds them, without
weights or a forward pass: the model built on the meta device (its layers register in the config's
static forward context), each layer's `get_kv_cache_spec`, the KV-cache layout resolved as the engine
core resolves it, `get_kv_cache_configs` (the workers' KVCacheConfig) and
`generate_scheduler_kv_cache_config` (the scheduler's). Runs on any x86 machine (no AVX-512 op is
called); in a subprocess too (`python -m bsr_harness.dsv4_engine objects OUT.pkl '[[MODEL, {kwargs}]]'`),
since it initialises torch.distributed.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM CPU's DeepSeek-V4 path: these ops are in _C_AVX512 only (vLLM CPU 0.32)
AVX512_OPS = ("convert_weight_packed", "bmm_cpu", "flash_mla_with_kvcache_cpu", "save_partial_states_cpu",
              "fused_qnorm_rope_kv_insert_cpu", "fused_indexer_q_rope_quant_cpu", "inverse_gptj_rope_o_proj_cpu")

ENGINE_ARGS = dict(skip_tokenizer_init=True, enforce_eager=True, block_size=256, max_model_len=8192, max_num_seqs=4,
                   dtype="bfloat16", seed=0)


class _FakeCpuDriver:
    @staticmethod
    def is_active():
        return True


def setup() -> None:
    """Before vLLM is imported: Triton in interpreter mode with a stand-in "cpu" backend, the V1 runner."""
    if "vllm" in sys.modules:
        raise RuntimeError("bsr_harness.dsv4_engine.setup() must run before vllm is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    import triton.backends as tb

    if "cpu" not in tb.backends:
        tb.backends["cpu"] = tb.Backend(compiler=object, driver=_FakeCpuDriver)


def patch_vllm() -> None:
    """After vLLM is imported: the vLLM 0.32 `KeyError: 'c1a'` work-around; the stand-in backend goes."""
    import triton.backends as tb
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa as s

    def build_tile_scheduler(self, num_decode_tokens):
        return {k: None for k in (s._LAYER_TYPE_SWAONLY, s._LAYER_TYPE_C4A, s._LAYER_TYPE_C128A,
                                  s._LAYER_TYPE_C1A, s._LAYER_TYPE_C2A)}

    cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = build_tile_scheduler
    if tb.backends.get("cpu") is not None and tb.backends["cpu"].driver is _FakeCpuDriver:
        del tb.backends["cpu"]
    if not isinstance(s._COMPUTE_SWA_INDICES_AND_LENS_KERNEL, _SwaIndicesTorch):
        s._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = _SwaIndicesTorch(s._COMPUTE_SWA_INDICES_AND_LENS_KERNEL)


class _SwaIndicesTorch:
    """vLLM's `_compute_swa_indices_and_lens_kernel` (v1/attention/backends/mla/sparse_swa.py) in torch: the
    sliding-window slot indices and lengths of each token, the same integers. Under Triton's interpreter
    the kernel runs one Python program per token and layer (about 17 ms each here: 36 of a 41 s prefill of
    513 tokens, hours for the 43-layer benchmark's prompts). `check()` compares it with the interpreted
    kernel (`triton`, kept here) on random batches."""

    def __init__(self, triton_kernel) -> None:
        self.triton = triton_kernel

    def register_warmup(self, *args, **kwargs) -> None:
        return None

    def __call__(self, swa_indices, swa_lens, window_size, index_width, left_visible, right_visible,
                 query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table, block_size,
                 replay_start, *, num_tokens, token_offset, has_image=False):
        import torch

        n = int(num_tokens)
        if n == 0:
            return
        tok = torch.arange(token_offset, token_offset + n, dtype=torch.int64)
        valid = is_valid_token[tok].bool()
        req = token_to_req_indices[tok].long().clamp(0, query_start_loc.numel() - 2)
        qs, qe = query_start_loc[req].long(), query_start_loc[req + 1].long()
        pos = seq_lens[req].long() - (qe - qs) + tok - qs
        left = left_visible[tok].long() if has_image else torch.zeros_like(pos)
        right = right_visible[tok].long() if has_image else torch.zeros_like(pos)
        left_add = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - left_add).clamp(min=0)
        start = torch.maximum(start, replay_start[req].long())
        end = pos + right + 1
        lens = end - start
        off = torch.arange(index_width, dtype=torch.int64)
        p = start[:, None] + off
        inside = off[None, :] < lens[:, None]
        bi = torch.where(inside, p // block_size, 0).clamp(max=block_table.shape[1] - 1)
        slots = block_table[req[:, None], bi].long() * block_size + p % block_size
        rows = torch.where(inside & valid[:, None], slots, -1)
        out = torch.as_strided(swa_indices, (n, index_width), (swa_indices.stride(0), 1), swa_indices.storage_offset())
        out.copy_(rows.to(swa_indices.dtype))
        swa_lens[:n] = torch.where(valid, lens, 0).to(swa_lens.dtype)

    def check(self, trials: int = 4, seed: int = 0) -> bool:
        """The torch version against the interpreted Triton kernel, on random mixed batches."""
        import torch

        g = torch.Generator().manual_seed(seed)
        for t in range(trials):
            reqs = 1 + t % 3
            qlen = torch.randint(1, 20, (reqs,), generator=g)
            prefix = torch.randint(0, 300, (reqs,), generator=g)
            qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlen.cumsum(0)]).to(torch.int32)
            n = int(qlen.sum())
            seq = (prefix + qlen).to(torch.int32)
            t2r = torch.repeat_interleave(torch.arange(reqs), qlen).to(torch.int32)
            valid = torch.rand(n, generator=g) > 0.1
            table = torch.randint(0, 1000, (reqs, 16), generator=g, dtype=torch.int32)
            replay = torch.randint(0, 50, (reqs,), generator=g, dtype=torch.int32) * (t % 2)
            window, width, bs = 128, 136, 64
            outs = []
            for fn in (self.triton, self):
                idx = torch.full((n + 3, width + 8), 7, dtype=torch.int32)
                lens = torch.full((n + 3,), 7, dtype=torch.int32)
                fn(idx, lens, window, width, lens, lens, qsl, seq, t2r, valid, table, bs, replay,
                   num_tokens=n, token_offset=0)
                outs.append((idx, lens))
            if not (torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])):
                return False
        return True


def force_chunked_prefill() -> None:
    """After vLLM is imported: keep the user's chunked prefill, prefix caching and max_num_batched_tokens for
    DeepSeek-V4. vLLM CPU 0.32's CpuPlatform.check_and_update_config turns them off for every MLA model on a
    machine without AMX (platforms/cpu.py, `amx_mla_or_dsv4_enabled`; its own comment says the DeepSeek-V4
    CPU kernels support both), making a prefill one step of the whole prompt: the compressor-state blocks
    of every prompt token at once (about 19 GB for 64K tokens of the 43-layer model). The benchmark's
    long prompts need the steps bounded."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        keep = (sc.enable_chunked_prefill, cc.enable_prefix_caching, sc.max_num_batched_tokens)
        orig(cls, vllm_config)
        mc = vllm_config.model_config
        if mc is not None and getattr(mc.hf_config, "model_type", None) == "deepseek_v4":
            sc.enable_chunked_prefill, cc.enable_prefix_caching, sc.max_num_batched_tokens = keep

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def cpu_isa() -> dict:
    """The CPU features vLLM CPU chooses its kernels by, and the kernel library it loaded."""
    import torch

    return {"avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
            "amx": torch.cpu._is_amx_tile_supported(),
            "vllm_kernel_library": "_C_AVX512" if torch.cpu._is_avx512_supported() else "_C_AVX2",
            "deepseek_v4_ops_missing": missing_ops()}


def missing_ops() -> list[str]:
    """The AVX512_OPS vLLM CPU's kernel library (loaded here) lacks: empty where DeepSeek-V4 can run."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return [op for op in AVX512_OPS if not hasattr(torch.ops._C, op)]


def skip_reason() -> str | None:
    """One line naming the missing ISA when this machine cannot run DeepSeek-V4 in vLLM CPU, else None;
    asked in a fresh process (importing vLLM's kernels here would fix vLLM's Triton choice)."""
    out = _run_module(["missing-ops"], timeout=300)
    missing = out.get("missing", [])
    if not missing:
        return None
    return (f"vLLM CPU's DeepSeek-V4 path needs AVX-512: torch.ops._C lacks {', '.join(missing)} "
            f"(this CPU's vLLM kernel library is {out.get('library', '?')})")


# -- vLLM's own KV-cache objects, no forward pass ------------------------------------------------


@dataclass
class KVCacheObjects:
    """What the engine core and the model runner hand the connector for one model."""

    worker_config: Any  # KVCacheConfig of the (only) worker: per-layer specs kept
    scheduler_config: Any  # the scheduler's: UniformTypeKVCacheSpecs replaced by their first spec
    layer_specs: dict  # layer name -> its own KVCacheSpec (get_kv_cache_spec)
    layout: str  # the resolved KV-cache layout's name
    kernel_block_sizes: list[int]  # per group, as the model runner allocates

    def kv_caches(self):
        """The KV-cache tensors as vLLM's worker allocates them (vllm.v1.worker.utils.allocate_kv_cache):
        layer name -> [num_blocks, H, N, C] view of one allocation; what register_kv_caches receives."""
        import torch
        from vllm.v1.attention.backends.utils import _layout_from_name
        from vllm.v1.worker.utils import allocate_kv_cache

        return allocate_kv_cache(self.worker_config, torch.device("cpu"), _layout_from_name(self.layout),
                                 self.kernel_block_sizes)


def build_kv_cache_objects(model: str, memory_bytes: int = 256 << 20, **engine_kw: Any) -> KVCacheObjects:
    """In this process (it initialises torch.distributed with one rank): see the module docstring."""
    import tempfile

    import torch
    import torch.distributed as dist
    import vllm.v1.worker.cpu.shm  # noqa: F401 - vLLM CPU's torch.cuda.Event stand-in, as its worker imports it
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop, _torch_cuda_wrapper

    args = {**ENGINE_ARGS, **engine_kw}
    vc = EngineArgs(model=model, **args).create_engine_config()
    with set_current_vllm_config(vc):
        if not dist.is_initialized():
            init_distributed_environment(1, 0, "file://" + tempfile.mktemp(prefix="bsr-dsv4-"), 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    _set_torch_accelerator_to_noop()
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype), torch.device("meta"), \
            _torch_cuda_wrapper():
        cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architectures, vc.model_config)
        cls(vllm_config=vc, prefix="")
        specs = {}
        for name, layer in vc.compilation_config.static_forward_context.items():
            if isinstance(layer, AttentionLayerBase):
                spec = layer.get_kv_cache_spec(vc)
                if spec is not None:
                    specs[name] = spec
        supported = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vc))]
        layout = resolve_kv_cache_layout(vc, [supported], specs.values())
        vc.cache_config.kv_cache_layout = layout.name
        (worker,) = get_kv_cache_configs(vc, [specs], [memory_bytes])
    scheduler = generate_scheduler_kv_cache_config([worker])
    kernel = [g.kv_cache_spec.block_size for g in worker.kv_cache_groups]
    return KVCacheObjects(worker, scheduler, specs, layout.name, kernel)


def kv_cache_objects(model: str, **engine_kw: Any) -> KVCacheObjects:
    """build_kv_cache_objects in a fresh process (torch.distributed and vLLM's config state stay there)."""
    return kv_cache_objects_of([(model, engine_kw)])[0]


def kv_cache_objects_of(models: Sequence[tuple[str, dict]]) -> list[KVCacheObjects]:
    """build_kv_cache_objects of several (model, engine kwargs) in one fresh process."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bsr-dsv4-objects-") as d:
        out = os.path.join(d, "objects.pkl")
        _run_module(["objects", out, json.dumps([list(m) for m in models])], timeout=600)
        with open(out, "rb") as f:
            return pickle.load(f)


# -- engines in a process of their own -----------------------------------------------------------


def _run_module(argv: Sequence[str], timeout: float, env: dict | None = None,
                module: str = "bsr_harness.dsv4_engine") -> dict:
    """`python -m <module> argv...` in a fresh process; its last stdout line as JSON."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               **(env or {})}
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          timeout=timeout, env=environ, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-4000:]
        raise RuntimeError(f"{module} {argv[0]} exited {proc.returncode}:\n{tail}")
    return json.loads(lines[-1])


def run_scenario(name: str, args: dict, timeout: float = 600, env: dict | None = None) -> dict:
    """One engine scenario (bsr_harness.dsv4_scenarios.SCENARIOS) in a fresh process; its result record, or
    {"skipped": one line} where vLLM CPU's kernels lack the DeepSeek-V4 ops."""
    return _run_module([name, json.dumps(args)], timeout=timeout, env=env, module="bsr_harness.dsv4_scenarios")


def make_llm(model: str, kv: dict | None = None, **kw: Any):
    """An in-process DeepSeek-V4 engine (setup() and patch_vllm() done by the caller's process)."""
    from .vllm_engines import make_llm as _make

    args = {**ENGINE_ARGS, "kv_cache_memory_bytes": 1 << 30, "max_num_batched_tokens": 256, **kw}
    for k in ("skip_tokenizer_init", "enforce_eager", "max_num_seqs", "seed"):
        args.pop(k, None)  # make_llm sets these
    return _make(model, kv, **args)


def _as_avx2_machine() -> None:
    """BSR_DSV4_AS_AVX2=1: this process plays an AVX2-only machine (vLLM CPU then loads its _C_AVX2 library,
    which lacks AVX512_OPS), to check the skip and the no-forward-pass path on an AVX-512 machine."""
    if os.environ.get("BSR_DSV4_AS_AVX2") == "1":
        import torch

        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False


def prepare_process() -> list[str]:
    """A fresh process ready for a DeepSeek-V4 engine: setup(), vLLM imported, patch_vllm(); returns
    missing_ops() (empty: the engine can run)."""
    _as_avx2_machine()
    setup()
    import vllm  # noqa: F401 - after setup(): vLLM decides on Triton at import

    patch_vllm()
    return missing_ops()


def check_swa_indices() -> bool:
    """The torch stand-in of vLLM's SWA slot-index kernel against the interpreted kernel (patch_vllm first)."""
    from vllm.v1.attention.backends.mla import sparse_swa

    return sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL.check()


def _main(argv: list[str]) -> int:
    _as_avx2_machine()
    cmd = argv[0]
    if cmd == "objects":
        setup()
        import vllm  # noqa: F401

        patch_vllm()
        from bsr_harness import dsv4_engine  # the package's module, not __main__: the pickle names its class

        objs = [dsv4_engine.build_kv_cache_objects(model, **kw) for model, kw in json.loads(argv[2])]
        with open(argv[1], "wb") as f:
            pickle.dump(objs, f)
        print(json.dumps({"ok": True, "groups": [len(o.worker_config.kv_cache_groups) for o in objs]}))
        return 0
    if cmd == "missing-ops":
        missing = missing_ops()
        import torch

        lib = "_C_AVX512" if torch.cpu._is_avx512_supported() else "_C_AVX2"
        print(json.dumps({"missing": missing, "library": lib}))
        return 0
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
