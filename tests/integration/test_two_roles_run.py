"""Two roles through the whole pipeline, under faults: the relay example (a planner and a solver, two LoRA
adapters of the tiny model on one real vLLM CPU server) trained while the trainer, both agent-runners, the
reward service and the vLLM server are each killed once. Then, from its streams and batch files:

- the audit, per role: nothing admitted lost or trained twice, each row judged against its own role's version;
- both roles trained, each with its own versions, every version's adapters served with parity, the fleet's
  record of each adapter's version per server;
- each turn sampled under its role's adapter, its version that adapter's;
- a replay of the trajectories through a fresh reward service re-derives the same per-role rewards,
  advantages and batches.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from rollstream.cli.chaos.harness import ChaosPlan, ChaosRun
from rollstream.cli.examples import example_settings
from rollstream.shared.contract.archive import ArchiveReader
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.events import (
    BatchReady,
    PolicyUpdated,
    RewardAssigned,
    TrajectorySegment,
    TrajectoryTurn,
    decode,
)
from rollstream.shared.runtime.storage import Storage
from tests.support import MODELS

pytestmark = pytest.mark.integration

VERSIONS = 6
BATCH = 8
GROUP = 4
ROLES = ("planner", "solver")


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    warm = MODELS / "tiny-llama-warm"
    if not (warm / "config.json").exists():
        pytest.skip("the warm tiny model is built by make setup")
    root = tmp_path_factory.mktemp("two-roles")
    return example_settings(
        "relay", f"roles-{uuid.uuid4().hex[:8]}", storage_uri=str(root / "runs"), model={"path": warm},
        data={"samples_per_prompt": GROUP}, rollout={"max_tokens": 24, "concurrency": 8},
        train={"batch_size": BATCH, "total_versions": VERSIONS, "max_staleness": 1},
        bus={"reclaim_idle_ms": 5000}, recorder={"flush_s": 1.0})


@pytest.fixture(scope="module")
def chaos(settings):
    plan = ChaosPlan(seed=3, kills_per_service=1, services=("trainer", "agent-runner", "reward"),
                     redis_restarts=0, vllm_restarts=1, pauses=0, interval_s=4.0)
    run = ChaosRun(settings, plan, on_event=print)
    try:
        return run.run(timeout_s=900)
    except BaseException:
        for name in run.local.processes:
            print(f"--- {name}\n{run.local.log_tail(name, 40)}")
        raise


def archived(settings, stream: str, kind, run_id: str | None = None) -> list:
    reader = ArchiveReader(settings.storage_uri, run_id or settings.run_id)
    return [envelope for envelope in (decode(entry.fields) for entry in reader.entries(stream))
            if isinstance(envelope.payload, kind)]


def test_nothing_admitted_is_lost_or_trained_twice_counted_per_role(chaos):
    audit = chaos.audit
    killed = {f"{f.kind} {f.target}" for f in chaos.faults if f.done}
    assert {"crash trainer", "crash agent-runner-1", "crash agent-runner-2", "crash reward",
            "vllm vllm"} <= killed
    assert audit.problems() == []
    assert audit.trained + audit.left_out_invalid + sum(audit.dropped.values()) == audit.admitted
    assert set(audit.rows_by_role) == set(ROLES)
    assert all(fates.get("trained", 0) > 0 for fates in audit.rows_by_role.values()), audit.rows_by_role


def test_both_roles_trained_and_served_each_version_with_parity(chaos, settings):
    updates = [e.payload for e in archived(settings, "policy", PolicyUpdated)]
    assert [u.version for u in updates] == list(range(1, VERSIONS + 1))
    for update in updates:
        assert set(update.role_versions) == set(ROLES)
        assert update.servers and update.parity_max_abs_diff <= settings.train.parity_tolerance
    # a role's version grows by one with each batch that trained it, never past the trainer's step
    last = updates[-1].role_versions
    assert all(0 < last[role] <= VERSIONS for role in ROLES), last
    assert all(b.role_versions[role] - a.role_versions[role] in (0, 1)
               for a, b in zip(updates, updates[1:]) for role in ROLES)


def test_each_turn_is_sampled_as_its_role_at_that_roles_version(chaos, settings):
    segments = archived(settings, "trajectories", TrajectorySegment)
    turns = {(e.rollout_id, e.payload.segment_index, e.payload.turn): e.payload
             for e in archived(settings, "trajectories", TrajectoryTurn)}
    assert Counter(e.payload.role for e in segments).keys() == set(ROLES)
    updates = [e.payload for e in archived(settings, "policy", PolicyUpdated)]
    published = {role: {0} | {u.role_versions[role] for u in updates} for role in ROLES}
    for envelope in segments:
        segment = envelope.payload
        # each of its turns' versions is one its own role published (the other role's may differ)
        assert set(segment.turn_policy_versions) <= published[segment.role], segment
        assert segment.response_length > 0 and any(segment.loss_mask)
    planner_segments = [e for e in segments if e.payload.role == "planner"]
    assert all((e.rollout_id, 0, 0) in turns for e in planner_segments)


def test_a_replay_rederives_the_same_per_role_rewards_and_batches(chaos, settings):
    from rollstream.cli.replay.command import replay_run

    replay = settings.model_copy(update={"run_id": f"{settings.run_id}-rescored"})
    result = replay_run(replay, settings.run_id, source="archive", streams=("trajectories",),
                        services=("reward",), timeout_s=300, quiet_s=2.0)
    assert result.exit_codes == {"reward": 0, "recorder": 0}

    def rewards(run_id: str) -> dict[str, tuple]:
        return {e.event_id: (e.payload.reward, e.payload.advantage, e.payload.role_rewards,
                             e.payload.role_advantages)
                for e in archived(settings, "rewards", RewardAssigned, run_id)}

    original, again = rewards(settings.run_id), rewards(replay.run_id)
    assert original and {key: again.get(key) for key in original} == original
    assert all(set(values[3]) <= set(ROLES) and values[3] for values in original.values())
    storage = Storage(settings.storage_uri)
    before = [e.payload for e in archived(settings, "batches", BatchReady)]
    after = {e.payload.batch_id: e.payload for e in archived(settings, "batches", BatchReady, replay.run_id)}
    assert before and all(b.batch_id in after for b in before)
    for batch in before:
        rows = read_batch(storage, batch.uri)
        assert rows == read_batch(storage, after[batch.batch_id].uri)
        assert {row.role for row in rows} <= set(ROLES)
