"""The trainer's work on one batch: train on it, checkpoint the new version, make the fleet serve it
(checking the servers' logprobs against the trainer's), then publish PolicyUpdated. main.py wires it
to the `batches` stream.

Trainer.train_step takes a batch through every step: load_batch reads the batch file and checks that
it is the batch the event announces (BatchRejected otherwise: that entry's failure, retried and then
dead-lettered, while the trainer goes on), check_rows leaves out the rows no model could train on
(token ids outside the vocabulary, longer than the model's positions, misaligned, non-finite or from
a policy version not published yet: dropped as `invalid`, counted), select_fresh drops the samples
older than eta versions, optimize takes train.minibatches optimizer steps (services/trainer/ppo.py)
on the backend (services/trainer/backends/), save_checkpoint writes the training state,
sync_with_retries waits for every server to answer (one restarting is waited for, up to FLEET_WAIT_S),
tries a failed sync again for SYNC_RETRY_S (a server shutting down refuses /pause before it stops
answering), reloads every server and raises ParityError (a StopConsuming for main.py) when one
serves other logprobs, and PolicyUpdated goes out with the batch marked trained, in one transaction.
A step that fails after it may have changed the model puts back the state of the last published
version before the error goes on, so that a retry, or the next batch, starts from it; with several ranks the
whole group stops instead, and its launcher starts it again from that version.

With several ranks (services/trainer/ranks.py) the leader runs train_step and every other rank follow():
each trains its share of the micro-batches and writes its part of the checkpoint, and the leader alone syncs
and publishes.

Tests: tests/integration/test_trainer_restart.py runs the trainer service (a few minutes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from rollstream.services.trainer.ranks import Command, Ranks
from rollstream.shared.contract.batches import (
    BatchRow,
    TrainerLogprobs,
    read_batch,
    write_trainer_logprobs,
)
from rollstream.shared.contract.bus import Bus, StopConsuming
from rollstream.shared.contract.events import BatchReady, PolicyUpdated, decode
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.errors import RollstreamError
from rollstream.shared.inference.serving_weights import copy_tokenizer_files
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage, replace_dir
from rollstream.shared.runtime.tracking import Tracker

log = logging.getLogger("trainer")

POLICY_VERSION = Gauge("rollstream_trainer_policy_version", "The policy version this trainer last published.")
PHASE_SECONDS = Histogram("rollstream_trainer_phase_seconds",
                          "Time of each phase of a version: train (the optimizer steps over a batch), "
                          "checkpoint, sync (every fleet server serving it).", ["phase"],
                          buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900))
STEP_STATS = Gauge("rollstream_trainer_step_stat",
                   "The last version's training statistics, averaged over its optimizer steps: loss, "
                   "pg_loss, kl, ratio_mean, clip_fraction, importance_weight_mean, importance_weight_max, "
                   "capped_fraction, grad_norm, tokens, micro_batches, logprob_gap_abs_mean (the trainer's "
                   "logprobs against the rollout's).", ["stat"])
SAMPLES = Counter("rollstream_trainer_samples_total",
                  "Batch samples by what the trainer did with them: trained, or dropped as stale or invalid.",
                  ["outcome"])
STALENESS = Histogram("rollstream_trainer_sample_staleness_versions",
                      "Versions between the policy a trained sample was generated with and the one it "
                      "trains.",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16))
PARITY = Gauge("rollstream_trainer_sync_parity_max_abs_diff",
               "Largest gap between a fleet server's and the trainer's logprobs of the probe after the last "
               "sync.")

PROBE_TOKENS = 256
SYNC_RETRY_S = 120.0
"""How long a weight sync that fails is tried again (with back-off) before the trainer stops: long
enough to outlast a vLLM server's graceful shutdown (it answers /health but refuses /pause for up to its
grace period, then stops answering and is waited for as restarting)."""
SYNC_BACKOFF_MAX_S = 10.0
FLEET_WAIT_S = 600.0
FLEET_RECHECK_S = 2.0
POLICY_PAGE = 64
"""Entries of `policy` read at a time while looking for the trainer's own last update."""


