"""An L2 adapter for LMCache's MP server in tests: BSR's checked FS plugin whose loads obey a control
file named by $BSR_TEST_L2_FAULTS (read on every load, so a test arms and disarms faults while the
server runs):

    {"delete": true}   each object's file is deleted just before it is loaded (an object the lookup
                       saw and the retrieve does not find: deleted between probe and retrieve)
    {"late_s": 3.0}    each load waits that long first (an object that arrives after the deadline)

Loaded by the server as {"type": "plugin", "module_path": "lmcache_faults", "class_name":
"FaultyFSL2Adapter", "config_class_name": "ConcurrentFSL2AdapterConfig", ...} with tests/ on its
PYTHONPATH (`l2_adapter_arg`)."""

from __future__ import annotations

import contextlib
import json
import os
import time

from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename

from bsr_runtime.integrations.lmcache.fs_l2 import ConcurrentFSL2Adapter, ConcurrentFSL2AdapterConfig

__all__ = ["ConcurrentFSL2AdapterConfig", "FaultyFSL2Adapter", "l2_adapter_arg"]

ENV = "BSR_TEST_L2_FAULTS"


def l2_adapter_arg(base_path: str | os.PathLike) -> str:
    return json.dumps({"type": "plugin", "module_path": "lmcache_faults", "class_name": "FaultyFSL2Adapter",
                       "config_class_name": "ConcurrentFSL2AdapterConfig",
                       "adapter_params": {"base_path": os.fspath(base_path)}})


def _faults() -> dict:
    path = os.environ.get(ENV)
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class FaultyFSL2Adapter(ConcurrentFSL2Adapter):
    def _load_one(self, key, obj) -> bool:
        faults = _faults()
        if faults.get("late_s"):
            time.sleep(float(faults["late_s"]))
        if faults.get("delete"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_object_key_to_filename(key), dir_fd=self._base_fd)
        return super()._load_one(key, obj)
