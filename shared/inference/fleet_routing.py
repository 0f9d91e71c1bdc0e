"""Which server a session's turn goes to: rendezvous hashing with bounded load, and the load readings it
goes by.

Rendezvous hashing of the session id picks the same server for every turn of a session (its prefix cache
stays warm), with bounded load: a server already carrying more than (1 + epsilon) times the average load is
passed over for the session's next-ranked server, and so is one whose KV cache is nearly full. A server's
load is the fleet client's requests open on it plus the other clients' requests vLLM reports on /metrics
(Prometheus text; gauges read, one sample per engine: vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, a fraction, 1 = full).

Library module, not run directly (FleetClient.route and FleetClient.refresh_load use it):
    python -m pytest tests/unit/shared/inference/test_fleet_routing.py -q
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"
KV_CACHE_METRIC = "vllm:kv_cache_usage_perc"

SERVER_REQUESTS = Gauge("rollstream_fleet_server_requests",
                        "Requests a vLLM server reported in its own /metrics (vllm:num_requests_running and "
                        "_waiting), at this client's last reading.", ["server", "state"])
SERVER_KV_CACHE = Gauge("rollstream_fleet_server_kv_cache_usage_ratio",
                        "Fraction of a vLLM server's KV cache in use, at this client's last reading.",
                        ["server"])


@dataclass(frozen=True)
class ServerLoad:
    """One reading of a server's /metrics; counts are summed over its engines."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of the KV cache in use, averaged over the engines
    own_in_flight: int  # this client's requests open on the server when the reading came back

    def others(self) -> int:
        """The other clients' requests at this reading.

        vLLM's running + waiting already include the requests this client had open when /metrics was
        read; counting them again beside the client's live count would make every busy-with-us server look
        twice as busy. So the reading minus our share at that moment is the others' load. (Our requests
        sent but not yet queued by vLLM can make the difference negative: 0 then.)
        """
        return max(0, self.running + self.waiting - self.own_in_flight)


def rank(session_id: str, url: str) -> int:
    """Rendezvous score; stable across processes (unlike hash()), so every replica routes alike."""
    digest = hashlib.blake2b(f"{url}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def bounded_load_order(session_id: str, servers: Sequence[str], load: Callable[[str], int],
                       kv_cache_is_full: Callable[[str], bool], epsilon: float) -> list[str]:
    """`servers` in the order the session tries them: by its rendezvous rank, those with room first.

    Capacity is (1 + epsilon) x the average load including this request. With equal loads every server is
    within it, so a session keeps its own server. A server over it, or with a full KV cache, stays in the
    order, as a last resort: bounded load reorders, it does not drop servers.
    """
    if not servers:
        return []
    ranked = sorted(servers, key=lambda url: rank(session_id, url), reverse=True)
    loads = {url: load(url) for url in servers}
    total = sum(loads.values()) + 1
    capacity = math.ceil((1 + epsilon) * total / len(servers))
    with_room = [url for url in ranked if loads[url] + 1 <= capacity and not kv_cache_is_full(url)]
    return with_room + [url for url in ranked if url not in with_room]


def holding(servers: Sequence[str], contexts: Mapping[str, int], tokens: int) -> list[str]:
    """The servers whose context holds `tokens` (prompt and answer) when some do and others do not;
    otherwise all of them (a server of unknown context is taken to hold it)."""
    fitting = [url for url in servers if contexts.get(url, tokens) >= tokens]
    return fitting or list(servers)


async def read_server_load(http: httpx.AsyncClient, url: str, timeout_s: float,
                           in_flight: Mapping[str, int]) -> ServerLoad | None:
    """A reading of the server's /metrics; None when it does not answer, or answers garbage."""
    try:
        response = await http.get(f"{url}/metrics", timeout=timeout_s)
        if response.status_code != 200:
            return None
        # vLLM's whole exposition (histograms and all) takes 15-30 ms to parse: not on the event loop
        running, waiting, kv_usages = await asyncio.to_thread(read_load_metrics, response.text)
    except (httpx.HTTPError, ValueError):
        return None
    reading = ServerLoad(running=running, waiting=waiting,
                         kv_cache_usage=sum(kv_usages) / len(kv_usages) if kv_usages else 0.0,
                         own_in_flight=in_flight[url])
    SERVER_REQUESTS.labels(url, "running").set(reading.running)
    SERVER_REQUESTS.labels(url, "waiting").set(reading.waiting)
    SERVER_KV_CACHE.labels(url).set(reading.kv_cache_usage)
    return reading


def read_load_metrics(text: str) -> tuple[int, int, list[float]]:
    """(running, waiting, KV cache usage per engine) from Prometheus text; ValueError if unreadable or
    without the request counts (then it is no reading, rather than a reading of an idle server)."""
    values: dict[str, list[float]] = {RUNNING_METRIC: [], WAITING_METRIC: [], KV_CACHE_METRIC: []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                if not math.isfinite(sample.value):
                    raise ValueError(f"{sample.name} is {sample.value}")
                values[sample.name].append(sample.value)
    if not values[RUNNING_METRIC] or not values[WAITING_METRIC]:
        raise ValueError(f"no {RUNNING_METRIC} / {WAITING_METRIC} in the metrics")
    return round(sum(values[RUNNING_METRIC])), round(sum(values[WAITING_METRIC])), values[KV_CACHE_METRIC]
