"""Results with provenance: one JSON record per benchmark run, appended to
`benchmarks/results/<benchmark>.jsonl`.

A record says what ran, where and on which code, beside its figures:

    {"benchmark": "bsr_sweep", "commit": "<git HEAD>[-dirty]", "date": "<UTC ISO 8601>",
     "machine": {"cpu", "isa", "cores", "memory_gib", "gpu", "python", "torch", "packages"},
     "command": "<the command line, shell-quoted>", "settings": {<what identifies the configuration>},
     "figures": {<the numbers>}, "notes": "<optional>"}

"-dirty" marks a tree with uncommitted changes to tracked files outside the generated results and
documentation (benchmarks/results, docs, *.md), since those do not change what is measured. Outside
a git checkout the commit is $BSR_COMMIT, else "unknown". `settings` identifies a configuration:
`bsr_harness.report` renders the latest record of each (benchmark, settings) on each kind of machine (its CPU
model: figures differ between the AVX-512 and the AVX2 machines, and goals must hold on both).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
REQUIRED = ("benchmark", "commit", "date", "machine", "command", "figures")
GENERATED_PATHS = (":(exclude)benchmarks/results", ":(exclude)docs", ":(exclude)*.md")
ENV_PREFIXES = ("BSR_", "LMCACHE_", "VLLM_CPU_", "TRITON_INTERPRET")
ENV_IGNORED = {"BSR_DEBUG", "BSR_COMMIT", "LMCACHE_LOG_LEVEL"}  # output only, or provenance itself
# The environment as the process started (before vLLM, LMCache or Triton set variables of their own),
# for a script that imports this module before those.
STARTING_ENVIRONMENT = dict(os.environ)
PACKAGES = ("vllm-cpu", "vllm", "lmcache", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "triton")
_NAME = re.compile(r"[a-z0-9][a-z0-9_]*\Z")


def source_commit(root: Path = REPO_ROOT) -> str:
    """git HEAD of the checkout this package runs from, "-dirty" when tracked code has uncommitted
    changes; $BSR_COMMIT or "unknown" outside a git checkout (e.g. an installed wheel)."""
    fallback = os.environ.get("BSR_COMMIT") or "unknown"
    if not (root / ".git").exists():  # a wheel inside some other repository must not take its HEAD
        return fallback
    try:
        head = _git(root, "rev-parse", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *GENERATED_PATHS)
    except (OSError, subprocess.SubprocessError):
        return fallback
    return head + ("-dirty" if changed else "")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def machine() -> dict[str, Any]:
    """CPU model and vector ISA, cores, memory, GPU (or None), Python, torch and the engine/cache packages present."""
    cpuinfo = _cpuinfo()
    info: dict[str, Any] = {"cpu": _cpu_model(cpuinfo), "isa": cpu_isa(cpuinfo), "cores": os.cpu_count(),
                            "memory_gib": _memory_gib(), "gpu": None, "python": platform.python_version(),
                            "torch": None}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(torch.cuda.current_device())
    except ImportError:
        pass
    info["packages"] = {p: v for p in PACKAGES if (v := _version(p))}
    return info


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_isa(cpuinfo: str | None = None) -> str:
    """The widest x86 vector ISA the CPU flags name ("AVX-512", "AVX2", "x86-64"), else the machine
    (aarch64, ...). `cpuinfo`: the text of /proc/cpuinfo (read when None)."""
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "x86-64" if flags else platform.machine()


def machine_kind(rec: dict) -> str:
    """What the figures of a record depend on beside its settings: the CPU model it ran on (so far AMD EPYC
    machines with AVX2 and Intel Xeon ones with AVX-512; `isa` is recorded from 2026-12-04 on, so records
    from before it are keyed alike)."""
    return str((rec.get("machine") or {}).get("cpu", "?"))


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(program: Sequence[str], args: Sequence[str], env: dict[str, str] | None = None) -> str:
    """The command as typed: the environment settings that change what BSR, LMCache or vLLM's CPU
    backend do (from `env`, default the environment this module found at import), then the program
    and its arguments, shell-quoted."""
    env = STARTING_ENVIRONMENT if env is None else env
    assigns = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
               if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED]
    return " ".join([*assigns, shlex.join([*program, *args])])


def script_command(argv: Sequence[str] | None = None) -> str:
    """`python benchmarks/<script>.py ARGS` for the running script (path relative to the repository)."""
    argv = list(sys.argv if argv is None else argv)
    path = Path(argv[0]).resolve()
    script = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else argv[0]
    return command_line(["python", script], argv[1:])


def cli_command(argv: Sequence[str], env: dict[str, str] | None = None) -> str:
    """`bsr ARGS` for the `bsr` command's arguments."""
    return command_line(["bsr"], argv, env)


