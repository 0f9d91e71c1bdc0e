"""The reward service's settings (`reward.*`, RS_REWARD__*): the order in which complete groups fill batches,
a reward function to score every rollout with, and how long it waits for what a group misses.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class RewardSettings(Section):
    batch_order: Literal["finished", "completed"] = "finished"
    """Order in which complete groups fill batches. finished: the order in which their last rollout
    finished on the trajectories stream, so a replay of the same trajectories builds the same batches
    however its grades interleave (a group waiting for a sandbox grade holds back the groups that
    finished after it); completed: as soon as each group's rewards are known (lowest latency, not
    reproducible when grades arrive in another order)."""
    function: str | None = None
    """Score every rollout with this function instead of the one its prompt names, and without waiting
    for sandbox grades: a built-in name (`exact_match`) or `module:function` taking (response, label)
    and returning a float. For re-scoring a recorded run with a new reward (`rollstream replay`)."""
    done_ttl_s: int = Field(86_400, ge=60)
    """How long a completed group is remembered, so that a late redelivery of one of its events is ignored."""
    grade_timeout_s: float = Field(3600.0, gt=0)
    """A group whose rollouts have all finished is resolved after this long even if a grade (or a segment)
    never came (a dead-lettered event, a lost job): the rollouts still missing theirs are dropped with the
    reason, so that one lost grade never holds back training. Longer than the slowest task's grading."""
