"""The short chaos run: every part of the pipeline killed or restarted once while it trains (each
service process, a sandbox work-horse, Redis, the vLLM server, and an agent-runner paused past the
reclaim timeout), then the audit from its streams and batch files: nothing lost, no segment twice, nothing
left pending, the archive equal to Redis, no more drops than the faults explain, and no process exit but
those the harness brought about. `rollstream chaos run` is the long version (docs/operations/failures.md)."""

from __future__ import annotations

import uuid

import pytest

from rollstream.cli.chaos.harness import ChaosPlan, ChaosRun
from rollstream.shared.contract.archive import ArchiveReader
from rollstream.shared.contract.events import decode
from rollstream.shared.runtime.config import Settings

pytestmark = pytest.mark.integration

VERSIONS = 12
BATCH = 8
GROUP = 4


@pytest.fixture(scope="module")
def settings(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("chaos")
    return Settings(
        run_id=f"chaos-{uuid.uuid4().hex[:8]}", storage_uri=str(root / "runs"), model={"path": tiny_model},
        data={"samples_per_prompt": GROUP, "synthetic_sandbox_every": 2},
        rollout={"max_tokens": 12, "concurrency": 8},
        train={"batch_size": BATCH, "total_versions": VERSIONS, "max_staleness": 1, "learning_rate": 1e-3},
        bus={"reclaim_idle_ms": 5000}, reward={"grade_timeout_s": 90}, recorder={"flush_s": 1.0},
    )


@pytest.fixture(scope="module")
def chaos(settings):
    plan = ChaosPlan(seed=7, kills_per_service=1, redis_restarts=1, vllm_restarts=1, pauses=1, interval_s=3.0)
    run = ChaosRun(settings, plan, on_event=print)
    try:
        return run.run(timeout_s=1200)
    except BaseException:
        for name in run.local.processes:
            print(f"--- {name}\n{run.local.log_tail(name, 40)}")
        raise


def test_every_part_was_hit_and_restarted(chaos):
    injected = {f"{f.kind} {f.target}" for f in chaos.faults if f.done}
    for process in ("dispatcher", "agent-runner-1", "agent-runner-2", "sandbox-grader", "reward",
                    "trainer", "recorder"):
        assert f"crash {process}" in injected
        assert chaos.summary["restarts"].get(process, 0) >= 1
    assert {"redis redis", "vllm vllm"} <= injected
    assert any(kind.startswith("pause agent-runner") for kind in injected)


def test_the_trainer_and_the_vllm_server_were_killed_in_the_middle_of_a_weight_sync(chaos, settings):
    """With the collective transport (the default) both ends of a broadcast die while it is under way; every
    version is published all the same, each served with the trainer's logprobs."""
    assert settings.train.weight_transport == "collective"
    timed = {f"{f.kind} {f.target}": f.mid_sync for f in chaos.faults if f.done and f.mid_sync is not None}
    assert timed == {"vllm vllm": True, "crash trainer": True}
    updates = [decode(entry.fields).payload
               for entry in ArchiveReader(settings.storage_uri, settings.run_id).entries("policy")]
    assert [update.version for update in updates] == list(range(1, VERSIONS + 1))
    assert all(update.servers and update.parity_max_abs_diff <= settings.train.parity_tolerance
               for update in updates)


def test_nothing_admitted_is_lost_or_trained_twice_and_nothing_is_left_pending(chaos):
    audit = chaos.audit
    assert audit.problems() == []
    assert audit.admitted >= BATCH * VERSIONS
    assert audit.trained + audit.left_out_invalid + sum(audit.dropped.values()) == audit.admitted
    assert chaos.summary["policy_version"] == VERSIONS


def test_no_process_exited_but_those_the_harness_killed(chaos):
    unexpected = chaos.audit.unexpected_exits
    assert unexpected == [], "\n\n".join(seen.describe() for seen in unexpected)
    killed = {seen["process"] for seen in chaos.summary["exits"] if seen["injected"]}
    assert {"dispatcher", "agent-runner-1", "agent-runner-2", "sandbox-grader", "reward",
            "trainer", "recorder", "redis", "vllm"} <= killed


def test_the_drops_are_no_more_than_the_faults_explain(chaos):
    audit = chaos.audit
    assert audit.drops_over_bound == []
    # a kill of the work-horse, of the sandbox-grader and a Redis restart explain at most one lost grade each
    horse_kills = [fault for fault in chaos.faults if fault.kind == "horse"]
    assert all(fault.done for fault in horse_kills), [fault.note for fault in horse_kills]
    assert audit.drop_bound["grading_failed + grade_timeout"] == 3
