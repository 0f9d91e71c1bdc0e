"""The sandbox-grader's RQ jobs on real Redis and real bubblewrap: retries for infrastructure errors
only, and every rollout ends with a grade event."""

import difflib
import os
import shutil
import signal
from pathlib import Path

import pytest
from rq import Callback, Queue, Retry, SimpleWorker, Worker

from rollstream.services.sandbox_grader.jobs import (
    VERDICT_META,
    GradeRequest,
    grade_rollout,
    report_failures_without_verdict,
    report_job_failure,
)
from rollstream.shared.contract.events import GradeReported, GradingFailed
from rollstream.shared.runtime.storage import Storage
from tests.support import BWRAP_NO_USERNS, FIXTURES, break_bwrap, sandbox_bin_dir

TASK = FIXTURES / "harbor" / "fix-add"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def request(bus, tmp_path, rollout: str, **overrides) -> dict:
    fields = dict(run_id=bus.keys.run_id, storage_uri=str(tmp_path), backend="bubblewrap",
                  ids={"rollout_id": rollout, "group_id": "g", "trajectory_id": rollout,
                       "session_id": rollout},
                  wall_time_s=30, memory_mb=512, grader={"kind": "harbor", "task_dir": str(TASK)})
    return GradeRequest(**{**fields, **overrides}).as_job_arg()


def run_jobs(bus, jobs) -> Queue:
    queue = Queue(f"{bus.keys.prefix}:sandbox", connection=bus.redis)
    for job_id, payload in jobs:
        queue.enqueue(grade_rollout, payload, job_id=job_id, retry=Retry(max=2),
                      on_failure=Callback(report_job_failure))
    SimpleWorker([queue], connection=bus.redis).work(burst=True)
    return queue


@pytest.fixture
def published(bus):
    """The bus the jobs publish on: the worker's own connection, so the test's Redis."""
    return bus


def test_a_job_carries_no_redis_url_and_one_queued_by_an_older_grader_still_loads(bus, tmp_path):
    # RQ logs a job's call with its arguments: a URL there would put the Redis password in the log
    payload = request(bus, tmp_path, "r0")
    assert "redis_url" not in payload and not any("redis://" in str(v) for v in payload.values())
    older = {**payload, "redis_url": "redis://grader:secret@redis:6379/0"}
    assert GradeRequest.from_job_arg(older) == GradeRequest.from_job_arg(payload)


def test_failing_tests_are_a_grade_and_are_not_retried(published, tmp_path):
    queue = run_jobs(published, [("grade-r1", request(published, tmp_path, "r1"))])  # empty diff
    (grade,) = [d.event for d in published.read_all("grades")]
    assert grade.score == 0.0 and not grade.passed
    assert queue.fetch_job("grade-r1").get_status() == "finished"
    assert Path(grade.log_uri).exists()


def test_a_passing_diff_grades_one_and_the_log_is_stored(published, tmp_path):
    storage = Storage(str(tmp_path))
    original = (TASK / "environment" / "workspace" / "calc.py").read_text()
    fixed = original.replace("a - b", "a + b")
    assert fixed != original
    diff = "".join(difflib.unified_diff(original.splitlines(True), fixed.splitlines(True),
                                        "a/calc.py", "b/calc.py"))
    uri = storage.write_bytes(diff.encode(), "run", "artifacts", "r2.diff")
    run_jobs(published, [("grade-r2", request(published, tmp_path, "r2", diff_uri=uri))])
    (grade,) = [d.event for d in published.read_all("grades")]
    assert grade.score == 1.0 and grade.passed


def test_an_infrastructure_error_is_retried_then_reported_as_grading_failed_never_as_a_grade(published,
                                                                                           tmp_path,
                                                                                           monkeypatch):
    # the docker backend pointed at an engine that is not there (SimpleWorker runs jobs in this process)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    payload = request(published, tmp_path, "r3", backend="docker", retries=2)
    queue = run_jobs(published, [("grade-r3", payload)])
    job = queue.fetch_job("grade-r3")
    assert job.get_status() == "failed"
    assert job.retries_left == 0  # two retries were spent
    (failed,) = published.read_all("grades")
    assert isinstance(failed.event, GradingFailed) and not isinstance(failed.event, GradeReported)
    assert "no Docker engine reachable" in failed.event.reason and "no retry is left" in failed.event.reason
    assert failed.event.attempts == 3 and failed.envelope.rollout_id == "r3"


CHECK_FOR_7 = "grep -qx 7 answer.txt"


@pytest.mark.parametrize("answer, score", [("7", 1.0), ("3", 0.0)])
def test_a_shell_check_that_runs_grades_the_answer_and_a_failing_check_is_a_real_zero(published, tmp_path,
                                                                                      answer, score):
    payload = request(published, tmp_path, "r9", grader={}, check=CHECK_FOR_7, answer=answer, retries=2)
    queue = run_jobs(published, [("grade-r9", payload)])
    assert queue.fetch_job("grade-r9").get_status() == "finished"  # graded on the first try, never retried
    (grade,) = [d.event for d in published.read_all("grades")]
    assert isinstance(grade, GradeReported) and grade.score == score and grade.passed == (score == 1.0)
    assert grade.reason == ("exit 0" if score else "exit 1")


