"""The sandbox-grader's RQ job ids, which are global to the Redis server: a rollout delivered again in its run
is graded once, and a new run under the id of a deleted one grades its rollouts anew, whether the old run was
deleted with Bus.delete_run or its keys by hand. Runs the real service process, real RQ, real bubblewrap,
against the local Redis."""

import os
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryFinished
from tests.support import free_port, health, stop_process_group, wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@contextmanager
def grader(tmp_path: Path, redis_url: str, run_id: str):
    """The service on `run_id` until the block ends; yields its health port."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")}, "RS_REDIS_URL": redis_url,
           "RS_RUN_ID": run_id, "RS_HEALTH_PORT": str(port), "RS_STORAGE_URI": str(tmp_path / "runs")}
    with open(tmp_path / f"grader-{port}.log", "wb") as log:
        process = subprocess.Popen([str(Path(sys.executable).parent / "rollstream-sandbox-grader")], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: (health(port) or (0,))[0] == 200, 60, "the grader to become ready")
            yield port
        finally:
            stop_process_group(process)


@pytest.fixture
def run(machine_redis_url):
    bus = Bus.connect(machine_redis_url, f"jobids-{uuid.uuid4().hex[:8]}")
    yield bus
    bus.delete_run()


def finish_rollout_answering_7(bus: Bus, rollout: str) -> None:
    finished = TrajectoryFinished(status="completed", attempt="a1", segment_count=1, group_size=1,
                                  sample_index=0, response_text="7", sandbox_check="grep -qx 7 answer.txt")
    bus.publish("trajectories", finished, rollout_id=rollout, group_id=rollout, trajectory_id=rollout,
                session_id=rollout)


def graded(bus: Bus, rollout: str) -> list:
    return [d for d in bus.read_all("grades") if d.envelope.rollout_id == rollout]


def run_jobs(bus: Bus) -> list[bytes]:
    return list(bus.redis.scan_iter(match=f"rq:job:grade-{bus.keys.run_id}-*", count=1000))


def test_a_rollout_delivered_again_is_graded_once(run, machine_redis_url, tmp_path):
    with grader(tmp_path, machine_redis_url, run.keys.run_id) as port:
        finish_rollout_answering_7(run, "r0")
        wait_for(lambda: graded(run, "r0"), 60, "r0's grade")
        finish_rollout_answering_7(run, "r0")  # as a redelivery, or a replica's retry, would bring it
        wait_for(lambda: run.group_lag("trajectories", "sandbox-grader") == (0, 0), 30,
                 "the grader to take it")
        assert health(port)[1]["enqueued"] == 1
    assert len(graded(run, "r0")) == 1 and len(run_jobs(run)) == 1


def test_a_new_run_under_a_deleted_runs_id_grades_its_rollouts_anew(run, machine_redis_url, tmp_path):
    with grader(tmp_path, machine_redis_url, run.keys.run_id):
        finish_rollout_answering_7(run, "r0")
        wait_for(lambda: graded(run, "r0"), 60, "the first run's grade")
    assert len(run_jobs(run)) == 1  # the finished job stays in Redis for its result TTL

    # the old run's keys deleted by hand, which leaves RQ's: the next run's job is another all the same
    run.redis.delete(*run.redis.scan_iter(match=run.keys.pattern, count=1000))
    with grader(tmp_path, machine_redis_url, run.keys.run_id):
        finish_rollout_answering_7(run, "r0")
        wait_for(lambda: graded(run, "r0"), 60, "the second run's grade")
    assert len(run_jobs(run)) == 2

    # Bus.delete_run deletes the run's RQ queue with both runs' jobs
    run.delete_run()
    assert run_jobs(run) == []
    with grader(tmp_path, machine_redis_url, run.keys.run_id):
        finish_rollout_answering_7(run, "r0")
        wait_for(lambda: graded(run, "r0"), 60, "the third run's grade")
