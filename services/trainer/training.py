"""The trainer's work on one batch: train on it, checkpoint the new version, make the fleet serve it
(checking the servers' logprobs against the trainer's), then publish PolicyUpdated. main.py wires it
to the `batches` stream.

Trainer.train_step takes a batch through every step: select_fresh drops the samples older than eta
versions, optimize takes train.minibatches optimizer steps (services/trainer/ppo.py) on the backend
(services/trainer/backends/), save_checkpoint writes the training state, sync_with_retries reloads
every server and raises ParityError (a StopConsuming for main.py) when one serves other logprobs, and
PolicyUpdated goes out with the batch marked trained, in one transaction.

Tests: tests/integration/test_trainer_restart.py runs the trainer service (a few minutes).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.shared.contract.batches import BatchRow, read_batch
from rollstream.shared.contract.bus import Bus, StopConsuming
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.errors import RollstreamError
from rollstream.shared.inference.serving_weights import copy_tokenizer_files
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage, replace_dir
from rollstream.shared.runtime.tracking import Tracker

log = logging.getLogger("trainer")

PROBE_TOKENS = 256
SYNC_ATTEMPTS = 3


@dataclass
class TrainedStep:
    """A batch trained on and checkpointed, not yet served by the fleet."""

    version: int
    checkpoint: Path
    probe: list[int]
    trained: int
    dropped: dict[str, int]
    metrics: dict[str, float] = field(default_factory=dict)


class ParityError(RollstreamError, RuntimeError):
    """A server's logprobs after a weight sync do not match the trainer's."""


def select_fresh(rows: list[BatchRow], version: int, max_staleness: int) -> tuple[list[BatchRow], dict[str, int]]:
    """The rows the policy after `version` may learn from: none produced more than eta versions ago,
    by any of its turns. Returns them and the count left out per reason."""
    oldest_allowed = version - max_staleness
    fresh = [r for r in rows if r.min_policy_version >= oldest_allowed]
    return fresh, ({"stale": len(rows) - len(fresh)} if len(fresh) < len(rows) else {})


class Trainer:
    def __init__(self, settings: Settings, bus: Bus, storage: Storage) -> None:
        import torch

        from rollstream.services.trainer.backends.base import load_model
        from rollstream.services.trainer.backends.factory import make_backend

        self.torch = torch
        self.settings = settings
        self.bus = bus
        self.storage = storage
        last = bus.last("policy")
        self.version = last.event.version if last else 0
        start = Path(last.event.checkpoint_uri) if last else Path(settings.model.path)
        torch.manual_seed(settings.train.seed)
        self.backend = make_backend(settings.train, start)
        if last:
            self.backend.load_training_state(start)
        self.pad_id = self.backend.model.config.pad_token_id or 0
        self.reference = None
        if settings.train.kl_coef > 0:
            self.reference = load_model(Path(settings.model.path), self.backend.device).eval()
            self.reference.requires_grad_(False)
        self.tracker = Tracker(settings.train.trackers, settings.run_id, settings.run_dir(),
                               settings.model_dump(mode="json"))
        # One event loop for the trainer's life: the fleet client's connections belong to it.
        self.loop = asyncio.Runner()
        self.fleet = None
        if settings.fleet.urls:
            from rollstream.shared.inference.fleet import FleetClient

            self.fleet = FleetClient(settings.fleet.urls, model=settings.model.served_name,
                                     timeout_s=settings.fleet.request_timeout_s)
            for url in self.fleet.urls:
                bus.redis.hsetnx(bus.keys.fleet_versions, url, self.version)

    # ------------------------------------------------------------------------------------ train
    def train(self, batch: BatchReady) -> TrainedStep:
        started = time.monotonic()
        rows = read_batch(self.storage, batch.uri)
        fresh, dropped = select_fresh(rows, self.version, self.settings.train.max_staleness)
        metrics = self.optimize(fresh) if fresh else {}
        version = self.version + 1
        trained_time = time.monotonic()
        checkpoint = self.save_checkpoint(version)
        staleness = [self.version - r.min_policy_version for r in fresh]
        metrics.update({
            "train/step_seconds": trained_time - started,
            "train/checkpoint_seconds": time.monotonic() - trained_time,
            "samples/trained": len(fresh),
            "samples/dropped_stale": dropped.get("stale", 0),
            "samples/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "samples/staleness_max": max(staleness, default=0),
            "reward/batch_mean": batch.mean_reward,
        })
        return TrainedStep(version=version, checkpoint=checkpoint, probe=(fresh or rows)[0].tokens[:PROBE_TOKENS],
                           trained=len(fresh), dropped=dropped, metrics=metrics)

    def optimize(self, rows: list[BatchRow]) -> dict[str, float]:
        """train.minibatches optimizer steps over the rows; returns the averaged step metrics."""
        from rollstream.services.trainer.ppo import (
            make_micro_batches,
            merge_stats,
            policy_loss,
            split_minibatches,
            token_logprobs,
        )

        torch, cfg, backend = self.torch, self.settings.train, self.backend
        plan = [make_micro_batches(part, cfg.loss_aggregation, cfg.micro_batch_tokens, self.pad_id, backend.device)
                for part in split_minibatches(rows, cfg.minibatches)]
        with torch.no_grad():  # every minibatch is clipped against the policy before the first update
            for index, micros in enumerate(plan):
                for micro in micros:
                    # the first minibatch's own forward runs before any update: its detached logprobs are it
                    if cfg.decoupled and index > 0:
                        micro.prox_logprobs = token_logprobs(backend.model, micro)
                    if self.reference is not None:
                        micro.ref_logprobs = token_logprobs(self.reference, micro)
        per_step: list[dict[str, float]] = []
        for micros in plan:
            stats = []
            for micro in micros:
                logprobs = token_logprobs(backend.model, micro)
                if cfg.decoupled and micro.prox_logprobs is None:
                    micro.prox_logprobs = logprobs.detach()
                loss, micro_stats = policy_loss(logprobs, micro, clip_eps=cfg.clip_eps,
                                                decoupled=cfg.decoupled, importance_weight_cap=cfg.importance_weight_cap,
                                                kl_coef=cfg.kl_coef)
                backend.backward(loss)
                stats.append(micro_stats)
            merged = merge_stats(stats)
            merged["grad_norm"] = backend.step()
            merged["micro_batches"] = len(micros)
            per_step.append(merged)
        return {f"train/{key}": sum(step[key] for step in per_step) / len(per_step) for key in per_step[0]
                if key != "weight"}

    def save_checkpoint(self, version: int) -> Path:
        final = self.storage.local_path(self.settings.run_id, "checkpoints", f"v{version:05d}")
        temp = final.with_name(final.name + ".tmp")
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        self.backend.save(temp)
        copy_tokenizer_files(Path(self.settings.model.path), temp)
        replace_dir(temp, final)
        return final

    # ------------------------------------------------------------------------------------- sync
    def sync_with_retries(self, step: TrainedStep) -> float:
        """Make every server serve the new weights; the fleet must serve a policy before the next one
        is trained, so a sync that keeps failing stops the trainer (the batch stays pending)."""
        from rollstream.shared.inference.fleet import FleetRequestError, WeightSyncError

        if self.fleet is None:
            return 0.0
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            try:
                return self.loop.run(self.sync_fleet(step.checkpoint, step.probe))
            except (WeightSyncError, FleetRequestError, OSError) as exc:
                if attempt == SYNC_ATTEMPTS:
                    raise StopConsuming(f"weight sync of v{step.version} failed {attempt} times: {exc}") from exc
                log.warning("weight sync failed; retrying", extra={"attempt": attempt, "error": str(exc)})
                time.sleep(2 ** attempt)
            except ParityError as exc:
                raise StopConsuming(str(exc)) from exc
        raise AssertionError("unreachable")

    def trainer_logprobs(self, ids: list[int]) -> list[float]:
        from rollstream.services.trainer.ppo import sequence_logprobs

        with self.torch.no_grad():
            return sequence_logprobs(self.backend.model, ids)

    async def sync_fleet(self, checkpoint: Path, probe: list[int]) -> float:
        """Reload every server and check its probe logprobs; returns the worst difference."""
        assert self.fleet is not None
        expected = self.trainer_logprobs(probe)
        worst = 0.0
        for url in self.fleet.urls:
            await self.fleet.reload_weights(url, str(checkpoint))
            served = await self.fleet.prompt_logprobs(url, probe)
            diff = max(abs(a - b) for a, b in zip(served, expected, strict=True))
            if diff > self.settings.train.parity_tolerance:
                raise ParityError(f"{url}: prompt logprobs differ from the trainer's by {diff:.2e} after "
                                  f"loading {checkpoint} (tolerance {self.settings.train.parity_tolerance:g})")
            worst = max(worst, diff)
        return worst

    # ---------------------------------------------------------------------------------- publish
    def train_step(self, batch: BatchReady, trained_key: str) -> PolicyUpdated:
        step = self.train(batch)
        sync_started = time.monotonic()
        parity = self.sync_with_retries(step)
        step.metrics["sync/seconds"] = time.monotonic() - sync_started
        step.metrics["sync/parity_max_abs_diff"] = parity
        update = PolicyUpdated(version=step.version, checkpoint_uri=str(step.checkpoint), batch_id=batch.batch_id,
                               servers=list(self.fleet.urls) if self.fleet else [], parity_max_abs_diff=parity,
                               loss=step.metrics.get("train/loss", 0.0), trained_samples=step.trained,
                               dropped_stale=step.dropped.get("stale", 0), dropped=step.dropped, metrics=step.metrics)
        pipe = self.bus.redis.pipeline(transaction=True)
        self.bus.publish("policy", update, pipe=pipe, event_id=f"policy:v{update.version}")
        pipe.sadd(trained_key, batch.batch_id)
        for url in update.servers:
            pipe.hset(self.bus.keys.fleet_versions, url, update.version)
        pipe.execute()
        self.version = update.version
        self.tracker.log(step.metrics, update.version)
        return update

    def close(self) -> None:
        if self.fleet is not None:
            self.loop.run(self.fleet.aclose())
        self.loop.close()
        self.tracker.close()
