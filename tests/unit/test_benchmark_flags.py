"""The benchmarks take W as `--window-chunks` (the CLI's flag): each script's own parser, run on a command
line up to the parse (nothing is measured)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = ["lmcache_ladder", "budget_throughput", "fs_tier_throughput", "fs_restore_efficiency",
           "lmcache_fs_concurrency", "thread_handoff", "vllm_engine", "lmcache_restore_road"]


class Parsed(Exception):
    def __init__(self, args) -> None:
        self.args_ = args


def parsed(script: str, argv: list[str], monkeypatch):
    """The namespace the script's parser makes of `argv` (its main() stopped right after parsing)."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}", BENCHMARKS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse = argparse.ArgumentParser.parse_args

    def stop_after_parse(parser, _argv=None, namespace=None):
        raise Parsed(parse(parser, argv))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parse)
        with pytest.raises(Parsed) as stopped:
            module.main()
    return stopped.value.args_


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_takes_window_chunks(script, monkeypatch):
    if script.startswith("lmcache_"):
        pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")
    assert parsed(script, ["--window-chunks", "3"], monkeypatch).window == 3
    with pytest.raises(SystemExit):
        parsed(script, ["--window-chunks", "x"], monkeypatch)


def test_bench_install_takes_scales_as_fractions(monkeypatch, capsys):
    args = parsed("bench_install", ["--scales", "1/4, 1/64,1", "--windows", "8"], monkeypatch)
    assert args.scales == (0.25, 0.015625, 1.0)
    assert parsed("bench_install", [], monkeypatch).scales == (1 / 16, 1 / 64)
    for bad, why in (("1/0", "not a number"), ("2", "outside (0, 1]"), ("x", "not a number"), ("0", "outside")):
        with pytest.raises(SystemExit):
            parsed("bench_install", ["--scales", bad], monkeypatch)
        assert why in capsys.readouterr().err
