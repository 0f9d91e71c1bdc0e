"""The reward service's book, kept in Redis: every prompt group's events until the group is complete,
its rewards and advantages (RewardAssigned), the order in which complete groups go into batches, and
the batches themselves (Parquet, announced with BatchReady). main.py feeds it deliveries.

record stores an event in its group and accounts for its rollout; complete_if_ready scores a group (as
scoring.py decides) once all its rollouts, segments and grades are in, or are accounted for as dropped (a
dead letter of one of the rollout's events, a failed grading, or expire_overdue: no grade within
reward.grade_timeout_s); seal and release keep reward.batch_order "finished" (complete groups batched in
the order their last rollout finished); flush_batches writes every full batch. Every step is idempotent,
so a redelivery or a restart changes nothing (see main.py for the rules).

What an arrival costs does not depend on its group's size. A group keeps its rollouts' finishes, grades and
drops in one hash (its ledger) and its segments in another, read only to batch the group. Each rollout is
`ended` once it finished or was dropped, and `resolved` once nothing more is needed of it: dropped, or
finished with every segment of its attempt and the grade it needs. An arrival marks its own rollout from
what is stored of it (never from a count kept per arrival, so that an event handled twice, or again after a
crash, changes nothing), and the two sets' sizes say when the group is complete. The ledger is read whole
once, to score the group, and the segments once, to batch it; each stored event is kept with the `type`
and `v` a stream entry has, so it decodes on decode()'s fast path. The ledger also keeps the role each
segment names (`role:<segment's field>`; none kept: the default role), so that the group's roles are
scored without decoding its segments: only those a role's own reward function scores (the role's last in
each rollout) are read to score it.

Tests: tests/unit/services/reward/test_reward_book.py, tests/unit/services/dispatcher/test_staleness_gate.py
(filtered groups and the dispatcher's gate) against the local Redis;
tests/unit/services/reward/test_replay_of_a_recorded_run.py (a run recorded by an earlier book);
tests/unit/services/reward/test_role_rewards.py (each role's rewards, advantages and rows).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import takewhile

import redis
from prometheus_client import Gauge, Histogram

from rollstream.services.reward.scoring import GroupScore, GroupScoring, count_group, segment_field
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.bus import Bus, Delivery
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    Envelope,
    GradeReported,
    GradingFailed,
    RewardAssigned,
    RolloutDropped,
    TrajectoryFinished,
    TrajectorySegment,
    decode,
    encode,
)
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.contract.run_facts import FILTERED_SAMPLES
from rollstream.shared.runtime.config import RewardSettings
from rollstream.shared.runtime.storage import Storage

BATCH_ORDERS = ("finished", "completed")
_DEFAULTS = RewardSettings()
DROPPING_STREAMS = ("prompts", "trajectories", "grades")
"""A dead letter of an event on these streams means its rollout can never complete: it is dropped."""
LEDGER_EVENTS = {"finished": TrajectoryFinished, "grade": GradeReported, "grading-failed": GradingFailed}
"""The events a group's ledger keeps, by the kind its fields name (`<kind>:<rollout>`); besides them it keeps
each dropped rollout's cause and reason (`dropped:<rollout>`) and the group's size (GROUP_SIZE_FIELD)."""
ROLLOUT_FIELDS = (*LEDGER_EVENTS, "dropped")
ROLE_FIELD_KIND = "role"
"""A ledger field `role:<rollout>:<attempt>:<index>` holds the role a segment names (where it names one)."""
GROUP_SIZE_FIELD = "group-size"
"""The group's size as its first TrajectoryFinished says (a group known only from dead letters has none)."""
_WIRE_FIELDS = {cls: (cls.TYPE.encode(), str(cls.VERSION).encode())
                for cls in (TrajectorySegment, *LEDGER_EVENTS.values())}
"""The `type` and `v` fields, as redis-py reads them, of each event the book keeps only the body of."""

GRADE_WAIT_SECONDS = Histogram("rollstream_reward_group_grade_wait_seconds",
                               "From the last rollout of a group finishing to the group's scoring: the wait "
                               "for its sandbox grades.",
                               buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900))
BATCH_MEAN = Gauge("rollstream_reward_batch_mean",
                   "Mean reward of the rollouts of the last batch written (rewards may be negative, so the "
                   "reward histogram has no _sum to average).")
BATCH_SAMPLES = Histogram("rollstream_reward_batch_samples", "Samples (segments) in each batch written.",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))


