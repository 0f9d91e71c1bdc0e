"""The whole pipeline for real: Redis 7.0, vLLM on the CPU, the five services as processes.

One run of 3 policy versions; the tests below read what it left in Redis and in storage.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.archive import ArchiveReader, read_history
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import (
    BatchReady,
    DeadLettered,
    GradeReported,
    PolicyUpdated,
    PromptIssued,
    RewardAssigned,
    TrajectoryFinished,
    TrajectoryTurn,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

pytestmark = pytest.mark.integration

VERSIONS = 3
BATCH = 8
GROUP = 4
ETA = 1


@pytest.fixture(scope="module")
def run(tmp_path_factory, machine_redis_url, tiny_model):

    root = tmp_path_factory.mktemp("e2e")
    model = tiny_model
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        run_id=run_id, redis_url=machine_redis_url, storage_uri=str(root / "runs"),
        model={"path": model}, data={"samples_per_prompt": GROUP, "synthetic_sandbox_every": 2},
        rollout={"max_tokens": 12, "concurrency": 8},
        train={"batch_size": BATCH, "total_versions": VERSIONS, "max_staleness": ETA, "learning_rate": 3e-3},
        bus={"reclaim_idle_ms": 5000},
    )
    with LocalRun(settings) as local:
        bus = local.bus
        # Malformed entries on two streams: they must be dead-lettered while the services keep going.
        bus.redis.xadd(bus.keys.stream("prompts"), {"type": "PromptIssued", "v": "1", "body": b"\x00garbage"})
        bus.redis.xadd(bus.keys.stream("batches"), {"type": "BatchReady", "v": "99", "body": b""})
        progress = local.wait_for_version(VERSIONS, timeout_s=600)
        served = asyncio.run(probe_served_logprobs(local, model))
    yield {"local": local, "progress": progress, "served": served, "exit_codes": local.exit_codes, "model": model}
    local.bus.delete_run()


async def probe_served_logprobs(local: LocalRun, model: Path) -> dict:
    """vLLM's prompt logprobs on a probe, and the trainer's final checkpoint's own, computed here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.shared.inference.fleet import FleetClient

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids) + tokenizer.encode("42", add_special_tokens=False)
    url = local.settings.fleet.urls[0]
    fleet = FleetClient(local.settings.fleet.urls, model=local.settings.model.served_name)
    served = await fleet.prompt_logprobs(url, ids)
    await fleet.aclose()
    checkpoint = local.progress().updates[-1].checkpoint_uri

    def expected(path) -> list[float]:
        net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(net(torch.tensor([ids])).logits[0, :-1].float(), -1)
        return logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()

    return {"served": served, "final": expected(checkpoint), "initial": expected(model)}


def events(local: LocalRun, stream, kind, run_id: str | None = None):
    """A stream's whole history (the recorder trims what it archived), of one kind."""
    bus = local.bus if run_id is None else Bus(local.bus.redis, run_id)
    return [d for d in read_history(bus, stream, local.settings.storage_uri) if isinstance(d.event, kind)]


def all_batch_rows(local: LocalRun):
    storage = Storage(local.settings.storage_uri)
    return {b.batch_id: read_batch(storage, b.uri) for b in local.progress().batches}


def test_every_dispatched_sample_reached_exactly_one_batch(run):
    local = run["local"]
    dispatched = [d.envelope.rollout_id for d in events(local, "prompts", PromptIssued)]
    assert len(dispatched) == VERSIONS * BATCH
    batched = Counter(row.rollout_id for rows in all_batch_rows(local).values() for row in rows)
    assert sorted(batched) == sorted(dispatched)
    assert set(batched.values()) == {1}


