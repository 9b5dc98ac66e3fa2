"""Several `vllm serve` engines sharing one Mooncake cluster (issue 39): starting them, and the soak that
drives them with mixed requests while store hosts are killed and restarted.

    engines = cluster_engines(cluster, model, workdir, replica_nums=(2, 1))
    report = run_soak(engines, cluster, SoakPlan(duration_s=600, kill_every_s=60))

The soak: `clients_per_engine` client threads per engine send, until the deadline, requests of three
kinds: a long shared prefix (one of `shared_prefixes` prefixes of `prefix_chunks` chunks, with one of
two tails), a new prefix (a prompt never sent before), or an abort (a shared prefix the client gives up
on after 10-100 ms, so vLLM aborts it, often while it loads); before an abort and some shared-prefix
requests the engine's own prefix cache is dropped, so the tier serves them (`vllm serve` with
VLLM_SERVER_DEV_MODE=1). Meanwhile, every `kill_every_s`, a store host is killed (SIGKILL) and started
again on its port once the master forgot it, in turn. Afterwards every output is compared with a cold
prefill of its prompt (in a key space of its own: `cache_salt`), every engine must hold no staging,
budget or load (BSR's gauges on /metrics, after one more request makes it step) and no request or KV
block (vLLM's gauges), and the engines' memory is sampled throughout.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bsr_harness import vllm_engines
from bsr_harness.mooncake_cluster import MooncakeCluster
from bsr_harness.tiny_model import VOCAB
from bsr_harness.vllm_serve import VllmServer, bsr_value, cached_tokens, completion_tokens

CHUNK = 256
BLOCK_SIZE = 64
# the connector of a cluster engine: windows of 4 chunks, a fetch may wait out a lost host's TTL (a few s),
# an unreachable master is skipped for 1 s only (requests find a restarted master at once)
CONNECTOR = {"window_chunks": 4, "timeouts": {"fetch_s": 6.0, "probe_s": 3.0, "shutdown_s": 10.0},
             "tuning": {"unavailable_cooldown_s": 1.0}}
TIER = {"rpc_timeout_s": 2.0, "connect_timeout_s": 10.0}
LEVELS = ("vllm:bsr_restore_staging_bytes", "vllm:bsr_save_staging_bytes", "vllm:bsr_loads_in_flight")
ENGINE_LEVELS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
REQUEST_TIMEOUT_S = 120.0


def prompt(rng: random.Random, n_tokens: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n_tokens)]


def kv_config(cluster: MooncakeCluster, replica_num: int, **connector) -> dict:
    """The --kv-transfer-config of an engine on `cluster` whose saves store `replica_num` copies."""
    tier = cluster.tier_spec(replica_num=replica_num, **TIER)
    return vllm_engines.kv_transfer_config([tier], **{**CONNECTOR, **connector})


def cluster_engines(cluster: MooncakeCluster, model: str | Path, workdir: Path, replica_nums: Sequence[int],
                    **connector) -> list[VllmServer]:
    """One `vllm serve` per entry of `replica_nums` (its saves' copies), all started at once."""
    engines = []
    try:
        for i, replicas in enumerate(replica_nums):
            argv = ["vllm", "serve", str(model), "--block-size", str(BLOCK_SIZE), "--kv-transfer-config",
                    json.dumps(kv_config(cluster, replicas, **connector))]
            engines.append(VllmServer(argv, workdir / f"engine{i}.log", env={"VLLM_SERVER_DEV_MODE": "1"},
                                      worker_in_engine_core=True).launch())
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


def levels(engine: VllmServer) -> dict[str, float]:
    """BSR's gauges of what the engine holds now, after one more request has made it step (a worker ships
    its levels at a step: a put that finished after the last one shows at the next)."""
    engine.complete([5, 6, 7], max_tokens=1)
    m = engine.metrics()
    return {name: bsr_value(m, name) for name in LEVELS}


def engine_holds(engine: VllmServer) -> dict[str, float]:
    """What vLLM itself holds when no request is sent: requests running or waiting (a load never reported
    keeps its request waiting), the KV cache in use by requests."""
    m = engine.metrics()
    return {name: bsr_value(m, name) for name in ENGINE_LEVELS}


def wait_idle(engine: VllmServer, timeout_s: float = 30.0) -> dict[str, float]:
    """levels() until all are 0 (saves still putting drain), or what they were at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = levels(engine)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@dataclass
class SoakPlan:
    duration_s: float = 600.0
    kill_every_s: float = 60.0
    clients_per_engine: int = 2
    shared_prefixes: int = 3
    prefix_chunks: int = 6
    tail_tokens: int = 40
    new_prefix_chunks: int = 3
    max_tokens: int = 8
    p_new: float = 0.3
    p_abort: float = 0.1
    p_forget: float = 0.3  # a shared-prefix request after dropping the engine's own prefix cache: the tier serves it
    seed: int = 39


@dataclass
class _Request:
    engine: int
    prompt: str
    kind: str  # shared, new, abort
    seconds: float
    output: tuple[list[int], list[float]] | None = None
    cached: int = 0
    error: str | None = None


@dataclass
class _Soak:
    plan: SoakPlan
    engines: list[VllmServer]
    cluster: MooncakeCluster
    prompts: dict[str, list[int]] = field(default_factory=dict)
    requests: list[_Request] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    rss: list[list[int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)


def run_soak(engines: list[VllmServer], cluster: MooncakeCluster, plan: SoakPlan,
             log: Callable[[str], None] = print) -> dict:
    """Drive the soak (module docstring); its figures: requests by kind and engine, outputs against cold,
    requests lost, host kills, the engines' gauges at the end, their memory over time."""
    soak = _Soak(plan, engines, cluster)
    rng = random.Random(plan.seed)
    for p in range(plan.shared_prefixes):
        prefix = prompt(rng, plan.prefix_chunks * CHUNK)
        for t in range(2):
            soak.prompts[f"shared{p}.{t}"] = prefix + prompt(rng, plan.tail_tokens)
    threads = [threading.Thread(target=_client, args=(soak, e, c), name=f"soak-client-{e}.{c}", daemon=True)
               for e in range(len(engines)) for c in range(plan.clients_per_engine)]
    threads += [threading.Thread(target=_killer, args=(soak, log), name="soak-killer", daemon=True),
                threading.Thread(target=_sampler, args=(soak,), name="soak-memory", daemon=True)]
    before = [e.metrics() for e in engines]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    soak.stop.wait(plan.duration_s)
    soak.stop.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 60)
    hung = [t.name for t in threads if t.is_alive()]
    cluster.wait_mounted()
    idle = [wait_idle(e) for e in engines]
    soak.rss.append([e.rss_bytes() for e in engines])
    figures = _figures(soak, _references(soak), idle, hung, time.monotonic() - t0) | _counts(engines, before)
    log(json.dumps({k: v for k, v in figures.items() if k != "rss_mib"}))
    return figures


