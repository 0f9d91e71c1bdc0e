"""What the console keeps of the run it shows, read incrementally: each refresh reads only what the streams
got since the last one, so a page polling every few seconds costs Redis what the run publishes, not its
history.

    throughput   every stream's entries of the last THROUGHPUT_WINDOW_MS, counted per minute from their ids'
                 timestamps (LiveTail: the live stream, first its last window, then what comes)
    rollouts     the RECENT_ROLLOUTS latest finished rollouts (TrajectoryFinished) with their grade (grades),
                 reward and advantage (and each role's, where the rollout's roles have their own) or why
                 they were dropped (rewards)
    curves       per policy version: each role's version after it, its batch's mean reward, the staleness of
                 its samples, the loss; and the mean reward per minute (the whole history of `rewards`,
                 `batches` and `policy`, trimmed part from the archive: StreamHistory)
    dead         the newest DEAD_SHOWN dead letters with their errors, and how many there were

    python -m pytest tests/unit/services/console -q
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import redis

from rollstream.shared.contract.archive import ArchiveReader, StreamHistory, parse_id
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    EventDecodeError,
    GradeReported,
    GradingFailed,
    PolicyUpdated,
    RewardAssigned,
    RolloutDropped,
    TrajectoryFinished,
    decode,
)
from rollstream.shared.contract.run_source import RawEntry, as_text

THROUGHPUT_WINDOW_MS = 10 * 60_000
"""How far back throughput is counted: ten one-minute buckets."""
MINUTE_MS = 60_000
TAIL_BACKLOG = 2000
"""A tail's first read goes back at least this many entries, so that a run that went quiet still lists its
last rollouts."""
READ_CAP = 10_000
"""Most entries one refresh reads of one stream; a stream that got more since is read on at the next."""
RECENT_ROLLOUTS = 500
DEAD_SHOWN = 20
REFRESH_S = 1.0
"""Refreshes closer together than this (several pages open) reuse the last one."""
_TYPE = b"type"


class LiveTail:
    """The entries a live stream gets, each read once: first the last THROUGHPUT_WINDOW_MS of them (at least
    the last TAIL_BACKLOG), then whatever comes after the last one read."""

    def __init__(self, bus: Bus, stream: StreamName) -> None:
        self.bus = bus
        self.key = bus.keys.stream(stream)
        self.cursor: str | None = None
        self.behind = False
        """The last read stopped at READ_CAP: newer entries are still to be read."""

    def new_entries(self, now_ms: int) -> list[RawEntry]:
        if self.cursor is None:
            start = f"{now_ms - THROUGHPUT_WINDOW_MS}"
            newest = self.bus.redis.xrevrange(self.key, count=TAIL_BACKLOG)
            if newest and parse_id(as_text(newest[-1][0])) < parse_id(f"{start}-0"):
                start = as_text(newest[-1][0])
        else:
            start = f"({self.cursor}"
        entries = [(as_text(entry_id), fields) for entry_id, fields in
                   self.bus.redis.xrange(self.key, min=start, max="+", count=READ_CAP)]
        self.behind = len(entries) == READ_CAP
        if entries:
            self.cursor = entries[-1][0]
        return entries


@dataclass
class Throughput:
    """One stream's entry times (ms) within the window."""

    times: deque[int] = field(default_factory=deque)

    def add(self, entries: list[RawEntry]) -> None:
        self.times.extend(parse_id(entry_id)[0] for entry_id, _ in entries)

    def per_minute(self, now_ms: int) -> list[int]:
        """Entries in each of the window's minutes, oldest first (the last is the minute up to now)."""
        while self.times and self.times[0] <= now_ms - THROUGHPUT_WINDOW_MS:
            self.times.popleft()
        buckets = [0] * (THROUGHPUT_WINDOW_MS // MINUTE_MS)
        for ms in self.times:
            index = len(buckets) - 1 - (now_ms - ms) // MINUTE_MS
            if 0 <= index < len(buckets):
                buckets[index] += 1
        return buckets


def _bounded_put(table: OrderedDict, key: str, value: Any, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


class RunWatch:
    """The run's live numbers, refreshed on demand (refresh) and read under one lock by the API's threads."""

    def __init__(self, bus: Bus, storage_uri: str) -> None:
        self.bus = bus
        self.lock = threading.Lock()
        self.refreshed = 0.0
        self.tails = {stream: LiveTail(bus, stream) for stream in STREAMS}
        self.throughput = {stream: Throughput() for stream in STREAMS}
        reader = ArchiveReader(storage_uri, bus.keys.run_id)
        self.histories = {stream: StreamHistory(bus, stream, reader)
                          for stream in ("rewards", "batches", "policy")}
        self.rollouts: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.outcomes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        """Rollout id -> what grades and rewards said of it, kept for rollouts whose finish comes later."""
        self.batches: dict[str, BatchReady] = {}
        self.versions: list[dict[str, Any]] = []
        self.reward_minutes: dict[int, list[float]] = {}
        """Minute (Unix time // 60) -> [sum of rewards, count]."""

    def refresh(self) -> None:
        with self.lock:
            if time.monotonic() - self.refreshed < REFRESH_S:
                return
            now_ms = int(time.time() * 1000)
            for stream, tail in self.tails.items():
                entries = tail.new_entries(now_ms)
                self.throughput[stream].add(entries)
                if stream == "trajectories":
                    self._finished(entries)
                elif stream == "grades":
                    self._graded(entries)
            for history in self.histories.values():
                for delivery in history.new_events():
                    self._history_event(delivery.envelope)
            self.refreshed = time.monotonic()

    def _finished(self, entries: list[RawEntry]) -> None:
        wanted = TrajectoryFinished.TYPE.encode()
        for _, fields in entries:
            if fields.get(_TYPE) != wanted:
                continue
            try:
                envelope = decode(fields)
            except EventDecodeError:
                continue
            f: TrajectoryFinished = envelope.payload
            row = {"rollout_id": envelope.rollout_id, "group_id": envelope.group_id,
                   "session_id": envelope.session_id, "status": f.status, "attempt": f.attempt,
                   "segments": f.segment_count, "finished_at": envelope.time, "error": f.error,
                   "needs_grade": f.needs_grade}
            _bounded_put(self.rollouts, envelope.rollout_id or envelope.event_id, row, RECENT_ROLLOUTS)

    def _graded(self, entries: list[RawEntry]) -> None:
        for _, fields in entries:
            try:
                envelope = decode(fields)
            except EventDecodeError:
                continue
            event = envelope.payload
            if isinstance(event, GradeReported):
                grade = "passed" if event.passed else f"failed ({event.score:g})"
                self._outcome(envelope.rollout_id, grade=grade)
            elif isinstance(event, GradingFailed):
                self._outcome(envelope.rollout_id, grade="could not grade")

    def _outcome(self, rollout_id: str | None, **facts: Any) -> None:
        if rollout_id:
            _bounded_put(self.outcomes, rollout_id, {**self.outcomes.get(rollout_id, {}), **facts},
                         RECENT_ROLLOUTS * 4)

    def _history_event(self, envelope) -> None:
        event = envelope.payload
        if isinstance(event, RewardAssigned):
            self._outcome(envelope.rollout_id, reward=event.reward, advantage=event.advantage,
                          role_rewards=dict(event.role_rewards), role_advantages=dict(event.role_advantages))
            bucket = self.reward_minutes.setdefault(int(envelope.time // 60), [0.0, 0])
            bucket[0] += event.reward
            bucket[1] += 1
        elif isinstance(event, RolloutDropped):
            self._outcome(envelope.rollout_id, dropped=event.cause)
        elif isinstance(event, BatchReady):
            self.batches[event.batch_id] = event
        elif isinstance(event, PolicyUpdated):
            self.versions.append(self._version_point(envelope.time, event))

    def _version_point(self, at: float, event: PolicyUpdated) -> dict[str, Any]:
        """One point of the curves: a policy version, its batch's mean reward and its samples' staleness (the
        trainer's own measure; the batch's oldest turn when the trainer gave none)."""
        batch = self.batches.get(event.batch_id)
        oldest = event.version - 1 - batch.min_policy_version if batch is not None else None
        return {"version": event.version, "role_versions": dict(event.role_versions), "time": at,
                "batch_id": event.batch_id,
                "batch_mean_reward": batch.mean_reward if batch is not None else None,
                "staleness_mean": event.metrics.get("samples/staleness_mean"),
                "staleness_max": event.metrics.get("samples/staleness_max", oldest),
                "dropped_stale": event.dropped.get("stale", 0), "loss": event.loss,
                "trained": event.trained_samples}

    # ------------------------------------------------------------------------------------------ views
    def streams_throughput(self) -> dict[str, dict[str, Any]]:
        now_ms = int(time.time() * 1000)
        with self.lock:
            out = {}
            for stream in STREAMS:
                minutes = self.throughput[stream].per_minute(now_ms)
                out[stream] = {"per_minute": minutes, "last_minute": minutes[-1],
                               "mean_per_minute": round(sum(minutes) / len(minutes), 2),
                               "behind": self.tails[stream].behind}
            return out

    def recent_rollouts(self, limit: int) -> list[dict[str, Any]]:
        with self.lock:
            newest = list(self.rollouts.values())[-limit:][::-1]
            return [{**row, **self.outcomes.get(row["rollout_id"], {})} for row in newest]

    def curves(self) -> dict[str, Any]:
        with self.lock:
            trained = {point["batch_id"] for point in self.versions}
            return {"versions": list(self.versions),
                    "reward_per_minute": [{"minute": minute * 60, "mean": total / count, "count": count}
                                          for minute, (total, count) in sorted(self.reward_minutes.items())],
                    "batches_waiting": sorted(set(self.batches) - trained)}

    def dead_letters(self) -> dict[str, Any]:
        """The newest dead letters (those that do not decode shown by their entry id alone) and how many."""
        key = self.bus.keys.stream("dead")
        try:
            added = int(self.bus.redis.xinfo_stream(key)["entries-added"])
        except redis.ResponseError:  # no dead letter yet
            return {"total": 0, "latest": []}
        latest = []
        for entry_id, fields in self.bus.redis.xrevrange(key, count=DEAD_SHOWN):
            row: dict[str, Any] = {"entry_id": as_text(entry_id), "at": parse_id(as_text(entry_id))[0] / 1000}
            try:
                envelope = decode(fields)
            except EventDecodeError as exc:
                row["error"] = f"not a dead letter: {exc}"
            else:
                if isinstance(envelope.payload, DeadLettered):
                    d: DeadLettered = envelope.payload
                    row.update(stream=d.stream, original_entry=d.entry_id, group=d.group,
                               deliveries=d.deliveries, error=d.error, rollout_id=envelope.rollout_id)
            latest.append(row)
        return {"total": added, "latest": latest}
