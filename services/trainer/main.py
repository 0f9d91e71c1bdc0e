"""Trainer: learns from reward-complete batches and pushes each new policy to the fleet.

Consumes BatchReady on `batches` (consumer group `trainer`) as soon as one exists. For each batch:
drop samples older than eta versions (counted), one PPO-clip step against the rollout logprobs,
save an HF safetensors checkpoint, then for every vLLM server: pause (keep in-flight requests),
reload the weights, reset the prefix cache, resume, and compare the server's prompt logprobs on a
probe with the trainer's own. Only when every server is within train.parity_tolerance is the
server registry updated and PolicyUpdated published.

    rollstream-trainer           # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from shared.batches import read_batch
from shared.bus import Bus, Delivery, StopConsuming, consumer_name, run_consumer
from shared.config import Settings
from shared.events import BatchReady, PolicyUpdated
from shared.service import ServiceRuntime
from shared.storage import Storage, replace_dir

log = logging.getLogger("trainer")

GROUP = "trainer"
PROBE_TOKENS = 256
SYNC_ATTEMPTS = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class TrainedStep:
    """A batch trained on and checkpointed, not yet served by the fleet."""

    version: int
    checkpoint: Path
    probe: list[int]
    loss: float
    trained: int
    dropped: int


class ParityError(RuntimeError):
    """A server's logprobs after a weight sync do not match the trainer's."""


class Trainer:
    def __init__(self, settings: Settings, bus: Bus, storage: Storage) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from shared.fleet import FleetClient

        self.torch = torch
        self.settings = settings
        self.bus = bus
        self.storage = storage
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(settings.train.seed)
        last = bus.last("policy")
        self.version = last.event.version if last else 0
        start = Path(last.event.checkpoint_uri) if last else settings.model.path
        self.model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).to(self.device)
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=settings.train.learning_rate)
        # One event loop for the trainer's life: the fleet client's connections belong to it.
        self.loop = asyncio.Runner()
        self.fleet = FleetClient(settings.fleet.urls, model=settings.model.served_name,
                                 timeout_s=settings.fleet.request_timeout_s)
        for url in self.fleet.urls:
            bus.redis.hsetnx(bus.keys.fleet_versions, url, self.version)

    def train_step(self, batch: BatchReady) -> PolicyUpdated:
        """Train on the batch, then make every server serve the result. The fleet must serve a
        policy before the next one is trained; a sync that keeps failing stops the trainer."""
        step = self.train(batch)
        parity = self.sync_with_retries(step)
        self.version = step.version
        for url in self.fleet.urls:
            self.bus.redis.hset(self.bus.keys.fleet_versions, url, step.version)
        return PolicyUpdated(version=step.version, checkpoint_uri=str(step.checkpoint), batch_id=batch.batch_id,
                             servers=list(self.fleet.urls), parity_max_abs_diff=parity, loss=step.loss,
                             trained_samples=step.trained, dropped_stale=step.dropped)

    def sync_with_retries(self, step: TrainedStep) -> float:
        from shared.fleet import FleetRequestError, WeightSyncError

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

    def train(self, batch: BatchReady) -> TrainedStep:
        from services.trainer.ppo import collate, ppo_clip_loss, token_logprobs

        rows = read_batch(self.storage, batch.uri)
        oldest_allowed = self.version - self.settings.train.max_staleness
        fresh = [r for r in rows if r.min_policy_version >= oldest_allowed]
        loss = 0.0
        if fresh:
            self.model.train()
            data = collate(fresh, self.pad_id, self.device)
            logprobs = token_logprobs(self.model, data.tokens, data.attention_mask)
            objective, stats = ppo_clip_loss(logprobs, data, self.settings.train.clip_eps,
                                             self.settings.train.loss_aggregation)
            self.optimizer.zero_grad(set_to_none=True)
            objective.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            loss = stats["loss"]
        version = self.version + 1
        return TrainedStep(version=version, checkpoint=self.save_checkpoint(version),
                           probe=(fresh or rows)[0].tokens[:PROBE_TOKENS], loss=loss, trained=len(fresh),
                           dropped=len(rows) - len(fresh))

    def close(self) -> None:
        self.loop.run(self.fleet.aclose())
        self.loop.close()

    def save_checkpoint(self, version: int) -> Path:
        final = self.storage.local_path(self.settings.run_id, "checkpoints", f"v{version:05d}")
        temp = final.with_name(final.name + ".tmp")
        shutil.rmtree(temp, ignore_errors=True)
        self.model.save_pretrained(temp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            source = Path(self.settings.model.path) / name
            if source.exists():
                shutil.copy(source, temp / name)
        replace_dir(temp, final)
        return final

    def trainer_logprobs(self, ids: list[int]) -> list[float]:
        from services.trainer.ppo import token_logprobs

        torch = self.torch
        self.model.eval()
        with torch.no_grad():
            values = token_logprobs(self.model, torch.tensor([ids], device=self.device))
        return values[0, 1:].tolist()

    async def sync_fleet(self, checkpoint: Path, probe: list[int]) -> float:
        """Reload every server and check its probe logprobs; returns the worst difference."""
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
        update = trainer.train_step(batch)
        pipe = bus.redis.pipeline(transaction=True)
        bus.publish("policy", update, pipe=pipe, event_id=f"policy:v{update.version}")
        pipe.sadd(trained_key, batch.batch_id)
        pipe.execute()
        runtime.status["policy_version"] = update.version
        runtime.log.info("policy updated", extra={"version": update.version, "loss": round(update.loss, 5),
                                                  "parity_max_abs_diff": update.parity_max_abs_diff,
                                                  "trained": update.trained_samples, "dropped_stale": update.dropped_stale})

    try:
        run_consumer(bus, ("batches",), GROUP, consumer_name(GROUP), handle, runtime.should_stop)
    except StopConsuming as exc:
        # The batch stays pending; a restarted trainer resumes from the last published checkpoint.
        runtime.log.critical("trainer stopped", extra={"error": str(exc)})
        raise SystemExit(1) from exc
    finally:
        trainer.close()
        runtime.close()


if __name__ == "__main__":
    main()
