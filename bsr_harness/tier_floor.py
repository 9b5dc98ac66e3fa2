"""A tier's own floor: what its own reads of a restore's objects cost at each W, with no BSR code around them.

For the W law (`bsr wlaw`) and BSR against the whole plan (`bsr sweep --baseline`): a window costs BSR the
tier's read of its objects plus BSR's own per-window work (keys, staging, the hand-off to the tier's
worker, checks, install). The floor is the first part alone, so a ratio that BSR cannot reach because the
tier itself cannot is shown as such (issue 41: "where a tier cannot get there, ... what is left and why").

Mooncake: a second client of the same master (no segment of its own, the tier's connection options)
reads the same objects (header + payload) with `batch_get_into` into one registered buffer, W objects
per get (the whole plan: gets of the tier's `in_place_batch_bytes`, as its read path does), back to
back on the calling thread, nothing checked or installed while timed. Every get must return every
object whole, and after the timed runs each landed payload must match its header's CRC-32C (a floor
that read nothing, or the wrong bytes, raises instead of reporting).

LMCache (a tier with its own window source: its L1): the tier's own source, each window's prefetch (L2 ->
L1 through LMCache's prefetch controller, the BSR L2 plugin checking each object as it lands), its read
of the L1 objects and their release, back to back, nothing installed; a window whose objects are not all
there raises.

The filesystem tier has no floor here (None): it meets its goals.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from .native_log import redirected


def tier_floor(tier, prefix_keys, num_chunks: int, windows: Sequence[int], repeat: int,
               timeout_s: float = 120.0) -> dict[int, float] | None:
    """{W: median seconds} of the tier's own reads of the first num_chunks objects of `prefix_keys` (a
    PrefixKeys), W objects a call (0: the whole plan's calls), the W's runs interleaved; None for a tier
    without a floor."""
    from bsr_runtime.tiers.mooncake import MooncakeTier

    repeat = max(1, repeat)
    if isinstance(tier, MooncakeTier):
        return _mooncake_floor(tier, prefix_keys.window(0, num_chunks), list(windows), repeat)
    if tier.window_source(prefix_keys, timeout_s) is not None:
        return _source_floor(tier, prefix_keys, num_chunks, windows, repeat, timeout_s)
    return None


def _source_floor(tier, prefix_keys, num_chunks: int, windows: Sequence[int], repeat: int,
                  timeout_s: float) -> dict[int, float]:
    """The tier's own window source over the chunks, W a window, nothing installed."""
    from bsr_runtime.plan import plan_windows

    times: dict[int, list[float]] = {w: [] for w in windows}
    for _ in range(repeat):
        for w in windows:
            source = tier.window_source(prefix_keys, timeout_s)
            t0 = time.perf_counter()
            for window in plan_windows(num_chunks, w):
                _read_window(source, window)
            times[w].append(time.perf_counter() - t0)
    return {w: statistics.median(ts) for w, ts in times.items()}


def _read_window(source, window) -> None:
    submitted = source.submit(window)
    try:
        runs = submitted.fetched()
        got = sum(count for _, count, _ in runs)
        if got != window.num_chunks:
            raise RuntimeError(f"tier floor: window {window.index} gave {got} of its {window.num_chunks} chunks")
        submitted.synchronize(None)
        submitted.release()
    except BaseException:
        submitted.abandon(None)
        raise


def _mooncake_floor(tier, keys: list[str], windows: list[int], repeat: int) -> dict[int, float]:
    from bsr_runtime.tiers.mooncake_client import connect_store, per_key
    from bsr_runtime.tiers.mooncake_reads import sub_batches

    o = tier.options
    with redirected():  # the client's glog lines go to the native log, as the tier's do
        store, _ = connect_store(tier.master_address, tier.metadata_server, protocol=o.protocol,
                                 local_hostname=o.local_hostname, global_segment_size=0,
                                 local_buffer_size=o.local_buffer_size, device_name=o.device_name,
                                 connect_timeout_s=o.connect_timeout_s, rpc_timeout_s=o.rpc_timeout_s,
                                 tenant_id=o.tenant_id)
    ob, n = tier.object_bytes, len(keys)
    buf = torch.empty(n * ob, dtype=torch.uint8)
    buf.fill_(0)  # touched before timing, as BSR's staging is
    ptrs = [buf.data_ptr() + i * ob for i in range(n)]
    try:
        rc = store.register_buffer(buf.data_ptr(), n * ob)
        if rc != 0:
            raise RuntimeError(f"tier floor: register_buffer of {n * ob:,} B returned {rc}")
        gets = {w: ([(s, min(s + w, n)) for s in range(0, n, w)] if w else
                    sub_batches([tier.chunk_bytes] * n, o.in_place_batch_bytes)) for w in windows}
        times: dict[int, list[float]] = {w: [] for w in windows}
        for _ in range(repeat):
            for w in windows:
                t0 = time.perf_counter()
                for s, e in gets[w]:
                    codes = per_key(store.batch_get_into(keys[s:e], ptrs[s:e], [ob] * (e - s)), e - s,
                                    "batch_get_into")
                    if any(c != ob for c in codes):
                        raise RuntimeError(f"tier floor: a get of {keys[s:e]} returned {codes}, "
                                           f"not {ob} B each")
                times[w].append(time.perf_counter() - t0)
        _check_landed(tier, buf.view(n, ob), keys)
        store.unregister_buffer(buf.data_ptr())
    finally:
        with redirected():
            store.close()
    return {w: statistics.median(ts) for w, ts in times.items()}


def _check_landed(tier, rows: torch.Tensor, keys: list[str]) -> None:
    """Every landed object is the one its key names and its payload matches its CRC-32C."""
    from bsr_kernels import host_crc
    from bsr_runtime.tiers.mooncake_object import HEADER_SIZE

    headers = rows[:, :HEADER_SIZE].numpy()
    payloads = [rows[i, HEADER_SIZE:].data_ptr() for i in range(len(keys))]
    bad = tier.codec.problems(keys, headers, payloads, [tier.chunk_bytes] * len(keys), verify=True,
                              landed_crcs=host_crc.crc32c_many(payloads, tier.chunk_bytes))
    if bad:
        raise RuntimeError(f"tier floor: {len(bad)} objects landed wrong, first: {next(iter(bad.values()))}")
