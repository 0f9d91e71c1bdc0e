"""The sandbox-grader grades nothing while its sandbox backend cannot run: /healthz answers 503 with
the reason and the install hint, finished rollouts stay on the stream, and grading starts once the
backend is there. Runs the real service process against the local Redis."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryFinished
from tests.support import free_port, health, wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture
def grader(tmp_path, machine_redis_url):
    """The service with a PATH of its own (empty at first) and a fresh run."""
    # bwrap runs as the sandbox's own host uid, which must be able to reach it: not under pytest's 0700 tmp_path
    bin_dir = Path(tempfile.mkdtemp(prefix="rs-test-bin-"))
    bin_dir.chmod(0o755)
    run_id = f"ready-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")}, "PATH": str(bin_dir),
           "RS_REDIS_URL": machine_redis_url, "RS_RUN_ID": run_id, "RS_HEALTH_PORT": str(port),
           "RS_STORAGE_URI": str(tmp_path / "runs")}
    log = open(tmp_path / "grader.log", "wb")
    process = subprocess.Popen([str(Path(sys.executable).parent / "rollstream-sandbox-grader")], env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    bus = Bus.connect(machine_redis_url, run_id)
    try:
        yield process, port, bus, bin_dir
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
        bus.delete_run()
        shutil.rmtree(bin_dir, ignore_errors=True)


def test_without_its_backend_the_grader_is_not_ready_and_grades_nothing_until_it_is_there(grader):
    process, port, bus, bin_dir = grader
    status, body = wait_for(lambda: health(port), 60, "the grader's /healthz")
    assert status == 503 and body["status"] == "not ready"
    assert "bubblewrap is not installed" in body["reason"] and "apt-get install bubblewrap" in body["reason"]
    finished = TrajectoryFinished(status="completed", attempt="a1", segment_count=1, group_size=1, sample_index=0,
                                  response_text="7", sandbox_check="grep -q 7 answer.txt")
    bus.publish("trajectories", finished, rollout_id="r0", group_id="g0", trajectory_id="r0", session_id="r0")
    time.sleep(2)
    assert bus.read_all("grades") == []  # nothing graded, and nothing turned into a grade of 0
    assert process.poll() is None  # up, saying why it waits

    os.symlink(shutil.which("bwrap", path="/usr/bin:/bin"), bin_dir / "bwrap")
    os.symlink("/bin/sh", bin_dir / "sh")
    wait_for(lambda: (health(port) or (0,))[0] == 200, 30, "the grader to become ready")
    (grade,) = wait_for(lambda: bus.read_all("grades"), 60, "the waiting rollout's grade")
    assert grade.envelope.rollout_id == "r0" and grade.event.score == 1.0


def test_a_grader_that_is_not_ready_stops_promptly(grader):
    process, port, _, _ = grader
    wait_for(lambda: health(port), 60, "the grader's /healthz")
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=10) == 0
