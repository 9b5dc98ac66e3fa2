"""The benchmarks take W as `--window-chunks` (the CLI's flag), their earlier `--window` still read with a
one-line notice: each script's own parser, run on a command line up to the parse (nothing is measured)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bsr_cli import args as cli_args

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = ["lmcache_ladder", "budget_throughput", "fs_tier_throughput", "fs_restore_efficiency",
           "lmcache_fs_concurrency", "thread_handoff", "vllm_engine", "lmcache_restore_road"]


class Parsed(Exception):
    def __init__(self, args) -> None:
        self.args_ = args


def parsed(script: str, argv: list[str]):
    """The namespace the script's parser makes of `argv` (its main() stopped right after parsing)."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}", BENCHMARKS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def stop_after_parse(parser, _argv=None):
        raise Parsed(cli_args.parse_with_notices(parser, argv))

    module.parse_with_notices = stop_after_parse
    with pytest.raises(Parsed) as stopped:
        module.main()
    return stopped.value.args_


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_takes_window_chunks_and_the_earlier_window_with_a_notice(script, capsys):
    if script.startswith("lmcache_"):
        pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")
    assert parsed(script, ["--window-chunks", "3"]).window == 3
    assert "deprecated" not in capsys.readouterr().err  # (stderr may hold LMCache's import-time log lines)
    assert parsed(script, ["--window", "5"]).window == 5
    (notice,) = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert notice.endswith(": --window is deprecated, use --window-chunks")
    with pytest.raises(SystemExit):
        parsed(script, ["--window-chunks", "x"])
