"""The RQ job a sandbox worker runs: grade one rollout by running its task's check in a sandbox."""

from __future__ import annotations

import tempfile
from pathlib import Path

from shared.bus import Bus
from shared.events import GradeReported
from shared.sandbox import SandboxLimits, run_in_sandbox
from shared.storage import Storage


def grade_rollout(redis_url: str, run_id: str, storage_uri: str, ids: dict[str, str], check: str,
                  answer: str, wall_time_s: float, memory_mb: int) -> dict:
    """Write the answer into a fresh workspace, run `check` there, publish the grade."""
    limits = SandboxLimits(wall_time_s=wall_time_s, cpu_time_s=wall_time_s, memory_mb=memory_mb)
    with tempfile.TemporaryDirectory(prefix="rs-grade-") as workspace:
        Path(workspace, "answer.txt").write_text(answer)
        result = run_in_sandbox(check, Path(workspace), limits)
    log_dir = Storage(storage_uri).local_path(run_id, "sandbox-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{ids['rollout_id']}.log"
    log_path.write_text(f"$ {check}\n# {result.reason}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}\n")
    passed = result.exit_code == 0
    grade = GradeReported(score=1.0 if passed else 0.0, passed=passed, reason=result.reason,
                          duration_s=result.duration_s, log_uri=str(log_path))
    bus = Bus.connect(redis_url, run_id)
    bus.publish("grades", grade, event_id=f"{ids['rollout_id']}:grade", **ids)
    return {"passed": passed, "reason": result.reason}


def report_job_failure(job, connection, exc_type, exc_value, _traceback) -> None:
    """RQ failure callback: a grading job that crashed or timed out still yields a grade (a failed
    one, with the reason), so the rollout's group can complete."""
    redis_url, run_id, _storage, ids, *_ = job.args
    grade = GradeReported(score=0.0, passed=False, duration_s=0.0,
                          reason=f"grading job failed: {exc_type.__name__}: {exc_value}")
    Bus(connection, run_id).publish("grades", grade, event_id=f"{ids['rollout_id']}:grade", **ids)
