"""kill -9 of the trainer at random points of a run loses and repeats no batch.

The same recorded batches are trained twice on the real Redis: once by a trainer left alone, once by
a trainer that is SIGKILLed again and again (mid-step, mid-checkpoint, between batches) and restarted,
writing a checkpoint only every third version (train.checkpoint_every), so that a restart trains the
versions published since its newest checkpoint again. The killed run must publish every policy version once,
from every batch once, in order, and end with the same weights as the undisturbed run: a batch trained
twice, a replay that differs, or an optimizer state lost, would change them. Then the same batches on two
DeepSpeed ranks (gloo, a checkpoint every second version), one rank killed mid-run: the group starts again
and ends where the one torch process ended.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import redis
from safetensors.torch import load_file

from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.runtime.storage import Storage

pytestmark = pytest.mark.integration

BATCHES = 10
ROLLOUTS = 32
GROUP = 4
KILLS = 3


def synthetic_rows(rng: random.Random, batch_index: int, vocab: int) -> list[BatchRow]:
    rows = []
    for index in range(ROLLOUTS):
        length = rng.randint(120, 240)
        response = rng.randint(20, 80)
        rollout = f"b{batch_index}-r{index}"
        rows.append(BatchRow(
            sample_index=batch_index * ROLLOUTS + index, trajectory_id=rollout, rollout_id=rollout,
            group_id=f"b{batch_index}-g{index // GROUP}", session_id=rollout, segment_index=0,
            tokens=[rng.randrange(vocab) for _ in range(length)], response_length=response,
            loss_mask=[0] * (length - response) + [1] * response,
            rollout_logprobs=[0.0] * (length - response) + [rng.uniform(-7.0, -4.0) for _ in range(response)],
            turn_policy_versions=[batch_index], status="completed", reward=float(index % 2),
            advantage=1.0 if index % 2 else -1.0,
        ))
    return rows


@pytest.fixture(scope="module")
def recorded_batches(tmp_path_factory, tiny_model):
    from rollstream.cli.model.tiny_model import VOCAB_SIZE

    root = tmp_path_factory.mktemp("restart")
    model = tiny_model
    storage = Storage(str(root / "recorded"))
    rng = random.Random(7)
    batches = []
    for index in range(BATCHES):
        rows = synthetic_rows(rng, index, VOCAB_SIZE)
        uri = write_batch(storage, "recorded", f"batch-{index:02d}", rows)
        batches.append(BatchReady(batch_id=f"batch-{index:02d}", uri=uri, sample_count=len(rows),
                                  group_ids=sorted({r.group_id for r in rows}), min_policy_version=index,
                                  mean_reward=0.5))
    return root, model, batches


def start_trainer(config: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rollstream.services.trainer.main"],
                                env={**os.environ, "RS_CONFIG_FILE": str(config)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def published_versions(bus: Bus) -> list[PolicyUpdated]:
    return [d.event for d in bus.read_all("policy")]


def trainer_ranks(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The rank processes torchrun runs, by rank."""
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "rollstream.services.trainer.main" in " ".join(child.cmdline()):
            found[int(rank)] = child
    return found


def kill_one_rank(launcher: subprocess.Popen, rank: int) -> None:
    deadline = time.monotonic() + 60
    while rank not in (found := trainer_ranks(launcher)):
        assert time.monotonic() < deadline, f"no rank {rank} under the trainer's launcher"
        time.sleep(0.1)
    found[rank].kill()


