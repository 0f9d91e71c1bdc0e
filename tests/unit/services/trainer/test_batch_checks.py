"""What the trainer refuses before it trains (services/trainer/training.py): a BatchReady whose file is
missing, unreadable or another batch's (BatchRejected: the entry's failure, retried or dead-lettered,
never the trainer's), rows no model can train on (left out and counted), and a PolicyUpdated it
did not write itself (a restart resumes from its own last one). Against the local Redis and Valkey
where Redis is involved; no model is loaded."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from rollstream.services.trainer.training import BatchRejected, Trainer, last_own_update, row_problem
from rollstream.shared.contract.batches import BatchRow, write_batch
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.runtime.storage import Storage


def row(**overrides) -> BatchRow:
    fields = dict(sample_index=0, trajectory_id="r0", rollout_id="r0", group_id="g0", session_id="r0",
                  segment_index=0, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[0, 0, 1, 1],
                  rollout_logprobs=[0.0, 0.0, -0.5, -1.0], turn_policy_versions=[0], status="completed",
                  reward=1.0, advantage=0.5)
    return BatchRow(**{**fields, **overrides})


@pytest.mark.parametrize("overrides, problem", [
    ({}, None),
    ({"tokens": [1, 2, 3]}, "differ"),
    ({"tokens": [], "loss_mask": [], "rollout_logprobs": []}, "differ"),
    ({"tokens": [1, 2, 3, 400]}, "outside the vocabulary"),
    ({"tokens": [-1, 2, 3, 4]}, "outside the vocabulary"),
    ({"tokens": list(range(1, 40)), "loss_mask": [1] * 39, "rollout_logprobs": [-1.0] * 39}, "positions"),
    ({"loss_mask": [0, 0, 1, 2]}, "not only 0 and 1"),
    ({"advantage": math.nan}, "not finite"),
    ({"rollout_logprobs": [0.0, 0.0, -math.inf, -1.0]}, "not finite"),
    ({"turn_policy_versions": [7]}, "the latest published is 3"),
])
def test_rows_no_model_can_train_on_are_named_with_their_problem(overrides, problem):
    found = row_problem(row(**overrides), vocab_size=352, max_positions=32, version=3)
    assert (found is None) if problem is None else (problem in found)


@pytest.fixture
def trainer_reading(tmp_path):
    """Trainer.load_batch needs only the storage."""
    storage = Storage(str(tmp_path))
    return SimpleNamespace(storage=storage), storage


def announce(storage: Storage, batch_id: str, rows: list[BatchRow], **overrides) -> BatchReady:
    uri = write_batch(storage, "run", batch_id, rows)
    fields = dict(batch_id=batch_id, uri=uri, sample_count=len(rows),
                  group_ids=sorted({r.group_id for r in rows}), min_policy_version=0, mean_reward=1.0)
    return BatchReady(**{**fields, **overrides})


def test_the_batch_announced_is_read(trainer_reading):
    trainer, storage = trainer_reading
    batch = announce(storage, "b-1", [row(), row(rollout_id="r1")])
    assert [r.rollout_id for r in Trainer.load_batch(trainer, batch)] == ["r0", "r1"]


def test_a_batch_whose_file_is_missing_or_no_batch_is_rejected_for_a_retry(trainer_reading, tmp_path):
    trainer, storage = trainer_reading
    missing = announce(storage, "b-2", [row()]).model_copy(
        update={"uri": str(tmp_path / "gone" / "b-2.parquet")})
    (tmp_path / "b-3.parquet").write_text("not parquet")
    not_parquet = missing.model_copy(update={"batch_id": "b-3", "uri": str(tmp_path / "b-3.parquet")})
    for batch, error in ((missing, "FileNotFoundError"), (not_parquet, "cannot read")):
        with pytest.raises(BatchRejected, match=error) as caught:
            Trainer.load_batch(trainer, batch)
        assert caught.value.retryable


def test_a_batch_that_is_not_the_one_announced_is_rejected_for_good(trainer_reading):
    trainer, storage = trainer_reading
    real = announce(storage, "b-4", [row(), row(rollout_id="r1")])
    for batch, error in ((real.model_copy(update={"batch_id": "b-4-again"}), "not its file"),
                         (real.model_copy(update={"sample_count": 5}), "holds 2 rows"),
                         (real.model_copy(update={"group_ids": ["g9"]}), "holds 2 rows")):
        with pytest.raises(BatchRejected, match=error) as caught:
            Trainer.load_batch(trainer, batch)
        assert not caught.value.retryable


def test_a_restart_resumes_from_the_trainers_own_last_update_not_a_forged_one(bus):
    trained = bus.keys.state("trainer", "trained-batches")
    assert last_own_update(bus, trained) is None

    def update(version: int, batch_id: str) -> PolicyUpdated:
        return PolicyUpdated(version=version, checkpoint_uri=f"/ckpt/v{version}", batch_id=batch_id,
                             servers=[], parity_max_abs_diff=0.0, loss=0.0, trained_samples=1)

    for version in (1, 2):
        bus.publish("policy", update(version, f"b-{version}"))
        bus.redis.sadd(trained, f"b-{version}")
    bus.publish("policy", update(1_000_000, "b-forged"))  # no trainer trained b-forged
    for _ in range(100):  # more than a page of entries that are no event at all
        bus.redis.xadd(bus.keys.stream("policy"), {"type": "PolicyUpdated", "v": "1", "body": b"\x00"})
    assert last_own_update(bus, trained).version == 2


def test_a_restart_finds_its_own_last_update_in_the_archive_when_the_stream_kept_only_a_forged_one(
        bus, tmp_path):
    from rollstream.shared.contract.archive import trim_stream
    from tests.support import archive_all

    trained = bus.keys.state("trainer", "trained-batches")
    for version in (1, 2):
        bus.publish("policy", PolicyUpdated(version=version, checkpoint_uri=f"/ckpt/v{version}",
                                            batch_id=f"b-{version}", servers=[], parity_max_abs_diff=0.0,
                                            loss=0.0, trained_samples=1))
        bus.redis.sadd(trained, f"b-{version}")
    bus.publish("policy", PolicyUpdated(version=1_000_000, checkpoint_uri="/ckpt/forged", batch_id="b-forged",
                                        servers=[], parity_max_abs_diff=0.0, loss=0.0, trained_samples=1))
    archive_all(bus, tmp_path)
    trim_stream(bus, "policy")
    assert bus.redis.xlen(bus.keys.stream("policy")) == 1  # the recorder kept the newest entry only: forged
    assert last_own_update(bus, trained) is None
    assert last_own_update(bus, trained, str(tmp_path)).version == 2
