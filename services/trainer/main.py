"""Trainer: learns from reward-complete batches and pushes each new policy to the fleet.

Consumes BatchReady on `batches` (consumer group `trainer`, one trainer per run) as soon as one
exists. For each batch (services/trainer/training.py):
  1. drop samples older than eta versions (train.max_staleness), counted by reason;
  2. the proximal logprobs (decoupled PPO) and, with a KL term, the reference logprobs, before any
     update; then train.minibatches optimizer steps over packed micro-batches (services/trainer/ppo.py)
     on the configured backend (torch or DeepSpeed ZeRO, services/trainer/backends/);
  3. save the training state (HF safetensors weights the fleet can load, optimizer, RNG) as the
     checkpoint of the new version;
  4. per vLLM server, train.sync_concurrency at once: pause (in-flight requests keep going), reload, reset the
     prefix cache, resume, then compare the server's prompt logprobs on a probe with the trainer's own;
     a LoRA run (train.lora_rank > 0) trains one adapter per role instead, each on its role's samples with an
     optimizer of its own, writes each new version of an adapter for the servers and has every server load
     the adapters it does not serve yet, each then probed under its role's name (see training.py);
  5. only when every server is within train.parity_tolerance: publish PolicyUpdated (with the step's
     metrics) and mark the batch trained, in one transaction; metrics go to the trackers.

The trainer trains on train.ranks data-parallel processes (DeepSpeed), or on the WORLD_SIZE of a launcher of
the user's own: rank 0 leads, the others train their share of each batch in step with it
(services/trainer/ranks.py). One trainer trains a run: a second one started for it stands by (`/healthz`
status `state`) until the first's lock lapses (shared/contract/run_lock.py; TRAINER_LOCK_TTL_MS after a kill),
and a trainer that lost the lock stops at its next batch without syncing or publishing it. Restarts are exact:
a trainer starts from the checkpoint of its own last PolicyUpdated (weights, optimizer and RNG state; one
whose batch it never trained was not written by it and is passed over) and first finishes the batches its
predecessor left pending, in order. A batch is part of the model once its PolicyUpdated exists, and never
again.

One entry's failure is that entry's: an entry of another type than BatchReady (by the bus's
decode_on), or a BatchReady whose file is not the batch it announces, is dead-lettered at once; one
whose file cannot be read is retried and dead-lettered after bus.max_deliveries; rows no model can
train on are left out and counted (PolicyUpdated.dropped["invalid"]). The trainer stops (exit 1, the
batch left pending) only when the fleet cannot be made to serve a new version: a weight sync that
keeps failing, or logprobs that differ from the trainer's.

    rollstream-trainer           # configured by RS_* variables or RS_CONFIG_FILE
    torchrun --nnodes 2 --nproc-per-node 8 ... -m rollstream.services.trainer.main   # over several nodes
"""

from __future__ import annotations

import logging
import os
import signal

from rollstream.services.trainer.batch_intake import read_announced_batch
from rollstream.services.trainer.publishing import resume_point
from rollstream.services.trainer.ranks import Command, Ranks, launch_ranks
from rollstream.services.trainer.training import BatchRejected, Trainer
from rollstream.shared.contract.bus import Bus, Delivery, StopConsuming, run_consumer
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.contract.events import BatchReady, encode
from rollstream.shared.contract.run_lock import RunLock
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime, configure_logging
from rollstream.shared.runtime.storage import Storage

GROUP = consumer_group("trainer")
CONSUMER = "trainer"  # one trainer per run: a restarted one takes over its predecessor's pending batches
TRAINER_LOCK_TTL_MS = 10_000


def main() -> None:
    settings = Settings()
    if settings.train.ranks > 1 and "WORLD_SIZE" not in os.environ:
        launch_ranks(settings.train.ranks)
    ranks = Ranks.from_environment()
    if ranks.world_size > 1:
        if settings.train.backend != "deepspeed":
            raise SystemExit(f"{ranks.world_size} trainer ranks need train.backend='deepspeed'")
        from rollstream.services.trainer.backends.deepspeed_backend import ensure_distributed

        ensure_distributed()
    try:
        if ranks.leader:
            lead(settings, ranks)
        else:
            follow(settings, ranks)
    finally:
        if settings.train.backend == "deepspeed":  # a world of one too: the backend joins one of its own
            from rollstream.services.trainer.backends.deepspeed_backend import leave_distributed

            leave_distributed()


