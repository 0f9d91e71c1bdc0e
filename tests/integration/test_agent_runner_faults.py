"""Two agent-runner replicas, one killed with SIGKILL in the middle of episodes; a fan-out agent
plugged in by import path. Real Redis, real vLLM on the CPU, every service as a process."""

from __future__ import annotations

import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import consumer_name
from rollstream.shared.contract.events import PolicyUpdated, PromptIssued
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

pytestmark = pytest.mark.integration

VERSIONS = 2
BATCH = 8
GROUP = 4
PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture(scope="module")
def run(tmp_path_factory, machine_redis_url, tiny_model):
    root = tmp_path_factory.mktemp("faults")
    model = tiny_model
    settings = Settings(
        run_id=f"faults-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url, storage_uri=str(root / "runs"),
        model={"path": model}, data={"samples_per_prompt": GROUP, "synthetic_sandbox_every": 0},
        rollout={"max_tokens": 8, "concurrency": 4},
        agent={"default": "fanout_agents:slow_branches"},
        train={"batch_size": BATCH, "total_versions": VERSIONS, "max_staleness": 1,
               "loss_aggregation": "rollout"},
        bus={"reclaim_idle_ms": 3000},
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(PLUGINS))
    try:
        with LocalRun(settings, replicas={"agent-runner": 2}) as local:
            victim, held = wait_for_a_replica_holding_episodes(local)
            victim_pid = local.kill(victim)
            progress = local.wait_for_version(VERSIONS, timeout_s=600)
    finally:
        mp.undo()
    yield {"local": local, "progress": progress, "held": held, "victim_pid": victim_pid,
           "exit_codes": local.exit_codes}
    local.bus.delete_run()


def wait_for_a_replica_holding_episodes(local: LocalRun, timeout_s: float = 120) -> tuple[str, list[str]]:
    """The replica with prompts delivered and not yet acknowledged, and those entries' ids."""
    bus = local.bus
    key = bus.keys.stream("prompts")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        bus.ensure_group("prompts", "agent-runner")
        for name, process in local.processes.items():
            if not name.startswith("agent-runner"):
                continue
            consumer = consumer_name("agent-runner").rsplit("-", 1)[0] + f"-{process.pid}"
            pending = bus.redis.xpending_range(key, "agent-runner", "-", "+", 100, consumername=consumer)
            if len(pending) >= 2:
                return name, [row["message_id"].decode() for row in pending]
        time.sleep(0.2)
    raise TimeoutError("no agent-runner replica held two episodes at once")


def rows_by_batch(local: LocalRun):
    storage = Storage(local.settings.storage_uri)
    return {b.batch_id: read_batch(storage, b.uri) for b in local.progress().batches}


def test_the_killed_replicas_episodes_were_finished_by_the_other(run):
    local = run["local"]
    prompts = {d.entry_id: d.envelope.rollout_id
               for d in read_history(local.bus, "prompts", local.settings.storage_uri)
               if isinstance(d.event, PromptIssued)}
    batched = {row.rollout_id for rows in rows_by_batch(local).values() for row in rows}
    assert run["held"] and {prompts[entry] for entry in run["held"]} <= batched
    assert local.bus.group_lag("prompts", "agent-runner") == (0, 0)


def test_no_sample_lost_and_none_batched_twice(run):
    local = run["local"]
    history = read_history(local.bus, "prompts", local.settings.storage_uri)
    dispatched = [d.envelope.rollout_id for d in history if isinstance(d.event, PromptIssued)]
    rows = [row for rows in rows_by_batch(local).values() for row in rows]
    assert sorted({r.rollout_id for r in rows}) == sorted(dispatched)
    segments = Counter((r.rollout_id, r.segment_index) for r in rows)
    assert set(segments.values()) == {1}


def test_fan_out_segments_share_their_rollout_and_its_advantage(run):
    rows = [row for rows in rows_by_batch(run["local"]).values() for row in rows]
    by_rollout = defaultdict(list)
    for row in rows:
        by_rollout[row.rollout_id].append(row)
    counts = {rollout: len(segments) for rollout, segments in by_rollout.items()}
    assert set(counts.values()) == {1, 2}
    for rollout, segments in by_rollout.items():
        assert counts[rollout] == 1 + int(rollout[-1]) % 2
        assert len({s.advantage for s in segments}) == 1
        assert len({s.group_id for s in segments}) == 1


def test_group_advantages_are_normalised_over_rollouts_not_segments(run):
    rows = [row for rows in rows_by_batch(run["local"]).values() for row in rows]
    groups = defaultdict(dict)
    for row in rows:
        groups[row.group_id][row.rollout_id] = (row.reward, row.advantage)
    for rollouts in groups.values():
        assert len(rollouts) == GROUP  # a group counts rollouts
        rewards = sorted(r for r, _ in rollouts.values())
        assert rewards[0] < rewards[-1]
        assert abs(sum(a for _, a in rollouts.values())) < 1e-4


def test_the_trainer_trained_every_segment(run):
    local = run["local"]
    batches = rows_by_batch(local)
    updates = [d.event for d in read_history(local.bus, "policy", local.settings.storage_uri)
               if isinstance(d.event, PolicyUpdated)]
    assert [u.version for u in updates] == list(range(1, VERSIONS + 1))
    for update in updates:
        assert update.trained_samples + update.dropped.get("stale", 0) == len(batches[update.batch_id])
        assert update.trained_samples > BATCH  # segments, more than the batch's rollouts
    assert all(code == 0 for code in run["exit_codes"].values())