class RewardBook:
    """The reward service's state in Redis: per open group its ledger, its segments and its ended and
    resolved rollouts; a list of complete groups ready for batching and, in batch_order "finished", the
    sealed groups waiting for their turn."""

    def __init__(self, bus: Bus, storage: Storage, batch_size: int, advantage_estimator: str = "grpo",
                 filter_zero_variance: bool = False, batch_order: str = _DEFAULTS.batch_order,
                 reward_function: str | None = _DEFAULTS.function, done_ttl_s: int = _DEFAULTS.done_ttl_s,
                 group_size: int | None = None, grade_timeout_s: float = _DEFAULTS.grade_timeout_s,
                 roles: RunRoles | None = None,
                 role_reward_functions: Mapping[str, str] | None = None) -> None:
        if batch_order not in BATCH_ORDERS:
            raise ValueError(f"unknown batch order {batch_order!r}; use one of {', '.join(BATCH_ORDERS)}")
        self.bus = bus
        self.storage = storage
        self.batch_size = batch_size
        self.batch_order = batch_order
        self.scoring = GroupScoring(advantage_estimator, filter_zero_variance, reward_function, roles,
                                    role_reward_functions)
        self.done_ttl_s = done_ttl_s
        self.group_size = group_size
        """Rollouts per group, for a group known only from dead letters (no TrajectoryFinished says it)."""
        self.grade_timeout_s = grade_timeout_s
        self.keys = bus.keys.reward
        """Every key of the book (Keys.reward)."""

    # ------------------------------------------------------------------------------------ arrivals
    def record(self, delivery: Delivery) -> str | None:
        """Store the event in its group and account for its rollout; returns the group id to check for
        completion (None: the event is none of the book's, or its group is done)."""
        envelope, event = delivery.envelope, delivery.event
        group_id, rollout = envelope.group_id, envelope.rollout_id
        kept = None if group_id is None else self.kept_as(envelope, event)
        if kept is None or self.bus.redis.exists(self.keys.done(group_id)):
            return None
        key, field, body = kept
        pipe = self.bus.redis.pipeline(transaction=True)
        # hsetnx: the first finished attempt of a rollout wins; segments of other attempts are never read.
        pipe.hsetnx(key, field, body)
        if isinstance(event, TrajectorySegment) and event.role is not None:
            pipe.hsetnx(self.keys.group(group_id), f"{ROLE_FIELD_KIND}:{field}", event.role)
        if isinstance(event, TrajectoryFinished):
            pipe.hsetnx(self.keys.group(group_id), GROUP_SIZE_FIELD, event.group_size)
        pipe.hmget(self.keys.group(group_id), [f"{kind}:{rollout}" for kind in ROLLOUT_FIELDS])
        self.account(group_id, rollout, *pipe.execute()[-1])
        return group_id

    def kept_as(self, envelope: Envelope, event: object) -> tuple[str, str, bytes | str] | None:
        """(hash, field, value) the event is kept as in its group; None for one the book does not keep."""
        group_id, rollout = envelope.group_id, envelope.rollout_id
        if isinstance(event, TrajectorySegment):
            field = segment_field(rollout, event.attempt, event.segment_index)
            return self.keys.segments(group_id), field, encode(envelope)["body"]
        for kind, event_type in LEDGER_EVENTS.items():
            if isinstance(event, event_type):
                return self.keys.group(group_id), f"{kind}:{rollout}", encode(envelope)["body"]
        if isinstance(event, DeadLettered) and rollout and event.stream in DROPPING_STREAMS:
            reason = (f"{event.fields.get('type', 'an event')} dead-lettered on {event.stream} by "
                      f"{event.group}: {event.error}")
            return self.keys.group(group_id), f"dropped:{rollout}", f"dead_lettered|{reason}"
        return None

    def account(self, group_id: str, rollout: str, finished: bytes | None, grade: bytes | None,
                grading_failed: bytes | None, dropped: bytes | None) -> None:
        """Mark the rollout ended once it finished or was dropped, and resolved once nothing more is needed
        of it, from what the ledger holds of it (its ROLLOUT_FIELDS)."""
        if finished is None and dropped is None:
            return  # still running: what came of it waits for its TrajectoryFinished
        resolved = dropped is not None or self.lacking(
            group_id, rollout, decode_stored(TrajectoryFinished, finished).payload,
            judged=grade is not None or grading_failed is not None) is None
        pipe = self.bus.redis.pipeline(transaction=True)
        pipe.sadd(self.keys.ended(group_id), rollout)
        if resolved:
            pipe.sadd(self.keys.resolved(group_id), rollout)
        pipe.execute()

    def lacking(self, group_id: str, rollout: str, finished: TrajectoryFinished, judged: bool) -> str | None:
        """What a finished rollout still lacks (segments of its attempt, or the grade it needs: `judged` says
        whether a grade or a grading failure came); None once nothing."""
        pipe = self.bus.redis.pipeline(transaction=False)
        for index in range(finished.segment_count):
            pipe.hexists(self.keys.segments(group_id), segment_field(rollout, finished.attempt, index))
        segments = sum(pipe.execute())
        if segments < finished.segment_count:
            return f"{finished.segment_count - segments} of its {finished.segment_count} segments"
        if finished.needs_grade and self.scoring.uses_grades and not judged:
            return "its grade"
        return None

    def load(self, group_id: str) -> dict[str, dict]:
        """The group's ledger: {'finished': {rollout: envelope}, 'grade': {rollout: ...}, 'grading-failed':
        {rollout: ...}, 'dropped': {rollout: (cause, reason)}, 'role': {segment's field: role it names}}."""
        out: dict[str, dict] = {kind: {} for kind in (*ROLLOUT_FIELDS, ROLE_FIELD_KIND)}
        for field, body in self.bus.redis.hgetall(self.keys.group(group_id)).items():
            kind, _, rollout = field.decode().partition(":")
            if kind == ROLE_FIELD_KIND:
                out[kind][rollout] = body.decode()
            elif kind == "dropped":
                cause, _, reason = body.decode(errors="replace").partition("|")
                out[kind][rollout] = (cause, reason)
            elif kind in LEDGER_EVENTS:  # not GROUP_SIZE_FIELD
                out[kind][rollout] = decode_stored(LEDGER_EVENTS[kind], body)
        return out

    def missing(self, group_id: str, state: dict[str, dict]) -> dict[str, str]:
        """Each finished rollout, not dropped, that still lacks segments or a grade -> what it lacks."""
        out = {}
        for rollout, envelope in state["finished"].items():
            if rollout in state["dropped"]:
                continue
            judged = rollout in state["grade"] or rollout in state["grading-failed"]
            lacking = self.lacking(group_id, rollout, envelope.payload, judged)
            if lacking is not None:
                out[rollout] = lacking
        return out

    def expire_overdue(self, now: float | None = None) -> list[str]:
        """Resolve the groups that have waited longer than grade_timeout_s since their last rollout finished:
        the rollouts still missing a grade or segments are dropped with the reason (grade_timeout), the rest
        are scored as usual. Returns the groups completed."""
        now = time.time() if now is None else now
        overdue = [g.decode() for g in self.bus.redis.zrangebyscore(self.keys.awaiting_grades, "-inf",
                                                                    now - self.grade_timeout_s)]
        completed = []
        for group_id in overdue:
            if self.bus.redis.exists(self.keys.done(group_id)):
                self.bus.redis.zrem(self.keys.awaiting_grades, group_id)
                continue
            for rollout, lacking in self.missing(group_id, self.load(group_id)).items():
                pipe = self.bus.redis.pipeline(transaction=True)
                pipe.hsetnx(self.keys.group(group_id), f"dropped:{rollout}",
                            f"grade_timeout|{lacking} did not come within {self.grade_timeout_s:g} s")
                pipe.sadd(self.keys.resolved(group_id), rollout)
                pipe.execute()
            if self.complete_if_ready(group_id):
                completed.append(group_id)
        return completed

    # ---------------------------------------------------------------------------------- completion
    def seal(self, group_id: str) -> None:
        """Give the group the next place in batch order, once: a redelivered event keeps its place."""
        if self.bus.redis.zscore(self.keys.sealed_groups, group_id) is not None:
            return
        number = self.bus.redis.incr(self.keys.seal_counter)
        # NX: a crash between the two steps costs a number, never a second place
        self.bus.redis.zadd(self.keys.sealed_groups, {group_id: number}, nx=True)

    def complete_if_ready(self, group_id: str) -> bool:
        """Score the group once each of its rollouts has finished or was dropped and none lacks segments
        or a grade: rewards and drops published, the group done and queued for batching, in one
        transaction. Returns whether it completed now."""
        pipe = self.bus.redis.pipeline(transaction=True)
        pipe.scard(self.keys.ended(group_id))
        pipe.scard(self.keys.resolved(group_id))
        pipe.hget(self.keys.group(group_id), GROUP_SIZE_FIELD)
        ended, resolved, size = pipe.execute()
        # as its TrajectoryFinished says; as configured for a group known only from dead letters
        group_size = int(size) if size is not None else (self.group_size if ended else None)
        if not group_size or ended < group_size:
            return False
        # Every rollout has finished or was dropped: from now on only grades (or segments) can be missing,
        # and expire_overdue resolves the group if they do not come.
        self.bus.redis.zadd(self.keys.awaiting_grades, {group_id: time.time()}, nx=True)
        if self.batch_order == "finished":
            # Here rather than in record(): sealed before it can complete, even if the process died
            # between storing the last TrajectoryFinished and sealing.
            self.seal(group_id)
        if resolved < ended:
            return False
        state = self.load(group_id)
        scored = self.scoring.score_group(state, lambda wanted: self.segment_texts(group_id, state, wanted))
        all_finished_at = self.bus.redis.zscore(self.keys.awaiting_grades, group_id)
        self.commit_group(group_id, state["finished"], group_size, scored)
        if all_finished_at is not None:
            GRADE_WAIT_SECONDS.observe(max(0.0, time.time() - all_finished_at))
        if self.batch_order == "finished":
            self.release()
        return True

    def commit_group(self, group_id: str, finished: dict[str, Envelope], group_size: int,
                     score: GroupScore) -> None:
        """Publish the group's rewards and drops, mark it done and hand it on to batching (or, filtered, give
        its samples back to the dispatcher). One transaction: a crash leaves the group either untouched
        (redone on redelivery) or done."""
        pipe = self.bus.redis.pipeline(transaction=True)
        kept = zip(score.rollouts, score.rewards, score.advantages, score.sources, score.roles)
        for rollout, reward, advantage, source, roles in kept:
            ids = finished[rollout]
            event = RewardAssigned(reward=reward, advantage=advantage, source=source,
                                   role_rewards={role: s.reward for role, s in roles.items() if s.own},
                                   role_advantages={role: s.advantage for role, s in roles.items()})
            self.bus.publish("rewards", event, pipe=pipe, event_id=f"{rollout}:reward", rollout_id=rollout,
                             group_id=group_id, trajectory_id=ids.trajectory_id, session_id=ids.session_id)
            if not score.filtered:
                role_scores = {role: (s.reward, s.advantage) for role, s in roles.items()}
                pipe.hset(self.keys.assigned(group_id), rollout,
                          Assigned(reward, advantage, role_scores).encode())
        for rollout, (cause, reason) in sorted(score.drops.items()):
            self.bus.publish("rewards", RolloutDropped(reason=reason, cause=cause), pipe=pipe,
                             event_id=f"{rollout}:dropped", rollout_id=rollout, group_id=group_id)
            if cause != "filtered":
                pipe.hincrby(self.keys.dropped, cause, 1)
        pipe.set(self.keys.done(group_id), 1, ex=self.done_ttl_s)
        pipe.zrem(self.keys.awaiting_grades, group_id)
        pipe.delete(self.keys.ended(group_id), self.keys.resolved(group_id))
        # The dispatcher counts admitted samples, group_size per group: it admits as many again as were left
        # out.
        given_back = group_size if score.filtered else len(score.drops)
        if given_back:
            pipe.incrby(FILTERED_SAMPLES.key(self.bus.keys), given_back)
        if score.filtered:
            if score.rollouts:
                pipe.incr(self.keys.filtered_groups)
            pipe.delete(self.keys.group(group_id), self.keys.segments(group_id))
        if self.batch_order == "finished":
            pipe.hset(self.keys.held_groups, group_id, 0 if score.filtered else len(score.rollouts))
        elif not score.filtered:
            pipe.rpush(self.keys.ready_groups, group_id)
            pipe.incrby(self.keys.ready_rollouts, len(score.rollouts))
        pipe.execute()
        count_group(score, self.scoring.roles)

    # ------------------------------------------------------------------------------------ batching
    def release(self) -> int:
        """Move the complete groups at the head of the sealed set to the ready list, in seal order,
        stopping at the first group that is not complete; filtered groups leave the set without
        being batched. Returns how many groups left the set.

        One transaction, watched on the sealed set: a crash releases all of them or none (the next
        completion, or a restart, releases them), and a concurrent release makes this one start again
        instead of releasing a group twice."""
        with self.bus.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.keys.sealed_groups)
                    sealed = [g.decode() for g in pipe.zrange(self.keys.sealed_groups, 0, -1)]
                    held = pipe.hmget(self.keys.held_groups, sealed) if sealed else []
                    head = [(g, int(n)) for g, n in takewhile(lambda pair: pair[1] is not None,
                                                              zip(sealed, held))]
                    if not head:
                        pipe.unwatch()
                        return 0
                    pipe.multi()
                    for group_id, rollouts in head:
                        if rollouts:
                            pipe.rpush(self.keys.ready_groups, group_id)
                            pipe.incrby(self.keys.ready_rollouts, rollouts)
                    groups = [group_id for group_id, _ in head]
                    pipe.zrem(self.keys.sealed_groups, *groups)
                    pipe.hdel(self.keys.held_groups, *groups)
                    pipe.execute()
                    return len(head)
                except redis.WatchError:
                    continue

    def filtered_groups(self) -> int:
        return self.status()["groups_filtered"]

    def dropped(self) -> dict[str, int]:
        """Rollouts left out of their group's batch, by cause (grading_failed, dead_lettered,
        grade_timeout)."""
        return self.status()["rollouts_dropped"]

    def status(self) -> dict:
        """What the service reports of the book, read in one round trip (main.py reads it on every
        delivery): groups filtered, rollouts dropped by cause, groups sealed but not yet batched (held back
        by an earlier one that waits for its grades) and groups waiting for their grades."""
        pipe = self.bus.redis.pipeline(transaction=False)
        pipe.get(self.keys.filtered_groups)
        pipe.hgetall(self.keys.dropped)
        pipe.zcard(self.keys.sealed_groups)
        pipe.zcard(self.keys.awaiting_grades)
        filtered, dropped, waiting_in_order, awaiting_grades = pipe.execute()
        return {"groups_filtered": int(filtered or 0),
                "rollouts_dropped": {k.decode(): int(v) for k, v in dropped.items()},
                "groups_waiting_in_order": waiting_in_order, "groups_awaiting_grades": awaiting_grades}

    def batch_rows(self, group_id: str) -> tuple[list[BatchRow], dict[str, float]]:
        """The group's rows: each segment of the finished attempt of each rollout that counts, in order, with
        its role and that role's reward and advantage; and the reward of each of those rollouts."""
        finished = self.load(group_id)["finished"]
        assigned = {k.decode(): Assigned.decode(v)
                    for k, v in self.bus.redis.hgetall(self.keys.assigned(group_id)).items()}
        # dropped from the group (see RolloutDropped): not assigned
        wanted = [(rollout, index) for rollout in sorted(assigned)
                  for index in range(finished[rollout].payload.segment_count)]
        bodies = self.bus.redis.hmget(self.keys.segments(group_id), [
            segment_field(rollout, finished[rollout].payload.attempt, index) for rollout, index in wanted])
        rows = []
        for (rollout, index), body in zip(wanted, bodies):
            envelope = self.stored_segment(group_id, rollout, index, body)
            seg: TrajectorySegment = envelope.payload
            role = self.scoring.roles.role_of(seg.role)
            reward, advantage = assigned[rollout].of_role(role, f"rollout {rollout!r} of group {group_id!r}")
            rows.append(BatchRow(
                sample_index=seg.sample_index, trajectory_id=envelope.trajectory_id or rollout,
                rollout_id=rollout, group_id=group_id, session_id=envelope.session_id or rollout,
                segment_index=index, tokens=seg.tokens, response_length=seg.response_length,
                loss_mask=seg.loss_mask, rollout_logprobs=seg.rollout_logprobs,
                turn_policy_versions=seg.turn_policy_versions, status=seg.status, reward=reward,
                advantage=advantage, metadata=seg.metadata, role=role,
            ))
        return rows, {rollout: assigned[rollout].reward for rollout in sorted(assigned)}

    def segment_texts(self, group_id: str, state: dict[str, dict],
                      wanted: list[tuple[str, int]]) -> list[str]:
        """The response texts of segments of the group's rollouts' finished attempts, by (rollout, index)."""
        finished = state["finished"]
        bodies = self.bus.redis.hmget(self.keys.segments(group_id), [
            segment_field(rollout, finished[rollout].payload.attempt, index) for rollout, index in wanted])
        return [self.stored_segment(group_id, rollout, index, body).payload.response_text
                for (rollout, index), body in zip(wanted, bodies)]

    @staticmethod
    def stored_segment(group_id: str, rollout: str, index: int, body: bytes | None) -> Envelope:
        if body is None:
            raise RuntimeError(f"segment {index} of rollout {rollout!r} of complete group {group_id!r} "
                               "is not in the book: its state in Redis was changed outside the reward "
                               "service")
        return decode_stored(TrajectorySegment, body)

    def flush_batches(self, run_id: str) -> list[BatchReady]:
        """Write every full batch of complete groups; returns what was announced."""
        announced = []
        while int(self.bus.redis.get(self.keys.ready_rollouts) or 0) >= self.batch_size:
            groups_needed = None
            ready = [g.decode() for g in self.bus.redis.lrange(self.keys.ready_groups, 0, -1)]
            rows: list[BatchRow] = []
            taken: list[str] = []
            rewards: dict[str, float] = {}
            for group_id in ready:
                group_rows, group_rewards = self.batch_rows(group_id)
                rows.extend(group_rows)
                taken.append(group_id)
                rewards.update(group_rewards)
                if len(rewards) >= self.batch_size:
                    groups_needed = len(taken)
                    break
            if groups_needed is None:
                raise RuntimeError(f"ready-rollouts counter says {self.batch_size}+ but the ready groups "
                                   f"hold {len(rewards)} rollouts")
            batch_id = "b-" + hashlib.sha1(",".join(taken).encode()).hexdigest()[:16]
            uri = write_batch(self.storage, run_id, batch_id, rows)
            event = BatchReady(batch_id=batch_id, uri=uri, sample_count=len(rows), group_ids=taken,
                               min_policy_version=min(r.min_policy_version for r in rows),
                               mean_reward=sum(rewards.values()) / len(rewards))
            pipe = self.bus.redis.pipeline(transaction=True)
            self.bus.publish("batches", event, pipe=pipe, event_id=f"{batch_id}:ready")
            pipe.ltrim(self.keys.ready_groups, groups_needed, -1)
            pipe.decrby(self.keys.ready_rollouts, len(rewards))
            if len(rewards) > self.batch_size:
                # Whole groups overshoot B when a group lost rollouts; the dispatcher counts B per batch, so
                # the surplus goes back like a drop, or the last batch would wait for samples never admitted.
                pipe.incrby(FILTERED_SAMPLES.key(self.bus.keys), len(rewards) - self.batch_size)
            for group_id in taken:
                pipe.delete(self.keys.group(group_id), self.keys.segments(group_id),
                            self.keys.assigned(group_id))
            pipe.execute()
            BATCH_SAMPLES.observe(len(rows))
            BATCH_MEAN.set(event.mean_reward)
            announced.append(event)
        return announced


