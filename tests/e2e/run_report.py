"""What a compose run did, as one JSON object on stdout: run inside a service container of the stack
(`docker compose exec -T reward python - [consumer] < tests/e2e/run_report.py`), where the run's
settings (RS_* from the compose file), its Redis and its `runs` volume are what the services see.

It reads each stream's whole history (archive + what Redis still holds: the recorder trims Redis behind
the archive) and the batch Parquet files, and says what became of the black-box episodes (rows whose agent
is `command`): their finish, the turns their gateway sessions recorded, their grades, batches and diffs.
With an argument, also the prompt entries pending on that agent-runner consumer. Standard library and the
installed project only: it runs in the slim image.
"""

import json
import sys
from collections import Counter

import redis

from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.contract.events import (
    BatchReady,
    GradeReported,
    GradingFailed,
    PolicyUpdated,
    PromptIssued,
    TrajectoryFinished,
    TrajectoryTurn,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

PROMPTS = consumer_group("agent-runner")


def main() -> None:
    settings = Settings()
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    storage_uri = settings.storage_uri

    def history(stream):
        return read_history(bus, stream, storage_uri)

    report: dict = {"run_id": settings.run_id}
    prompts = [d for d in history("prompts") if isinstance(d.event, PromptIssued)]
    report["dispatched"] = sorted(d.envelope.rollout_id for d in prompts)
    report["rollout_of_entry"] = {d.entry_id: d.envelope.rollout_id for d in prompts}
    updates = [d for d in history("policy") if isinstance(d.event, PolicyUpdated)]
    report["versions"] = sorted(d.event.version for d in updates)
    report["policy_batch_ids"] = [d.event.batch_id for d in updates]
    report["version_times"] = {d.event.version: d.envelope.time for d in updates}
    storage = Storage(storage_uri)
    batches = [d.event for d in history("batches") if isinstance(d.event, BatchReady)]
    rows = [(b.batch_id, row.rollout_id, row.segment_index)
            for b in batches for row in read_batch(storage, b.uri)]
    report["batches"] = len(batches)
    report["batched_rollouts"] = sorted({rollout for _, rollout, _ in rows})
    report["segments_batched_more_than_once"] = sorted(
        f"{rollout}:{segment}"
        for (rollout, segment), n in Counter((r, s) for _, r, s in rows).items() if n > 1)
    grades = history("grades")
    report["graded_in_sandbox"] = sum(isinstance(d.event, GradeReported) for d in grades)
    report["grading_failed"] = sum(isinstance(d.event, GradingFailed) for d in grades)
    report["dead_lettered"] = len(history("dead"))
    report["blackbox"] = blackbox_report(
        {d.envelope.rollout_id for d in prompts if d.event.agent == "command"},
        history("trajectories"), grades, set(report["batched_rollouts"]), storage)
    key = bus.keys.stream(PROMPTS.streams[0])
    try:
        consumers = bus.redis.xinfo_consumers(key, PROMPTS.name)
    except redis.ResponseError:  # no group yet
        consumers = []
    report["consumers"] = {_text(c["name"]): int(c["pending"]) for c in consumers}
    if len(sys.argv) > 1:
        pending = bus.redis.xpending_range(key, PROMPTS.name, "-", "+", 1000, consumername=sys.argv[1])
        report["pending_on_consumer"] = [_text(row["message_id"]) for row in pending]
    print(json.dumps(report))


def blackbox_report(rollouts, trajectories, grades, batched, storage) -> dict:
    """Per black-box rollout: its last finish (status, error, whether its diff has the agent's file), how
    many turns gateway sessions recorded for it, the scores its grades gave, whether it was batched."""
    report = {rollout: {"status": None, "session_turns": 0, "grade_scores": [], "batched": rollout in batched}
              for rollout in sorted(rollouts)}
    for delivery in trajectories:
        entry = report.get(delivery.envelope.rollout_id)
        if entry is None:
            continue
        event = delivery.event
        if isinstance(event, TrajectoryTurn) and delivery.envelope.session_id:
            entry["session_turns"] += 1
        elif isinstance(event, TrajectoryFinished):
            diff = storage.read_bytes(event.artifacts["diff"]).decode() if "diff" in event.artifacts else ""
            entry.update(status=event.status, error=event.error, grader=event.grader.get("kind"),
                         diff_has_answers="answers.txt" in diff, log="log" in event.artifacts)
    for delivery in grades:
        entry = report.get(delivery.envelope.rollout_id)
        if entry is not None and isinstance(delivery.event, GradeReported):
            entry["grade_scores"].append(delivery.event.score)
    return report


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    main()
