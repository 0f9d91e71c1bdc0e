"""What a compose run did, as one JSON object on stdout: run in the stack's `ops` container
(`docker compose run --rm -T ops python - < tests/e2e/run_report.py`), as Redis's admin user, where the
run's settings (RS_* from the compose file), its Redis, its `runs` volume and its model are what the
services see.

The accounting of every admitted rollout is the chaos audit's (cli/chaos/audit.py audit_run: each stream's
whole history, archive included, and the batch Parquet files): trained, dropped with its cause, lost,
duplicated, work left pending, the archive checked against Redis. Beside it: what became of the black-box
episodes (rows whose agent is `command`): their finish, the turns their gateway sessions recorded, their
grades, batches and diffs; and the prompts still pending per agent-runner consumer.
"""

import json
from dataclasses import asdict

import redis

from rollstream.cli.chaos.audit import RowLimits, audit_run
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
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

PROMPTS = consumer_group("agent-runner")


def main() -> None:
    settings = Settings()
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    storage_uri = settings.storage_uri

    def history(stream):
        return read_history(bus, stream, storage_uri)

    audit = audit_run(bus, storage_uri, settings.train.max_staleness, settings.grader.queue,
                      limits=RowLimits.of_model(settings.model.path), roles=RunRoles.of(settings))
    report: dict = {"run_id": settings.run_id, "audit": asdict(audit), "problems": audit.problems()}
    prompts = [d for d in history("prompts") if isinstance(d.event, PromptIssued)]
    report["rollout_of_entry"] = {d.entry_id: d.envelope.rollout_id for d in prompts}
    updates = [d for d in history("policy") if isinstance(d.event, PolicyUpdated)]
    report["versions"] = sorted(d.event.version for d in updates)
    report["policy_batch_ids"] = [d.event.batch_id for d in updates]
    report["version_times"] = {d.event.version: d.envelope.time for d in updates}
    storage = Storage(storage_uri)
    batches = [d.event for d in history("batches") if isinstance(d.event, BatchReady)]
    batched = {row.rollout_id for b in batches for row in read_batch(storage, b.uri)}
    grades = history("grades")
    report["graded_in_sandbox"] = sum(isinstance(d.event, GradeReported) for d in grades)
    report["grading_failed"] = sum(isinstance(d.event, GradingFailed) for d in grades)
    report["dead_lettered"] = len(history("dead"))
    report["blackbox"] = blackbox_report(
        {d.envelope.rollout_id for d in prompts if d.event.agent == "command"},
        history("trajectories"), grades, batched, storage)
    try:
        consumers = bus.redis.xinfo_consumers(bus.keys.stream(PROMPTS.streams[0]), PROMPTS.name)
    except redis.ResponseError:  # no group yet
        consumers = []
    report["consumers"] = {_text(c["name"]): int(c["pending"]) for c in consumers}
    print(json.dumps(report, default=str))


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