@dataclass(frozen=True)
class Assigned:
    """A rollout's scores as the book keeps them from its group's completion to its batch (Keys.assigned)."""

    reward: float
    advantage: float
    roles: dict[str, tuple[float, float]] | None
    """Each role of the rollout -> (reward, advantage); None: kept by a book from before roles, whose rows
    all take the rollout's."""

    def encode(self) -> str:
        roles = {role: list(pair) for role, pair in (self.roles or {}).items()}
        return json.dumps([self.reward, self.advantage, roles])  # floats as repr: read back exactly

    @classmethod
    def decode(cls, value: bytes) -> Assigned:
        text = value.decode()
        if not text.startswith("["):  # `reward,advantage`
            reward, advantage = (float(x) for x in text.split(","))
            return cls(reward, advantage, None)
        reward, advantage, roles = json.loads(text)
        return cls(float(reward), float(advantage),
                   {role: (float(r), float(a)) for role, (r, a) in roles.items()})

    def of_role(self, role: str, rollout: str) -> tuple[float, float]:
        """(reward, advantage) the role's segments of the rollout are trained with."""
        if self.roles is None:
            return self.reward, self.advantage
        if role not in self.roles:
            raise RuntimeError(f"{rollout} has a segment of role {role!r}, but its scores have none "
                               f"({', '.join(self.roles)}): the roles its group's ledger kept differ from "
                               "its segments'")
        return self.roles[role]


def decode_stored(event_type: type, body: bytes) -> Envelope:
    """The envelope of an event the book kept the body of, decoded as the stream entry it came in as."""
    type_field, version_field = _WIRE_FIELDS[event_type]
    return decode({b"type": type_field, b"v": version_field, b"body": body})
