"""The trainer's work on one batch: train on it, checkpoint the new version, make the fleet serve it, then
publish PolicyUpdated. main.py wires it to the `batches` stream.

Trainer.train_step takes a batch through every step: load_batch reads the batch file the event announces,
train sorts the rows by role and leaves out those of no trained role, those no model could train on and those
older than eta versions of their role (services/trainer/batch_intake.py), then each role present trains on
its own rows: train.minibatches optimizer steps (services/trainer/optimizing.py, services/trainer/ppo.py) on
the backend (services/trainer/backends/), keeping the trainer's logprobs of each segment for the console
(services/trainer/segment_logprobs.py); save_checkpoint writes the training state, the fleet is made to
serve it and checked against the trainer's logprobs of a probe (services/trainer/fleet_sync.py), and
PolicyUpdated goes out with the batch marked trained and every role's version
(services/trainer/publishing.py, services/trainer/role_versions.py).

A full fine-tune (train.lora_rank 0) trains the whole model, its one role's version being the trainer's. A
LoRA run trains one adapter per trained role over the frozen base, each with an optimizer of its own (the
backend's use_role), its reference (a KL term) the base itself; a role's version grows only with a batch
that trained it. Each version of a role's adapter is written where the servers load it from, and the
fleet's sync makes every server serve every role's adapter at its version (the base never moves; see
services/trainer/adapter_fleet.py); a checkpoint (the adapters, their optimizer states, the roles' versions)
follows train.checkpoint_every, whatever the transport.
A step that fails after it may have changed the model puts back the state of the last published
version before the error goes on, so that a retry, or the next batch, starts from it; with several ranks the
whole group stops instead, and its launcher starts it again from that version.

With several ranks (services/trainer/ranks.py) the leader runs train_step and every other rank follow():
each trains its share of the micro-batches and writes its part of the checkpoint, and the leader alone syncs
and publishes.

Tests: tests/integration/test_trainer_restart.py runs the trainer service (a few minutes).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.services.trainer.adapter_fleet import AdapterFleet
from rollstream.services.trainer.batch_intake import (
    BatchRejected,
    is_stale,
    read_announced_batch,
    row_problem,
    take_rows,
)
from rollstream.services.trainer.fleet_sync import FleetSync
from rollstream.services.trainer.publishing import (
    TrainedStep,
    last_own_update,
    publish_update,
    record_checkpoint,
    record_published,
)
from rollstream.services.trainer.ranks import Command, Ranks
from rollstream.services.trainer.role_versions import (
    next_role_versions,
    role_versions_of,
    starting_role_versions,
    write_role_versions,
)
from rollstream.services.trainer.segment_logprobs import SegmentLogprobs, record_logprobs
from rollstream.shared.contract.batches import BatchRow
from rollstream.shared.contract.bus import Bus, StopConsuming
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.inference.serving_weights import copy_tokenizer_files
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage, replace_dir
from rollstream.shared.runtime.tracking import Tracker

if TYPE_CHECKING:
    from rollstream.shared.inference.weight_transport import Weights

__all__ = ["BatchRejected", "Trainer", "is_stale", "last_own_update", "row_problem"]
"""Trainer, and the names main.py, the vLLM launcher's resume and the chaos audit import from here."""

log = logging.getLogger("trainer")

PROBE_TOKENS = 256


