"""A run recorded by an earlier reward service (tests/fixtures/reward-replay; recorded_run.py says what it
holds and how it was made), replayed through today's as `rollstream replay --services reward` does it: the
same rewards, advantages and drops, and the same batches, row for row. The run was recorded before samples
carried their role: what it left unsaid (no role advantages, rows of role None) is the run's one role, the
default, which today's service writes out. Real Redis, the service a process.

    python -m pytest tests/unit/services/reward/test_replay_of_a_recorded_run.py -q
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import PurePath

import redis

from rollstream.cli.replay.command import replay_run
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from tests.unit.services.reward.recorded_run import FIXTURE, INPUT_STREAMS, RUN_ID, SETTINGS


def rewards_written(bus: Bus, storage_uri: str) -> dict[str, tuple]:
    """Each RewardAssigned and RolloutDropped by its event id: its type, ids and payload."""
    return {d.envelope.event_id: (d.envelope.type, d.envelope.rollout_id, d.envelope.group_id,
                                  d.event.model_dump())
            for d in read_history(bus, "rewards", storage_uri)}


def batches_written(bus: Bus, storage_uri: str) -> list[tuple]:
    """Each BatchReady in order, without its URI, and the rows of its Parquet file, found under the run in
    `storage_uri` (the recorded URIs name the directory the run was recorded in)."""
    storage = Storage(storage_uri)
    return [(d.envelope.event_id, d.event.model_dump(exclude={"uri"}),
             read_batch(storage, storage.path(bus.keys.run_id, "batches", PurePath(d.event.uri).name)))
            for d in read_history(bus, "batches", storage_uri)]


def with_the_role_written_out(rewards: dict[str, tuple], batches: list[tuple], role: str) -> tuple:
    """The recorded rewards and batches as they read with the run's one role written out: each rollout's
    role advantage is its advantage, each row's role the default."""
    assert all(not payload.get("role_advantages") for _, _, _, payload in rewards.values())
    assert all(row.role is None for _, _, rows in batches for row in rows)
    rewards = {event_id: (kind, rollout, group, {**payload, "role_advantages": {role: payload["advantage"]}}
                                                if kind == "RewardAssigned" else payload)
               for event_id, (kind, rollout, group, payload) in rewards.items()}
    batches = [(event_id, batch, [dataclasses.replace(row, role=role) for row in rows])
               for event_id, batch, rows in batches]
    return rewards, batches


def test_a_replay_of_a_run_recorded_before_re_derives_its_rewards_and_batches(redis_url, run_id, tmp_path):
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    storage_uri = str(tmp_path)
    client = redis.Redis.from_url(redis_url)
    recorded = Bus(client, RUN_ID)  # nothing of it is in Redis: its history is the archive's
    settings = Settings(run_id=run_id, redis_url=redis_url, storage_uri=storage_uri, **SETTINGS)
    try:
        result = replay_run(settings, RUN_ID, streams=INPUT_STREAMS, source="archive", services=("reward",),
                            timeout_s=120, quiet_s=1.0)
        assert result.exit_codes == {"reward": 0}
        replayed = Bus(client, run_id)
        original_rewards = rewards_written(recorded, storage_uri)
        causes = {payload.get("cause") for _, _, _, payload in original_rewards.values()}
        assert len(original_rewards) == 27 and causes == {None, "grading_failed", "dead_lettered", "filtered"}
        original_batches = batches_written(recorded, storage_uri)
        assert [batch["group_ids"] for _, batch, _ in original_batches] == [["g1", "g2", "g4"], ["g5", "g6"]]
        original_rewards, original_batches = with_the_role_written_out(
            original_rewards, original_batches, RunRoles.of(settings).default)
        assert rewards_written(replayed, storage_uri) == original_rewards
        assert batches_written(replayed, storage_uri) == original_batches
    finally:
        Bus(client, run_id).delete_run()
        client.close()
