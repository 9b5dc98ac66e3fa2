"""BSR's LMCache server module without an engine: its factory (W = 0 loads nothing, what it cannot
bound is refused with one line), the hit-length rule of its probe, its version guard, and a real
server refusing the module in an LMCache whose handlers differ."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import lmcache_server_util as S
import pytest

from bsr_harness.lmcache_server import LMCacheServer
from bsr_runtime.integrations.lmcache import server_guard
from bsr_runtime.integrations.lmcache.server_lookup import servable_length
from bsr_runtime.integrations.lmcache.server_module import build_server_modules
from bsr_runtime.markers import ForceLocalMarkers


def _build(config: dict, mode: str = "lmcache_driven", transport: str = "zmq"):
    return SimpleNamespace(config=config, modules=(), server_context=None,
                           mp_config=SimpleNamespace(supported_transfer_mode=mode, transport=transport))


def _refusal(build) -> str:
    with pytest.raises(SystemExit) as e:
        build_server_modules(build)
    message = str(e.value.code)
    assert "\n" not in message
    return message


def test_w0_loads_no_module():
    """W = 0: the factory returns nothing, so the server's modules and handlers are LMCache's alone
    (whatever the transfer mode)."""
    assert build_server_modules(_build({"prefetch_window_chunks": 0})) == []
    assert build_server_modules(_build({"prefetch_window_chunks": 0}, mode="engine_driven")) == []


@pytest.mark.parametrize("mode", ["engine_driven", "auto"])
def test_unbounded_transfer_modes_are_refused(mode):
    assert f"--supported-transfer-mode {mode} is refused" in _refusal(_build({"prefetch_window_chunks": 4}, mode))


def test_probe_only_false_and_bad_keys_are_refused():
    assert "probe_only=false" in _refusal(_build({"prefetch_window_chunks": 4, "probe_only": False}))
    message = _refusal(_build({"prefetch_window_chunks": -1, "windw": 3}))
    assert "prefetch_window_chunks" in message and "windw" in message
    assert "--transport grpc is refused" in _refusal(_build({"prefetch_window_chunks": 4}, transport="grpc"))


def test_servable_length_follows_lmcache_fold_rule():
    full, sliding = -1, 2
    assert servable_length([[True, True, False, True]], [full]) == 2
    # a sliding-window row needs only the last w chunks of the prefix
    assert servable_length([[True] * 4, [False, False, True, True]], [full, sliding]) == 4
    assert servable_length([[True] * 4, [True, False, False, True]], [full, sliding]) == 1
    assert servable_length([], []) == 0


def test_force_local_markers_expire_and_clear():
    markers = ForceLocalMarkers(ttl_s=60.0)
    markers.set("r1")
    assert markers.is_set("r1") and not markers.is_set("r2")
    markers.clear_on_teardown("r1")
    assert not markers.is_set("r1")
    markers.ttl_s = 0.0
    markers.set("r3")
    assert not markers.is_set("r3")


def test_guard_accepts_this_lmcache_and_names_a_difference():
    assert server_guard.differences() == []
    changed = dict(server_guard.EXPECTED)
    path = next(iter(changed))
    changed[path] = "(self, key: IPCCacheServerKey) -> None"
    with pytest.raises(server_guard.IncompatibleLMCache, match=r"refused: LMCache \S+ differs from LMCache 0\.5\.6"):
        server_guard.check_lmcache(changed)


_PATCHED_SERVER = """
import runpy, sys
from lmcache.v1.multiprocess.modules import lookup
def lookup_v2(self, key, tp_size, lookup_mode=None):  # a handler of another LMCache
    return None
lookup.LookupModule.lookup = lookup_v2
sys.argv = ["lmcache-server", *sys.argv[1:]]
runpy.run_module("lmcache.v1.multiprocess.server", run_name="__main__")
"""


def test_real_server_refuses_the_module_in_another_lmcache(tmp_path):
    """The stock server, its LookupModule.lookup changed as another LMCache would have it, started
    with the module: it exits with one line naming the version and the difference."""
    server = LMCacheServer(tmp_path / "l2", window_chunks=4, env=S.server_env())
    (tmp_path / "l2").mkdir()
    args = server.args()
    proc = subprocess.run([sys.executable, "-c", _PATCHED_SERVER, *args[3:]], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, **S.server_env()})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "BSR server module refused: LMCache" in last and "LookupModule.lookup" in last, proc.stderr[-2000:]