def _client(soak: _Soak, engine: int, client: int) -> None:
    rng = random.Random(soak.plan.seed * 1000 + engine * 10 + client)
    sent = 0
    while not soak.stop.is_set():
        kind = rng.choices(["shared", "new", "abort"],
                           [1 - soak.plan.p_new - soak.plan.p_abort, soak.plan.p_new, soak.plan.p_abort])[0]
        name = _prompt_for(soak, rng, kind, f"new.{engine}.{client}.{sent}")
        req = _send(soak, rng, engine, kind, name)
        sent += 1
        with soak.lock:
            soak.requests.append(req)


def _prompt_for(soak: _Soak, rng: random.Random, kind: str, new_name: str) -> str:
    """A new prompt's name (made here) or a shared one's."""
    if kind != "new":
        return rng.choice([k for k in soak.prompts if k.startswith("shared")])
    with soak.lock:
        soak.prompts[new_name] = prompt(rng, soak.plan.new_prefix_chunks * CHUNK + soak.plan.tail_tokens)
    return new_name


def _send(soak: _Soak, rng: random.Random, engine: int, kind: str, name: str) -> _Request:
    """One request; an abort (and some shared-prefix requests) after dropping the engine's prefix cache, so
    it loads from the tier (an abort: given up on while it does, often: a load cancelled between windows)."""
    server, tokens = soak.engines[engine], soak.prompts[name]
    req = _Request(engine, name, kind, 0.0)
    t = time.monotonic()
    try:
        if kind == "abort" or (kind == "shared" and rng.random() < soak.plan.p_forget):
            server.post("/reset_prefix_cache")  # refused (success false) while a request runs: a local hit then
        if kind == "abort":
            if not server.abandon(tokens, after_s=rng.uniform(0.01, 0.1)):
                req.kind = "abort-finished"
        else:
            resp = server.complete(tokens, soak.plan.max_tokens, timeout=REQUEST_TIMEOUT_S)
            req.output, req.cached = completion_tokens(resp), cached_tokens(resp)
    except Exception as e:  # noqa: BLE001 - a lost request, counted and reported
        req.error = f"{type(e).__name__}: {e}"[:300]
    req.seconds = time.monotonic() - t
    return req


