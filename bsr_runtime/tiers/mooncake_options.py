"""How a MooncakeTier's client connects (MooncakeConnection), reads and writes (MooncakeTuning): config schemas,
flat in MooncakeTierOptions (the tier's keyword options)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..config_schema import Count, HostBytes, Schema, Seconds, Text

# the transports this Mooncake wheel's Python client sets up ("TCP" or "tpc" used to pass here and
# fail in the client's setup with only "returned -1")
MooncakeProtocol = Literal["tcp", "rdma"]
MAX_REPLICAS = 16
# the one default of a client's segment of the store, for library users and the harness (an engine's connector
# mounts none unless told: registry.py's engine_defaults for both Mooncake tier types)
DEFAULT_SEGMENT_BYTES = 512 << 20
# copies of every object a put stores, each on another store host (Mooncake's ReplicateConfig.replica_num)
ReplicaCount = Annotated[int, Field(ge=1, le=MAX_REPLICAS)]


class MooncakeConnection(Schema):
    """How a Mooncake client joins the store: what a deployment sets."""

    protocol: MooncakeProtocol = "tcp"  # "rdma" on real clusters
    local_hostname: Text = "127.0.0.1"
    global_segment_size: HostBytes = DEFAULT_SEGMENT_BYTES  # this client's segment of the store (0: a pure client)
    local_buffer_size: HostBytes = 16 << 20
    device_name: Text = ""
    connect_timeout_s: Seconds = 10.0
    rpc_timeout_s: Seconds = 5.0
    tenant_id: Text = "default"
    # every object a put stores is stored on this many store hosts (Mooncake places each copy in another
    # host's segment): a restore survives replica_num - 1 lost hosts, at replica_num times the store memory
    # and put traffic (docs/mooncake.md, "A cluster"). Reads use one copy.
    replica_num: ReplicaCount = 1


class MooncakeTuning(Schema):
    """How a Mooncake tier reads, checks and writes: working defaults, measured (a tier spec's `tuning`)."""

    verify: bool = True  # CRC-32C of every payload on fetch
    fetch_workers: Count = 2
    verify_batch_bytes: Count = 8 << 20  # sub-batch of a fetch checked while the next one lands
    # in place: a read (or a phase of one) in gets of at most this many bytes. Each get costs a
    # round trip and its transfers end together, so fewer, larger gets are faster (64 MiB windows
    # over tcp, one get against 2-3: benchmarks/mooncake_tier_throughput.py); it bounds how late a
    # passed deadline is noticed (one get: ~60 ms at 2 GB/s), not memory (nothing is staged but
    # the views)
    in_place_batch_bytes: Count = 128 << 20
    verify_threads: Count = 1
    put_batch_bytes: Count = 64 << 20
    local_reads: bool = True  # objects in this client's own segment: one checksumming copy (mooncake_local.py)
    # objects from other segments: True = land whole in 2 registered landing buffers of
    # verify_batch_bytes, then one checksumming copy; False = in place (header in the 128 B before
    # the payload, tiers/mooncake_reads.py); None = in place, except over tcp for a read that
    # fits one landing buffer (one get + copy beats the two gets of the in-place phases) or whose
    # views are never adjacent (a two-buffer get per object is slower there than the copy)
    land_whole: bool | None = None


class MooncakeTierOptions(MooncakeConnection, MooncakeTuning):
    """A MooncakeTier's keyword options, flat (the connection's and the tuning's); every field is checked on
    parse. A tier spec groups the tuning under `tuning` (specs.py)."""
