"""The stream bus: one run's events over Redis streams, published and consumed through consumer groups.

Delivery is at least once. A consumer reads through its group, handles, and acknowledges. What a dead
consumer left pending is taken over by a live one (reclaim.py); an entry that cannot be handled goes to the
run's `dead` stream with the error (dead_letters.py), and the pipeline goes on. Works on Redis 7.0, on
Valkey and on a Redis Cluster.

Services ride out a Redis restart or failover: their client retries every command on a lost connection for
as long as it takes (redis_clients.py), and a consumer group that the restarted Redis no longer has is
created again before the next read.

All Redis key names are built by `Keys` (keys.py); no other code writes a key string by hand.
`python bench/bench_bus.py` measures events/s against raw redis-py XADD / XREADGROUP.

    python -m pytest tests/unit/shared/contract/test_bus.py -q
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, NamedTuple

import redis

from rollstream.shared.contract.codec import decode, decode_on, encode, encode_event
from rollstream.shared.contract.dead_letters import DeadLetters
from rollstream.shared.contract.envelope import ENVELOPE_IDS, Envelope, make_envelope
from rollstream.shared.contract.event_models import Event
from rollstream.shared.contract.job_queues import delete_job_queues
from rollstream.shared.contract.keys import Keys
from rollstream.shared.contract.reclaim import Reclaim
from rollstream.shared.contract.redis_clients import (
    ASYNC_MAX_CONNECTIONS,
    connect_async_redis,
    connect_redis,
    with_credentials_of,
)
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.contract.streams import STREAMS, StreamName
from rollstream.shared.errors import EventDecodeError
from rollstream.shared.runtime.metrics import EVENTS_HANDLED, HANDLER_SECONDS, watch_consumer_group
from rollstream.shared.runtime.sections.bus import BusSettings

if TYPE_CHECKING:
    from rollstream.shared.contract.consumers import ConsumerGroup

__all__ = [
    # what services publish and consume with
    "Bus", "Delivery", "consumer_name", "run_consumer", "Handler", "StopConsuming", "LAST_PAGE",
    # the keys, streams, ids and clients the bus is built on, for the services that use them beside it
    "Keys", "StreamName", "STREAMS", "ENVELOPE_IDS", "connect_redis", "connect_async_redis",
    "ASYNC_MAX_CONNECTIONS",
]

log = logging.getLogger(__name__)

LAST_PAGE = 16
"""Entries Bus.last reads at a time while it looks for the newest one that decodes."""


class Delivery(NamedTuple):
    """One entry handed to a consumer (a tuple: half a frozen dataclass's cost to make, per entry read)."""

    stream: StreamName
    entry_id: str
    envelope: Envelope

    @property
    def event(self) -> Event:
        return self.envelope.payload


def consumer_name(service: str) -> str:
    """A name unique to this process, so a dead process's pending entries can be told apart."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


class Bus:
    """Publish and consume one run's events."""

    def __init__(self, client: redis.Redis, run_id: str, settings: BusSettings | None = None,
                 job_client: redis.Redis | None = None) -> None:
        self.redis = client
        self.keys = Keys(run_id)
        self.settings = settings or BusSettings()
        self.job_redis = job_client or client
        """The Redis of the run's RQ queues: bus.job_queue_url's, else the bus's own."""
        self.reclaim = Reclaim(client, self.settings)
        self.dead_letters = DeadLetters(client, self.keys)

    @classmethod
    def connect(cls, url: str, run_id: str, settings: BusSettings | None = None, *,
                ride_out_outages: bool = True) -> Bus:
        settings = settings or BusSettings()
        client = connect_redis(url, ride_out_outages=ride_out_outages, cluster=settings.cluster)
        job_client = None
        if settings.job_queue_url:
            job_client = connect_redis(with_credentials_of(url, settings.job_queue_url),
                                       ride_out_outages=ride_out_outages)
        return cls(client, run_id, settings, job_client)

    # ---------------------------------------------------------------------------------- publish
    def envelope(self, payload: Event, **ids: str | None) -> Envelope:
        return make_envelope(payload, run_id=self.keys.run_id, **ids)

    def publish(self, stream: StreamName, payload: Event | Envelope, pipe=None,
                **ids: str | None) -> str | None:
        """Append an event; returns its entry id (None when queued on a pipeline)."""
        if isinstance(payload, Envelope):
            fields = encode(payload)
        else:
            fields = encode_event(payload, run_id=self.keys.run_id, **ids)
        entry_id = (pipe or self.redis).xadd(self.keys.stream(stream), fields)
        return entry_id.decode() if isinstance(entry_id, bytes) else None

    def read_all(self, stream: StreamName) -> list[Delivery]:
        """Every decodable entry of a stream, oldest first (for inspection and tests)."""
        out = []
        for entry_id, fields in self.redis.xrange(self.keys.stream(stream)):
            try:
                out.append(Delivery(stream, entry_id.decode(), decode(fields)))
            except EventDecodeError:
                continue
        return out

    def last(self, stream: StreamName) -> Delivery | None:
        """The newest entry that decodes; entries that do not are passed over (a malformed entry at the
        end of `policy` must not stop the dispatcher or the trainer from reading the policy version)."""
        end = "+"
        while True:
            page = self.redis.xrevrange(self.keys.stream(stream), max=end, count=LAST_PAGE)
            for entry_id, fields in page:
                try:
                    return Delivery(stream, entry_id.decode(), decode(fields))
                except EventDecodeError:
                    continue
            if len(page) < LAST_PAGE:
                return None
            end = f"({page[-1][0].decode()}"

    # ---------------------------------------------------------------------------------- consume
    def ensure_group(self, stream: StreamName, group: str) -> None:
        try:
            self.redis.xgroup_create(self.keys.stream(stream), group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def consume(self, stream: StreamName, group: str, consumer: str, count: int | None = None,
                block_ms: int | None = None, held: Collection[str] = ()) -> list[Delivery]:
        """Entries to handle: first any reclaimed from dead consumers, else new ones.

        Entries that do not decode, or were delivered too often, are dead-lettered here and not
        returned. held: entry ids this consumer is still working on (see keep_alive). Should its keep-alive
        have come late, the reclaim hands such an entry back to this very consumer: it is not returned a
        second time, and the delivery the reclaim counted is taken back, so a late keep-alive never
        spends an entry's deliveries towards its dead letter.
        """
        count = count or self.settings.read_count
        key = self.keys.stream(stream)
        try:
            reclaimed = self.reclaim.idle_entries(key, group, consumer, count)
            present = [entry for entry in reclaimed if entry[1]]  # trimmed away while pending: no fields
            raw = self.reclaim.without_held(key, group, consumer, present, held)
            if not raw:
                block = self.settings.block_ms if block_ms is None else block_ms
                response = self.redis.xreadgroup(group, consumer, {key: ">"}, count=count, block=block)
                raw = response[0][1] if response else []
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # A Redis that came back without our group (restarted without its data, or the stream was
            # deleted): make it again and read on; there is nothing pending in a new group.
            log.warning("consumer group missing; creating it again", extra={"stream": stream, "group": group})
            self.ensure_group(stream, group)
            return []
        if not raw:
            return []
        counts = self.reclaim.delivery_counts(key, group, raw) if reclaimed else {}
        out = []
        for entry_id, fields in raw:
            entry_id = entry_id.decode()
            deliveries = counts.get(entry_id, 1)
            if deliveries > self.settings.max_deliveries:
                self.dead_letters.give_up(stream, group, entry_id, fields, deliveries)
                continue
            try:
                out.append(Delivery(stream, entry_id, decode_on(stream, fields)))
            except EventDecodeError as exc:
                self.dead_letter(stream, group, entry_id, fields, deliveries, str(exc))
        return out

    def take_over_pending(self, stream: StreamName, group: str, consumer: str) -> list[Delivery]:
        """Claim every entry pending in the group for `consumer` and return them oldest first.

        For a consumer that is alone in its group and must not skip ahead (the trainer): a restart
        finishes what its killed predecessor had started before it reads anything new, without
        waiting for the reclaim timeout."""
        key = self.keys.stream(stream)
        out = []
        for entry_id, fields in self.reclaim.every_pending_entry(key, group, consumer):
            entry_id = entry_id.decode()
            if not fields:  # trimmed away while pending: nothing left to handle
                self.redis.xack(key, group, entry_id)
                continue
            try:
                out.append(Delivery(stream, entry_id, decode_on(stream, fields)))
            except EventDecodeError as exc:
                self.dead_letter(stream, group, entry_id, fields, 1, str(exc))
        return out

    def ack(self, delivery: Delivery, group: str) -> None:
        self.redis.xack(self.keys.stream(delivery.stream), group, delivery.entry_id)
        EVENTS_HANDLED.labels(delivery.stream, group, "ok").inc()

    def keep_alive(self, stream: StreamName, group: str, consumer: str, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this consumer is still working on (Reclaim.keep_alive)."""
        self.reclaim.keep_alive(self.keys.stream(stream), group, consumer, entry_ids)

    def record_failure(self, delivery: Delivery, group: str, error: str) -> None:
        """Keep a handler's error so that the dead letter, if it comes to that, says what failed."""
        self.dead_letters.record_failure(delivery.stream, group, delivery.entry_id, error)
        EVENTS_HANDLED.labels(delivery.stream, group, "failed").inc()

    def dead_letter(self, stream: StreamName, group: str, entry_id: str, fields: dict, deliveries: int,
                    error: str) -> None:
        """Move an entry to the dead-letter stream and acknowledge it, atomically (DeadLetters.move)."""
        self.dead_letters.move(stream, group, entry_id, fields, deliveries, error)

    # ------------------------------------------------------------------------------------ the run
    def has_keys(self) -> bool:
        """Whether anything of this run exists in Redis (a new run or a replay needs an empty namespace)."""
        return next(iter(self.redis.scan_iter(match=self.keys.pattern, count=1000)), None) is not None

    def fleet_versions(self) -> dict[str, int]:
        """Server url -> the policy version it serves, as the trainer last recorded it."""
        return {k.decode(): int(v) for k, v in self.redis.hgetall(FLEET_VERSIONS.key(self.keys)).items()}

    def incarnation(self) -> str:
        """This incarnation's id (Keys.incarnation), made by the first caller; every caller gets the same."""
        self.redis.set(self.keys.incarnation, uuid.uuid4().hex, nx=True)
        return self.redis.get(self.keys.incarnation).decode()

    def delete_run(self) -> int:
        """Delete every key of this run, and its RQ queues with their jobs, which RQ keeps outside the run's
        namespace (a queued or failed job left behind would be run, or reported, into the next run under this
        id); returns how many keys of the namespace and jobs."""
        jobs = delete_job_queues(self.job_redis, self.keys.job_queue(""))
        keys = list(self.redis.scan_iter(match=self.keys.pattern, count=1000))
        return jobs + (self.redis.delete(*keys) if keys else 0)

    def job_queue(self, name: str):
        """The run's RQ queue `name` (the grader's sandbox queue: grader.queue), on the job queues' Redis."""
        from rq import Queue

        return Queue(self.keys.job_queue(name), connection=self.job_redis)

    # ----------------------------------------------------------------------------------- inspect
    def group_lag(self, stream: StreamName, group: str) -> tuple[int, int]:
        """(entries not yet delivered to the group, entries delivered but not acknowledged)."""
        key = self.keys.stream(stream)
        try:
            groups = self.redis.xinfo_groups(key)
        except redis.ResponseError:
            return 0, 0
        for info in groups:
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if name == group:
                if info.get("lag") is not None:  # Redis 7 counts it; it cannot after some deletions
                    return int(info["lag"]), int(info["pending"])
                last = info["last-delivered-id"]
                last = last.decode() if isinstance(last, bytes) else last
                undelivered = len(self.redis.xrange(key, min=f"({last}", max="+"))
                return undelivered, int(info["pending"])
        return self.redis.xlen(key), 0


Handler = Callable[[Delivery], None]


class StopConsuming(Exception):
    """Raised by a handler that must not go on to the next entry; the current one stays pending."""


def run_consumer(bus: Bus, group: ConsumerGroup, consumer: str, handle: Handler,
                 should_stop: Callable[[], bool], take_over_pending: bool = False,
                 between_reads: Callable[[], None] = lambda: None) -> None:
    """The consume loop services use: read the group's streams (shared/contract/consumers.py), handle, ack. A
    failing handler leaves the entry pending, so that it is retried (reclaimed) and, after too many failures,
    dead-lettered.

    take_over_pending: first handle, in order, every entry the group left pending (see
    Bus.take_over_pending); for a consumer that is alone in its group.
    between_reads: called after every round of reads (at least every bus.block_ms), for time-driven work."""

    def handle_and_ack(delivery: Delivery) -> None:
        started = time.perf_counter()
        try:
            handle(delivery)
        except StopConsuming as exc:
            bus.record_failure(delivery, group.name, f"{type(exc).__name__}: {exc}")
            raise
        except Exception as exc:
            bus.record_failure(delivery, group.name, f"{type(exc).__name__}: {exc}")
            log.exception("handler failed; entry stays pending for retry",
                          extra={"stream": delivery.stream, "entry_id": delivery.entry_id,
                                 "event_type": delivery.envelope.type})
            return
        finally:
            HANDLER_SECONDS.labels(delivery.stream, group.name).observe(time.perf_counter() - started)
        bus.ack(delivery, group.name)

    watch_consumer_group(bus, group.name, group.streams)
    for stream in group.streams:
        bus.ensure_group(stream, group.name)
        if take_over_pending:
            for delivery in bus.take_over_pending(stream, group.name, consumer):
                handle_and_ack(delivery)
    block_ms = max(1, bus.settings.block_ms // len(group.streams))
    while not should_stop():
        for stream in group.streams:
            for delivery in bus.consume(stream, group.name, consumer, block_ms=block_ms):
                handle_and_ack(delivery)
        between_reads()
