"""The subcommands of `bsr`: demo, sweep, wlaw, ladder, faults and bench."""

from __future__ import annotations

import contextlib
import time

from .args import CliError, load_registration, tier_names
from .engine_demo import engine_demo
from .output import (
    PHASES,
    Progress,
    baseline_table,
    human_bytes,
    line_plot,
    plot_peaks,
    print_table,
    ratio,
    rows_table,
    write_json,
)
from .resources import (
    TOKEN_ID_BYTES,
    check_sweep_fits,
    kv_bytes,
    require_disk,
    require_memory,
    require_tier_disk,
    tier_bytes,
)

OUTPUT_OPTIONS = ("func", "argv", "environ", "json", "plot", "quiet", "record", "root", "engine_log")


def _record(args, figures: dict) -> None:
    """With --record DIR: append the run's provenance record to DIR/bsr_<command>.jsonl. Its settings are
    the options that change what is measured (not where output goes)."""
    if args.record is None:
        return
    from bsr_harness.records import cli_command, record

    settings = {k: v for k, v in vars(args).items() if k not in OUTPUT_OPTIONS}
    record(f"bsr_{args.command}", figures, command=cli_command(args.argv, args.environ), results_dir=args.record,
           settings=settings)


def _tier_options(args, name: str):
    from bsr_harness.tier_setup import TierOptions

    return TierOptions(name=name, root=args.root, load_concurrency=args.load_concurrency,
                       mooncake_master=args.mooncake_master, metadata_server=args.metadata_server,
                       options=dict(getattr(args, "tier_option", None) or ()))


def _store(progress: Progress, src, tier, window_chunks: int = 32) -> None:
    from bsr_harness.experiments import store_source

    with progress.bar(src.num_chunks, f"store -> {tier.name}", "chunk") as bar:
        store_source(src, tier, window_chunks, progress=bar.update)


