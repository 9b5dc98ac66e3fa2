"""Arguments of the `bsr` command: constants, argument types, registrations, the shared options."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import threading
from pathlib import Path

PAPER_TOKENS = [32768, 65536, 131072, 262144, 393216, 524032]


DEFAULT_SCALE = 1 / 64  # c = 249,152 B: the 524032-token sweep fits in about 2 GiB here


REGISTRATION_NAMES = ("dsv4-flash", "dsv4-flash-mtp", "llama-like")


MAX_WINDOW = 1 << 16  # = bsr_runtime.restore.MAX_WINDOW_CHUNKS (kept import-free for --help speed)


MAX_COUNT = 1 << 20  # --repeat, --rounds, --load-concurrency: anything above is a typo


# = bsr_harness.tier_setup.TIER_NAMES, the tiers the harness starts (kept import-free for --help); any other
# registered tier type is accepted too (tier_names, at run time)
TIER_CHOICES = ("filesystem", "mooncake", "lmcache-filesystem", "lmcache-mooncake")
# = ("auto", *bsr_kernels.backends.backend_names()), kept import-free for --help (test_config_schemas keeps them equal)
BACKEND_CHOICES = ("auto", "torch", "triton", "cuda", "cpu")


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def add_window_chunks(p: argparse.ArgumentParser, *, default: int, help: str, type=None,
                      flag: str = "--window-chunks", dest: str = "window") -> None:
    """W in chunks as `flag` (the CLI's and every benchmark's spelling)."""
    p.add_argument(flag, dest=dest, type=type or window_int, default=default, help=help, metavar="W")


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be a comma-separated list of integers, got {text!r}") from None
    if not tokens or any(t <= 0 for t in tokens):
        raise argparse.ArgumentTypeError("--tokens needs at least one positive token count")
    return tokens


def int_arg(text: str, lo: int, hi: int | None = None) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
    return v


def non_negative_int(text: str) -> int:
    return int_arg(text, 0)


def positive_int(text: str) -> int:
    return int_arg(text, 1)


def window_int(text: str) -> int:
    """W in chunks: 0 (whole plan) .. MAX_WINDOW."""
    return int_arg(text, 0, MAX_WINDOW)


def positive_window(text: str) -> int:
    """W in chunks where the whole plan is no choice: 1 .. MAX_WINDOW."""
    return int_arg(text, 1, MAX_WINDOW)


def count_int(text: str) -> int:
    return int_arg(text, 1, MAX_COUNT)


def parse_windows(text: str) -> list[int]:
    """A comma-separated list of positive window sizes."""
    try:
        return [int_arg(t, 1, MAX_WINDOW) for t in text.replace(" ", "").split(",") if t] or no_windows(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--windows must be positive window sizes up to {MAX_WINDOW}: {e}") from None


def no_windows(text: str) -> list[int]:
    raise argparse.ArgumentTypeError(f"no window size in {text!r}")


def seconds_type(text: str) -> float:
    """A timeout: a finite number of seconds in (0, threading.TIMEOUT_MAX]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or not 0 < v <= threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds in (0, {threading.TIMEOUT_MAX:g}], "
                                         f"got {text!r}")
    return v


def output_file(text: str) -> str:
    """A file the command writes at the end (--json, --plot, a log): checked when the option enters,
    not after a long run: its directory must exist and take a new file, and it must not be a
    directory or a file that cannot be written."""
    import os

    if not text:
        raise argparse.ArgumentTypeError("expected a file name")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} ({parent}) does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if os.path.exists(text) and not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file (a FIFO or device would block)")
    if not writable_dir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: its directory {parent} is read-only")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is read-only")
    return text


def writable_dir(path: str) -> bool:
    """Whether a file can be created in the directory `path`. Tried (a nameless temporary file, gone
    once closed) rather than asked of the permission bits: root writes through those, not into a
    read-only mount or an immutable directory, and a network filesystem decides at create time."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def tier_list(text: str) -> str:
    """--tier: auto, or a comma-separated list of tier names: the harness's four, or any registered tier type
    (the registry is looked at only for a name not among the four: --help and the common case stay fast)."""
    if text == "auto" or all(n in TIER_CHOICES for n in text.split(",")):
        return text
    from bsr_harness.tier_setup import known_tier_names

    known = known_tier_names()
    for n in text.split(","):
        if n not in known:
            raise argparse.ArgumentTypeError(f"unknown tier {n!r}; choose from {', '.join(known)} or auto")
    return text


def tier_option(text: str) -> tuple[str, object]:
    """--tier-option KEY=VALUE: VALUE as JSON when it parses (numbers, true, lists), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"a tier option is KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def scale_type(text: str) -> float:
    try:
        num, _, den = text.partition("/")  # "1/64" is allowed
        v = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"--scale must be a number in (0, 1] such as 0.015625 or 1/64, got {text!r}")\
            from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"--scale must be in (0, 1], got {v}")
    return v


