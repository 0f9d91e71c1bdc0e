"""The sandbox-grader grades nothing while its sandbox backend cannot make a sandbox: /healthz answers 503
with the reason and what to do, finished rollouts stay on the stream, and grading starts once a real sandbox
runs. A sandbox that breaks while it grades makes it not ready again, saying why. Runs the real service
process against the local Redis."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryFinished
from tests.support import (
    BWRAP_NO_USERNS,
    break_bwrap,
    free_port,
    health,
    repair_bwrap,
    sandbox_bin_dir,
    stop_process_group,
    wait_for,
)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture
def grader(tmp_path, machine_redis_url):
    """The service with a PATH of its own (no bwrap at first; the test puts one there) and a fresh run."""
    bin_dir = sandbox_bin_dir()
    os.symlink("/bin/sh", bin_dir / "sh")
    run_id = f"ready-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")}, "PATH": str(bin_dir),
           "RS_REDIS_URL": machine_redis_url, "RS_RUN_ID": run_id, "RS_HEALTH_PORT": str(port),
           "RS_STORAGE_URI": str(tmp_path / "runs"), "RS_GRADER__PROBE_INTERVAL_S": "1"}
    log = open(tmp_path / "grader.log", "wb")
    process = subprocess.Popen([str(Path(sys.executable).parent / "rollstream-sandbox-grader")], env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    bus = Bus.connect(machine_redis_url, run_id)
    try:
        yield process, port, bus, bin_dir
    finally:
        stop_process_group(process)
        log.close()
        bus.delete_run()
        shutil.rmtree(bin_dir, ignore_errors=True)


def publish_rollout_answering_7(bus, rollout: str) -> None:
    finished = TrajectoryFinished(status="completed", attempt="a1", segment_count=1, group_size=1,
                                  sample_index=0, response_text="7", sandbox_check="grep -qx 7 answer.txt")
    bus.publish("trajectories", finished, rollout_id=rollout, group_id=rollout, trajectory_id=rollout,
                session_id=rollout)


def not_ready_because_of_bwrap(port: int) -> dict | None:
    reply = health(port)
    if reply and reply[0] == 503 and BWRAP_NO_USERNS in reply[1].get("reason", ""):
        return reply[1]
    return None


def waits_then_grades_once_repaired(process, port, bus, bin_dir) -> None:
    """A rollout that arrives while the sandbox is broken is neither graded nor turned into a 0; the grader
    stays up saying why it waits, and grades the rollout once bwrap is repaired."""
    publish_rollout_answering_7(bus, "r0")
    time.sleep(2)
    assert bus.read_all("grades") == []  # nothing graded, and nothing turned into a grade of 0
    assert process.poll() is None  # up, saying why it waits

    repair_bwrap(bin_dir)
    wait_for(lambda: (health(port) or (0,))[0] == 200, 30, "the grader to become ready")
    (grade,) = wait_for(lambda: bus.read_all("grades"), 60, "the waiting rollout's grade")
    assert grade.envelope.rollout_id == "r0" and grade.event.score == 1.0


def test_without_its_backend_the_grader_is_not_ready_and_grades_nothing_until_it_is_there(grader):
    process, port, bus, bin_dir = grader
    status, body = wait_for(lambda: health(port), 60, "the grader's /healthz")
    assert status == 503 and body["status"] == "not ready"
    assert "bubblewrap is not installed" in body["reason"] and "apt-get install bubblewrap" in body["reason"]
    waits_then_grades_once_repaired(process, port, bus, bin_dir)


def test_a_bwrap_that_cannot_make_a_sandbox_keeps_the_grader_not_ready_with_bwraps_reason(grader):
    process, port, bus, bin_dir = grader
    break_bwrap(bin_dir)  # on PATH, so "is bwrap installed" says yes
    body = wait_for(lambda: not_ready_because_of_bwrap(port), 60, "/healthz to give bwrap's reason")
    assert body["status"] == "not ready" and "kernel.apparmor_restrict_unprivileged_userns" in body["reason"]
    waits_then_grades_once_repaired(process, port, bus, bin_dir)


def test_a_sandbox_that_breaks_while_grading_makes_the_grader_say_why(grader):
    process, port, bus, bin_dir = grader
    repair_bwrap(bin_dir)
    wait_for(lambda: (health(port) or (0,))[0] == 200, 60, "the grader to become ready")
    publish_rollout_answering_7(bus, "r1")
    wait_for(lambda: bus.read_all("grades"), 60, "a grade while the sandbox works")

    break_bwrap(bin_dir)
    wait_for(lambda: not_ready_because_of_bwrap(port), 30, "/healthz to give bwrap's reason once it broke")
    repair_bwrap(bin_dir)
    wait_for(lambda: (health(port) or (0,))[0] == 200, 30, "the grader to be ready again")
    assert process.poll() is None


def test_a_grader_that_is_not_ready_stops_promptly(grader):
    process, port, _, _ = grader
    wait_for(lambda: health(port), 60, "the grader's /healthz")
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=10) == 0
