"""Every Redis key of a run, built in one place: `Keys`. No other code writes a key string by hand.

A run's keys live under `rs:{<run_id>}:`, its namespace: its streams, each service's state, its locks and
counters. The braces make the run id the keys' hash tag, so that on a Redis Cluster every key of a run is in
one slot. The RQ queues of a run are the one exception: RQ keeps them under its own prefix, named after
the run (job_queue, grade_job_id), and Bus.delete_run deletes them with the run.

    python -m pytest tests/unit/shared/contract/test_keys.py -q
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property

from rollstream.shared.contract.streams import STREAMS, StreamName

NOT_IN_RUN_IDS = ":{} \n"
"""What a run id may not hold: the key separator, the braces of the keys' hash tag, whitespace."""
_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")
"""What RQ accepts as a job id."""


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

    @cached_property
    def reward(self) -> RewardKeys:
        """The reward service's keys (its state, `state('reward', ...)`)."""
        return RewardKeys(self.state("reward"))

    @property
    def incarnation(self) -> str:
        """String: a random id of this incarnation of the run (Bus.incarnation). Deleted with the run's other
        keys, so a new run under the same id gets another, and ids made from it (grade_job_id) never name what
        the old run left outside the namespace."""
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
        """Set: ids of the batches the run's trainer trained, added in the transaction that publishes the
        policy version trained on each: a PolicyUpdated whose batch is not here is no version of this
        run's."""
        return self.state("trainer", "trained-batches")

    @property
    def fleet_versions(self) -> str:
        """Hash: server url -> policy version it serves (a run fact: run_facts.FLEET_VERSIONS says who writes
        and who reads it)."""
        return f"{self.prefix}:fleet:versions"

    @property
    def fleet_members(self) -> str:
        """Set: the url of each policy server that registered in the run's fleet (a run fact:
        run_facts.FLEET_MEMBERS); one is a member while its `fleet_member` key lives."""
        return f"{self.prefix}:fleet:members"

    def fleet_member(self, url: str) -> str:
        """String with a time to live: a registered policy server's registration (its group and the version it
        started on), renewed by its heartbeat; Redis deletes it when the heartbeat lapses."""
        return f"{self.fleet_members}:{url}"

    @property
    def admitted(self) -> str:
        """Counter of samples the dispatcher admitted."""
        return f"{self.prefix}:admitted"

    @property
    def filtered(self) -> str:
        """Counter of admitted samples given back to the dispatcher: left out of training (zero-variance
        groups, dropped rollouts) or trained beyond a batch's B (whole groups overshoot it when one lost
        rollouts). A run fact: run_facts.FILTERED_SAMPLES says who writes and who reads it."""
        return f"{self.prefix}:filtered"


@dataclass(frozen=True)
class RewardKeys:
    """The reward service's keys (services/reward/book.py): each open group's book and the order and queue
    of the complete ones, under `<run>:state:reward`."""

    base: str

    def group(self, group_id: str) -> str:
        """Hash: the group's ledger: each rollout's TrajectoryFinished, grade or grading failure, and drop
        (`<kind>:<rollout>`), and the group's size."""
        return f"{self.base}:group:{group_id}"

    def segments(self, group_id: str) -> str:
        """Hash: `<rollout>:<attempt>:<index>` -> a segment of the group, of any attempt."""
        return f"{self.base}:segments:{group_id}"

    def ended(self, group_id: str) -> str:
        """Set: the group's rollouts that finished or were dropped; deleted when the group completes."""
        return f"{self.base}:ended:{group_id}"

    def resolved(self, group_id: str) -> str:
        """Set: the group's rollouts of which nothing more is needed (dropped, or finished with every
        segment and the grade it needs); deleted when the group completes."""
        return f"{self.base}:resolved:{group_id}"

    def assigned(self, group_id: str) -> str:
        """Hash: each rollout of a complete group that counts -> `<reward>,<advantage>`, until the group is
        batched."""
        return f"{self.base}:assigned:{group_id}"

    def done(self, group_id: str) -> str:
        """String: the marker of a completed group, which expires after reward.done_ttl_s."""
        return f"{self.base}:done:{group_id}"

    @property
    def ready_groups(self) -> str:
        """List: complete groups waiting to be batched, in batch order."""
        return f"{self.base}:ready-groups"

    @property
    def ready_rollouts(self) -> str:
        """Counter: the rollouts that count in ready_groups."""
        return f"{self.base}:ready-rollouts"

    @property
    def filtered_groups(self) -> str:
        """Counter: groups scored but not batched, for want of a learning signal."""
        return f"{self.base}:filtered-groups"

    @property
    def seal_counter(self) -> str:
        """Counter: the last place in batch order given (reward.batch_order "finished")."""
        return f"{self.base}:seal-counter"

    @property
    def sealed_groups(self) -> str:
        """Sorted set: each group sealed and not yet released -> its place in batch order."""
        return f"{self.base}:sealed-groups"

    @property
    def held_groups(self) -> str:
        """Hash: each complete group still in sealed_groups -> the rollouts it adds to ready_groups (0:
        filtered)."""
        return f"{self.base}:held-groups"

    @property
    def dropped(self) -> str:
        """Hash: cause -> rollouts left out of their group's batch."""
        return f"{self.base}:dropped"

    @property
    def awaiting_grades(self) -> str:
        """Sorted set: each group whose every rollout finished or was dropped -> when it got there; left
        when the group completes."""
        return f"{self.base}:awaiting-grades"