@dataclass
class TrainedStep:
    """A batch trained on and checkpointed, not yet served by the fleet."""

    version: int
    checkpoint: Path
    probe: list[int]
    trained: int
    dropped: dict[str, int]
    expected: list[float]
    """The trainer's own logprobs of the probe, which every server must serve after the sync."""
    metrics: dict[str, float] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    """Of each trained sample: versions between the policy that generated it and the one it trained."""


class ParityError(RollstreamError, RuntimeError):
    """A server's logprobs after a weight sync do not match the trainer's."""


class BatchRejected(RollstreamError, ValueError):
    """A BatchReady the trainer cannot train on: its file cannot be read, or is not the batch the event
    announces. The entry's failure, never the trainer's: `retryable` ones (the file could not be read)
    are retried and then dead-lettered, the others are dead-lettered at once."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def row_problem(row: BatchRow, vocab_size: int, max_positions: int | None, version: int) -> str | None:
    """Why no model could train on this row, or None. A row comes from a decoded, validated segment,
    so any of these means the file was not written by the reward service from such segments."""
    n = len(row.tokens)
    if not n or len(row.loss_mask) != n or len(row.rollout_logprobs) != n:
        return (f"tokens ({n}), loss_mask ({len(row.loss_mask)}) and rollout_logprobs "
                f"({len(row.rollout_logprobs)}) differ")
    if max_positions is not None and n > max_positions:
        return f"{n} tokens, the model has {max_positions} positions"
    if min(row.tokens) < 0 or max(row.tokens) >= vocab_size:
        return f"token ids {min(row.tokens)}..{max(row.tokens)} outside the vocabulary (0..{vocab_size - 1})"
    if not set(row.loss_mask) <= {0, 1}:
        return f"loss_mask holds {sorted(set(row.loss_mask) - {0, 1})}, not only 0 and 1"
    if not all(map(math.isfinite, (row.reward, row.advantage, *row.rollout_logprobs))):
        return "reward, advantage or a logprob is not finite"
    if any(v < 0 or v > version for v in row.turn_policy_versions):
        return f"turn policy versions {row.turn_policy_versions}: the latest published is {version}"
    return None


def last_own_update(bus: Bus, trained_key: str, storage_uri: str | None = None) -> PolicyUpdated | None:
    """The newest PolicyUpdated this run's trainer published: its batch is in the trained set, which the
    trainer adds to in the same transaction. A PolicyUpdated anyone else wrote on `policy` (its batch
    never trained here) is passed over, as are entries that do not decode. The recorder trims `policy`
    down to its newest entry: what is not on the stream any more is looked for in the run's archive."""

    def own(fields: dict) -> PolicyUpdated | None:
        try:
            event = decode(fields).payload
        except ValueError:
            return None
        if isinstance(event, PolicyUpdated) and bus.redis.sismember(trained_key, event.batch_id):
            return event
        return None

    key, end = bus.keys.stream("policy"), "+"
    while True:
        page = bus.redis.xrevrange(key, max=end, count=POLICY_PAGE)
        for _, fields in page:
            if (found := own(fields)) is not None:
                return found
        if len(page) < POLICY_PAGE:
            break
        end = f"({page[-1][0].decode()}"
    if storage_uri is None:
        return None
    from rollstream.shared.contract.archive import ArchiveReader

    found = None
    for entry in ArchiveReader(storage_uri, bus.keys.run_id).entries("policy"):
        found = own(entry.fields) or found
    return found


def is_stale(row: BatchRow, version: int, max_staleness: int) -> bool:
    """Whether the policy after `version` may not learn from `row`: a turn of it was produced more than eta
    (max_staleness) versions ago."""
    return row.min_policy_version < version - max_staleness


def select_fresh(rows: list[BatchRow], version: int,
                 max_staleness: int) -> tuple[list[BatchRow], dict[str, int]]:
    """The rows the policy after `version` may learn from (none is_stale). Returns them and the count left
    out per reason."""
    fresh = [r for r in rows if not is_stale(r, version, max_staleness)]
    return fresh, ({"stale": len(rows) - len(fresh)} if len(fresh) < len(rows) else {})


