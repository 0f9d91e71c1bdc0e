"""Training metrics reach TensorBoard and W&B (offline, no network), and a tracker that cannot work
fails at start."""

from __future__ import annotations

import pytest

from rollstream.shared.runtime.tracking import Tracker, TrackingError, flatten


def test_tensorboard_event_files_hold_every_metric_per_version(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(["tensorboard"], "run-a", tmp_path, {"train": {"learning_rate": 0.001}})
    for version in (1, 2, 3):
        tracker.log({"train/loss": 0.5 / version, "reward/batch_mean": 0.1 * version}, step=version)
    tracker.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "reward/batch_mean"}
    rewards = events.Scalars("reward/batch_mean")
    assert [e.step for e in rewards] == [1, 2, 3]
    assert [e.value for e in rewards] == pytest.approx([0.1, 0.2, 0.3])


def test_wandb_offline_run_records_config_and_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(["wandb"], "run-b", tmp_path, {"train": {"max_staleness": 2}})
    run = tracker.sinks[0][1]
    tracker.log({"train/loss": 1.5}, step=1)
    tracker.log({"train/loss": 0.75}, step=2)
    assert run.config["train"] == {"max_staleness": 2}
    assert run.summary["train/loss"] == 0.75
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*-run-b/run-run-b.wandb"))


def test_an_unknown_or_missing_tracker_fails_at_start(tmp_path):
    with pytest.raises(TrackingError, match="unknown tracker 'neptune'"):
        Tracker(["neptune"], "run-c", tmp_path, {})
    with pytest.raises(TrackingError, match="the mlflow package is not installed"):
        Tracker(["mlflow"], "run-c", tmp_path, {})


def test_flatten_config_for_trackers_that_take_flat_parameters():
    assert flatten({"train": {"lr": 1, "trackers": ["tensorboard"]}, "run_id": "x"}) == {
        "train.lr": 1, "train.trackers": "['tensorboard']", "run_id": "x"}