def test_trained_tokens_are_the_ids_vllm_returned_and_prompts_are_masked(run):
    local = run["local"]
    turns = defaultdict(list)
    for d in events(local, "trajectories", TrajectoryTurn):
        turns[d.envelope.rollout_id].append(d.event)
    trained = {u.event.batch_id for u in events(local, "policy", PolicyUpdated)}
    rows = [row for batch_id, rows in all_batch_rows(local).items() if batch_id in trained for row in rows]
    assert len(rows) == VERSIONS * BATCH
    for row in rows:
        rebuilt, sampled = [], []
        for turn in sorted(turns[row.rollout_id], key=lambda t: t.turn):
            assert row.tokens[turn.offset: turn.offset + len(turn.response_ids)] == turn.response_ids
            assert row.rollout_logprobs[turn.offset: turn.offset + len(turn.response_ids)] == pytest.approx(
                turn.logprobs, abs=1e-6)
            rebuilt += turn.appended_ids + turn.response_ids
            sampled += range(turn.offset, turn.offset + len(turn.response_ids))
        assert row.tokens[: len(rebuilt)] == rebuilt
        assert [i for i, m in enumerate(row.loss_mask) if m] == sampled
        prompt_length = len(row.tokens) - row.response_length
        assert row.loss_mask[:prompt_length] == [0] * prompt_length


def test_policy_version_is_recorded_per_turn_and_new_versions_generate(run):
    local = run["local"]
    rows = [row for rows in all_batch_rows(local).values() for row in rows]
    turns = Counter(d.envelope.rollout_id for d in events(local, "trajectories", TrajectoryTurn))
    assert all(len(row.turn_policy_versions) == turns[row.rollout_id] >= 1 for row in rows)
    versions = Counter(row.turn_policy_versions[0] for row in rows)
    assert set(versions) <= set(range(VERSIONS))
    assert max(versions) >= 1, f"no sample was generated by an updated policy: {versions}"


def test_staleness_bound_was_never_exceeded(run):
    local = run["local"]
    for delivery in events(local, "prompts", PromptIssued):
        prompt = delivery.event
        assert prompt.sample_index + 1 <= (ETA + prompt.policy_version + 1) * BATCH
    batches = all_batch_rows(local)
    for update in events(local, "policy", PolicyUpdated):
        trained_at = update.event.version - 1
        rows = batches[update.event.batch_id]
        # A sample that finished late can land in a later batch: the trainer drops it and counts it.
        stale = [row for row in rows if trained_at - min(row.turn_policy_versions) > ETA]
        assert update.event.dropped.get("stale", 0) == len(stale)
        assert update.event.trained_samples == len(rows) - len(stale)
        assert update.event.metrics["samples/staleness_max"] <= ETA


def test_vllm_matches_the_trainer_after_every_weight_sync(run):
    updates = [d.event for d in events(run["local"], "policy", PolicyUpdated)]
    assert [u.version for u in updates] == list(range(1, VERSIONS + 1))
    assert all(u.parity_max_abs_diff <= 1e-3 for u in updates)
    probe = run["served"]
    assert max(abs(a - b) for a, b in zip(probe["served"], probe["final"])) <= 1e-3
    # The weights moved exactly when some trained sample carried a learning signal: a random tiny model
    # can score 0 on every rollout, and then every advantage is exactly 0 and the policy must stay put.
    trained = {u.batch_id for u in updates}
    signal = any(row.advantage != 0 for batch_id, rows in all_batch_rows(run["local"]).items()
                 if batch_id in trained for row in rows)
    moved = max(abs(a - b) for a, b in zip(probe["final"], probe["initial"]))
    assert (moved > 1e-3) if signal else (moved == 0.0)


def test_sandbox_grades_reach_the_rewards(run):
    local = run["local"]
    grades = {d.envelope.rollout_id: d.event for d in events(local, "grades", GradeReported)}
    rewards = {d.envelope.rollout_id: d.event for d in events(local, "rewards", RewardAssigned)}
    prompts = {d.envelope.rollout_id: d.event for d in events(local, "prompts", PromptIssued)}
    graded = [r for r, p in prompts.items() if p.sandbox_check]
    assert graded and set(graded) <= set(grades)
    for rollout in graded:
        assert rewards[rollout].source == "sandbox"
        assert rewards[rollout].reward == grades[rollout].score
        assert grades[rollout].reason.startswith("exit")


def test_malformed_events_were_dead_lettered_and_services_drained_cleanly(run):
    dead = [d.event for d in events(run["local"], "dead", DeadLettered)]
    assert {(e.stream, e.group) for e in dead} >= {("prompts", "agent-runner"), ("batches", "trainer")}
    assert any("not msgpack" in e.error for e in dead)
    assert any("schema version '99'" in e.error for e in dead)
    assert run["exit_codes"] == {name: 0 for name in run["exit_codes"]}


