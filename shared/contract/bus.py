"""The stream bus: events over Redis streams with consumer groups, reclaim and dead letters.

Delivery is at least once. A consumer reads through its group, handles, and acknowledges. An entry
left pending by a dead consumer for `reclaim_idle_ms` is taken over by a live one (XAUTOCLAIM). An
entry that failed `max_deliveries` times, or does not decode at all, goes to the run's `dead` stream
with the error, and the pipeline goes on. Works on Redis 7.0 and on Valkey.

Services ride out a Redis restart or failover: their client (`connect_redis`, or `connect_async_redis` for
one that serves from an event loop) retries every command on a lost connection with capped exponential
back-off, for as long as it takes, and logs the outage; a consumer group that the restarted Redis no longer
has is created again before the next read.

All Redis key names are built by `Keys`; no other code writes a key string by hand.
`python bench/bench_bus.py` measures events/s against raw redis-py XADD / XREADGROUP.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError
from redis.retry import Retry

from rollstream.shared.contract.events import (
    STREAM_EVENTS,
    STREAMS,
    DeadLettered,
    Envelope,
    Event,
    EventDecodeError,
    StreamName,
    decode,
    encode,
    encode_event,
    make_envelope,
)
from rollstream.shared.contract.job_queues import delete_job_queues
from rollstream.shared.runtime.config import BusSettings
from rollstream.shared.runtime.metrics import (
    DEAD_LETTERS,
    EVENTS_HANDLED,
    HANDLER_SECONDS,
    watch_consumer_group,
)

if TYPE_CHECKING:
    from rollstream.shared.contract.consumers import ConsumerGroup

log = logging.getLogger(__name__)

LAST_PAGE = 16
"""Entries Bus.last reads at a time while it looks for the newest one that decodes."""
DEAD_LETTER_FIELD_CHARS = 65_536
"""Characters of each field a dead letter shows of its entry."""
RECONNECT_BASE_S = 0.1
RECONNECT_CAP_S = 5.0
"""Back-off between reconnection attempts: doubling from the base, never longer than the cap."""
_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")
"""What RQ accepts as a job id."""


class _LoggedBackoff(ExponentialWithJitterBackoff):
    """The back-off of a lost connection, which says so in the log: at the first failed attempt, then
    at every power of two, so that a long outage is visible without a line per attempt."""

    def compute(self, failures: int) -> float:
        if failures & (failures - 1) == 0:
            log.warning("Redis unreachable; retrying with back-off", extra={"attempts": failures})
        return super().compute(failures)


def _unless_refused(is_retryable: Callable[[Exception], bool] | None) -> Callable[[Exception], bool]:
    """Retry lost connections, but not a refused login: AuthenticationError is a ConnectionError to redis-py,
    and a wrong password never gets better by waiting."""

    def retryable(error: Exception) -> bool:
        if isinstance(error, AuthenticationError):
            return False
        return is_retryable(error) if is_retryable is not None else True

    return retryable


class _OutageRetry(Retry):
    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return super().call_with_retry(do, fail, _unless_refused(is_retryable), with_failure_count)


class _AsyncOutageRetry(AsyncRetry):
    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return await super().call_with_retry(do, fail, _unless_refused(is_retryable), with_failure_count)


_OUTAGE_ERRORS = [redis.ConnectionError, redis.TimeoutError, BusyLoadingError]
ASYNC_MAX_CONNECTIONS = 64


def connect_redis(url: str, *, ride_out_outages: bool = True, cluster: bool = False) -> redis.Redis:
    """A client for a service: every command is retried on a lost connection (ConnectionError,
    TimeoutError, and LOADING while a restarted Redis reads its append-only file) until Redis answers
    again. ride_out_outages=False: fail at once (commands a person waits on, such as `inspect`).
    cluster: `url` is a node of a Redis Cluster (a RedisCluster client, which retries on the cluster's own
    terms: a moved slot, a failed-over node)."""
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, socket_connect_timeout=5, socket_keepalive=True)
    if not ride_out_outages:
        return redis.Redis.from_url(url, socket_connect_timeout=5)
    retry = _OutageRetry(_LoggedBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S), retries=-1)
    return redis.Redis.from_url(url, retry=retry, socket_connect_timeout=5, socket_keepalive=True,
                                retry_on_error=_OUTAGE_ERRORS)


def connect_async_redis(url: str, *, ride_out_outages: bool = True,
                        cluster: bool = False) -> redis.asyncio.Redis:
    """connect_redis's client for asyncio: its commands run on the event loop that first uses it (one loop
    per client), and wait out an outage the same way without holding the loop. At most
    ASYNC_MAX_CONNECTIONS connections: a command waits for a free one (the default pool refuses the 101st
    command at once, which 256 gateway sessions reached)."""
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, socket_connect_timeout=5, socket_keepalive=True)
    options = {"max_connections": ASYNC_MAX_CONNECTIONS, "timeout": None, "socket_connect_timeout": 5}
    if ride_out_outages:
        retry = _AsyncOutageRetry(_LoggedBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S), retries=-1)
        options.update(retry=retry, retry_on_error=_OUTAGE_ERRORS, socket_keepalive=True)
    return redis.asyncio.Redis.from_pool(redis.asyncio.BlockingConnectionPool.from_url(url, **options))


NOT_IN_RUN_IDS = ":{} \n"
"""What a run id may not hold: the key separator, the braces of the keys' hash tag, whitespace."""


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one run, under the `rs:{<run_id>}:` namespace."""

    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in NOT_IN_RUN_IDS):
            raise ValueError(f"run id {self.run_id!r} must be non-empty without ':', braces or spaces")

    @cached_property
    def prefix(self) -> str:
        # the run id in braces is the keys' hash tag: on a Redis Cluster every key of a run lands in one slot,
        # so the bus's transactions, scripts and multi-stream reads, which span several keys, run there too
        return f"rs:{{{self.run_id}}}"

    @staticmethod
    def run_of(key: str) -> str | None:
        """The run id of a key in a run's namespace; None for any other key."""
        found = re.fullmatch(rf"rs:\{{([^{re.escape(NOT_IN_RUN_IDS)}]+)\}}:.+", key, flags=re.DOTALL)
        return found.group(1) if found else None

    @property
    def pattern(self) -> str:
        """SCAN pattern of every key of this run; glob characters a run id may hold are escaped, so that
        run `a*` does not match run `ab`'s keys."""
        return re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + ":*"

    def stream(self, name: StreamName) -> str:
        if name not in STREAMS:
            raise ValueError(f"unknown stream {name!r}; streams are {', '.join(STREAMS)}")
        return f"{self.prefix}:{name}"

    def state(self, service: str, *parts: str) -> str:
        """A service's own state key, e.g. state('reward', 'group', gid)."""
        return ":".join((self.prefix, "state", service, *parts))

    def lock(self, name: str) -> str:
        return f"{self.prefix}:lock:{name}"

    @property
    def incarnation(self) -> str:
        """String: a random id of this incarnation of the run (Bus.incarnation). Deleted with the run's other keys,
        so a new run under the same id gets another, and ids made from it (grade_job_id) never name what the
        old run left outside the namespace."""
        return f"{self.prefix}:incarnation"

    def job_queue(self, name: str) -> str:
        """The name of the run's RQ queue `name` (the grader's sandbox queue: grader.queue). RQ keeps its keys
        under its own prefix (rq:queue:<name>, rq:failed:<name>, ...); Bus.delete_run deletes them with their
        jobs."""
        return f"{self.prefix}:{name}"

    def grade_job_id(self, incarnation: str, rollout_id: str) -> str:
        """The RQ job id of a rollout's sandbox grading. RQ job ids are global to the Redis server: the run
        id keeps a replay into another run from finding the original's job, the incarnation a new run under
        an old id from finding the old run's; within one incarnation a re-delivered rollout finds its job.
        RQ takes only [A-Za-z0-9_-] in an id: where the run or rollout id has anything else, a digest of
        the three stands for them."""
        readable = f"grade-{self.run_id}-{incarnation}-{rollout_id}"
        if _JOB_ID.fullmatch(readable):
            return readable
        digest = hashlib.sha256(f"{self.run_id}\0{incarnation}\0{rollout_id}".encode()).hexdigest()
        return f"grade-{digest[:40]}"

    @property
    def trained_batches(self) -> str:
        """Set: ids of the batches the run's trainer trained, added in the transaction that publishes the policy
        version trained on each: a PolicyUpdated whose batch is not here is no version of this run's."""
        return self.state("trainer", "trained-batches")

    @property
    def fleet_versions(self) -> str:
        """Hash: server url -> policy version it serves."""
        return f"{self.prefix}:fleet:versions"

    @property
    def admitted(self) -> str:
        """Counter of samples the dispatcher admitted."""
        return f"{self.prefix}:admitted"

    @property
    def filtered(self) -> str:
        """Counter of admitted samples given back to the dispatcher: left out of training (zero-variance groups,
        dropped rollouts) or trained beyond a batch's B (whole groups overshoot it when one lost rollouts)."""
        return f"{self.prefix}:filtered"


