"""Dispatcher: admits prompt samples into the run under the staleness rule.

Reads the dataset, and emits one PromptIssued per sample, n per prompt group, on `prompts`. A new
group is admitted only while admitted - filtered + n <= (eta + v + 1) x B (v: policy version, B:
batch size, eta: max staleness), so generation runs at most eta versions ahead of training. Samples
the reward service filtered out (zero-variance groups, train.filter_zero_variance) never reach a
batch, so their slots are given back. One dispatcher is active per run (a Redis lock); it stops
admitting once B x total_versions samples that were not filtered out have been admitted.

    rollstream-dispatcher        # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PolicyUpdated, PromptIssued
from rollstream.shared.errors import DatasetError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime
from rollstream.shared.tasks.datasets import arithmetic_dataset, load_dataset
from rollstream.shared.tasks.rows import PromptRow

LOCK_TTL_MS = 15_000


class StalenessGate:
    """AReaL's admission rule: admitted - filtered <= (eta + v + 1) x B. Filtered samples never
    reach a batch, so counting them would stall generation short of the batches training needs."""

    def __init__(self, max_staleness: int, batch_size: int) -> None:
        self.max_staleness = max_staleness
        self.batch_size = batch_size

    def capacity(self, policy_version: int) -> int:
        return (self.max_staleness + policy_version + 1) * self.batch_size

    def admits(self, admitted: int, count: int, policy_version: int, filtered: int = 0) -> bool:
        return admitted - filtered + count <= self.capacity(policy_version)


def filtered_samples(bus: Bus) -> int:
    """Admitted samples the reward service left out of training."""
    return int(bus.redis.get(bus.keys.filtered) or 0)


def next_step(gate: StalenessGate, *, admitted: int, filtered: int, group_size: int, policy_version: int,
              total: int) -> Literal["done", "wait", "admit"]:
    """What the dispatcher does next: only samples that can reach a batch count towards the run's total."""
    if admitted - filtered >= total:
        return "done"
    if not gate.admits(admitted, group_size, policy_version, filtered):
        return "wait"
    return "admit"


def prompt_rows(settings: Settings) -> list[PromptRow]:
    if settings.data.path is None:
        return arithmetic_dataset(settings.data.synthetic_prompts, settings.data.seed,
                                  settings.data.synthetic_sandbox_every)
    return load_dataset(settings.data.path)


def current_policy_version(bus: Bus) -> int:
    last = bus.last("policy")
    return last.event.version if last and isinstance(last.event, PolicyUpdated) else 0


def admit_group(bus: Bus, row: PromptRow, group_index: int, first_sample: int, n: int, version: int) -> None:
    """Publish a group's n samples and advance the admitted counter in one transaction."""
    run = bus.keys.run_id
    group_id = f"{run}-g{group_index:06d}"
    pipe = bus.redis.pipeline(transaction=True)
    for offset in range(n):
        sample_index = first_sample + offset
        event = PromptIssued(sample_index=sample_index, group_size=n, messages=row.messages, label=row.label,
                             reward_fn=row.reward_fn, sandbox_check=row.sandbox_check, agent=row.agent,
                             tools=row.tools, policy_version=version, metadata=row.metadata)
        rollout_id = f"{run}-r{sample_index:07d}"
        bus.publish("prompts", event, pipe=pipe, event_id=f"{rollout_id}:prompt", group_id=group_id,
                    rollout_id=rollout_id, trajectory_id=rollout_id, session_id=rollout_id)
    pipe.set(bus.keys.admitted, first_sample + n)
    pipe.execute()


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("dispatcher", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    log = runtime.log

    try:
        rows = prompt_rows(settings)
    except DatasetError as exc:
        log.critical("dataset rejected", extra={"error": str(exc)})
        runtime.close()
        raise SystemExit(2) from exc
    n = settings.data.samples_per_prompt
    total = settings.train.batch_size * settings.train.total_versions
    gate = StalenessGate(settings.train.max_staleness, settings.train.batch_size)
    log.info("dataset loaded", extra={"rows": len(rows), "samples_to_admit": total})

    token = uuid.uuid4().hex
    lock = bus.keys.lock("dispatcher")
    while not runtime.stopping and not bus.redis.set(lock, token, nx=True, px=LOCK_TTL_MS):
        runtime.status["state"] = "standby: another dispatcher is active"
        time.sleep(1)

    lock_renewed = time.monotonic()
    admitted = int(bus.redis.get(bus.keys.admitted) or 0)
    while not runtime.stopping:
        if time.monotonic() - lock_renewed > LOCK_TTL_MS / 3000:
            if bus.redis.get(lock) != token.encode():
                raise RuntimeError("lost the dispatcher lock to another dispatcher")
            bus.redis.pexpire(lock, LOCK_TTL_MS)
            lock_renewed = time.monotonic()
        version = current_policy_version(bus)
        filtered = filtered_samples(bus)
        runtime.status.update(admitted=admitted, filtered=filtered, policy_version=version,
                              capacity=gate.capacity(version))
        step = next_step(gate, admitted=admitted, filtered=filtered, group_size=n, policy_version=version, total=total)
        if step == "done":
            # Not final: samples still in flight may yet be filtered out and need replacing.
            runtime.status["state"] = "done"
            time.sleep(0.5)
            continue
        if step == "wait":
            runtime.status["state"] = "waiting for a new policy version or filtered samples"
            bus.redis.xread({bus.keys.stream("policy"): "$"}, block=500)
            continue
        runtime.status["state"] = "admitting"
        group_index = admitted // n
        admit_group(bus, rows[group_index % len(rows)], group_index, admitted, n, version)
        admitted += n
        log.debug("admitted group", extra={"group_index": group_index, "policy_version": version})

    if bus.redis.get(lock) == token.encode():
        bus.redis.delete(lock)
    runtime.close()


if __name__ == "__main__":
    main()
