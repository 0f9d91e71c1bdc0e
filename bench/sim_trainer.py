"""A simulated GPU trainer: the trainer service's contract on the bus, with the step time of a GPU profile
instead of a CPU training step, so that a simulated fleet (bench/sim_fleet.py) waits for training as long
as it would on a cluster.

    python bench/sim_trainer.py --gpu-profile h100x8-7b      # configured like a service: RS_CONFIG_FILE
    python bench/sim_trainer.py --gpu-profile h100x8-7b --train-tokens-per-s 20000 --step-overhead-s 2

bench/bench_async.py --trainer sim-gpu starts it in place of the trainer service. What it does per batch is
what services/trainer does, less the training itself:
  - consumes BatchReady on `batches` as consumer group `trainer` (one consumer, pending entries first);
    a batch already in the trained set is passed over;
  - reads the batch file (read_batch) and drops the rows older than train.max_staleness versions
    (row.min_policy_version < version - eta), counted as dropped["stale"]; rows are not checked for
    validity (the reward service writes valid ones, and no model is trained on them);
  - waits for the profile's step time (below), counted from the moment the batch was taken;
  - syncs the fleet with sync_weights, reloading from disk train.sync_concurrency servers at once:
    pause (requests kept), reload, reset the prefix cache, resume, probe; the simulated servers stay paused
    for their --reload-s, which bench_async sets to the profile's sync time. The checkpoint is the starting
    model directory (settings.model.path): the simulated servers load any HF checkpoint (config.json), and no
    weights change. The probe's logprobs must match the starting model's (train.parity_tolerance);
  - publishes PolicyUpdated on `policy` with event_id "policy:v<version>", in one transaction with SADD of
    the batch id into the trained set and HSET of every server url -> version into the fleet's versions.
At start, like the trainer, every server's entry in the fleet's versions is set to 0 if it has none. It does
not resume from an earlier trainer's last version (the bench starts every run afresh).

Step time of a profile, in seconds:
    step = step_overhead_s + (trained_tokens + forward_only_tokens / 3) / train_tokens_per_s
trained_tokens: every token of the fresh rows (prompt and response: all go through forward and backward);
forward_only_tokens: the extra forward passes of services/trainer/training.py, which cost about a third of a
forward and backward (2N against 6N FLOPs per token for N parameters): the proximal logprobs of every
minibatch after the first ((m - 1)/m of the tokens with train.decoupled and m = train.minibatches) and the
reference logprobs (all tokens, with train.kl_coef > 0).

Profiles. The numbers are assumptions, derived from public reports, not measurements of rollstream on GPUs:
  h100x8-7b    a 7B policy trained with FSDP/ZeRO-3 on 8 H100s (one node), served by one-GPU vLLM servers.
               train_tokens_per_s = 40,000 (5,000 per GPU): torchtitan (github.com/pytorch/torchtitan,
               docs/performance.md, Table 1) reports 5,762 tokens/s per GPU for Llama 3.1 8B with FSDP in
               bf16 on 8 H100s (selective activation checkpointing, no torch.compile); a 7-7.6B model at the
               same MFU would do ~6,100-6,600 (FLOPs per token scale with the parameters), and an RL step
               packs variable-length rows less densely than pre-training: 5,000 assumed.
               step_overhead_s = 1.0: optimizer step over the sharded states, gathering the weights for the
               probe, handing the checkpoint over. sync_s = 1.0: ~15 GB of bf16 weights
               (7.6B parameters) into every server at once, broadcast over 400 Gb/s links (~50 GB/s: 0.3 s)
               plus pausing the engine, loading the tensors and resuming; a reload from a checkpoint on
               local disk takes several seconds (give it with bench_async's --sync-s).
  h100x8-1.5b  a 1.5B policy on the same node: 5x the tokens per second (FLOPs per token scale with the
               parameters: 7.6B / 1.5B), 0.5 s overhead, 0.3 s sync (3 GB of weights).
Give the numbers directly with --train-tokens-per-s and --step-overhead-s here (each overrides the profile's);
the sync time is the simulated fleet's (its --reload-s), which bench_async sets from the profile or from its
--sync-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rollstream.shared.contract.batches import BatchRow, read_batch
from rollstream.shared.contract.bus import Bus, Delivery, StopConsuming, run_consumer
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.contract.events import BatchReady, PolicyUpdated
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_sync import sync_weights
from rollstream.shared.inference.weight_transport import DiskTransport, WeightUpdate
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage

log = logging.getLogger("sim-trainer")

SIM_TRAINER_READY = "SIM_TRAINER_READY"
CONSUMER = "trainer"  # the trainer service's consumer name: one trainer per run
PROBE = list(range(1, 17))
"""Token ids the fleet's logprobs are checked on after each sync (the trainer's before its first batch)."""
FORWARD_COST = 1 / 3
"""A forward pass's share of a forward and backward pass (2N of 6N FLOPs per token)."""


