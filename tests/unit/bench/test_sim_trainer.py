"""The simulated GPU trainer (bench/sim_trainer.py): its profile's step time, and that it publishes a trained
batch the way the trainer service does (services/trainer/training.py, sync_and_publish), against the
machine's Redis and two simulated servers.

    python -m pytest tests/unit/bench/test_sim_trainer.py -q
"""

from __future__ import annotations

import httpx
import pytest

from bench.sim_checkpoints import Checkpoints
from bench.sim_fleet import SimFleet, parse_metrics
from bench.sim_latency import LatencyModel
from bench.sim_trainer import (
    PROBE,
    PROFILES,
    GpuProfile,
    SimTrainer,
    forward_only_tokens,
    profile_from,
    select_fresh,
)
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

INSTANT = GpuProfile("instant", train_tokens_per_s=1e12, step_overhead_s=0.0, sync_s=0.0)


def row(index: int, versions: list[int], tokens: int = 8) -> BatchRow:
    rollout = f"r{index}"
    return BatchRow(sample_index=index, trajectory_id=rollout, rollout_id=rollout, group_id="g0",
                    session_id=rollout, segment_index=0, tokens=list(range(1, tokens + 1)), response_length=4,
                    loss_mask=[0] * (tokens - 4) + [1] * 4, rollout_logprobs=[-1.0] * tokens,
                    turn_policy_versions=versions, status="completed", reward=float(index % 2),
                    advantage=0.0)


# ---------------------------------------------------------------------------------- the profile
def test_a_step_takes_the_overhead_plus_the_tokens_at_the_profiles_throughput():
    profile = PROFILES["h100x8-7b"]
    assert profile.step_seconds(0) == pytest.approx(profile.step_overhead_s)
    tokens = int(2 * profile.train_tokens_per_s)
    assert profile.step_seconds(tokens) == pytest.approx(profile.step_overhead_s + 2.0)


def test_a_forward_only_pass_costs_a_third_of_a_trained_token():
    profile = GpuProfile("p", train_tokens_per_s=1000, step_overhead_s=0.5, sync_s=1.0)
    assert profile.step_seconds(3000, forward_only_tokens=3000) == pytest.approx(0.5 + 3 + 1)


def test_extra_forward_passes_are_the_trainers():
    # one minibatch: its own forward gives the proximal logprobs; each further one needs a forward first
    assert forward_only_tokens(1000, minibatches=1, decoupled=True, kl_coef=0.0) == 0
    assert forward_only_tokens(1000, minibatches=4, decoupled=True, kl_coef=0.0) == pytest.approx(750)
    assert forward_only_tokens(1000, minibatches=4, decoupled=False, kl_coef=0.0) == 0
    assert forward_only_tokens(1000, minibatches=1, decoupled=True, kl_coef=0.1) == 1000  # the reference


def test_given_numbers_replace_the_profiles():
    assert profile_from("h100x8-7b") is PROFILES["h100x8-7b"]
    custom = profile_from("h100x8-7b", tokens_per_s=10_000, sync_s=2.5)
    assert (custom.train_tokens_per_s, custom.sync_s) == (10_000, 2.5)
    assert custom.step_overhead_s == PROFILES["h100x8-7b"].step_overhead_s
    with pytest.raises(ValueError, match="unknown GPU profile"):
        profile_from("tpu")


def test_rows_older_than_eta_versions_are_dropped():
    rows = [row(0, [1, 3]), row(1, [2, 3]), row(2, [])]
    fresh, dropped = select_fresh(rows, version=3, max_staleness=1)
    assert [r.sample_index for r in fresh] == [1] and dropped == {"stale": 2}  # no turns: version 0
    assert select_fresh(rows, version=3, max_staleness=3) == (rows, {})


# ----------------------------------------------------------------------------------- publishing
@pytest.fixture
def fleet(tiny_model):
    with SimFleet(tiny_model, 2, latency=LatencyModel(reload_s=0.0)) as sim:
        yield sim


def metric(url: str, name: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics").text)[name]


def test_a_batch_is_published_as_the_trainer_publishes_it(bus, redis_url, run_id, tiny_model, fleet,
                                                           tmp_path):
    settings = Settings(run_id=run_id, redis_url=redis_url, storage_uri=str(tmp_path),
                        model={"path": tiny_model}, fleet={"urls": fleet.urls}, train={"max_staleness": 1})
    expected = [logprob for logprob, _ in Checkpoints().prompt_logprobs(str(tiny_model), PROBE)]
    trainer = SimTrainer(settings, INSTANT, bus, expected)
    try:
        assert bus.fleet_versions() == {url: 0 for url in fleet.urls}
        trainer.version = 2  # a row sampled at version 0 is too stale for the step after version 2
        rows = [row(0, [0, 2]), row(1, [1, 2])]
        uri = write_batch(Storage(str(tmp_path)), run_id, "b-1", rows)
        bus.publish("batches", BatchReady(batch_id="b-1", uri=uri, sample_count=2, group_ids=["g0"],
                                          min_policy_version=0, mean_reward=0.5))
        delivery = bus.read_all("batches")[0]
        update = trainer.handle(delivery)
        assert trainer.handle(delivery) is None  # a batch already trained is passed over
    finally:
        trainer.close()

    published = bus.read_all("policy")
    assert len(published) == 1 and published[0].envelope.event_id == "policy:v3"
    event = published[0].event
    assert isinstance(event, PolicyUpdated) and event == update
    assert (event.version, event.batch_id, event.trained_samples) == (3, "b-1", 1)
    assert event.dropped == {"stale": 1}
    assert event.servers == fleet.urls and event.checkpoint_uri == str(tiny_model)
    assert event.parity_max_abs_diff <= settings.train.parity_tolerance
    assert event.metrics["train/trained_tokens"] == 8
    assert bus.redis.sismember(bus.keys.trained_batches, "b-1")
    assert bus.fleet_versions() == {url: 3 for url in fleet.urls}
    assert [metric(url, "sim:weight_reloads_total") for url in fleet.urls] == [1.0, 1.0]
    assert not any(httpx.get(f"{url}/is_paused").json()["is_paused"] for url in fleet.urls)
