"""The RQ job a sandbox worker runs: grade one rollout in a sandbox and publish the grade.

A `GradeRequest` says what to grade: a shell `check` run on the rollout's answer (rule-like tasks),
or a task (`harbor` directory or `swebench` row) whose tests judge the rollout's stored diff.
An infrastructure error (the sandbox could not run at all) raises, so RQ retries the job with
backoff; failing tests are a grade, never retried. When the retries are spent, `report_job_failure`
publishes GradingFailed with the reason: the reward service leaves that rollout out of its group
(counted), so the group completes without a made-up reward. RQ fails some jobs without calling that
callback (the work-horse killed on the last try, a job stuck between dequeue and start when its worker
died): `report_failures_without_verdict`, which the grader runs every few seconds, publishes theirs.
Each job that published a verdict says so in its meta (VERDICT_META).
A request no retry can grade (its diff artifact or its task does not exist, an unknown grader kind)
gets its GradingFailed at once, without the retries and their back-off. A SWE row's environment is built
on its first grading when nobody prepared it (`rollstream environments prepare`, which spares the job's
timeout the build); a build that fails is an infrastructure error like a sandbox that does not start.

A job publishes through the grader's own connection to the bus (publish_grades_through; the job's RQ
connection where none is set, the bus's Redis then): its arguments carry no Redis URL, because RQ logs a
job's description (its call with arguments) and the URL would carry the service's password.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rq import Queue, get_current_job
from rq.job import Job
from rq.registry import FailedJobRegistry

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import GradeReported, GradingFailed
from rollstream.shared.errors import RollstreamError, TaskError
from rollstream.shared.grading.harbor import grade_harbor
from rollstream.shared.grading.outcome import GradeOutcome, make_outcome
from rollstream.shared.grading.runs import run_log, run_wrapped
from rollstream.shared.grading.swebench import grade_swebench
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.workspace import workspace_prefix
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.swebench import load_swebench_rows

VERDICT_META = "verdict"
"""Job meta key: the verdict (GradeReported or GradingFailed) the job published for its rollout."""
FAILURE_META = "failure"
"""Job meta key beside a GradingFailed verdict: `ungradable` (the request) or `infrastructure` (the
sandbox)."""


class InfrastructureError(RollstreamError, RuntimeError):
    """The sandbox could not run the grading; the job is retried."""


class UngradableRequest(RollstreamError, ValueError):
    """The request names what is not there (the rollout's diff artifact, its task, a SWE-bench instance)
    or a grader kind this code does not know: no retry can grade it."""


@dataclass
class GradeRequest:
    run_id: str
    storage_uri: str
    ids: dict[str, str]
    backend: str
    wall_time_s: float
    memory_mb: int
    check: str | None = None
    answer: str = ""
    grader: dict[str, Any] = field(default_factory=dict)
    """{"kind": "harbor", "task_dir": ...} or {"kind": "swebench", "dataset": ..., "instance_id": ...}"""
    diff_uri: str | None = None
    retries: int = 0
    """Retries RQ was given for the job (infrastructure errors only)."""
    incarnation: str = ""
    """The run's incarnation when the job was queued (Bus.incarnation): once the run is deleted, a job left
    in its queue publishes nothing into a new run under the same id. Empty: queued by an older grader."""
    environments_dir: str = ""
    """grader.environments_dir: where the bubblewrap backend keeps SWE rows' environments, building one on
    its first grading. Empty: its default (shared/sandbox/venv_environments.py)."""

    def as_job_arg(self) -> dict:
        return asdict(self)

    @classmethod
    def from_job_arg(cls, arg: dict) -> GradeRequest:
        # Jobs an older grader queued also carry its Redis URL (redis_url), which is no longer read.
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in arg.items() if key in known})


def grade_rollout(request: dict) -> dict:
    req = GradeRequest.from_job_arg(request)
    storage = Storage(req.storage_uri)
    try:
        outcome = grade(req, storage)
    except UngradableRequest as exc:
        failed = GradingFailed(reason=f"cannot be graded: {exc}", attempts=1)
        publish(req, failed, get_current_job(), "ungradable")
        return {"score": None, "reason": str(exc)}
    if outcome.infrastructure_error:
        raise InfrastructureError(outcome.reason)
    log_path = storage.write_bytes(outcome.log.encode(), req.run_id, "sandbox-logs",
                                   f"{req.ids['rollout_id']}.log")
    publish(req, GradeReported(score=outcome.score, passed=outcome.passed, reason=outcome.reason,
                               duration_s=outcome.duration_s, log_uri=log_path, tests=outcome.tests),
            get_current_job())
    return {"score": outcome.score, "reason": outcome.reason}


def grade(req: GradeRequest, storage: Storage) -> GradeOutcome:
    backend = get_backend(req.backend, **backend_options(req))
    limits = SandboxLimits(wall_time_s=req.wall_time_s, cpu_time_s=req.wall_time_s, memory_mb=req.memory_mb)
    kind = req.grader.get("kind") if req.grader else "check"
    if kind == "check":
        return grade_answer(req, backend, limits)
    if kind not in ("harbor", "swebench"):
        raise UngradableRequest(f"unknown grader kind {kind!r}")
    diff = read_diff(req, storage)
    try:
        if kind == "harbor":
            task = load_harbor_task(Path(req.grader["task_dir"]))
        else:
            rows = load_swebench_rows(Path(req.grader["dataset"]))
            task = {t.instance_id: t for t in rows}[req.grader["instance_id"]]
    except (KeyError, TaskError) as exc:
        raise UngradableRequest(f"{kind} task {req.grader}: {type(exc).__name__}: {exc}") from exc
    return grade_harbor(task, diff, backend) if kind == "harbor" else grade_swebench(task, diff, backend)


def backend_options(req: GradeRequest) -> dict[str, Any]:
    """The request's options of its backend: the bubblewrap backend's environments directory."""
    if req.environments_dir and req.backend in ("bubblewrap", "bwrap"):
        return {"environments_dir": Path(req.environments_dir)}
    return {}


def read_diff(req: GradeRequest, storage: Storage) -> str:
    """The rollout's stored diff ("" when the episode left none)."""
    if not req.diff_uri:
        return ""
    try:
        return storage.read_bytes(req.diff_uri).decode()
    except FileNotFoundError as exc:
        raise UngradableRequest(f"diff artifact {req.diff_uri} does not exist") from exc
    except UnicodeDecodeError as exc:
        raise UngradableRequest(f"diff artifact {req.diff_uri} is not UTF-8 text: {exc}") from exc


def grade_answer(req: GradeRequest, backend, limits: SandboxLimits) -> GradeOutcome:
    """Run the row's shell check in a workspace holding the rollout's answer as answer.txt: exit 0 is 1,
    any other end of the check 0. Behind the start marker (run_wrapped), so that a sandbox that never
    started the check (bwrap refused its namespaces, no container) is an infrastructure error, not a 0."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=workspace_prefix("grade")) as workspace:
        Path(workspace, "answer.txt").write_text(req.answer)
        run = run_wrapped(backend, req.check, Path(workspace), limits, {}, {}, {}, None)
    log = f"$ {req.check}\n{run_log(run)}\n"
    if run.error:
        return make_outcome(0, run.error, log_text=log, started=started, infrastructure_error=True)
    return make_outcome(1.0 if run.result.exit_code == 0 else 0.0, run.result.reason, log_text=log,
                        started=started)


_bus_client = None
"""The bus's Redis client, where the grader set it (its job queue may be on another Redis)."""


def publish_grades_through(client) -> None:
    """Jobs of this process (and of the work-horses it forks) publish their verdicts through `client`, the
    bus's Redis (a cluster client too), not through RQ's connection."""
    global _bus_client
    _bus_client = client


def publish(req: GradeRequest, grade: GradeReported | GradingFailed, job: Job, failure: str = "infrastructure"
            ) -> None:
    """On `grades`, under one event id per rollout whichever it is: a rollout has one verdict. Through the
    bus's connection (publish_grades_through, else the job's own); the job's meta then records that its
    verdict is out, and for a GradingFailed what it blames (`failure`, FAILURE_META). Nothing is published for
    a run deleted since the job was queued (its incarnation is gone or another)."""
    bus = Bus(_bus_client or job.connection, req.run_id)
    current = bus.redis.get(bus.keys.incarnation)
    if req.incarnation and (current or b"").decode() != req.incarnation:
        job.meta[VERDICT_META] = "none: the run it was queued for was deleted"
        job.save_meta()
        return
    bus.publish("grades", grade, event_id=f"{req.ids['rollout_id']}:grade", **req.ids)
    job.meta[VERDICT_META] = type(grade).__name__
    if isinstance(grade, GradingFailed):
        job.meta[FAILURE_META] = failure
    job.save_meta()


def failed_for_good(job: Job, cause: str) -> None:
    req = GradeRequest.from_job_arg(job.args[0])
    attempts = req.retries - (job.retries_left or 0) + 1
    publish(req, GradingFailed(reason=f"grading failed and no retry is left: {cause}", attempts=attempts),
            job)


def report_job_failure(job, connection, exc_type, exc_value, _traceback) -> None:
    """RQ failure callback: once no retry is left, GradingFailed with the reason. Never a grade: the
    job failing is the machinery's failure, and the rollout's work was never judged."""
    if job.should_retry:
        return
    failed_for_good(job, f"{exc_type.__name__}: {exc_value}")


def report_failures_without_verdict(queue: Queue) -> list[str]:
    """GradingFailed for every job in the queue's failed registry that published no verdict (RQ failed it
    without the failure callback); returns their ids. A job that is not a grade request (someone else's, on
    this queue) is marked so and left alone."""
    registry = FailedJobRegistry(queue=queue)
    reported = []
    for job in Job.fetch_many(registry.get_job_ids(), connection=queue.connection):
        if job is None or VERDICT_META in job.meta:
            continue
        result = job.latest_result()
        lines = (result.exc_string or "").strip().splitlines() if result else []
        try:
            failed_for_good(job, lines[-1].strip() if lines else "the job failed without a recorded error")
        except (IndexError, KeyError, TypeError, ValueError):
            job.meta[VERDICT_META] = "none: not a grade request"
            job.save_meta()
            continue
        reported.append(job.id)
    return reported