ENVELOPE_IDS = ("trajectory_id", "rollout_id", "group_id", "session_id")
"""The ids an envelope belongs to."""


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


def _with_credentials_of(source: str, target: str) -> str:
    """URL `target` with the user and password of URL `source`."""
    userinfo = urlsplit(source).netloc.rpartition("@")[0]
    parts = urlsplit(target)
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}")) if userinfo else target


class Bus:
    """Publish and consume one run's events."""

    def __init__(self, client: redis.Redis, run_id: str, settings: BusSettings | None = None,
                 job_client: redis.Redis | None = None) -> None:
        self.redis = client
        self.keys = Keys(run_id)
        self.settings = settings or BusSettings()
        self.job_redis = job_client or client
        """The Redis of the run's RQ queues: bus.job_queue_url's, else the bus's own."""
        self._next_reclaim: dict[tuple[str, str], float] = {}  # per stream key and group: see _reclaim

    @classmethod
    def connect(cls, url: str, run_id: str, settings: BusSettings | None = None, *,
                ride_out_outages: bool = True) -> "Bus":
        settings = settings or BusSettings()
        client = connect_redis(url, ride_out_outages=ride_out_outages, cluster=settings.cluster)
        job_client = None
        if settings.job_queue_url:
            job_client = connect_redis(_with_credentials_of(url, settings.job_queue_url),
                                       ride_out_outages=ride_out_outages)
        return cls(client, run_id, settings, job_client)

    # ---------------------------------------------------------------------------------- publish
    def envelope(self, payload: Event, **ids: str | None) -> Envelope:
        return make_envelope(payload, run_id=self.keys.run_id, **ids)

    def publish(self, stream: StreamName, payload: Event | Envelope, pipe=None, **ids: str | None) -> str | None:
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
            reclaimed = self._reclaim(key, group, consumer, count)
            raw = self._without_held(key, group, consumer, [entry for entry in reclaimed if entry[1]], held)
            if not raw:
                response = self.redis.xreadgroup(group, consumer, {key: ">"}, count=count,
                                                 block=self.settings.block_ms if block_ms is None else block_ms)
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
        counts = self._delivery_counts(key, group, raw) if reclaimed else {}
        out = []
        for entry_id, fields in raw:
            entry_id = entry_id.decode()
            deliveries = counts.get(entry_id, 1)
            if deliveries > self.settings.max_deliveries:
                last_error = self.redis.hget(self._errors_key(stream, group), entry_id)
                self.dead_letter(stream, group, entry_id, fields, deliveries,
                                 f"gave up after {deliveries - 1} failed deliveries; last error: "
                                 f"{_show(last_error) if last_error else 'unknown'}")
                continue
            try:
                out.append(Delivery(stream, entry_id, decode_on(stream, fields)))
            except EventDecodeError as exc:
                self.dead_letter(stream, group, entry_id, fields, deliveries, str(exc))
        return out

    def _reclaim(self, key: str, group: str, consumer: str, count: int) -> list:
        """Entries pending over reclaim_idle_ms, now this consumer's (XAUTOCLAIM). A look that finds none is
        repeated a tenth of reclaim_idle_ms later, not at the next read: a busy consumer does not pay a round
        trip per read for it, and an entry waits at most 1.1 times reclaim_idle_ms."""
        now = time.monotonic()
        if now < self._next_reclaim.get((key, group), 0.0):
            return []
        idle_ms = self.settings.reclaim_idle_ms
        reclaimed = self.redis.xautoclaim(key, group, consumer, idle_ms, "0-0", count=count)[1]
        if not reclaimed:
            self._next_reclaim[(key, group)] = now + idle_ms / 10_000
        return reclaimed

    def take_over_pending(self, stream: StreamName, group: str, consumer: str) -> list[Delivery]:
        """Claim every entry pending in the group for `consumer` and return them oldest first.

        For a consumer that is alone in its group and must not skip ahead (the trainer): a restart
        finishes what its killed predecessor had started before it reads anything new, without
        waiting for the reclaim timeout."""
        key = self.keys.stream(stream)
        start = "0-0"
        while True:
            start, *_ = self.redis.xautoclaim(key, group, consumer, 0, start, count=1000)
            if start in (b"0-0", "0-0"):
                break
        out = []
        for entry_id, fields in (self.redis.xreadgroup(group, consumer, {key: "0"}) or [[None, []]])[0][1]:
            entry_id = entry_id.decode()
            if not fields:  # trimmed away while pending: nothing left to handle
                self.redis.xack(key, group, entry_id)
                continue
            try:
                out.append(Delivery(stream, entry_id, decode_on(stream, fields)))
            except EventDecodeError as exc:
                self.dead_letter(stream, group, entry_id, fields, 1, str(exc))
        return out

    def _without_held(self, key: str, group: str, consumer: str, raw: list, held: Collection[str]) -> list:
        """The reclaimed entries but those the consumer holds, whose delivery count is set back (XCLAIM
        RETRYCOUNT; JUSTID counts no delivery)."""
        mine = [entry for entry in raw if entry[0].decode() in held]
        if not mine:
            return raw
        for entry_id, deliveries in self._delivery_counts(key, group, mine).items():
            self.redis.xclaim(key, group, consumer, 0, [entry_id], retrycount=max(deliveries - 1, 1), justid=True)
        return [entry for entry in raw if entry[0].decode() not in held]

    def _delivery_counts(self, key: str, group: str, raw: list) -> dict[str, int]:
        ids = [entry_id for entry_id, _ in raw]
        pending = self.redis.xpending_range(key, group, min=ids[0], max=ids[-1], count=len(ids) * 4 + 16)
        wanted = {i.decode() for i in ids}
        out = {}
        for row in pending:
            entry_id = row["message_id"].decode() if isinstance(row["message_id"], bytes) else row["message_id"]
            if entry_id in wanted:
                out[entry_id] = row["times_delivered"]
        return out

    def ack(self, delivery: Delivery, group: str) -> None:
        self.redis.xack(self.keys.stream(delivery.stream), group, delivery.entry_id)
        EVENTS_HANDLED.labels(delivery.stream, group, "ok").inc()

    def keep_alive(self, stream: StreamName, group: str, consumer: str, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this consumer is still working on, so that live consumers
        do not reclaim a long episode from a replica that is alive (XCLAIM JUSTID: no delivery counted)."""
        if entry_ids:
            self.redis.xclaim(self.keys.stream(stream), group, consumer, 0, entry_ids, justid=True)

    def record_failure(self, delivery: Delivery, group: str, error: str) -> None:
        """Keep a handler's error so that the dead letter, if it comes to that, says what failed."""
        self.redis.hset(self._errors_key(delivery.stream, group), delivery.entry_id, error[-2000:])
        EVENTS_HANDLED.labels(delivery.stream, group, "failed").inc()

    def _errors_key(self, stream: StreamName, group: str) -> str:
        return self.keys.state("bus", "errors", stream, group)

    def dead_letter(self, stream: StreamName, group: str, entry_id: str, fields: dict, deliveries: int,
                    error: str) -> None:
        """Move an entry to the dead-letter stream and acknowledge it, atomically. The dead letter carries
        the entry's ids when the entry is an event of the stream, so that the rollout it belonged to can be
        accounted for (the reward service drops it from its group with the reason)."""
        shown = {_clip(_show(k)): _clip(_show(v)) for k, v in fields.items()}
        event = DeadLettered(stream=stream, entry_id=entry_id, group=group, deliveries=deliveries,
                             error=error, fields=shown)
        try:  # an event that does not belong on the stream is no part of its rollout's work: no ids
            envelope = decode_on(stream, fields)
            ids = {name: getattr(envelope, name) for name in ENVELOPE_IDS}
        except EventDecodeError:
            ids = {}
        pipe = self.redis.pipeline(transaction=True)
        self.publish("dead", event, pipe=pipe, **ids)
        pipe.xack(self.keys.stream(stream), group, entry_id)
        pipe.hdel(self._errors_key(stream, group), entry_id)
        pipe.execute()
        DEAD_LETTERS.labels(stream, group).inc()
        log.warning("dead-lettered entry", extra={"stream": stream, "entry_id": entry_id, "error": error})

    def has_keys(self) -> bool:
        """Whether anything of this run exists in Redis (a new run or a replay needs an empty namespace)."""
        return next(iter(self.redis.scan_iter(match=self.keys.pattern, count=1000)), None) is not None

    def fleet_versions(self) -> dict[str, int]:
        """Server url -> the policy version it serves, as the trainer last recorded it."""
        return {k.decode(): int(v) for k, v in self.redis.hgetall(self.keys.fleet_versions).items()}

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


def decode_on(stream: StreamName, fields: dict) -> Envelope:
    """decode(), and EventDecodeError for an event of a type the stream does not carry (STREAM_EVENTS): its
    consumer cannot tell what it means there (a TrajectoryFinished on `grades` is no grade)."""
    envelope = decode(fields)
    if not isinstance(envelope.payload, STREAM_EVENTS[stream]):
        carried = ", ".join(cls.TYPE for cls in STREAM_EVENTS[stream])
        raise EventDecodeError(f"{envelope.type} does not belong on {stream} (it carries {carried})")
    return envelope


def _clip(text: str) -> str:
    """A dead letter shows at most DEAD_LETTER_FIELD_CHARS of a field: a poison entry of megabytes, shown
    as repr once per consumer group, must not multiply on `dead` (the archive keeps the entry whole)."""
    if len(text) <= DEAD_LETTER_FIELD_CHARS:
        return text
    return f"{text[:DEAD_LETTER_FIELD_CHARS]}... [cut: {len(text)} characters]"


def _show(value: bytes | str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return repr(value)


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
