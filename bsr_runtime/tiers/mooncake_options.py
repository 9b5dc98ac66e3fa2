"""MooncakeTierOptions: how a MooncakeTier's client connects, reads and writes (checked here)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_int, check_text, check_timeout


@dataclass(frozen=True)
class MooncakeTierOptions:
    """How a MooncakeTier's client connects and moves data; every field is checked here."""

    protocol: str = "tcp"  # "rdma" on real clusters
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 512 << 20  # this client's segment of the store (0: a pure client)
    local_buffer_size: int = 16 << 20
    device_name: str = ""
    connect_timeout_s: float = 10.0
    rpc_timeout_s: float = 5.0
    tenant_id: str = "default"
    verify: bool = True  # CRC-32C of every payload on fetch
    fetch_workers: int = 2
    verify_batch_bytes: int = 8 << 20  # sub-batch of a fetch checked while the next one lands
    # in place: a read (or a phase of one) in gets of at most this many bytes. Each get costs a
    # round trip and its transfers end together, so fewer, larger gets are faster (64 MiB windows
    # over tcp, one get against 2-3: benchmarks/mooncake_tier_throughput.py); it bounds how late a
    # passed deadline is noticed (one get: ~60 ms at 2 GB/s), not memory (nothing is staged but
    # the views)
    in_place_batch_bytes: int = 128 << 20
    verify_threads: int = 1
    put_batch_bytes: int = 64 << 20
    local_reads: bool = True  # objects in this client's own segment: one checksumming copy (mooncake_local.py)
    # objects from other segments: True = land whole in 2 registered landing buffers of
    # verify_batch_bytes, then one checksumming copy; False = in place (header in the 128 B before
    # the payload, tiers/mooncake_reads.py); None = in place, except over tcp for a read that
    # fits one landing buffer (one get + copy beats the two gets of the in-place phases) or whose
    # views are never adjacent (a two-buffer get per object is slower there than the copy)
    land_whole: bool | None = None

    def __post_init__(self) -> None:
        for name in ("protocol", "local_hostname", "device_name", "tenant_id"):
            check_text(name, getattr(self, name))
        for name in ("connect_timeout_s", "rpc_timeout_s"):
            check_timeout(name, getattr(self, name))
        for name in ("global_segment_size", "local_buffer_size"):
            check_int(name, getattr(self, name), lo=0)
        for name in ("fetch_workers", "verify_threads", "verify_batch_bytes", "in_place_batch_bytes",
                     "put_batch_bytes"):
            check_int(name, getattr(self, name), lo=1)
        for name in ("verify", "local_reads", "land_whole"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "land_whole" and value is None):
                raise ValueError(f"{name} must be a bool, got {value!r}")