@dataclass(frozen=True)
class GpuProfile:
    name: str
    train_tokens_per_s: float
    """Tokens of the batch's rows the whole trainer takes through forward and backward per second."""
    step_overhead_s: float
    """Per step, whatever the tokens: optimizer step, weight gathering, checkpoint hand-over."""
    sync_s: float
    """Each server's pause while it takes in the new weights."""

    def step_seconds(self, trained_tokens: int, forward_only_tokens: float = 0.0) -> float:
        work = trained_tokens + forward_only_tokens * FORWARD_COST
        return self.step_overhead_s + work / self.train_tokens_per_s

    def describe_step(self) -> str:
        return (f"{self.name}: {self.train_tokens_per_s:,.0f} trained tokens/s, "
                f"{self.step_overhead_s:g} s per step")


PROFILES = {profile.name: profile for profile in (  # where the numbers come from: the module docstring
    GpuProfile("h100x8-7b", train_tokens_per_s=40_000, step_overhead_s=1.0, sync_s=1.0),
    GpuProfile("h100x8-1.5b", train_tokens_per_s=200_000, step_overhead_s=0.5, sync_s=0.3),
)}


def profile_from(name: str, tokens_per_s: float | None = None, overhead_s: float | None = None,
                 sync_s: float | None = None) -> GpuProfile:
    """A named profile with any of its numbers replaced by the given ones."""
    if name not in PROFILES:
        raise ValueError(f"unknown GPU profile {name!r}; profiles: {', '.join(PROFILES)}")
    profile = PROFILES[name]
    given = {"train_tokens_per_s": tokens_per_s, "step_overhead_s": overhead_s, "sync_s": sync_s}
    changes = {key: value for key, value in given.items() if value is not None}
    return replace(profile, name=f"{name} (custom)", **changes) if changes else profile


def forward_only_tokens(trained_tokens: int, minibatches: int, decoupled: bool, kl_coef: float) -> float:
    """Tokens of the extra forward passes the trainer takes before its updates (see the module docstring)."""
    proximal = trained_tokens * (minibatches - 1) / minibatches if decoupled else 0.0
    reference = trained_tokens if kl_coef > 0 else 0.0
    return proximal + reference


def select_fresh(rows: list[BatchRow], version: int,
                 max_staleness: int) -> tuple[list[BatchRow], dict[str, int]]:
    """The trainer's staleness rule: a row whose oldest turn is more than eta versions behind is dropped."""
    fresh = [row for row in rows if row.min_policy_version >= version - max_staleness]
    return fresh, ({"stale": len(rows) - len(fresh)} if len(fresh) < len(rows) else {})