def make_record(benchmark: str, figures: dict, *, command: str, settings: dict | None = None,
                notes: str | None = None) -> dict:
    if not _NAME.match(benchmark):
        raise ValueError(f"benchmark name {benchmark!r} must be lower case letters, digits and _")
    if not isinstance(figures, dict) or not figures:
        raise ValueError(f"{benchmark}: figures must be a non-empty mapping")
    record = {"benchmark": benchmark, "commit": source_commit(),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "command": command, "settings": _plain(settings or {}), "figures": _plain(figures)}
    if notes:
        record["notes"] = notes
    return record


def append_record(record: dict, results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """Append one record (from make_record) to results_dir/<benchmark>.jsonl; returns the file."""
    check_record(record, "record")
    path = Path(results_dir) / f"{record['benchmark']}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, allow_nan=False, separators=(",", ":"))
    with path.open("a") as f:
        f.write(line + "\n")
    return path


def record(benchmark: str, figures: dict, *, command: str, results_dir: str | os.PathLike | None = RESULTS_DIR,
           settings: dict | None = None, notes: str | None = None) -> Path | None:
    """make_record + append_record; results_dir None records nothing. Prints where it went (stderr)."""
    if results_dir is None:
        return None
    path = append_record(make_record(benchmark, figures, command=command, settings=settings, notes=notes),
                         results_dir)
    print(f"record appended to {path}", file=sys.stderr)
    return path


def check_record(rec: Any, where: str) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record is a JSON object")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"{where}: record without {', '.join(missing)}")
    if not _NAME.match(str(rec["benchmark"])):
        raise ValueError(f"{where}: bad benchmark name {rec['benchmark']!r}")
    for key in ("commit", "date", "command"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise ValueError(f"{where}: {key} must be a non-empty string")
    for key in ("machine", "figures"):
        if not isinstance(rec[key], dict):
            raise ValueError(f"{where}: {key} must be an object")


def load_records(path: str | os.PathLike) -> list[dict]:
    """Every record of one .jsonl file, in the order appended; a malformed line is a ValueError
    naming the file and line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        check_record(rec, f"{path}:{n}")
        if f"{rec['benchmark']}.jsonl" != Path(path).name:
            raise ValueError(f"{path}:{n}: a {rec['benchmark']} record in another benchmark's file")
        out.append(rec)
    return out


def all_records(results_dir: str | os.PathLike = RESULTS_DIR) -> dict[str, list[dict]]:
    """benchmark -> its records, for every .jsonl file in results_dir."""
    return {p.stem: load_records(p) for p in sorted(Path(results_dir).glob("*.jsonl"))}


def latest(records: Iterable[dict]) -> list[dict]:
    """The last record appended of each distinct `settings` on each kind of machine (machine_kind), in the
    order of their newest runs."""
    newest: dict[str, dict] = {}
    for rec in records:
        key = json.dumps([rec.get("settings", {}), machine_kind(rec)], sort_keys=True)
        newest.pop(key, None)  # re-inserted: the order follows the newest run
        newest[key] = rec
    return list(newest.values())


def _plain(value: Any) -> Any:
    """JSON-safe copy: tuples as lists, paths as strings, NaN/inf as None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# -- the options of a benchmark script -----------------------------------------------------------
def add_record_options(parser: argparse.ArgumentParser, default: str | None = str(RESULTS_DIR)) -> None:
    """--record DIR (where to append this run's record) and --no-record."""
    where = "benchmarks/results" if default == str(RESULTS_DIR) else default
    parser.add_argument("--record", metavar="DIR", default=default,
                        help=f"append this run's record to DIR/<benchmark>.jsonl (default {where})")
    parser.add_argument("--no-record", dest="record", action="store_const", const=None,
                        help="do not append a record")


def script_settings(args: argparse.Namespace, *, omit: Sequence[str] = ()) -> dict:
    """A script's parsed options as its settings, without --record and the options in `omit`
    (output paths and the like, which do not change what is measured)."""
    return {k: v for k, v in vars(args).items() if k != "record" and k not in omit}


def record_script(args: argparse.Namespace, benchmark: str, figures: dict, *, omit: Sequence[str] = (),
                  notes: str | None = None) -> Path | None:
    """The record of a benchmark script's run (its command line, its options as settings)."""
    return record(benchmark, figures, command=script_command(), results_dir=args.record,
                  settings=script_settings(args, omit=omit), notes=notes)