def existing_dir(text: str) -> str:
    """--record DIR: an existing directory a record can be appended in (checked before the run, which
    may take minutes)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"--record needs an existing directory, got {text!r}")
    if not writable_dir(text):
        raise argparse.ArgumentTypeError(f"--record needs a writable directory, {text!r} is read-only")
    return text


def load_registration(name: str, scale: float):
    from bsr_kernels import presets

    if name == "dsv4-flash":
        return presets.dsv4_flash(mtp=False, scale=scale)
    if name == "dsv4-flash-mtp":
        return presets.dsv4_flash(mtp=True, scale=scale)
    if name == "llama-like":
        return presets.llama_like(layers=32, kv_heads=8, head_dim=128, block_size=16) if scale == 1 else \
            presets.llama_like(layers=32, kv_heads=max(1, round(8 * scale)), head_dim=128, block_size=16)
    if not Path(name).is_file():
        raise CliError(f"--registration {name!r} is neither one of {', '.join(REGISTRATION_NAMES)} nor a file")
    from .registration_file import RegistrationFileError, load_registration_file

    try:
        return load_registration_file(name)
    except RegistrationFileError as e:
        raise CliError(str(e)) from None


def add_common(p: argparse.ArgumentParser, *, tier_default: str = "filesystem") -> None:
    g = p.add_argument_group("state and tier")
    g.add_argument("--registration", default="dsv4-flash", metavar="NAME|FILE",
                   help="dsv4-flash (167 tensors), dsv4-flash-mtp (170), llama-like, or a JSON/YAML file "
                        "with {'chunk_tokens': 256, 'tensors': [{name, dtype, entry_shape, block_size, "
                        "token_ratio, group}, ...]} (default dsv4-flash)")
    g.add_argument("--scale", type=scale_type, default=DEFAULT_SCALE,
                   help="shrink preset entry widths so long prefixes fit in memory here (default 1/64; "
                        "1 = the real widths); ignored for registration files")
    g.add_argument("--tier", type=tier_list, default=tier_default,
                   metavar="filesystem|mooncake|lmcache-filesystem|lmcache-mooncake",
                   help=f"where the state is stored and restored from, a comma-separated list, or any tier type "
                        f"registered (bsr_runtime.tiers.registry) (default {tier_default})")
    g.add_argument("--tier-option", type=tier_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an option of a registered tier type's spec (repeatable; the four above take the flags "
                        "below instead)")
    g.add_argument("--root", help="filesystem tiers: keep the objects in this existing directory (default: a "
                                  "temporary directory, removed afterwards)")
    g.add_argument("--load-concurrency", type=count_int, default=None,
                   help="filesystem tiers: parallel object reads (default $LMCACHE_FS_LOAD_CONCURRENCY or 1)")
    g.add_argument("--mooncake-master", metavar="HOST:PORT",
                   help="use an existing mooncake_master (default: start one on 127.0.0.1 and stop it after)")
    g.add_argument("--metadata-server", metavar="URL",
                   help="its metadata server (default http://HOST:8080/metadata)")
    r = p.add_argument_group("restore")
    r.add_argument("--depth", type=int, choices=(1, 2), default=None,
                   help="pipeline depth: 2 fetches window j+1 while window j installs (default: the tier's, "
                        "2 for the filesystem; Mooncake over tcp and LMCache 2 from windows of 32 MiB, else 1)")
    r.add_argument("--timeout", type=seconds_type, default=120.0,
                   help="fetch timeout per window, seconds (default 120)")
    r.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="install backend (default auto)")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=output_file, metavar="FILE", help="write the rows as JSON to FILE")
    o.add_argument("--quiet", action="store_true", help="no progress bars or notes, just the table")
    o.add_argument("--record", metavar="DIR", type=existing_dir,
                   help="append this run's provenance record (commit, machine, command, figures) to "
                        "DIR/bsr_<command>.jsonl; the repository keeps its results in benchmarks/results")


class Parser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def tier_names(args) -> list[str]:
    """The tiers of --tier (each name checked where it was parsed: tier_list), "auto" resolved."""
    if args.tier != "auto":
        return args.tier.split(",")
    names = ["filesystem"]
    with contextlib.suppress(ImportError, OSError):
        import mooncake.store  # noqa: F401

        names.append("mooncake")
    return names