def test_services_logged_no_errors(run):
    local = run["local"]
    for name in local.processes:
        errors = [line for line in (local.log_dir / f"{name}.log").read_text().splitlines()
                  if '"level": "ERROR"' in line or '"level": "CRITICAL"' in line]
        assert errors == [], f"{name} logged errors"


def test_every_entry_of_every_stream_was_archived_and_the_live_streams_were_trimmed(run):
    local = run["local"]
    reader = ArchiveReader(local.settings.storage_uri, local.settings.run_id)
    # counted, not decoded: the garbage entries the fixture injected are archived as they were
    archived = {stream: sum(1 for _ in reader.entries(stream)) for stream in reader.streams()}
    added = {s: int(local.bus.redis.xinfo_stream(local.bus.keys.stream(s))["entries-added"]) for s in archived}
    assert archived == added and set(archived) >= {"prompts", "trajectories", "grades", "rewards", "batches", "policy"}
    live = sum(local.bus.redis.xlen(local.bus.keys.stream(s)) for s in archived)
    assert live < sum(added.values())  # the recorder trimmed behind the consumers


# ------------------------------------------------------------------------------------------ replay
def replayed(source: Settings, suffix: str, **kwargs):
    """Replay the run configured by `source` from its archive into run `<run>-<suffix>`, same settings."""
    from rollstream.cli.replay.command import replay_run

    settings = source.model_copy(update={"run_id": f"{source.run_id}-{suffix}"})
    result = replay_run(settings, source.run_id, source="archive", timeout_s=300, quiet_s=2.0, **kwargs)
    return settings, result


@pytest.fixture(scope="module")
def rescored(run):
    """The recorded run's trajectories and grades replayed through a fresh reward service, from the archive."""
    settings, result = replayed(run["local"].settings, "rescored", streams=("trajectories", "grades"), services=("reward",))
    yield settings, result
    Bus(run["local"].bus.redis, settings.run_id).delete_run()


def rewards_by_event(local, run_id=None) -> dict[str, tuple]:
    return {d.envelope.event_id: (d.event.reward, d.event.advantage, d.event.source)
            for d in events(local, "rewards", RewardAssigned, run_id)}


def assert_reproduced(local, replay_run_id: str) -> None:
    """The replay's rewards, advantages and batches are the original's."""
    original, replay = rewards_by_event(local), rewards_by_event(local, replay_run_id)
    assert original and all(replay.get(event_id) == values for event_id, values in original.items())
    # The original run was stopped mid-flight: what its reward service had not handled yet, the replay
    # handles now; those are groups the original never completed.
    original_groups = {d.envelope.group_id for d in events(local, "rewards", RewardAssigned)}
    extra = {d.envelope.group_id for d in events(local, "rewards", RewardAssigned, replay_run_id)
             if d.envelope.event_id not in original}
    assert not extra & original_groups

    storage = Storage(local.settings.storage_uri)
    before = [d.event for d in events(local, "batches", BatchReady)]
    after = [d.event for d in events(local, "batches", BatchReady, replay_run_id)]
    assert before and [b.batch_id for b in after[:len(before)]] == [b.batch_id for b in before]
    for old, new in zip(before, after):
        assert old.group_ids == new.group_ids and old.mean_reward == new.mean_reward
        assert new.uri != old.uri  # written by the replay, under its own run
        assert read_batch(storage, new.uri) == read_batch(storage, old.uri)


def test_a_replay_reproduces_the_rewards_advantages_and_batches(run, rescored):
    settings, result = rescored
    assert result.services == ("reward", "recorder") and result.exit_codes == {"reward": 0, "recorder": 0}
    assert_reproduced(run["local"], settings.run_id)


