"""The dispatcher's staleness gate: AReaL's admission rule, admitted - filtered + n <= (eta + v + 1) x B,
what the dispatcher does next under it (admit a group, wait for a new policy version, or stop), its
inputs read from Redis (filtered samples, the policy version), and admit_group, which publishes a
group's samples and advances the admitted counter in one transaction. main.py runs the loop around it.

Tests: tests/unit/services/dispatcher/test_staleness_gate.py (against the local Redis).
"""

from __future__ import annotations

from typing import Literal

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PolicyUpdated, PromptIssued
from rollstream.shared.contract.run_facts import FILTERED_SAMPLES
from rollstream.shared.tasks.rows import PromptRow


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
    """Admitted samples the reward service gave back (FILTERED_SAMPLES): left out of training."""
    return int(bus.redis.get(FILTERED_SAMPLES.key(bus.keys)) or 0)


def next_step(gate: StalenessGate, *, admitted: int, filtered: int, group_size: int, policy_version: int,
              total: int) -> Literal["done", "wait", "admit"]:
    """What the dispatcher does next: only samples that can reach a batch count towards the run's total."""
    if admitted - filtered >= total:
        return "done"
    if not gate.admits(admitted, group_size, policy_version, filtered):
        return "wait"
    return "admit"


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
                             tools=row.tools, policy_version=version, metadata=row.metadata, role=row.role)
        rollout_id = f"{run}-r{sample_index:07d}"
        bus.publish("prompts", event, pipe=pipe, event_id=f"{rollout_id}:prompt", group_id=group_id,
                    rollout_id=rollout_id, trajectory_id=rollout_id, session_id=rollout_id)
    pipe.set(bus.keys.admitted, first_sample + n)
    pipe.execute()
