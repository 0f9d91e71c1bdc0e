"""The recorded run that tests/fixtures/reward-replay holds: what its reward service was given (eight groups
of three on `trajectories`, `grades` and `dead`), the settings it ran with, and how it was recorded.

The service that recorded it is the reward service of commit 930bc86, whose book re-read and re-decoded
every event of a group on each delivery; the fixture keeps what that service wrote (`rewards` and
`batches` in the run's archive, the batches' Parquet files), so that test_replay_of_a_recorded_run.py can
check that today's service, given the same entries again, writes the same. Record it again only for a
change meant to alter what the service writes (and say so in the commit):

    python -m tests.unit.services.reward.recorded_run [--redis redis://127.0.0.1:6379/0]

The groups, in the order their trajectories were published (a group's grades and dead letters after them):
rule-scored with a two-segment rollout (g1); sandbox-graded, its grades last and in reverse order, one of
them a GradingFailed (g2); one answer for all, filtered out (g3); a reclaimed rollout whose second attempt
came after its first had finished (g4); rewards given by the episode (g5); a failed rollout (g6); a
rollout whose prompt was dead-lettered, its group's other rollouts finishing last (g7); and a group known
only from dead letters (g8). The batches hold six rollouts and so cut across groups, one overshooting.
Seal order, and so every batch, depends only on the order of `trajectories`: g7's dead letter can be
handled before or after its rollouts finish, and g8 never holds a batch back.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from rollstream.cli.local_run import LocalRun
from rollstream.services.recorder.archive_writer import ArchiveWriter
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.events import (
    DeadLettered,
    Event,
    GradeReported,
    GradingFailed,
    TrajectoryFinished,
    TrajectorySegment,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "reward-replay"
"""The storage root the run was recorded under: <run>/archive and <run>/batches."""
RUN_ID = "reward-recorded"
GROUP_SIZE = 3
SETTINGS = {"data": {"samples_per_prompt": GROUP_SIZE},
            "train": {"batch_size": 2 * GROUP_SIZE, "filter_zero_variance": True},
            "recorder": {"enabled": False}}
"""What the recorded run's reward service was configured with, besides its run id, Redis and storage."""
INPUT_STREAMS = ("trajectories", "grades", "dead")

Published = tuple[str, Event, dict[str, str]]
"""(stream, event, the envelope's ids)."""


def rollout_events(group: str, rollout: str, sample_index: int, answer: str, *, segments: int = 1,
                   attempt: str = "a1", status: str = "completed", **grading) -> list[Published]:
    """A rollout's segments and its TrajectoryFinished, as the agent-runner publishes them."""
    ids = {"group_id": group, "rollout_id": rollout, "trajectory_id": f"{rollout}-{attempt}",
           "session_id": rollout}
    out: list[Published] = []
    for index in range(segments):
        prompt = [(sample_index * 31 + index * 7 + i) % 1000 for i in range(12)]
        response = [(sample_index * 17 + i) % 1000 for i in range(4 + index)]
        out.append(("trajectories", TrajectorySegment(
            segment_index=index, attempt=attempt, tokens=prompt + response, response_length=len(response),
            loss_mask=[0] * len(prompt) + [1] * len(response),
            rollout_logprobs=[0.0] * len(prompt) + [-0.25 * (i + 1) for i in range(len(response))],
            turn_policy_versions=[index], status=status, response_text=answer, sample_index=sample_index,
            group_size=GROUP_SIZE, metadata={"turns": index + 1}), ids))
    finished = TrajectoryFinished(status=status, attempt=attempt, segment_count=segments,
                                  group_size=GROUP_SIZE, sample_index=sample_index, response_text=answer,
                                  **grading)
    return out + [("trajectories", finished, ids)]


