"""The `bsr` command: demo, sweep, wlaw, ladder, faults and bench.

Every subcommand prints a table, can write its rows as JSON (--json) and, where it has one, a
plot (--plot). Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from .args import (
    PAPER_TOKENS,
    CliError,
    Parser,
    add_common,
    add_window_chunks,
    count_int,
    output_file,
    parse_tokens,
    parse_windows,
    positive_int,
    positive_window,
)
from .commands import cmd_bench, cmd_demo, cmd_faults, cmd_ladder, cmd_sweep, cmd_wlaw


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="bsr",
        description="Bounded-state restoration: restore long KV-cache prefixes from an external tier window "
                    "by window, with local staging bounded by the window size W.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_sweep, _add_wlaw, _add_ladder, _add_faults, _add_bench):
        add(sub)
    return p


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="store a 524032-token scaled DeepSeek-V4-Flash state and restore prefixes "
                                    "with W=32 and the whole-plan path; table and plot",
                       description="The main job on its embedded default: writes the scaled 167-tensor "
                                   "DeepSeek-V4-Flash-like state of a 524032-token prefix to a filesystem tier in "
                                   "a temporary directory (and to a Mooncake master started on 127.0.0.1 when the "
                                   "Mooncake wheel is installed), restores prefixes of 32768..524032 tokens with "
                                   "W=32 and with the whole-plan path (W=0), prints a table and saves a plot of "
                                   "peak staging against prefix length.")
    add_common(d, tier_default="auto")
    d.add_argument("--tokens", type=parse_tokens, default=PAPER_TOKENS, help="prefix lengths (default the paper's)")
    add_window_chunks(d, default=32, help="W in chunks (default 32)")
    d.add_argument("--plot", type=output_file, default="bsr_demo_peak_staging.png",
                   help="PNG to write (default %(default)s)")
    e = d.add_argument_group("real engine (vLLM)")
    e.add_argument("--engine", choices=("auto", "on", "off"), default="auto",
                   help="also run a real vLLM engine on a tiny Llama built here: cold prefill, save, restore "
                        "with small W, output compared (auto: when vLLM is installed)")
    e.add_argument("--engine-tokens", type=positive_int, default=32 * 256 + 100,
                   help="prompt length (default %(default)s)")
    add_window_chunks(e, default=4, help="W of the engine restore (default %(default)s)", type=positive_window,
                      flag="--engine-window-chunks", dest="engine_window")
    e.add_argument("--engine-log", type=output_file, default="bsr_demo_engine.log",
                   help="vLLM's and Mooncake's native output of the engine part goes here (default %(default)s)")
    d.set_defaults(func=cmd_demo)


def _add_sweep(sub) -> None:
    s = sub.add_parser("sweep", help="the E1 sweep: restore several prefix lengths at one W",
                       description="Stores the state of the longest prefix once, then restores each prefix "
                                   "length at --window-chunks (and at W=0 with --baseline); one row per (tokens, W).")
    add_common(s)
    s.add_argument("--tokens", type=parse_tokens, default=PAPER_TOKENS, help="comma-separated prefix lengths")
    add_window_chunks(s, default=32, help="W in chunks (0 = whole plan; default 32)")
    s.add_argument("--baseline", action="store_true", help="also run the whole-plan path (W=0) for every length")
    s.add_argument("--repeat", type=count_int, default=1, help="runs per row; the median is reported (default 1)")
    s.add_argument("--plot", type=output_file, help="PNG of peak staging against prefix length")
    s.set_defaults(func=cmd_sweep)


def _add_wlaw(sub) -> None:
    w = sub.add_parser("wlaw", help="peak staging against W at one prefix length (the W -> RWS law)",
                       description="Restores one prefix (default 262144 tokens) at W in {8,16,32,64}; peak "
                                   "staging must be W*c; each W's median seconds over W=32's, and its phases.")
    add_common(w)
    w.add_argument("--tokens", type=positive_int, default=262144, help="prefix length (default 262144)")
    w.add_argument("--windows", type=parse_windows, default=[8, 16, 32, 64],
                   help="comma-separated W values (default 8,16,32,64)")
    w.add_argument("--repeat", type=count_int, default=3,
                   help="runs per W, the W's runs interleaved; the median is reported (default %(default)s)")
    w.add_argument("--plot", type=output_file, help="PNG of peak staging against W")
    w.set_defaults(func=cmd_wlaw)


def _add_ladder(sub) -> None:
    la = sub.add_parser("ladder", help="whole-plan staging capacity ladder beside BSR at a fixed W",
                        description="For each prefix length the whole-plan path (W=0) runs with staging capacity "
                                    "raised through doubling rungs until the full prefix is restored; BSR runs at "
                                    "--window-chunks with capacity W*c.")
    add_common(la)
    la.add_argument("--tokens", type=parse_tokens, default=[32768, 131072, 262144],
                    help="prefix lengths (default 32768,131072,262144)")
    add_window_chunks(la, default=32, help="BSR window W in chunks (default 32)")
    la.add_argument("--first-rung", type=positive_int, default=1 << 20,
                    help="first capacity rung in bytes (default 1 MiB)")
    la.add_argument("--plot", type=output_file, help="PNG of the first passing rung against prefix length")
    la.set_defaults(func=cmd_ladder)


def _add_faults(sub) -> None:
    f = sub.add_parser("faults", help="run the fault matrix against real tiers",
                       description="Runs each fault scenario (store unavailable, eviction, timeout, corruption, "
                                   "install exception, one rank failing, ...) and prints per scenario: outcome, "
                                   "exposed tokens, invalid blocks, force-local marker, staging leaked, tier that "
                                   "served.")
    add_common(f)
    f.add_argument("--tokens", type=positive_int, default=8192, help="prefix length per scenario (default 8192)")
    add_window_chunks(f, default=4, help="W in chunks (default 4)")
    f.add_argument("--scenarios", default="all", help="comma-separated scenario names (default all)")
    f.set_defaults(func=cmd_faults)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="per-window install microbenchmark of every backend on this machine",
                       description="Installs one window of W chunks for each W with every backend present "
                                   "(torch; Triton and CUDA on a GPU) and a contiguous copy of the same bytes.")
    add_common(b)
    b.add_argument("--windows", type=parse_windows, default=[1, 8, 16, 32, 64],
                   help="comma-separated W values (default 1,8,16,32,64)")
    b.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="cpu, cuda or auto (default)")
    b.add_argument("--rounds", type=count_int, default=5, help="timed rounds per case; the fastest counts (default 5)")
    b.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # LMCache logs every prefetch at INFO
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv, args.environ = argv, dict(os.environ)  # the command line of the provenance record (--record)
    from bsr_harness.mooncake_launcher import MooncakeMasterError
    from bsr_runtime.tiers.base import TierError

    try:
        return args.func(args)
    except (CliError, ValueError, TierError, MooncakeMasterError, OSError, TimeoutError) as e:
        return _one_line_error(args.command, f"error: {e}", 2)
    except MemoryError:
        return _one_line_error(args.command, "error: out of memory (use shorter --tokens or a smaller --scale)", 2)
    except KeyboardInterrupt:
        print(f"bsr {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - still one line, never a traceback (BSR_DEBUG=1 shows it)
        if os.environ.get("BSR_DEBUG"):
            raise
        if isinstance(e, RuntimeError) and "allocate" in str(e):  # torch's allocator gave up
            return _one_line_error(args.command, f"error: out of memory: {e}", 2)
        return _one_line_error(args.command, f"internal error: {type(e).__name__}: {e} "
                                             "(set BSR_DEBUG=1 for the traceback)", 3)


def _one_line_error(command: str, message: str, code: int) -> int:
    lines = f"bsr {command}: {message}".splitlines() or [f"bsr {command}: error"]
    print(lines[0], file=sys.stderr)
    return code
