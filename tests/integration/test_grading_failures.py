"""A grading the sandbox could not run never becomes a reward, in a running pipeline: the real
sandbox-grader (RQ worker, bubblewrap) and reward services, with bubblewrap breaking after the grader
started (a `bwrap` first on PATH that may not create its namespaces, as where the host forbids unprivileged
user namespaces). The grader's /healthz says why; the affected rollouts, a shell check's and a Harbor
task's alike, end as GradingFailed, get no reward, stay out of every batch and are counted; the rollouts
around them are rewarded and batched as usual.

    python -m pytest tests/integration/test_grading_failures.py -q   (needs bwrap and a local Redis)
"""

import os
import shutil
import uuid

import httpx
import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.events import (
    GradeReported,
    GradingFailed,
    RewardAssigned,
    TrajectoryFinished,
    TrajectorySegment,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from tests.support import (
    BWRAP_NO_USERNS,
    FIXTURES,
    break_bwrap,
    health,
    repair_bwrap,
    sandbox_bin_dir,
    wait_for,
)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (bwrap)")]

HARBOR_TASK = {"kind": "harbor", "task_dir": str(FIXTURES / "harbor" / "fix-add")}


def publish_rollout(bus, group: str, rollout: str, sample_index: int, answer: str, check: str | None,
                    grader: dict | None = None) -> None:
    ids = dict(group_id=group, rollout_id=rollout, trajectory_id=rollout, session_id=rollout)
    segment = TrajectorySegment(segment_index=0, attempt="a1", tokens=[1, 2, 3], response_length=1,
                                loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.3],
                                turn_policy_versions=[0], status="completed", response_text=answer,
                                sample_index=sample_index, group_size=2)
    bus.publish("trajectories", segment, **ids)
    bus.publish("trajectories", TrajectoryFinished(status="completed", attempt="a1",
                                                   segment_count=1, group_size=2, sample_index=sample_index,
                                                   response_text=answer, label="7", sandbox_check=check,
                                                   grader=grader or {}), **ids)


@pytest.fixture
def bwrap_on_path(monkeypatch):
    """A directory first on PATH (the services inherit it) whose `bwrap` is the real one until the test
    breaks it."""
    bin_dir = sandbox_bin_dir()
    repair_bwrap(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    yield bin_dir
    shutil.rmtree(bin_dir, ignore_errors=True)


def grader_unready_because_of_bwrap(port: int) -> str | None:
    reply = health(port)
    if reply and reply[0] == 503 and BWRAP_NO_USERNS in reply[1].get("reason", ""):
        return reply[1]["reason"]
    return None


def test_rollouts_whose_grading_could_not_run_get_no_reward_and_no_batch(tmp_path, machine_redis_url,
                                                                         bwrap_on_path):
    run_id = f"gradefail-{uuid.uuid4().hex[:8]}"
    settings = Settings(run_id=run_id, redis_url=machine_redis_url, storage_uri=str(tmp_path / "runs"),
                        data={"samples_per_prompt": 2}, train={"batch_size": 2},
                        grader={"retries": 1, "probe_interval_s": 1}, recorder={"enabled": False})
    local = LocalRun(settings, services=("sandbox-grader", "reward"))
    try:
        with local:  # its preflight made a real sandbox
            bus = local.bus
            grader_port = local.health_ports["sandbox-grader"]
            wait_for(lambda: (health(grader_port) or (0,))[0] == 200, 60, "the grader to be ready")
            break_bwrap(bwrap_on_path)
            reason = wait_for(lambda: grader_unready_because_of_bwrap(grader_port), 30,
                              "the grader to say why")
            assert "kernel.apparmor_restrict_unprivileged_userns" in reason

            check = "grep -q 7 answer.txt"
            # both sandboxed: the whole group cannot be graded
            publish_rollout(bus, "g1", "r1", 0, "7", check)
            publish_rollout(bus, "g1", "r2", 1, "", None, HARBOR_TASK)
            publish_rollout(bus, "g2", "r3", 2, "7", check)   # one sandboxed, one by rule
            publish_rollout(bus, "g2", "r4", 3, "7", None)
            publish_rollout(bus, "g3", "r5", 4, "7", None)    # no sandbox at all
            publish_rollout(bus, "g3", "r6", 5, "x", None)
            # a retry waits out its back-off off the streams, so wait for the verdicts before waiting
            # for quiet
            wait_for(lambda: len(bus.read_all("grades")) == 3, 120, "the three sandboxed rollouts' verdicts")
            local.wait_drained(timeout_s=180)

            grades = {d.envelope.rollout_id: d.event for d in bus.read_all("grades")}
            assert set(grades) == {"r1", "r2", "r3"}
            assert all(isinstance(event, GradingFailed) for event in grades.values())
            assert not any(isinstance(event, GradeReported) for event in grades.values())
            assert all(BWRAP_NO_USERNS in event.reason and event.attempts == 2 for event in grades.values())

            rewards = {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")
                       if isinstance(d.event, RewardAssigned)}
            assert set(rewards) == {"r4", "r5", "r6"}  # nothing for r1..r3: not even a reward of 0
            rows = [row for d in bus.read_all("batches")
                    for row in read_batch(Storage(settings.storage_uri), d.event.uri)]
            assert sorted(row.rollout_id for row in rows) == ["r4", "r5", "r6"]

            reward_health = httpx.get(f"http://127.0.0.1:{local.health_ports['reward']}/healthz",
                                      timeout=5).json()
            assert reward_health["rollouts_dropped"] == {"grading_failed": 3}
            # Their 3 slots go back to the dispatcher, and so does the one sample the batch of 3 holds
            # beyond B = 2.
            assert int(bus.redis.get(bus.keys.filtered)) == 3 + 1
            assert local.progress_reader.update().grading_failed == 3
    finally:
        local.bus.delete_run()
