"""What a local run has done so far, read from its streams (LocalRun.progress(), the run's live table).

Library of the command line, not run directly: `rollstream run` prints it as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from rollstream.shared.contract.archive import ArchiveReader, StreamHistory
from rollstream.shared.contract.bus import Bus, StreamName
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
