"""Prometheus series every consuming service shares: events its consumer group handled and failed, handler
latency, dead letters, and, read from Redis at each scrape, the group's lag and pending entries.

Each service serves them on its health port's /metrics (shared/runtime/service.py), next to its own series
(rollstream_<service>_...). Names and labels follow Prometheus' conventions: counters end in _total, times
are seconds, a label's values are few (streams, groups, outcomes, reasons; never ids).

    curl -H "Authorization: Bearer $RS_SECURITY__METRICS_TOKEN" http://127.0.0.1:<health_port>/metrics
    infra/prometheus/ scrapes a local run and the compose deployment; infra/grafana/ holds the dashboard.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Protocol

import redis
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class WatchedBus(Protocol):
    """What the collector asks of a bus (shared/contract/bus.py's Bus, which imports this module)."""

    keys: Any
    redis: redis.Redis

    def group_lag(self, stream: Any, group: str) -> tuple[int, int]: ...


log = logging.getLogger(__name__)

EVENTS_HANDLED = Counter(
    "rollstream_bus_events_handled_total",
    "Entries a consumer group took off a stream, by outcome: ok (handled and acknowledged), failed (the "
    "handler raised; the entry stays pending for a retry).", ["stream", "group", "outcome"])
HANDLER_SECONDS = Histogram(
    "rollstream_bus_handler_seconds",
    "Time a consumer group's handler spent on one entry, failures included.", ["stream", "group"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800))
DEAD_LETTERS = Counter(
    "rollstream_bus_dead_letters_total",
    "Entries moved to the dead-letter stream (undecodable, wrong stream, delivered too often, or refused by "
    "the service), by the stream and group they were read from.", ["stream", "group"])


class ConsumerGroupCollector(Collector):
    """At each scrape, the lag (entries the group has yet to read) and pending entries (read, not yet
    acknowledged) of the groups this process consumes through, and each stream's length. Several replicas
    of a service report the same figures: aggregate them with max(), not sum()."""

    def __init__(self) -> None:
        self._watched: dict[tuple[str, str, str], weakref.ref] = {}
        self._lock = threading.Lock()

    def watch(self, bus: WatchedBus, stream: str, group: str) -> None:
        with self._lock:
            self._watched[(bus.keys.run_id, stream, group)] = weakref.ref(bus)

    def collect(self):
        lag = GaugeMetricFamily("rollstream_bus_consumer_lag",
                                "Entries of the stream the consumer group has not read yet.",
                                labels=["stream", "group"])
        pending = GaugeMetricFamily("rollstream_bus_pending_entries",
                                    "Entries the consumer group has read and not acknowledged yet (in work, "
                                    "or waiting to be reclaimed).", labels=["stream", "group"])
        length = GaugeMetricFamily("rollstream_bus_stream_length",
                                   "Entries the stream holds (the recorder trims it behind its slowest "
                                   "group).", labels=["stream"])
        with self._lock:
            watched = list(self._watched.items())
        streams_seen = set()
        for (_, stream, group), ref in watched:
            bus = ref()
            if bus is None:
                continue
            try:
                not_read, in_work = bus.group_lag(stream, group)
                if stream not in streams_seen:
                    length.add_metric([stream], bus.redis.xlen(bus.keys.stream(stream)))
                    streams_seen.add(stream)
            except redis.RedisError as exc:  # a scrape while Redis is away shows no lag rather than failing
                log.debug("lag not read", extra={"stream": stream, "group": group, "error": str(exc)})
                continue
            lag.add_metric([stream, group], not_read)
            pending.add_metric([stream, group], in_work)
        yield from (lag, pending, length)


CONSUMER_GROUPS = ConsumerGroupCollector()
REGISTRY.register(CONSUMER_GROUPS)


def watch_consumer_group(bus: WatchedBus, group: str, streams: tuple[str, ...]) -> None:
    """Report the lag and pending entries of `group` on each of `streams` at every scrape of this process."""
    for stream in streams:
        CONSUMER_GROUPS.watch(bus, stream, group)