def _sweep_rows(args, reg, tier_names, tokens, windows, progress, repeat=1, max_staging=None, floor=False):
    """`floor`: each row also gets its tier's own floor (bsr_harness/tier_floor.py) where the tier has one."""
    from bsr_harness.experiments import Destinations, make_source, source_hashes, sweep

    max_chunks = max(tokens) // reg.chunk_tokens
    if max_chunks == 0:
        raise CliError(f"the longest prefix must hold at least one {reg.chunk_tokens}-token chunk")
    check_sweep_fits(args, reg, tier_names, max_chunks, windows)
    progress.say(f"building the source state of {max_chunks} chunks "
                 f"({human_bytes(max_chunks * reg.chunk_bytes)})")
    src = make_source(reg, max_chunks, seed=0)
    expected = source_hashes(src, [t // reg.chunk_tokens for t in tokens])
    dst = Destinations(reg, src.num_chunks, seed=1)
    rows = []
    for name in tier_names:
        with _open_target(args, name, reg, src, windows, progress) as target:
            with progress.bar(len(tokens) * len(windows), f"restore <- {target.name}", "row") as bar:
                def on_row(r, bar=bar):
                    bar.update(1)
                    bar.set_postfix_str(f"{r.tokens} tok W={r.window_chunks}: {r.seconds:.2f}s")
                new = sweep(src, target, tokens, windows, depth=args.depth, fetch_timeout_s=args.timeout,
                            backend=args.backend, expected=expected, dst=dst, repeat=repeat, on_row=on_row)
            if floor:
                _add_floors(new, target.tier, src, repeat)
            rows += new
    return rows


def _add_floors(rows, tier, src, repeat: int) -> None:
    """Each row's tier_floor_s: the tier's own reads of the row's objects at its W (None: no floor)."""
    from bsr_harness.tier_floor import tier_floor
    from bsr_runtime.keys import PrefixKeys

    ct = src.reg.chunk_tokens
    for tokens in sorted({r.tokens for r in rows}):
        n = tokens // ct
        windows = sorted({r.window_chunks for r in rows if r.tokens == tokens})
        floors = tier_floor(tier, PrefixKeys(src.keyspace, src.tokens[: n * ct], ct), n, windows, repeat)
        if floors is None:
            return
        for r in rows:
            if r.tokens == tokens:
                r.tier_floor_s = floors[r.window_chunks]


@contextlib.contextmanager
def _open_target(args, name: str, reg, src, windows, progress: Progress):
    """A sweep target holding `src`: a tier; LMCache's (lmcache-*) with an L1 that holds the largest
    window (or the whole plan when W = 0 is swept)."""
    from bsr_harness.experiments import TierTarget
    from bsr_harness.tier_setup import open_tier

    capacity = src.num_chunks * reg.chunk_bytes
    l1_bytes, store_window = None, 32
    if name.startswith("lmcache-"):
        w_max = src.num_chunks if 0 in windows else max(windows)
        l1_bytes = (w_max + 2) * (reg.chunk_bytes + 4096)
        store_window = min(store_window, w_max)  # a put stages its window in LMCache's L1
    with open_tier(_tier_options(args, name), reg, capacity_bytes=capacity, l1_bytes=l1_bytes) as tier:
        _store(progress, src, tier, store_window)
        yield TierTarget(tier, reg, windows, depth=args.depth, fetch_timeout_s=args.timeout, backend=args.backend,
                         name=name, whole_plan_chunks=src.num_chunks)


def cmd_demo(args) -> int:
    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    from bsr_kernels import presets

    print(f"{reg.describe()}")
    if args.registration.startswith("dsv4"):
        print(f"unscaled c = {presets.dsv4_flash(mtp=args.registration.endswith('mtp')).chunk_bytes:,} B per chunk "
              f"(the paper's figure for MTP off: {presets.PAPER_DSV4_CHUNK_BYTES:,} B); this run: scale {args.scale:g}")
    t0 = time.perf_counter()
    windows = [args.window, 0] if args.window else [0]
    rows = _sweep_rows(args, reg, tier_names(args), args.tokens, windows, progress)
    rows_table(rows)
    bsr = [r for r in rows if r.window_chunks]
    if bsr:
        peaks = {r.peak_staging_bytes for r in bsr}
        print(f"BSR peak staging is the same at every length: {len(peaks) == 1} "
              f"({', '.join(human_bytes(p) for p in sorted(peaks))} = W*c = "
              f"{human_bytes(args.window * reg.chunk_bytes)}); whole-plan peak grows with the prefix.")
    plot_peaks(args.plot, rows, f"{reg.name}: peak staging vs prefix length")
    print(f"plot: {args.plot}; {time.perf_counter() - t0:.0f} s")
    write_json(args.json, [r.to_dict() for r in rows])
    engine = engine_demo(args)
    _record(args, {"rows": [r.to_dict() for r in rows], "engine": engine})
    engine_ok = engine is None or (engine["committed"] and engine["tokens_identical"] and engine["logprobs_identical"])
    return 0 if all(r.state_hash_ok for r in rows) and engine_ok else 1


def cmd_sweep(args) -> int:
    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    print(reg.describe())
    windows = [args.window] + ([0] if args.baseline and args.window else [])
    rows = _sweep_rows(args, reg, tier_names(args), args.tokens, windows, progress, repeat=args.repeat,
                       floor=args.baseline)
    rows_table(rows)
    baseline_table(rows)
    write_json(args.json, [r.to_dict() for r in rows])
    _record(args, {"rows": [r.to_dict() for r in rows]})
    if args.plot:
        plot_peaks(args.plot, rows, f"{reg.name}: peak staging vs prefix length")
    return 0 if all(r.state_hash_ok for r in rows) else 1


def cmd_wlaw(args) -> int:
    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    windows = args.windows
    print(reg.describe())
    rows = _sweep_rows(args, reg, tier_names(args), [args.tokens], windows, progress, repeat=args.repeat,
                       floor=True)
    from bsr_harness.report_sections import WLAW_REFERENCE_W, per_window_extra_s

    ref = {r.tier: r for r in rows if r.window_chunks == WLAW_REFERENCE_W}

    def extra_us(r) -> str:
        x = per_window_extra_s(r.seconds, r.windows, ref[r.tier].seconds if r.tier in ref else None,
                               ref[r.tier].windows if r.tier in ref else None)
        return "-" if x is None else f"{x * 1e6:.0f}"

    print_table(["tier", "W", "peak staging", "W*c", "peak == W*c", "seconds", f"/ W={WLAW_REFERENCE_W}",
                 "tier's own s", f"tier's own / W={WLAW_REFERENCE_W}", f"us / window vs W={WLAW_REFERENCE_W}",
                 *(f"{p} ms" for p in PHASES)],
                [(r.tier, r.window_chunks, human_bytes(r.peak_staging_bytes),
                  human_bytes(min(r.window_chunks, r.chunks) * r.chunk_bytes),
                  "yes" if r.peak_staging_bytes == min(r.window_chunks, r.chunks) * r.chunk_bytes else "NO",
                  f"{r.seconds:.3f}", ratio(r.seconds, ref.get(r.tier) and ref[r.tier].seconds),
                  "-" if r.tier_floor_s is None else f"{r.tier_floor_s:.3f}",
                  ratio(r.tier_floor_s, ref.get(r.tier) and ref[r.tier].tier_floor_s), extra_us(r),
                  *(f"{getattr(r, p + '_s') * 1e3:.1f}" for p in PHASES)) for r in rows])
    print(f"us / window vs W={WLAW_REFERENCE_W}: (seconds - W={WLAW_REFERENCE_W}'s) / (windows - "
          f"W={WLAW_REFERENCE_W}'s): what each extra window costs beyond its bytes (the same bytes move at every W)")
    if any(r.tier_floor_s is not None for r in rows):
        print("tier's own: the tier's own reads of the same objects, W per call, back to back, nothing installed "
              "(Mooncake: bare gets, nothing checked; LMCache: its prefetch, read and release; "
              "bsr_harness/tier_floor.py): what no restore through that tier can go below")
    write_json(args.json, [r.to_dict() for r in rows])
    _record(args, {"rows": [r.to_dict() for r in rows]})
    if args.plot:
        line_plot(args.plot, {tier: [(r.window_chunks, r.peak_staging_bytes / 2**20) for r in rows if r.tier == tier]
                              for tier in sorted({r.tier for r in rows})},
                  "W (chunks)", "peak staging (MiB)", f"{reg.name}, {args.tokens} tokens")
    ok = all(r.state_hash_ok and r.peak_staging_bytes == min(r.window_chunks, r.chunks) * r.chunk_bytes
             for r in rows)
    return 0 if ok else 1


def cmd_ladder(args) -> int:
    from bsr_harness.experiments import Destinations, ladder, make_source
    from bsr_harness.tier_setup import open_tier

    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    print(reg.describe())
    if args.window <= 0:
        raise CliError("--window-chunks must be positive for the BSR side of the ladder")
    tiers = tier_names(args)
    if any(t.startswith("lmcache-") for t in tiers):
        raise CliError("the ladder through LMCache's L1 is benchmarks/lmcache_ladder.py; "
                       "bsr ladder runs on the fs and mooncake tiers")
    max_chunks = max(args.tokens) // reg.chunk_tokens
    if max_chunks == 0:
        raise CliError(f"the longest prefix must hold at least one {reg.chunk_tokens}-token chunk")
    c, kv = reg.chunk_bytes, kv_bytes(reg, max_chunks)
    require_memory("this run", {
        "source state": kv, "destinations": kv, "token ids": max_chunks * reg.chunk_tokens * TOKEN_ID_BYTES,
        "staging": (max_chunks + args.window + min(32, max_chunks)) * c, "tier": tier_bytes(reg, tiers, max_chunks)})
    require_tier_disk(reg, tiers, max_chunks, args.root)
    src = make_source(reg, max_chunks, seed=0)
    dst = Destinations(reg, max_chunks, seed=1)
    rows = []
    for name in tiers:
        with open_tier(_tier_options(args, name), reg, capacity_bytes=max_chunks * reg.chunk_bytes) as tier:
            _store(progress, src, tier)
            with progress.bar(len(args.tokens), f"ladder <- {tier.name}", "prefix") as bar:
                for tokens in args.tokens:
                    rows.append(ladder(src, tier, tokens, args.window, first_rung=args.first_rung,
                                       depth=args.depth, dst=dst))
                    bar.update(1)
    print_table(["tier", "tokens", "chunk bytes", "whole plan N*c", "first passing rung", "rungs tried",
                 "BSR capacity", "BSR pass"],
                [(r["tier"], r["tokens"], f"{r['chunk_bytes']:,}", human_bytes(r["whole_plan_bytes"]),
                  human_bytes(r["first_passing_rung_bytes"]), r["rungs_tried"], human_bytes(r["bsr_capacity_bytes"]),
                  "yes" if r["bsr_pass"] else "NO") for r in rows])
    write_json(args.json, rows)
    _record(args, {"rows": rows})
    if args.plot:
        line_plot(args.plot, {
            "whole plan: first passing rung": [(r["tokens"], (r["first_passing_rung_bytes"] or 0) / 2**20)
                                               for r in rows],
            f"BSR W={args.window}": [(r["tokens"], r["bsr_capacity_bytes"] / 2**20) for r in rows],
        }, "prefix length (tokens)", "staging capacity (MiB)", f"{reg.name}: capacity ladder")
    return 0 if all(r["bsr_pass"] for r in rows) else 1


def cmd_faults(args) -> int:
    from dataclasses import asdict

    from bsr_harness.fault_matrix import EXPECTED, SCENARIOS, run_fault_matrix

    progress = Progress(args.quiet)
    reg = load_registration(args.registration, args.scale)
    print(reg.describe())
    chunks = args.tokens // reg.chunk_tokens
    if chunks < 2 or args.window <= 0:
        raise CliError("faults needs --tokens of at least two chunks and a positive --window-chunks")
    scenarios = SCENARIOS if args.scenarios == "all" else tuple(args.scenarios.split(","))
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise CliError(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    long = 3 * chunks
    require_memory("this run", {
        "source states": 2 * kv_bytes(reg, long) + 2 * kv_bytes(reg, chunks),
        "token ids": 2 * (long + chunks) * reg.chunk_tokens * TOKEN_ID_BYTES,
        "staging": (args.window + 4) * reg.chunk_bytes, "tier": (long + chunks) * reg.chunk_bytes})
    require_disk("this run", None, 2 * (long + chunks) * (reg.chunk_bytes + 4096))
    rows = []
    with progress.bar(len(scenarios), "fault matrix", "scenario") as bar:
        for scenario in scenarios:  # one at a time, so the bar moves
            bar.set_postfix_str(scenario)
            (row,) = run_fault_matrix(reg, scenarios=[scenario], num_chunks=chunks, long_chunks=3 * chunks,
                                      window_chunks=args.window,
                                      depth=2 if args.depth is None else args.depth)  # its tiers overlap at 2
            rows.append(row)
            bar.update(1)
    print_table(["scenario", "outcome", "exposed tokens", "invalid/total blocks", "marker set", "marker cleared",
                 "staging leaked", "served by", "state hash ok", "as expected"],
                [(r.scenario, r.outcome, r.exposed_tokens, f"{r.invalid_blocks}/{r.total_blocks}", r.marker_set,
                  r.marker_cleared, human_bytes(r.staging_leaked_bytes), r.served_by, r.state_hash_ok,
                  "yes" if r.passed and r.outcome == EXPECTED[r.scenario] else "NO") for r in rows])
    figures = [asdict(r) | {"passed": r.passed} for r in rows]
    write_json(args.json, figures)
    _record(args, {"rows": figures})
    return 0 if all(r.passed and r.outcome == EXPECTED[r.scenario] for r in rows) else 1


def cmd_bench(args) -> int:
    import torch

    from bsr_harness.kernel_bench import bench_install

    reg = load_registration(args.registration, args.scale)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    windows = args.windows
    w_max = max(windows)
    if device == "cpu":
        require_memory("this run", {"destinations": kv_bytes(reg, w_max), "staging and copies": 3 * w_max *
                                     reg.chunk_bytes})
    print(f"{reg.describe()} on {device}")
    rows = bench_install(reg, windows, device=device, rounds=args.rounds)
    print_table(["W", "bytes", "backend", "GB/s", "contiguous GB/s", "ratio"],
                [(r["window_chunks"], human_bytes(r["bytes"]), r["backend"], f"{r['gbps']:.2f}",
                  f"{r['contiguous_gbps']:.2f}", f"{r['ratio']:.2f}") for r in rows])
    write_json(args.json, rows)
    _record(args, {"device": device, "rows": rows})
    return 0