@pytest.fixture
def broken_bwrap(monkeypatch):
    """First on PATH, a `bwrap` that cannot create its namespaces, as on a host that forbids unprivileged user
    namespaces (the jobs run in this process: SimpleWorker)."""
    bin_dir = sandbox_bin_dir()
    break_bwrap(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    yield
    shutil.rmtree(bin_dir, ignore_errors=True)


@pytest.mark.parametrize("row", [{"grader": {}, "check": CHECK_FOR_7, "answer": "7"},
                                 {"grader": {"kind": "harbor", "task_dir": str(TASK)}}],
                         ids=["shell-check", "harbor"])
def test_a_sandbox_that_cannot_be_made_is_retried_then_grading_failed_never_a_grade(published, tmp_path,
                                                                                     broken_bwrap, row):
    queue = run_jobs(published, [("grade-r10", request(published, tmp_path, "r10", retries=2, **row))])
    job = queue.fetch_job("grade-r10")
    assert job.get_status() == "failed" and job.retries_left == 0
    (failed,) = published.read_all("grades")
    assert isinstance(failed.event, GradingFailed) and failed.event.attempts == 3
    assert "sandbox did not start the command" in failed.event.reason
    assert BWRAP_NO_USERNS in failed.event.reason


def test_task_files_that_vanished_are_the_machinerys_failure_not_the_rollouts(published, tmp_path):
    payload = request(published, tmp_path, "r4",
                      grader={"kind": "harbor", "task_dir": str(tmp_path / "gone")})
    run_jobs(published, [("grade-r4", payload)])
    (failed,) = [d.event for d in published.read_all("grades")]
    assert isinstance(failed, GradingFailed) and "not a task directory" in failed.reason


@pytest.mark.parametrize("overrides, reason", [
    ({"diff_uri": "/nowhere/r5.diff"}, "diff artifact /nowhere/r5.diff does not exist"),
    ({"grader": {"kind": "swebench", "dataset": "/nowhere/swe.jsonl", "instance_id": "x"}},
     "no such SWE-bench file"),
    ({"grader": {"kind": "nonsense"}}, "unknown grader kind 'nonsense'"),
])
def test_a_request_no_retry_can_grade_gets_its_grading_failed_at_once(published, tmp_path, overrides, reason):
    queue = run_jobs(published, [("grade-r5", request(published, tmp_path, "r5", retries=2, **overrides))])
    assert queue.fetch_job("grade-r5").get_status() == "finished"  # not failed: nothing to retry
    (failed,) = published.read_all("grades")
    assert isinstance(failed.event, GradingFailed) and failed.envelope.rollout_id == "r5"
    assert reason in failed.event.reason and failed.event.attempts == 1


def die_in_the_work_horse(_request: dict) -> None:
    """A job whose process is killed under it, as the OOM killer or a kill -9 of the horse would."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_job_rq_failed_without_its_callback_gets_grading_failed_from_the_sweep_once(published, tmp_path):
    # RQ job ids are global to the Redis server, and a job enqueued again keeps the meta of an earlier one
    r6, r7 = (f"grade-{published.keys.run_id}-{rollout}" for rollout in ("r6", "r7"))
    queue = run_jobs(published, [(r7, request(published, tmp_path, "r7", backend="docker",
                                              grader={"kind": "nonsense"}))])  # its verdict is out already
    queue.enqueue(die_in_the_work_horse, request(published, tmp_path, "r6"), job_id=r6,
                  on_failure=Callback(report_job_failure))
    Worker([queue], connection=published.redis).work(burst=True)  # forks a work-horse, which dies
    assert queue.fetch_job(r6).get_status() == "failed"
    assert published.read_all("grades")[-1].envelope.rollout_id == "r7"  # RQ ran no callback for r6

    assert report_failures_without_verdict(queue) == [r6]
    (failed,) = [d for d in published.read_all("grades") if d.envelope.rollout_id == "r6"]
    assert isinstance(failed.event, GradingFailed) and failed.event.attempts == 1
    assert "Work-horse terminated unexpectedly" in failed.event.reason
    assert "no retry is left" in failed.event.reason
    assert queue.fetch_job(r6).meta[VERDICT_META] == "GradingFailed"
    assert report_failures_without_verdict(queue) == []  # once


def test_a_job_whose_callback_reported_is_not_reported_again_by_the_sweep(published, tmp_path, monkeypatch):
    r8 = f"grade-{published.keys.run_id}-r8"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    queue = run_jobs(published, [(r8, request(published, tmp_path, "r8", backend="docker"))])
    assert queue.fetch_job(r8).get_status() == "failed"
    assert report_failures_without_verdict(queue) == []
    assert len(published.read_all("grades")) == 1


def test_a_job_of_a_run_deleted_since_it_was_queued_publishes_nothing_into_the_new_run(published, tmp_path):
    """A job left in the queue of a run that was deleted (and started again under the same id) grades for
    nobody: the new run's rollouts have jobs of their own."""
    incarnation = published.incarnation()
    old = request(published, tmp_path, "r-old", incarnation="an-earlier-incarnation")
    current = request(published, tmp_path, "r-now", incarnation=incarnation)
    queue = run_jobs(published, [("grade-old", old), ("grade-now", current)])
    graded = [d.envelope.rollout_id for d in published.read_all("grades")]
    assert graded == ["r-now"]
    assert queue.fetch_job("grade-old").meta[VERDICT_META] == "none: the run it was queued for was deleted"
