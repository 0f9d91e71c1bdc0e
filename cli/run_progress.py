"""What a local run has done so far, read from its streams (LocalRun.progress(), the run's live table), the
work it has left (backlog), and its summary once it is over (run_summary, written as summary.json).

Library of the command line, not run directly: `rollstream run` prints it as it goes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from rollstream.cli.restart_policy import ProcessExit
from rollstream.shared.contract.archive import ArchiveReader, StreamHistory
from rollstream.shared.contract.bus import Bus, StreamName
from rollstream.shared.contract.consumers import stream_groups
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    GradingFailed,
    PolicyUpdated,
    TrajectoryFinished,
)


@dataclass
class Progress:
    """What the run has done so far, read from its streams."""

    admitted: int = 0
    finished: int = 0
    graded: int = 0
    grading_failed: int = 0
    """Rollouts the sandbox could not grade (GradingFailed): dropped from their groups, never rewarded."""
    batches: list[BatchReady] = field(default_factory=list)
    updates: list[PolicyUpdated] = field(default_factory=list)
    dead_letters: list[DeadLettered] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    """Process name -> times the local run restarted it after it exited."""

    @property
    def version(self) -> int:
        return self.updates[-1].version if self.updates else 0

    def per_version(self) -> list[dict]:
        """Each policy version's batch mean reward, loss, parity, samples trained and dropped as stale."""
        # the first BatchReady of an id, should one be published twice
        rewards = {batch.batch_id: batch.mean_reward for batch in reversed(self.batches)}
        return [{"version": u.version, "batch_mean_reward": rewards.get(u.batch_id), "loss": u.loss,
                 "parity_max_abs_diff": u.parity_max_abs_diff, "trained": u.trained_samples,
                 "dropped_stale": u.dropped.get("stale", 0)}
                for u in self.updates]


class ProgressReader:
    """Reads a run's progress from its streams, incrementally, whether or not the recorder has trimmed
    them: counts from XINFO's entries-added, events from each stream's history (archive, then live)."""

    def __init__(self, bus: Bus, storage_uri: str) -> None:
        self.bus = bus
        reader = ArchiveReader(storage_uri, bus.keys.run_id)
        self.histories = {stream: StreamHistory(bus, stream, reader)
                          for stream in ("trajectories", "grades", "batches", "policy", "dead")}
        self.progress = Progress()

    def entries_added(self, stream: StreamName) -> int:
        try:
            return int(self.bus.redis.xinfo_stream(self.bus.keys.stream(stream))["entries-added"])
        except redis.ResponseError:
            return 0

    def update(self) -> Progress:
        progress = self.progress
        progress.admitted = self.entries_added("prompts")
        progress.graded = self.entries_added("grades")
        finished_type = TrajectoryFinished.TYPE.encode()
        progress.finished += sum(fields.get(b"type") == finished_type
                                 for _, fields in self.histories["trajectories"].new_entries())
        failed_type = GradingFailed.TYPE.encode()
        progress.grading_failed += sum(fields.get(b"type") == failed_type
                                       for _, fields in self.histories["grades"].new_entries())
        for stream, kind, events in (("batches", BatchReady, progress.batches),
                                     ("policy", PolicyUpdated, progress.updates),
                                     ("dead", DeadLettered, progress.dead_letters)):
            events.extend(d.event for d in self.histories[stream].new_events() if isinstance(d.event, kind))
        return progress


def backlog(bus: Bus, services: Iterable[str], job_queue: str) -> dict[str, int]:
    """Work the run's consumers have not finished: per stream and group of a running service, entries not
    yet delivered plus delivered and unacknowledged (a group that does not exist yet: all of the stream); and
    sandbox jobs queued, running or scheduled for a retry."""
    running = set(services)
    return unfinished_work(bus, sorted(pair for pair in stream_groups() if pair[1] in running), job_queue)


def unfinished_work(bus: Bus, groups: Iterable[tuple[str, str]], job_queue: str) -> dict[str, int]:
    """Per (stream, group) of `groups`, the entries not yet delivered plus those delivered and not
    acknowledged, where there are any; and the sandbox jobs of `job_queue` queued, running or scheduled for a
    retry."""
    out: dict[str, int] = {}
    for stream, group in groups:
        undelivered, pending = bus.group_lag(stream, group)
        if undelivered + pending:
            out[f"{stream}/{group}"] = undelivered + pending
    queue = bus.job_queue(job_queue)
    jobs = queue.count + queue.started_job_registry.count + queue.scheduled_job_registry.count
    if jobs:
        out["sandbox jobs"] = jobs
    return out


def run_summary(progress: Progress, *, run_id: str, restarts: dict[str, int], exits: list[ProcessExit],
                vllm_startup_s: float | None, run_dir: Path) -> dict:
    """What the run did: its counts, restarts, every exit its supervisor saw, and each version's figures."""
    return {
        "run_id": run_id,
        "samples_admitted": progress.admitted,
        "trajectories_finished": progress.finished,
        "grades": progress.graded,
        "grading_failed": progress.grading_failed,
        "batches": len(progress.batches),
        "policy_version": progress.version,
        "dead_letters": len(progress.dead_letters),
        "restarts": dict(restarts),
        "exits": [asdict(e) for e in exits],
        "vllm_startup_s": None if vllm_startup_s is None else round(vllm_startup_s, 1),
        "per_version": progress.per_version(),
        "run_dir": str(run_dir),
    }


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    return path