class Trainer(AdapterFleet):
    """One rank of the trainer. `start` is the PolicyUpdated to resume from (None: the starting model); the
    leader (ranks.leader) alone has the bus and the fleet, syncs and publishes (services/trainer/ranks.py)."""

    def __init__(self, settings: Settings, storage: Storage, start: PolicyUpdated | None,
                 bus: Bus | None = None, ranks: Ranks = Ranks(),
                 replay: Sequence[tuple[BatchReady, list[BatchRow]]] = ()) -> None:
        import torch

        from rollstream.services.trainer.backends.base import load_model

        self.torch = torch
        self.settings = settings
        self.roles = RunRoles.of(settings)
        self.bus = bus
        self.storage = storage
        self.ranks = ranks
        self.version = start.version if start else 0
        self.checkpoint = Path(start.checkpoint_uri) if start else None
        """The newest training state on disk, of version self.checkpoint_version; None: the starting model."""
        self.checkpoint_version = self.version
        self.role_versions = starting_role_versions(start, self.checkpoint, self.roles)
        """Every trained role's published version."""
        self.load_state()
        config = self.backend.model.config
        self.pad_id = config.pad_token_id or 0
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.probes = {role: list(range(1, 17)) for role in self.roles.trained}
        """Token ids the fleet's logprobs of each role are checked on after a sync: the last batch's first
        usable row of the role, so a batch with none (every row left out) is checked on the one before."""
        self.reference = None
        if settings.train.kl_coef > 0 and not self.roles.lora:  # a LoRA run's reference is its base
            self.reference = load_model(Path(settings.model.path), self.backend.device).eval()
            self.reference.requires_grad_(False)
        self.tracker = (Tracker(settings.train.trackers, settings.run_id, settings.run_dir(),
                                settings.model_dump(mode="json")) if ranks.leader else None)
        if replay:
            self.replay(replay)
        self.fleet: FleetSync | None = None
        if self.roles.lora:
            self.start_adapters()
            return
        # what every rank takes part in before the leader's first sync (a forward, ZeRO-3's gather)
        start = self.sync_payload() if settings.fleet.has_policy_servers else None
        if start is not None and ranks.leader:
            assert bus is not None, "the leading rank publishes: it needs the bus"
            self.fleet = FleetSync(settings)
            for url in self.fleet.urls:
                bus.redis.hsetnx(FLEET_VERSIONS.key(bus.keys), url, self.version)
            self.take_over_fleet(*start)

    @property
    def probe(self) -> list[int]:
        """A full fine-tune's probe: its one role's."""
        return self.probes[self.roles.default]

    def sync_payload(self) -> tuple[list[float], Weights | None]:
        """The trainer's logprobs of the probe, and with a collective transport its weights: what a sync of
        the current model needs, computed with every rank."""
        collective = self.settings.train.weight_transport == "collective"
        return self.trainer_logprobs(self.probe), self.backend.serving_weights() if collective else None

    def take_over_fleet(self, expected: list[float], weights: Weights | None) -> None:
        """A starting trainer's first word to the fleet. With a collective transport: a sync of the version it
        starts from, which forms the group, sets the base of the next delta, and makes whole and resumes a
        server that a trainer killed in the middle of a broadcast left paused half-loaded. With the disk
        transport: servers left paused are resumed."""
        from rollstream.shared.inference.weight_transport import WeightUpdate

        assert self.fleet is not None and self.bus is not None
        if weights is None:
            self.fleet.resume_left_paused()
            return
        _, servers = self.fleet.sync(WeightUpdate(self.version, weights=weights), self.probe, expected)
        for url in servers:
            self.bus.redis.hset(FLEET_VERSIONS.key(self.bus.keys), url, self.version)

    def replay(self, batches: Sequence[tuple[BatchReady, list[BatchRow]]]) -> None:
        """Train again, in order, the batches published after the newest checkpoint (train.checkpoint_every
        > 1, or a stop before it was written), and checkpoint the version they lead to: the state a restart
        resumes from is then exactly the last published one. Nothing is synced or published again."""
        for batch, rows in batches:
            step = self.train(batch, rows, for_sync=False)
            self.version, self.role_versions = step.version, step.role_versions
            log.info("replayed a published version", extra={"version": self.version,
                                                            "batch_id": batch.batch_id})
        self.checkpoint = self.save_checkpoint(self.version)
        self.checkpoint_version = self.version

    def load_state(self) -> None:
        """The backend at the newest checkpoint's version: weights (a LoRA run's adapters over the base),
        optimizer and RNG state."""
        from rollstream.services.trainer.backends.factory import make_backend

        self.torch.manual_seed(self.settings.train.seed)
        model = Path(self.settings.model.path)
        if self.checkpoint is not None and not self.roles.lora:  # a full fine-tune's checkpoint is a model
            model = self.checkpoint
        self.backend = make_backend(self.settings.train, model, self.roles.adapters)
        if self.checkpoint is not None:
            self.backend.load_training_state(self.checkpoint)

    # ------------------------------------------------------------------------------------ train
    def load_batch(self, batch: BatchReady) -> list[BatchRow]:
        """The batch's rows; BatchRejected when its file cannot be read or is not the batch announced."""
        return read_announced_batch(self.storage, batch)

    def train(self, batch: BatchReady, rows: list[BatchRow], for_sync: bool = True) -> TrainedStep:
        """One version from a batch; for_sync: with what its sync needs (the probes' logprobs, the weights or
        the trained adapters), which a version trained again at a restart (replay) is not synced with."""
        started = time.monotonic()
        cfg = self.settings.train
        intake = take_rows(rows, self.roles, self.role_versions, self.vocab_size, self.max_positions,
                           cfg.max_staleness)
        before: SegmentLogprobs = {}
        metrics, trained = self.optimize_roles(intake.fresh, before)
        fresh = [row for role_rows in intake.fresh.values() for row in role_rows]
        if before and self.ranks.leader:
            metrics["train/logprob_gap_abs_mean"] = record_logprobs(
                self.storage, self.settings.run_id, batch.batch_id, self.version, fresh, before)
        staleness = [self.role_versions[role] - row.min_policy_version
                     for role, role_rows in intake.fresh.items() for row in role_rows]
        metrics.update({
            "train/step_seconds": time.monotonic() - started,
            "samples/trained": len(fresh),
            "samples/dropped_stale": intake.dropped.get("stale", 0),
            "samples/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "samples/staleness_max": max(staleness, default=0),
            "reward/batch_mean": batch.mean_reward,
        })
        if len(self.roles.trained) > 1:
            metrics.update({f"samples/{role}/trained": len(role_rows)
                            for role, role_rows in intake.fresh.items()})
        for role, usable in intake.usable.items():
            if intake.fresh[role] or usable:
                self.probes[role] = (intake.fresh[role] or usable)[0].tokens[:PROBE_TOKENS]
        # a LoRA step syncs each adapter on its own probe (step.probes); its default role may be frozen
        step = TrainedStep(version=self.version + 1, probe=[] if self.roles.lora else self.probe,
                           trained=len(fresh),
                           dropped=intake.dropped, expected=[], metrics=metrics, staleness=staleness,
                           probes=dict(self.probes),
                           role_versions=next_role_versions(self.role_versions, trained, self.roles,
                                                            self.version + 1))
        if for_sync:
            # the leader's parity check, and the weights a collective sync sends or the adapters written for
            # the servers: what every rank takes part in (ZeRO-3 gathers the weights for them)
            self.add_sync_payload(step, trained)
        return step

    def add_sync_payload(self, step: TrainedStep, trained: list[str]) -> None:
        """What the step's sync needs, computed with every rank: the probes' logprobs (with a fleet), and the
        weights of a collective sync or the trained roles' adapters."""
        with_fleet = self.settings.fleet.has_policy_servers
        if self.roles.lora:
            step.role_expected = self.adapters_logprobs() if with_fleet else {}
            step.adapter_states = self.adapter_states(trained)
        elif with_fleet:
            step.expected, step.weights = self.sync_payload()

    def optimize_roles(self, fresh: dict[str, list[BatchRow]],
                       logprobs_before: SegmentLogprobs) -> tuple[dict[str, float], list[str]]:
        """Train each role on its own fresh rows, in the run's order of its roles (every rank's); returns the
        step metrics (averaged over every optimizer step, and per role where the run has several) and the
        roles trained: those with a sampled token."""
        from rollstream.services.trainer.optimizing import mean_stats

        steps: list[dict[str, float]] = []
        metrics: dict[str, float] = {}
        trained = []
        for role, rows in fresh.items():
            # rows without a sampled token weigh nothing; a role with only such rows has no loss to step on
            if not any(any(row.loss_mask) for row in rows):
                continue
            if self.roles.lora:
                self.backend.use_role(role)
            role_steps = self.optimizer_steps(rows, logprobs_before)
            trained.append(role)
            steps += role_steps
            if len(self.roles.trained) > 1:
                metrics.update(mean_stats(role_steps, f"train/{role}/"))
        metrics.update(mean_stats(steps, "train/"))
        return metrics, trained

    def optimize(self, rows: list[BatchRow],
                 logprobs_before: SegmentLogprobs | None = None) -> dict[str, float]:
        """train.minibatches optimizer steps over the rows (of the backend's active role); returns the
        averaged step metrics (on the leader)."""
        from rollstream.services.trainer.optimizing import mean_stats

        return mean_stats(self.optimizer_steps(rows, logprobs_before), "train/")

    def optimizer_steps(self, rows: list[BatchRow],
                        logprobs_before: SegmentLogprobs | None = None) -> list[dict[str, float]]:
        from rollstream.services.trainer.optimizing import optimizer_steps

        reference = self.reference_logprobs if self.settings.train.kl_coef > 0 else None
        return optimizer_steps(self.backend, self.settings.train, self.ranks, self.pad_id, rows, reference,
                               logprobs_before)

    def reference_logprobs(self, micro) -> object:
        """The reference model's logprobs of a micro-batch (without gradient): the starting model's, or in a
        LoRA run the base's (the model with its adapters disabled)."""
        from rollstream.services.trainer.ppo import token_logprobs

        with self.torch.no_grad():
            if self.roles.lora:
                with self.backend.base_model() as base:
                    return token_logprobs(base, micro)
            return token_logprobs(self.reference, micro)

    def checkpoint_dir(self, version: int) -> Path:
        return self.storage.local_path(self.settings.run_id, "checkpoints", f"v{version:05d}")

    def save_checkpoint(self, version: int, role_versions: dict[str, int] | None = None) -> Path:
        """Write the training state of `version` (with its roles' versions: the published ones unless given):
        every rank its part, the leader the files the fleet loads."""
        final = self.checkpoint_dir(version)
        temp = final.with_name(final.name + ".tmp")
        if self.ranks.leader:
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir(parents=True)
        self.ranks.barrier()
        self.backend.save(temp)
        if self.ranks.leader:
            if self.roles.lora:  # the base is model.path: only the adapters are the run's
                write_role_versions(temp, role_versions or self.role_versions)
            else:
                copy_tokenizer_files(Path(self.settings.model.path), temp)
            replace_dir(temp, final)
        return final

    def trainer_logprobs(self, ids: list[int]) -> list[float]:
        """The model's logprobs of a token sequence: what the fleet must serve of the probe after a sync."""
        from rollstream.services.trainer.ppo import sequence_logprobs

        with self.torch.no_grad():
            return sequence_logprobs(self.backend.model, ids)

    # ---------------------------------------------------------------------------------- publish
    def train_step(self, batch: BatchReady, trained_key: str,
                   still_held: Callable[[], bool] = lambda: True) -> PolicyUpdated:
        """Train on one batch (with every rank), sync the fleet and publish the version, unless `still_held()`
        says this trainer lost the run to another one meanwhile (StopConsuming: the batch stays pending for
        the holder). The leader's work: the other ranks follow() it."""
        rows = self.load_batch(batch)
        self.ranks.share(Command("train", (batch, rows)))
        try:
            step = self.train(batch, rows)
        except Exception as exc:
            if self.ranks.world_size > 1:
                # the other ranks are somewhere in the same step: the launcher starts the group again, from
                # the published version
                raise StopConsuming(f"rank 0 failed training on batch {batch.batch_id}: {exc}") from exc
            # The optimizer may have stepped already: a retry of this batch (or the next batch) must
            # start from the published version, not from a half-trained model.
            self.back_to_published(f"training on batch {batch.batch_id} failed: {exc}")
            raise
        try:
            update = self.sync_and_publish(batch, step, trained_key, still_held)
        except Exception as exc:
            self.ranks.share(Command("stop", f"v{step.version} was not published: {exc}"))
            if self.ranks.world_size > 1 and not isinstance(exc, StopConsuming):
                # the other ranks have stopped: a retry needs the whole group again
                raise StopConsuming(f"v{step.version} was not published: {exc}") from exc
            if not isinstance(exc, StopConsuming):  # a retry starts from the published version
                self.back_to_published(f"v{step.version} was not published: {exc}")
            raise
        self.ranks.share(Command("published", update))
        if self.checkpoint_due_after_publish(update.version):
            record_checkpoint(self.save_published_checkpoint())
        return update

    def back_to_published(self, why: str) -> None:
        """Put back the state of the published version: from its checkpoint, or, when it has none (train.
        checkpoint_every), by a restart that replays the versions since the newest one."""
        if self.checkpoint_version != self.version:
            raise StopConsuming(f"{why}; v{self.version} has no checkpoint: a restart replays it")
        log.warning("back to the state of the published version", extra={"version": self.version,
                                                                          "why": why}, exc_info=True)
        self.load_state()

    @property
    def checkpoint_before_sync(self) -> bool:
        """Whether every version is checkpointed before its sync: the servers load it from there (disk). A
        LoRA run's servers load the adapters, which are written for them anyway."""
        train = self.settings.train
        return self.settings.fleet.has_policy_servers and train.weight_transport == "disk" and not train.lora

    def checkpoint_due_after_publish(self, version: int) -> bool:
        """Whether `version` is checkpointed once published: every train.checkpoint_every-th version, unless
        every version was checkpointed before its sync."""
        return not self.checkpoint_before_sync and version % self.settings.train.checkpoint_every == 0

    def checkpoint_on_stop(self) -> None:
        """A clean stop leaves the published version's training state on disk (with every rank)."""
        if self.checkpoint_version != self.version:
            self.ranks.share(Command("checkpoint"))
            self.save_published_checkpoint()

    def save_published_checkpoint(self) -> float:
        """The training state of the published version, written now (every rank its part); its seconds."""
        started = time.monotonic()
        self.checkpoint = self.save_checkpoint(self.version)
        self.checkpoint_version = self.version
        return time.monotonic() - started

    def sync_and_publish(self, batch: BatchReady, step: TrainedStep, trained_key: str,
                         still_held: Callable[[], bool]) -> PolicyUpdated:
        """Make the fleet serve the step's version, then publish it. A disk sync needs the version's
        checkpoint first, a LoRA sync the trained adapters written for the servers; otherwise the checkpoint
        is written once the version is published, every train.checkpoint_every versions (train_step), off the
        fleet's way."""
        if not still_held():
            raise StopConsuming(f"another trainer holds the run's lock: v{step.version} is not synced")
        if self.checkpoint_before_sync:
            started = time.monotonic()
            self.save_checkpoint(step.version, step.role_versions)
            step.metrics["train/checkpoint_seconds"] = time.monotonic() - started
        if self.roles.lora:
            self.write_adapters(step.adapter_states, step.role_versions)
            self.sync_adapters(step)
        else:
            self.sync_fleet(step)
        if not still_held():
            raise StopConsuming(f"another trainer holds the run's lock: v{step.version} is not published")
        assert self.bus is not None and self.tracker is not None
        update = PolicyUpdated(version=step.version, checkpoint_uri=str(self.checkpoint_dir(step.version)),
                               batch_id=batch.batch_id, servers=step.servers,
                               parity_max_abs_diff=step.metrics["sync/parity_max_abs_diff"],
                               loss=step.metrics.get("train/loss", 0.0), trained_samples=step.trained,
                               dropped=step.dropped, metrics=step.metrics, role_versions=step.role_versions)
        publish_update(self.bus, update, trained_key, self.roles.adapters)
        self.version, self.role_versions = update.version, dict(step.role_versions)
        if self.checkpoint_before_sync:
            self.checkpoint, self.checkpoint_version = Path(update.checkpoint_uri), update.version
        self.tracker.log(step.metrics, update.version)
        record_published(step)
        return update

    def sync_fleet(self, step: TrainedStep) -> None:
        """Every server serving the step's version, by the run's transport; its figures in the metrics."""
        from rollstream.shared.inference.weight_transport import WeightUpdate

        started = time.monotonic()
        parity = 0.0
        if self.fleet is not None:  # a fleet-less run only writes checkpoints
            update = WeightUpdate(step.version, checkpoint=self.checkpoint_dir(step.version),
                                  weights=step.weights)
            parity, step.servers = self.fleet.sync(update, step.probe, step.expected)
            report = self.fleet.last_push
            if report is not None:
                step.metrics.update({"sync/bytes": report.bytes_sent, "sync/paused_seconds": report.paused_s,
                                     "sync/delta": float(report.kind == "delta")})
                if report.changed_fraction is not None:
                    step.metrics["sync/changed_fraction"] = report.changed_fraction
        step.metrics["sync/seconds"] = time.monotonic() - started
        step.metrics["sync/parity_max_abs_diff"] = parity

    def follow(self) -> str:
        """A rank other than the leader: train on the batches the leader hands out, in step with it, until it
        says stop; returns why it did."""
        while True:
            command = self.ranks.share()
            if command.kind == "train":
                batch, rows = command.payload
                step = self.train(batch, rows)
                if self.checkpoint_before_sync:
                    self.save_checkpoint(step.version, step.role_versions)  # in step with the leader's
                command = self.ranks.share()
                if command.kind == "published":
                    self.version = command.payload.version
                    self.role_versions = role_versions_of(command.payload, self.roles)
                    if self.checkpoint_due_after_publish(self.version):
                        self.save_published_checkpoint()  # in step with the leader's
            if command.kind == "checkpoint":
                self.save_published_checkpoint()
            if command.kind == "stop":
                return command.payload

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        if self.tracker is not None:
            self.tracker.close()