def dead_letter(group: str, rollout: str) -> Published:
    """The dead letter of a rollout's PromptIssued, as the agent-runner's group gives it up."""
    event = DeadLettered(stream="prompts", entry_id="1-0", group="agent-runner", deliveries=6,
                         error="gave up after 5 failed deliveries; last error: ValueError: bad tool spec",
                         fields={"type": "PromptIssued"})
    return "dead", event, {"group_id": group, "rollout_id": rollout}


def graded(group: str, rollout: str, score: float) -> Published:
    event = GradeReported(score=score, passed=score == 1.0, reason="exit 0" if score else "exit 1",
                          duration_s=0.5)
    return "grades", event, {"group_id": group, "rollout_id": rollout}


def grading_failed(group: str, rollout: str) -> Published:
    event = GradingFailed(reason="grading failed and no retry is left: BackendUnavailable: no engine",
                          attempts=4)
    return "grades", event, {"group_id": group, "rollout_id": rollout}


def inputs() -> list[Published]:
    """Everything the reward service was given, in the order it was published."""
    rule = {"label": "7"}
    sandbox = {"label": "7", "sandbox_check": "test"}
    trajectories = [
        *rollout_events("g1", "r1", 0, "7", segments=2, **rule), *rollout_events("g1", "r2", 1, "3", **rule),
        *rollout_events("g1", "r3", 2, "the answer is 7", **rule),
        *(event for index, rollout in enumerate(("r4", "r5", "r6"))
          for event in rollout_events("g2", rollout, 3 + index, "x", **sandbox)),
        *(event for index, rollout in enumerate(("r7", "r8", "r9"))
          for event in rollout_events("g3", rollout, 6 + index, "7", **rule)),
        *rollout_events("g4", "r10", 9, "7", attempt="first", **rule),
        *rollout_events("g4", "r11", 10, "1", **rule),
        *rollout_events("g4", "r10", 9, "no", segments=2, attempt="second", **rule),
        *rollout_events("g4", "r12", 11, "2", **rule),
        *(event for index, (rollout, reward) in enumerate((("r13", 0.25), ("r14", 1.0), ("r15", 0.5)))
          for event in rollout_events("g5", rollout, 12 + index, "done", label=None, reward=reward)),
        *rollout_events("g6", "r16", 15, "7", **rule),
        *rollout_events("g6", "r17", 16, "", status="failed", **rule),
        *rollout_events("g6", "r18", 17, "7", segments=3, **rule),
        *rollout_events("g7", "r20", 19, "7", **rule), *rollout_events("g7", "r21", 20, "8", **rule),
    ]
    grades = [grading_failed("g2", "r6"), graded("g2", "r5", 0.0), graded("g2", "r4", 1.0)]
    dead = [dead_letter("g8", "r22"), dead_letter("g7", "r19"), dead_letter("g8", "r23"),
            dead_letter("g8", "r24")]
    return trajectories[:20] + dead[:2] + trajectories[20:] + dead[2:] + grades


def record(redis_url: str) -> None:
    """Run the reward service on inputs() and keep its run's archive and batches as the fixture."""
    with tempfile.TemporaryDirectory(prefix="reward-recorded-") as root:
        settings = Settings(run_id=RUN_ID, redis_url=redis_url, storage_uri=root, **SETTINGS)
        local = LocalRun(settings, services=("reward",))
        local.start()
        try:
            for stream, event, ids in inputs():
                local.bus.publish(stream, event, **ids)
            local.wait_drained(timeout_s=120, quiet_s=2.0)
        finally:
            local.stop()
        bus = Bus(local.bus.redis, RUN_ID)
        try:
            writer = ArchiveWriter(Storage(root), RUN_ID)
            for stream in STREAMS:
                writer.archive_new(bus, stream, 1000)
        finally:
            bus.delete_run()
        shutil.rmtree(FIXTURE, ignore_errors=True)
        for kept in ("archive", "batches"):
            shutil.copytree(Path(root) / RUN_ID / kept, FIXTURE / RUN_ID / kept)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    record(parser.parse_args().redis)