class Trainer:
    """One rank of the trainer. `start` is the PolicyUpdated to resume from (None: the starting model); the
    leader (ranks.leader) alone has the bus and the fleet, syncs and publishes (services/trainer/ranks.py)."""

    def __init__(self, settings: Settings, storage: Storage, start: PolicyUpdated | None,
                 bus: Bus | None = None, ranks: Ranks = Ranks()) -> None:
        import torch

        from rollstream.services.trainer.backends.base import load_model

        self.torch = torch
        self.settings = settings
        self.bus = bus
        self.storage = storage
        self.ranks = ranks
        self.version = start.version if start else 0
        self.checkpoint = Path(start.checkpoint_uri) if start else None
        """The training state of self.version; None: the starting model."""
        self.load_state()
        config = self.backend.model.config
        self.pad_id = config.pad_token_id or 0
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.probe = list(range(1, 17))
        """Token ids the fleet's logprobs are checked on after a sync: the last batch's first usable row,
        so a batch with none (every row left out) is checked on the one before."""
        self.reference = None
        if settings.train.kl_coef > 0:
            self.reference = load_model(Path(settings.model.path), self.backend.device).eval()
            self.reference.requires_grad_(False)
        self.tracker = (Tracker(settings.train.trackers, settings.run_id, settings.run_dir(),
                                settings.model_dump(mode="json")) if ranks.leader else None)
        # One event loop for the trainer's life: the fleet client's connections belong to it.
        self.loop = asyncio.Runner()
        self.fleet = None
        if settings.policy_servers() and ranks.leader:
            assert bus is not None, "the leading rank publishes: it needs the bus"
            from rollstream.shared.inference.fleet import FleetClient

            self.fleet = FleetClient.for_run(settings)
            for url in self.fleet.urls:
                bus.redis.hsetnx(FLEET_VERSIONS.key(bus.keys), url, self.version)

    def load_state(self) -> None:
        """The backend at the published version self.version: weights, optimizer and RNG state."""
        from rollstream.services.trainer.backends.factory import make_backend

        self.torch.manual_seed(self.settings.train.seed)
        self.backend = make_backend(self.settings.train, self.checkpoint or Path(self.settings.model.path))
        if self.checkpoint is not None:
            self.backend.load_training_state(self.checkpoint)

    # ------------------------------------------------------------------------------------ train
    def load_batch(self, batch: BatchReady) -> list[BatchRow]:
        """The batch's rows; BatchRejected when its file cannot be read or is not the batch announced."""
        if Path(batch.uri).name != f"{batch.batch_id}.parquet":
            # The reward service names every batch file after its batch id: anything else is another
            # batch (trained under its own id) or no batch at all.
            raise BatchRejected(f"batch {batch.batch_id} announces {batch.uri}, which is not its file",
                                retryable=False)
        try:
            rows = read_batch(self.storage, batch.uri)
        except Exception as exc:  # missing, unreadable, not Parquet, another schema: whatever the file is
            raise BatchRejected(f"batch {batch.batch_id}: cannot read {batch.uri}: "
                                f"{type(exc).__name__}: {exc}", retryable=True) from exc
        groups = {row.group_id for row in rows}
        if len(rows) != batch.sample_count or groups != set(batch.group_ids):
            raise BatchRejected(f"batch {batch.batch_id}: {batch.uri} holds {len(rows)} rows of groups "
                                f"{sorted(groups)[:4]}, the event announces {batch.sample_count} of "
                                f"{sorted(batch.group_ids)[:4]}", retryable=False)
        return rows

    def check_rows(self, rows: list[BatchRow]) -> tuple[list[BatchRow], int]:
        """The rows a model can train on, and how many were left out (each logged with its problem)."""
        usable = []
        for row in rows:
            problem = row_problem(row, self.vocab_size, self.max_positions, self.version)
            if problem is None:
                usable.append(row)
            else:
                log.warning("batch row left out", extra={"rollout_id": row.rollout_id,
                                                         "segment_index": row.segment_index,
                                                         "problem": problem})
        return usable, len(rows) - len(usable)

    def train(self, batch: BatchReady, rows: list[BatchRow]) -> TrainedStep:
        started = time.monotonic()
        usable, invalid = self.check_rows(rows)
        fresh, dropped = select_fresh(usable, self.version, self.settings.train.max_staleness)
        if invalid:
            dropped["invalid"] = invalid
        # rows without a sampled token weigh nothing; a batch of only such rows has no loss to step on
        before: dict[tuple[str, int], list[float]] = {}
        metrics = self.optimize(fresh, before) if any(any(row.loss_mask) for row in fresh) else {}
        if before and self.ranks.leader:
            metrics["train/logprob_gap_abs_mean"] = self.record_logprobs(batch, fresh, before)
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
        if fresh or usable:
            self.probe = (fresh or usable)[0].tokens[:PROBE_TOKENS]
        # the leader's parity check: a forward every rank takes part in (ZeRO-3 gathers the weights for it)
        expected = self.trainer_logprobs(self.probe) if self.settings.policy_servers() else []
        return TrainedStep(version=version, checkpoint=checkpoint, probe=self.probe, trained=len(fresh),
                           dropped=dropped, expected=expected, metrics=metrics, staleness=staleness)

    def optimize(self, rows: list[BatchRow], logprobs_before: dict[tuple[str, int], list[float]] | None = None
                 ) -> dict[str, float]:
        """train.minibatches optimizer steps over the rows; returns the averaged step metrics.
        logprobs_before, on the leader: filled with the trainer's logprobs of each segment (rollout id,
        segment index) before the batch's first update, where it computes them anyway (every minibatch with
        decoupled PPO, else the first)."""
        from rollstream.services.trainer.ppo import (
            make_micro_batches,
            merge_stats,
            policy_loss,
            split_minibatches,
            token_logprobs,
        )

        cfg, backend = self.settings.train, self.backend
        # each rank runs its share of every minibatch's micro-batches; only the real ones count in the stats
        parts = split_minibatches(rows, cfg.minibatches)
        plan = [self.ranks.own_share(make_micro_batches(part, cfg.loss_aggregation, cfg.micro_batch_tokens,
                                                        self.pad_id, backend.device))
                for part in parts]
        before: dict[tuple[str, int], list[float]] = {}
        self.score_before_update(plan, parts, before)
        per_step: list[dict[str, float]] = []
        for index, (micros, real) in enumerate(plan):
            stats = []
            for micro in micros:
                logprobs = token_logprobs(backend.model, micro)
                if index == 0:
                    keep_logprobs(before, parts[0], micro, logprobs.detach())
                if cfg.decoupled and micro.prox_logprobs is None:
                    micro.prox_logprobs = logprobs.detach()
                loss, micro_stats = policy_loss(logprobs, micro, clip_eps=cfg.clip_eps,
                                                decoupled=cfg.decoupled,
                                                importance_weight_cap=cfg.importance_weight_cap,
                                                kl_coef=cfg.kl_coef)
                backend.backward(loss)
                stats.append(micro_stats)
            every_rank = [s for rank_stats in self.ranks.gather(stats[:real]) for s in rank_stats]
            grad_norm = backend.step()
            if self.ranks.leader:
                per_step.append({**merge_stats(every_rank), "grad_norm": grad_norm,
                                 "micro_batches": len(every_rank)})
        for rank_before in self.ranks.gather(before):
            if logprobs_before is not None:
                logprobs_before.update(rank_before)
        if not per_step:  # a rank that leads nothing reports nothing
            return {}
        return {f"train/{key}": sum(step[key] for step in per_step) / len(per_step) for key in per_step[0]
                if key != "weight"}

    def score_before_update(self, plan: list[tuple[list, int]], parts: list[list[BatchRow]],
                            before: dict[tuple[str, int], list[float]]) -> None:
        """Set, on each micro-batch of the plan, the logprobs its loss compares with that must come before
        the batch's first update: the proximal ones (decoupled PPO, kept in `before`) and the reference
        model's (with a KL term)."""
        from rollstream.services.trainer.ppo import token_logprobs

        cfg, backend = self.settings.train, self.backend
        with self.torch.no_grad():  # every minibatch is clipped against the policy before the first update
            for index, (micros, _) in enumerate(plan):
                for micro in micros:
                    # the first minibatch's own forward runs before any update: its detached logprobs are it
                    if cfg.decoupled and index > 0:
                        micro.prox_logprobs = token_logprobs(backend.model, micro)
                        keep_logprobs(before, parts[index], micro, micro.prox_logprobs)
                    if self.reference is not None:
                        micro.ref_logprobs = token_logprobs(self.reference, micro)

    def record_logprobs(self, batch: BatchReady, rows: list[BatchRow],
                        before: dict[tuple[str, int], list[float]]) -> float:
        """Write the trainer's logprobs of the batch's segments beside the batch (for the console); returns
        the mean gap between them and the rollout's over the sampled tokens."""
        records = [TrainerLogprobs(rollout_id=rollout, segment_index=segment, policy_version=self.version,
                                   logprobs=values) for (rollout, segment), values in sorted(before.items())]
        write_trainer_logprobs(self.storage, self.settings.run_id, batch.batch_id, records)
        gaps = []
        for row in rows:
            mine = before.get((row.rollout_id, row.segment_index))
            if mine is not None:
                # a sample's first token has no trainer logprob (nothing to condition on)
                pairs = list(zip(mine, row.rollout_logprobs, row.loss_mask))[1:]
                gaps += [abs(a - b) for a, b, sampled in pairs if sampled]
        return sum(gaps) / len(gaps) if gaps else 0.0

    def save_checkpoint(self, version: int) -> Path:
        """Write the training state of `version`: every rank its part, the leader the files the fleet
        loads."""
        final = self.storage.local_path(self.settings.run_id, "checkpoints", f"v{version:05d}")
        temp = final.with_name(final.name + ".tmp")
        if self.ranks.leader:
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir(parents=True)
        self.ranks.barrier()
        self.backend.save(temp)
        if self.ranks.leader:
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
        deadline, attempt = time.monotonic() + SYNC_RETRY_S, 0
        while True:
            attempt += 1
            self.wait_for_fleet()
            try:
                return self.loop.run(self.sync_fleet(step))
            except (WeightSyncError, FleetRequestError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise StopConsuming(f"weight sync of v{step.version} failed {attempt} times in "
                                        f"{SYNC_RETRY_S:.0f}s: {exc}") from exc
                log.warning("weight sync failed; retrying", extra={"attempt": attempt, "error": str(exc)})
                time.sleep(min(2 ** attempt, SYNC_BACKOFF_MAX_S))
            except ParityError as exc:
                raise StopConsuming(str(exc)) from exc

    def wait_for_fleet(self) -> None:
        """Until every server answers /health: a restarting vLLM server (a minute on the CPU) is waited for,
        not counted as a failed sync. StopConsuming when one has not answered for FLEET_WAIT_S."""
        assert self.fleet is not None
        deadline, waiting = time.monotonic() + FLEET_WAIT_S, False
        while True:
            answers = self.loop.run(self._fleet_health())
            down = [url for url, healthy in zip(self.fleet.urls, answers) if not healthy]
            if not down:
                if waiting:
                    log.info("every fleet server answers again")
                return
            if time.monotonic() > deadline:
                raise StopConsuming(f"fleet servers not answering for {FLEET_WAIT_S:.0f}s: {', '.join(down)}")
            if not waiting:
                log.warning("waiting for fleet servers to answer before the weight sync",
                            extra={"servers": down})
                waiting = True
            time.sleep(FLEET_RECHECK_S)

    async def _fleet_health(self) -> list[bool]:
        assert self.fleet is not None
        return list(await asyncio.gather(*(self.fleet.health(url) for url in self.fleet.urls)))

    def trainer_logprobs(self, ids: list[int]) -> list[float]:
        from rollstream.services.trainer.ppo import sequence_logprobs

        with self.torch.no_grad():
            return sequence_logprobs(self.backend.model, ids)

    async def sync_fleet(self, step: TrainedStep) -> float:
        """Reload every server, train.sync_concurrency at a time, and check its probe logprobs; returns the
        worst difference. Servers off parity fail the sync with a ParityError naming each."""
        from rollstream.shared.inference.weight_sync import sync_weights

        assert self.fleet is not None
        diffs = await sync_weights(self.fleet, str(step.checkpoint), step.probe, step.expected,
                                   self.settings.train.sync_concurrency)
        tolerance = self.settings.train.parity_tolerance
        off = [f"{url}: {diff:.2e}" for url, diff in diffs.items() if diff > tolerance]
        if off:
            raise ParityError(f"prompt logprobs differ from the trainer's after loading {step.checkpoint} "
                              f"(tolerance {tolerance:g}): {'; '.join(off)}")
        return max(diffs.values(), default=0.0)

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
            log.warning("training step failed; back to the state of the published version",
                        extra={"batch_id": batch.batch_id, "version": self.version}, exc_info=True)
            self.load_state()
            raise
        try:
            update = self.sync_and_publish(batch, step, trained_key, still_held)
        except Exception as exc:
            self.ranks.share(Command("stop", f"v{step.version} was not published: {exc}"))
            if self.ranks.world_size > 1 and not isinstance(exc, StopConsuming):
                # the other ranks have stopped: a retry needs the whole group again
                raise StopConsuming(f"v{step.version} was not published: {exc}") from exc
            raise
        self.ranks.share(Command("published", update))
        return update

    def sync_and_publish(self, batch: BatchReady, step: TrainedStep, trained_key: str,
                         still_held: Callable[[], bool]) -> PolicyUpdated:
        if not still_held():
            raise StopConsuming(f"another trainer holds the run's lock: v{step.version} is not synced")
        sync_started = time.monotonic()
        parity = self.sync_with_retries(step)
        step.metrics["sync/seconds"] = time.monotonic() - sync_started
        step.metrics["sync/parity_max_abs_diff"] = parity
        if not still_held():
            raise StopConsuming(f"another trainer holds the run's lock: v{step.version} is not published")
        assert self.bus is not None and self.tracker is not None
        update = PolicyUpdated(version=step.version, checkpoint_uri=str(step.checkpoint),
                               batch_id=batch.batch_id, servers=list(self.fleet.urls) if self.fleet else [],
                               parity_max_abs_diff=parity, loss=step.metrics.get("train/loss", 0.0),
                               trained_samples=step.trained, dropped=step.dropped, metrics=step.metrics)
        pipe = self.bus.redis.pipeline(transaction=True)
        self.bus.publish("policy", update, pipe=pipe, event_id=f"policy:v{update.version}")
        pipe.sadd(trained_key, batch.batch_id)
        for url in update.servers:
            pipe.hset(FLEET_VERSIONS.key(self.bus.keys), url, update.version)
        pipe.execute()
        self.version, self.checkpoint = update.version, step.checkpoint
        self.tracker.log(step.metrics, update.version)
        record_published(step)
        return update

    def follow(self) -> str:
        """A rank other than the leader: train on the batches the leader hands out, in step with it, until it
        says stop; returns why it did."""
        while True:
            command = self.ranks.share()
            if command.kind == "train":
                batch, rows = command.payload
                self.train(batch, rows)
                command = self.ranks.share()
                if command.kind == "published":
                    update = command.payload
                    self.version, self.checkpoint = update.version, Path(update.checkpoint_uri)
            if command.kind == "stop":
                return command.payload

    def close(self) -> None:
        if self.fleet is not None:
            self.loop.run(self.fleet.aclose())
        self.loop.close()
        if self.tracker is not None:
            self.tracker.close()


def keep_logprobs(kept: dict[tuple[str, int], list[float]], rows: list[BatchRow], micro, logprobs) -> None:
    """Each sample's values of a micro-batch's [R, T] logprobs, by (rollout id, segment index)."""
    for index, values in micro.per_sample(logprobs).items():
        kept[(rows[index].rollout_id, rows[index].segment_index)] = values


def record_published(step: TrainedStep) -> None:
    """The published version's figures, as Prometheus series."""
    metrics = step.metrics
    POLICY_VERSION.set(step.version)
    for phase, key in (("train", "train/step_seconds"), ("checkpoint", "train/checkpoint_seconds"),
                       ("sync", "sync/seconds")):
        if key in metrics:
            PHASE_SECONDS.labels(phase).observe(metrics[key])
    for key, value in metrics.items():
        if key.startswith("train/") and not key.endswith("_seconds"):
            STEP_STATS.labels(key.removeprefix("train/")).set(value)
    SAMPLES.labels("trained").inc(step.trained)
    for reason, count in step.dropped.items():
        SAMPLES.labels(f"dropped_{reason}").inc(count)
    for staleness in step.staleness:
        STALENESS.observe(staleness)
    PARITY.set(metrics.get("sync/parity_max_abs_diff", 0.0))