def lead(settings: Settings, ranks: Ranks) -> None:
    """Rank 0: the run's lock, the `batches` stream, the fleet and the published versions."""
    runtime = ServiceRuntime("trainer", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    lock = hold_run_lock(runtime, bus, ranks)
    if lock is None:
        runtime.close()
        return
    runtime.status.update(state="training", ranks=ranks.world_size)
    lock.keep_renewed()
    trained_key = bus.keys.trained_batches
    storage = Storage(settings.storage_uri)
    start = resume_point(bus, trained_key, settings.storage_uri)
    replay = [(batch, read_announced_batch(storage, batch)) for batch in start.replay]
    ranks.share(Command("start", (start.checkpointed, replay)))
    trainer = Trainer(settings, storage, start.checkpointed, bus, ranks, replay=replay)
    runtime.status["policy_version"] = trainer.version
    rejected = 0

    def reject(delivery: Delivery, error: str) -> None:
        nonlocal rejected
        bus.dead_letter(delivery.stream, GROUP.name, delivery.entry_id, encode(delivery.envelope), 1, error)
        rejected += 1
        runtime.status["batches_rejected"] = rejected

    def handle(delivery: Delivery) -> None:
        batch: BatchReady = delivery.event
        if bus.redis.sismember(trained_key, batch.batch_id):
            return
        try:
            update = trainer.train_step(batch, trained_key, still_held=lambda: lock.lost is None)
        except BatchRejected as exc:
            if exc.retryable:
                raise
            reject(delivery, str(exc))
            return
        runtime.status["policy_version"] = update.version
        runtime.log.info("policy updated", extra={"version": update.version, "loss": round(update.loss, 5),
                                                  "parity_max_abs_diff": update.parity_max_abs_diff,
                                                  "role_versions": update.role_versions,
                                                  "trained": update.trained_samples,
                                                  "dropped": update.dropped})

    try:
        run_consumer(bus, GROUP, CONSUMER, handle, runtime.should_stop, take_over_pending=True,
                     between_reads=lambda: ranks.share(Command("idle")))
        trainer.checkpoint_on_stop()
        ranks.share(Command("stop", "the trainer stops"))
    except StopConsuming as exc:
        # The batch stays pending; a restarted trainer resumes from the last published checkpoint.
        runtime.log.critical("trainer stopped", extra={"error": str(exc)})
        raise SystemExit(1) from exc
    finally:
        trainer.close()
        lock.release()
        runtime.close()


def hold_run_lock(runtime: ServiceRuntime, bus: Bus, ranks: Ranks) -> RunLock | None:
    """The run's lock, once this trainer holds it (standing by, and the other ranks with it, while another
    trainer of the run holds it); None when asked to stop first, and the other ranks are told to stop."""
    lock = RunLock(bus, "trainer", TRAINER_LOCK_TTL_MS)
    standby = "standby: another trainer of this run is training"

    def stand_by() -> None:
        runtime.status["state"] = standby
        ranks.share(Command("standby"))

    if not lock.acquire(runtime.should_stop, stand_by):
        ranks.share(Command("stop", "stopped before holding the run's lock"))
        return None
    return lock


def follow(settings: Settings, ranks: Ranks) -> None:
    """Another rank: no Redis, no fleet; it trains what the leader hands out, and stops when the leader says
    so (a SIGTERM from the launcher reaches the leader too, which then says so)."""
    configure_logging("trainer", settings.log_level)
    log = logging.getLogger("trainer")
    signal.signal(signal.SIGTERM,
                  lambda *_: log.info("stop requested; waiting for rank 0", extra={"rank": ranks.rank}))
    command = ranks.share()
    while command.kind == "standby":
        command = ranks.share()
    if command.kind == "stop":
        return
    start, replay = command.payload
    trainer = Trainer(settings, Storage(settings.storage_uri), start, ranks=ranks, replay=replay)
    try:
        why = trainer.follow()
    finally:
        trainer.close()
    log.info("rank stopped", extra={"rank": ranks.rank, "why": why})


if __name__ == "__main__":
    main()