def _killer(soak: _Soak, log: Callable[[str], None]) -> None:
    """A host killed every kill_every_s from the start (or at once when its predecessor's restart took
    longer), in turn, each started again once the master forgot it."""
    hosts = soak.cluster.hosts
    start = time.monotonic()
    i = 0
    while not soak.stop.wait(max(0.0, start + (i + 1) * soak.plan.kill_every_s - time.monotonic())):
        host = hosts[i % len(hosts)]
        segment = next(iter(host.segments))
        t = time.monotonic()
        host.kill()
        soak.cluster.restart_host(i % len(hosts))
        event = {"host": segment, "down_s": round(time.monotonic() - t, 2)}
        soak.kills.append(event)
        log(f"soak: store host {segment} killed and restarted ({event['down_s']} s down)")
        i += 1


def _sampler(soak: _Soak) -> None:
    while True:
        soak.rss.append([e.rss_bytes() for e in soak.engines])
        if soak.stop.wait(5.0):
            return


def _references(soak: _Soak) -> dict[str, tuple[list[int], list[float]]]:
    """A cold prefill of every prompt that was answered, in a key space of its own (nothing restored)."""
    used = sorted({r.prompt for r in soak.requests if r.output is not None})
    return {name: completion_tokens(soak.engines[0].complete(soak.prompts[name], soak.plan.max_tokens,
                                                             cache_salt=f"cold-{name}"))
            for name in used}


def _counts(engines: list[VllmServer], before: list[dict]) -> dict:
    """BSR's counters of each engine over the soak (the references' cold prefills included)."""
    after = [e.metrics() for e in engines]

    def grown(name: str, **labels: str) -> list[float]:
        return [bsr_value(a, name, **labels) - bsr_value(b, name, **labels) for a, b in zip(after, before, strict=True)]

    return {"loads_committed": grown("vllm:bsr_loads_committed_total"),
            "loads_failed": [_failed_by_cause(a, b) for a, b in zip(after, before, strict=True)],
            "saves_failed": grown("vllm:bsr_saves_failed_total", tier="mooncake")}


def _failed_by_cause(after: dict, before: dict) -> dict[str, float]:
    return {labels[0][1]: value - before.get((name, labels), 0.0) for (name, labels), value in after.items()
            if name == "vllm:bsr_loads_failed_total" and value > before.get((name, labels), 0.0)}


def _figures(soak: _Soak, refs: dict, idle: list[dict], hung: list[str], seconds: float) -> dict:
    answered = [r for r in soak.requests if r.output is not None]
    tokens_same = sum(r.output[0] == refs[r.prompt][0] for r in answered)
    logprobs_same = sum(r.output[1] == refs[r.prompt][1] for r in answered)
    diff = max((abs(a - b) for r in answered for a, b in zip(r.output[1], refs[r.prompt][1], strict=True)),
               default=0.0)
    rss = [[round(b / 2**20, 1) for b in sample] for sample in soak.rss]
    warm = rss[min(1, len(rss) - 1)]  # after the first sample: the engines' first requests allocated
    errors = [r.error for r in soak.requests if r.error]
    return {
        "seconds": round(seconds, 1), "engines": len(soak.engines), "store_hosts": len(soak.cluster.hosts),
        "requests": len(soak.requests),
        "by_kind": {k: sum(r.kind == k for r in soak.requests) for k in ("shared", "new", "abort", "abort-finished")},
        "answered": len(answered), "restored": sum(r.cached > 0 for r in answered),
        "lost": len(errors), "lost_errors": errors[:5],
        "hung_threads": hung, "tokens_identical": tokens_same, "logprobs_identical": logprobs_same,
        "max_logprob_diff": diff, "max_request_s": round(max((r.seconds for r in soak.requests), default=0.0), 2),
        "host_kills": len(soak.kills), "kills": soak.kills,
        "levels_at_end": idle, "engine_at_end": [engine_holds(e) for e in soak.engines],
        "rss_mib": rss, "rss_growth_mib": [round(end - start, 1) for start, end in zip(warm, rss[-1], strict=True)],
    }
