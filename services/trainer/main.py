"""Trainer: learns from reward-complete batches and pushes each new policy to the fleet.

Consumes BatchReady on `batches` (consumer group `trainer`, one trainer per run) as soon as one
exists. For each batch (services/trainer/training.py):
  1. drop samples older than eta versions (train.max_staleness), counted by reason;
  2. the proximal logprobs (decoupled PPO) and, with a KL term, the reference logprobs, before any
     update; then train.minibatches optimizer steps over packed micro-batches (services/trainer/ppo.py)
     on the configured backend (torch or DeepSpeed ZeRO, services/trainer/backends/);
  3. save the training state (HF safetensors weights the fleet can load, optimizer, RNG) as the
     checkpoint of the new version;
  4. per vLLM server: pause (in-flight requests keep going), reload, reset the prefix cache, resume,
     then compare the server's prompt logprobs on a probe with the trainer's own;
  5. only when every server is within train.parity_tolerance: publish PolicyUpdated (with the step's
     metrics) and mark the batch trained, in one transaction; metrics go to the trackers.

Restarts are exact: a trainer starts from the checkpoint of the last PolicyUpdated (weights,
optimizer and RNG state) and first finishes the batches its predecessor left pending, in order. A
batch is part of the model once its PolicyUpdated exists, and never again.

    rollstream-trainer           # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

from rollstream.services.trainer.training import Trainer
from rollstream.shared.contract.bus import Bus, Delivery, StopConsuming, run_consumer
from rollstream.shared.contract.events import BatchReady
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime
from rollstream.shared.runtime.storage import Storage

GROUP = "trainer"
CONSUMER = "trainer"  # one trainer per run: a restarted one takes over its predecessor's pending batches


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("trainer", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    trainer = Trainer(settings, bus, Storage(settings.storage_uri))
    trained_key = bus.keys.state("trainer", "trained-batches")
    runtime.status["policy_version"] = trainer.version

    def handle(delivery: Delivery) -> None:
        batch = delivery.event
        if not isinstance(batch, BatchReady) or bus.redis.sismember(trained_key, batch.batch_id):
            return
        update = trainer.train_step(batch, trained_key)
        runtime.status["policy_version"] = update.version
        runtime.log.info("policy updated", extra={"version": update.version, "loss": round(update.loss, 5),
                                                  "parity_max_abs_diff": update.parity_max_abs_diff,
                                                  "trained": update.trained_samples, "dropped": update.dropped})

    try:
        run_consumer(bus, ("batches",), GROUP, CONSUMER, handle, runtime.should_stop, take_over_pending=True)
    except StopConsuming as exc:
        # The batch stays pending; a restarted trainer resumes from the last published checkpoint.
        runtime.log.critical("trainer stopped", extra={"error": str(exc)})
        raise SystemExit(1) from exc
    finally:
        trainer.close()
        runtime.close()


if __name__ == "__main__":
    main()