def train_run(root: Path, model: Path, batches: list[BatchReady], redis_url: str, kills: int, seed: int,
              backend: str = "torch", ranks: int = 1, checkpoint_every: int = 1):
    """Train the batches; `kills` times the trainer is SIGKILLed and started again (with several ranks: one
    rank is SIGKILLed and the launcher starts the group again)."""
    run_id = f"restart-{uuid.uuid4().hex[:8]}"
    bus = Bus(redis.Redis.from_url(redis_url), run_id)
    config = root / f"{run_id}.json"
    config.write_text(json.dumps({
        "run_id": run_id, "redis_url": redis_url, "storage_uri": str(root / "runs"),
        "model": {"path": str(model)}, "fleet": {"urls": []},
        # every sample stays fresh: this test is about delivery, not staleness
        "train": {"batch_size": ROLLOUTS, "max_staleness": 100, "minibatches": 2, "micro_batch_tokens": 2048,
                  "learning_rate": 3e-3, "trackers": [], "backend": backend, "ranks": ranks,
                  "checkpoint_every": checkpoint_every},
        "data": {"samples_per_prompt": GROUP},
    }))
    for batch in batches:
        bus.publish("batches", batch, event_id=f"{batch.batch_id}:ready")
    log = root / f"{run_id}.log"
    rng = random.Random(seed)
    kill_log = []
    process = start_trainer(config, log)
    try:
        deadline = time.monotonic() + 300
        while len(published_versions(bus)) < BATCHES:
            assert time.monotonic() < deadline, f"trainer stuck; log:\n{log.read_text()[-3000:]}"
            assert process.poll() is None, f"trainer died; log:\n{log.read_text()[-3000:]}"
            done = len(published_versions(bus))
            if len(kill_log) < kills and done >= 1 + len(kill_log) * 2:
                time.sleep(rng.uniform(0.0, 0.4))  # somewhere in a step, a checkpoint write or a sync
                if ranks > 1:
                    kill_one_rank(process, rng.randrange(ranks))
                else:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    process = start_trainer(config, log)
                kill_log.append(len(published_versions(bus)))
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGTERM)
        code = process.wait(timeout=60)
        # torchrun itself exits 1 on a SIGTERM: that its ranks stopped cleanly, the follower's last words say
        stopped = code == 0 if ranks == 1 else any("rank stopped" in line and "the trainer stops" in line
                                                   for line in log.read_text().splitlines())
        assert stopped, f"the trainer did not stop cleanly (exit {code}); log:\n{log.read_text()[-3000:]}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    updates = published_versions(bus)
    weights = load_file(Path(updates[-1].checkpoint_uri) / "model.safetensors")
    pending = bus.group_lag("batches", "trainer")
    bus.delete_run()
    replayed = sum("replayed a published version" in line for line in log.read_text().splitlines())
    return updates, weights, kill_log, pending, replayed


@pytest.fixture(scope="module")
def calm_run(recorded_batches, machine_redis_url):
    root, model, batches = recorded_batches
    return train_run(root, model, batches, machine_redis_url, kills=0, seed=0)


@pytest.mark.timeout(600)
def test_kill_9_of_the_trainer_loses_and_repeats_no_batch(recorded_batches, calm_run, machine_redis_url):
    root, model, batches = recorded_batches
    calm, calm_weights, _, _, _ = calm_run
    # a checkpoint every third version: a restart trains the versions published since the newest again
    killed, killed_weights, kill_log, pending, replayed = train_run(root, model, batches, machine_redis_url,
                                                                    kills=KILLS, seed=1, checkpoint_every=3)

    assert len(kill_log) == KILLS
    assert replayed >= 1, "no restart trained a published version again"
    for updates in (calm, killed):
        assert [u.version for u in updates] == list(range(1, BATCHES + 1))
        assert [u.batch_id for u in updates] == [b.batch_id for b in batches]
        assert all(u.trained_samples == ROLLOUTS for u in updates)
    assert pending == (0, 0)
    assert [u.loss for u in killed] == pytest.approx([u.loss for u in calm], abs=1e-6)
    assert calm_weights.keys() == killed_weights.keys()
    for name, tensor in calm_weights.items():
        assert (tensor - killed_weights[name]).abs().max().item() <= 1e-6, name


@pytest.mark.timeout(900)
def test_two_deepspeed_ranks_learn_what_one_torch_trainer_learns_across_a_killed_rank(
        recorded_batches, calm_run, machine_redis_url):
    """The trainer service on two DeepSpeed ZeRO-2 ranks (CPU, gloo; train.ranks=2, so torchrun), one rank
    SIGKILLed mid-run: the group starts again from its own checkpoint (every rank's engine and optimizer
    state) and ends where the single torch trainer ends, batch by batch."""
    root, model, batches = recorded_batches
    calm, calm_weights, _, _, _ = calm_run
    ranked, ranked_weights, kill_log, pending, _ = train_run(root, model, batches, machine_redis_url, kills=1,
                                                          seed=2, backend="deepspeed", ranks=2,
                                                          checkpoint_every=2)
    print("largest loss difference:", max(abs(a.loss - b.loss) for a, b in zip(ranked, calm)))
    assert len(kill_log) == 1 and pending == (0, 0)
    assert [u.version for u in ranked] == list(range(1, BATCHES + 1))
    assert [u.batch_id for u in ranked] == [b.batch_id for b in batches]
    assert all(u.trained_samples == ROLLOUTS for u in ranked)
    assert [u.loss for u in ranked] == pytest.approx([u.loss for u in calm], abs=1e-5)
    for name, tensor in calm_weights.items():
        assert (tensor - ranked_weights[name]).abs().max().item() <= 1e-4, name