class SimTrainer:
    """The trainer's work on the bus, one batch at a time, with a simulated step."""

    def __init__(self, settings: Settings, profile: GpuProfile, bus: Bus,
                 expected: list[float] | None = None) -> None:
        self.settings = settings
        self.profile = profile
        self.bus = bus
        self.storage = Storage(settings.storage_uri)
        self.version = 0
        self.checkpoint = str(settings.model.path)
        # one event loop for the trainer's life: the fleet client's connections belong to it
        self.loop = asyncio.Runner()
        self.fleet = FleetClient.for_run(settings) if settings.fleet.urls else None
        self.expected = expected
        if self.fleet is not None:
            for url in self.fleet.urls:
                bus.redis.hsetnx(bus.keys.fleet_versions, url, self.version)
            if self.expected is None:
                self.expected = starting_model_logprobs(self.checkpoint)

    def handle(self, delivery: Delivery) -> PolicyUpdated | None:
        taken = time.monotonic()
        batch: BatchReady = delivery.event
        if self.bus.redis.sismember(self.bus.keys.trained_batches, batch.batch_id):
            return None
        rows = read_batch(self.storage, batch.uri)
        fresh, dropped = select_fresh(rows, self.version, self.settings.train.max_staleness)
        tokens = sum(len(row.tokens) for row in fresh)
        train = self.settings.train
        extra_forward = forward_only_tokens(tokens, train.minibatches, train.decoupled, train.kl_coef)
        step_s = self.profile.step_seconds(tokens, extra_forward)
        # the simulated GPUs work while this process reads the batch: only the rest is waited for
        time.sleep(max(0.0, step_s - (time.monotonic() - taken)))
        sync_started = time.monotonic()
        parity = self.loop.run(self.sync_fleet()) if self.fleet is not None else 0.0
        staleness = [self.version - row.min_policy_version for row in fresh]
        metrics = {
            "train/step_seconds": step_s,
            "train/trained_tokens": float(tokens),
            "sync/seconds": time.monotonic() - sync_started,
            "sync/parity_max_abs_diff": parity,
            "samples/trained": float(len(fresh)),
            "samples/dropped_stale": float(dropped.get("stale", 0)),
            "samples/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "samples/staleness_max": float(max(staleness, default=0)),
            "reward/batch_mean": batch.mean_reward,
        }
        return self.publish(batch, len(fresh), dropped, parity, metrics)

    async def sync_fleet(self) -> float:
        assert self.fleet is not None and self.expected is not None
        # the simulated servers reload from disk (a collective needs vLLM's workers to join a process group)
        diffs, _ = await sync_weights(self.fleet, DiskTransport(self.settings.train.sync_concurrency),
                                      WeightUpdate(self.version, checkpoint=Path(self.checkpoint)), PROBE,
                                      self.expected)
        tolerance = self.settings.train.parity_tolerance
        off = [f"{url}: {diff:.2e}" for url, diff in diffs.items() if diff > tolerance]
        if off:  # the trainer stops the same way: the fleet does not serve what was trained
            raise StopConsuming(f"prompt logprobs differ after loading {self.checkpoint}: {'; '.join(off)}")
        return max(diffs.values(), default=0.0)

    def publish(self, batch: BatchReady, trained: int, dropped: dict[str, int], parity: float,
                metrics: dict[str, float]) -> PolicyUpdated:
        servers = list(self.fleet.urls) if self.fleet is not None else []
        update = PolicyUpdated(version=self.version + 1, checkpoint_uri=self.checkpoint,
                               batch_id=batch.batch_id, servers=servers, parity_max_abs_diff=parity, loss=0.0,
                               trained_samples=trained, dropped=dropped, metrics=metrics)
        pipe = self.bus.redis.pipeline(transaction=True)
        self.bus.publish("policy", update, pipe=pipe, event_id=f"policy:v{update.version}")
        pipe.sadd(self.bus.keys.trained_batches, batch.batch_id)
        for url in servers:
            pipe.hset(self.bus.keys.fleet_versions, url, update.version)
        pipe.execute()
        self.version = update.version
        return update

    def close(self) -> None:
        if self.fleet is not None:
            self.loop.run(self.fleet.aclose())
        self.loop.close()


def starting_model_logprobs(model_path: str) -> list[float]:
    """The probe's logprobs under the starting model, as a simulated server computes them."""
    from sim_checkpoints import Checkpoints  # bench/ is on sys.path when run as a script

    return [logprob for logprob, _ in Checkpoints().prompt_logprobs(model_path, PROBE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-profile", default="h100x8-7b", choices=sorted(PROFILES))
    parser.add_argument("--train-tokens-per-s", type=float, default=None, help="overrides the profile's")
    parser.add_argument("--step-overhead-s", type=float, default=None, help="overrides the profile's")
    parser.add_argument("--expected-logprobs", default=None,
                        help="JSON list: the probe's logprobs under the starting model (default: computed "
                             "here, which imports torch and takes seconds)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sim-trainer %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: five per server and sync
    profile = profile_from(args.gpu_profile, args.train_tokens_per_s, args.step_overhead_s)
    settings = Settings()
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    expected = json.loads(args.expected_logprobs) if args.expected_logprobs else None
    trainer = SimTrainer(settings, profile, bus, expected)
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def handle(delivery: Delivery) -> None:
        try:
            update = trainer.handle(delivery)
        except StopConsuming:
            raise
        except Exception as exc:
            # Left pending, the batch would be passed over for the next one and versions would come out of
            # order: the bench's trainer stops instead, and the bench reports its log.
            raise StopConsuming(f"entry {delivery.entry_id}: {type(exc).__name__}: {exc}") from exc
        if update is not None:
            log.info("v%d: trained %d, dropped %s, step %.2f s, sync %.2f s", update.version,
                     update.trained_samples, update.dropped, update.metrics["train/step_seconds"],
                     update.metrics["sync/seconds"])

    print(f"{SIM_TRAINER_READY} {profile.describe_step()}", flush=True)
    try:
        run_consumer(bus, consumer_group("trainer"), CONSUMER, handle, lambda: stopping,
                     take_over_pending=True)
    except StopConsuming as exc:
        log.critical("stopped: %s", exc)
        sys.exit(1)
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
