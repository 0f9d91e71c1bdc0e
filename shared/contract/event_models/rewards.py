"""The reward stage: what the reward service makes of a complete group: each rollout's reward and advantage,
or why it is left out (stream `rewards`), and the batch of the groups' trainable segments (stream `batches`).

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.shared.contract.event_models import Count, Event, Finite, Index


class RewardAssigned(Event):
    """A rollout's reward and its group-relative advantage (stream `rewards`), published by the reward service
    when the rollout's group is complete. No consumer group reads `rewards` (the batch carries the same
    values): `rollstream inspect` and the chaos audits do."""

    TYPE = "RewardAssigned"
    VERSION = 2  # v2: role_rewards, role_advantages
    reward: Finite
    """The rollout's reward, the same for all its segments: its grade's score, a reward function's, or a given
    one."""
    advantage: Finite
    """Its reward relative to the rest of its group (train.advantage_estimator: grpo or dr_grpo)."""
    source: str
    """Which reward produced it: a reward function's name (reward.function's or the prompt's), `sandbox`,
    `given` (TrajectoryFinished.reward), or `failed` (a failed rollout's 0)."""
    role_rewards: dict[str, Finite] = Field(default_factory=dict)
    """The reward of each role of the rollout that is scored by a reward function of its own
    (roles.names.<role>.reward_function); the other roles' segments have `reward`, the rollout's. Empty: every
    role's segments have `reward`."""
    role_advantages: dict[str, Finite] = Field(default_factory=dict)
    """Each role of the rollout (of its segments) -> its advantage, relative to that role's samples of the
    group: what its segments are trained with. Empty (a rollout recorded before roles existed):
    `advantage`."""


class RolloutDropped(Event):
    """A rollout that will never be in a batch, and why (stream `rewards`): its grading failed, an event it
    needed was dead-lettered, its grade did not come within reward.grade_timeout_s, or its group was filtered
    out (no reward variance). Its sample slot goes back to the dispatcher. Published by the reward service; no
    consumer group reads `rewards`: the chaos audits do."""

    TYPE = "RolloutDropped"
    reason: str
    """What happened, with the error or the timeout where there is one."""
    cause: Literal["grading_failed", "dead_lettered", "grade_timeout", "filtered"]
    """The reason's kind, as counted in the reward service's /healthz `rollouts_dropped`."""


class BatchReady(Event):
    """A reward-complete Parquet batch is in storage (stream `batches`); mean_reward is over its rollouts.
    Published by the reward service; the `trainer` group trains on it, reading the file at `uri`
    (batches.py)."""

    TYPE = "BatchReady"
    batch_id: str
    """`b-` and a digest of its group ids: the same groups make the same batch, which is trained once."""
    uri: str
    """Path of the Parquet file in run storage (`<run>/batches/<batch_id>.parquet`)."""
    sample_count: Count
    """Rows in the file: one per trainable segment of its rollouts."""
    group_ids: list[str]
    """The prompt groups it holds, each whole, in batch order."""
    min_policy_version: Index
    """The oldest policy version any of its turns was sampled with."""
    mean_reward: Finite
    """Mean reward of its rollouts, each counted once whatever its segments."""