def test_a_replay_regrades_finished_rollouts_in_a_new_order_to_the_same_batches(run):
    """The grader runs again: its grades arrive in another order than the original's, and the reward
    service still builds the same batches (batch_order=finished)."""
    local = run["local"]
    settings, result = replayed(local.settings, "regraded", streams=("trajectories",), finished_only=True,
                                services=("sandbox-grader", "reward"))
    try:
        assert result.published == {"trajectories": result.published["trajectories"]}
        original = {d.envelope.rollout_id: d.event for d in events(local, "grades", GradeReported)}
        regraded = {d.envelope.rollout_id: d.event for d in events(local, "grades", GradeReported, settings.run_id)}
        assert original and set(original) <= set(regraded)
        for rollout, grade in original.items():
            assert (regraded[rollout].score, regraded[rollout].passed, regraded[rollout].reason) == (
                grade.score, grade.passed, grade.reason)
        assert_reproduced(local, settings.run_id)
    finally:
        Bus(local.bus.redis, settings.run_id).delete_run()


def test_a_replay_through_a_new_reward_function_needs_no_agent_or_vllm(run, tmp_path, monkeypatch):
    (tmp_path / "strict_reward.py").write_text(
        "def score(response, label):\n    return float(len(response) % 5) / 4\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    local = run["local"]
    settings = local.settings.model_copy(update={"reward": local.settings.reward.model_copy(
        update={"function": "strict_reward:score"})})
    new_settings, result = replayed(settings, "strict", streams=("trajectories",), finished_only=True,
                                    services=("reward",))
    try:
        assert result.services == ("reward", "recorder") and result.produced.get("batches", 0) >= 1
        finished = {d.envelope.rollout_id: d.event for d in events(local, "trajectories", TrajectoryFinished)}
        new_rewards = {d.envelope.rollout_id: d for d in events(local, "rewards", RewardAssigned, new_settings.run_id)}
        assert set(new_rewards) == set(finished)  # every finished rollout, sandbox-graded ones too, no grades needed
        by_group = defaultdict(list)
        for rollout, delivery in new_rewards.items():
            want = 0.0 if finished[rollout].status == "failed" else float(len(finished[rollout].response_text) % 5) / 4
            assert delivery.event.reward == want
            by_group[delivery.envelope.group_id].append(delivery.event)
        for group in by_group.values():  # GRPO, recomputed here
            rewards = [e.reward for e in group]
            mean = sum(rewards) / len(rewards)
            std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
            for e in group:
                assert e.advantage == pytest.approx(0.0 if std == 0 else (e.reward - mean) / (std + 1e-6), abs=1e-6)
        storage = Storage(local.settings.storage_uri)
        for batch in events(local, "batches", BatchReady, new_settings.run_id):
            for row in read_batch(storage, batch.event.uri):
                assert row.reward == new_rewards[row.rollout_id].event.reward
    finally:
        Bus(local.bus.redis, new_settings.run_id).delete_run()


def test_a_replay_of_the_batches_retrains_the_same_steps(run):
    """The trainer on the recorded batches, from the same start, without a fleet: every version the
    original trained comes out with the same loss, metrics and weights (a trainer problem reproduces)."""
    from safetensors.torch import load_file

    local = run["local"]
    settings, result = replayed(local.settings, "retrained", streams=("batches",), services=("trainer",),
                                skip_dead_lettered=True)  # the fixture's malformed batch entry
    try:
        assert result.exit_codes == {"trainer": 0, "recorder": 0}
        original = [d.event for d in events(local, "policy", PolicyUpdated)]
        again = {d.event.version: d.event for d in events(local, "policy", PolicyUpdated, settings.run_id)}
        assert original and set(u.version for u in original) <= set(again)
        for update in original:
            redone = again[update.version]
            assert redone.batch_id == update.batch_id and redone.servers == []  # fleet-less
            assert (redone.trained_samples, redone.dropped) == (update.trained_samples, update.dropped)
            assert redone.loss == pytest.approx(update.loss, abs=1e-6)
            measured = {k for k in update.metrics if "seconds" in k or k.startswith("sync/")}
            assert {k: v for k, v in redone.metrics.items() if k not in measured} == pytest.approx(
                {k: v for k, v in update.metrics.items() if k not in measured}, abs=1e-6)
        final, final_again = (load_file(Path(u.checkpoint_uri) / "model.safetensors")
                              for u in (original[-1], again[original[-1].version]))
        assert max((final[name] - final_again[name]).abs().max().item() for name in final) <= 1e-6
    finally:
        Bus(local.bus.redis, settings.run_id).delete_run()
