"""How the reward service scores a complete group: each rollout's reward and where it came from (its
sandbox grade, reward.function, a reward the episode was given, or the rule its prompt names), the group's
advantages over the rollouts that count, and why each other rollout is left out. The book
(services/reward/book.py) reads the group, and publishes and counts what this decides.

Tests: tests/unit/services/reward/test_reward_book.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from rollstream.services.reward.rewards import advantages, resolve_reward_function, reward_for
from rollstream.shared.contract.events import Envelope, TrajectoryFinished

GROUPS = Counter("rollstream_reward_groups_completed_total",
                 "Prompt groups scored, by what became of them: batched, or filtered (no learning signal, or "
                 "every rollout dropped).", ["outcome"])
REWARDS = Histogram("rollstream_reward_value",
                    "Rewards assigned to rollouts that count, by where each came from (sandbox, a rule's "
                    "name, given, failed).", ["source"],
                    buckets=(-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2))
ADVANTAGES = Histogram("rollstream_reward_advantage",
                       "Advantages of the rollouts that count, over their group.",
                       buckets=(-2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2))
DROPPED = Counter("rollstream_reward_rollouts_dropped_total",
                  "Rollouts left out of their group without a reward, by cause (grading_failed, "
                  "dead_lettered, grade_timeout, filtered).", ["cause"])


@dataclass(frozen=True)
class GroupScore:
    """What completing a group decided: the rollouts that count (sorted), with their rewards, advantages and
    reward sources, and the rollouts left out, by id -> (cause, reason)."""

    rollouts: list[str]
    rewards: list[float]
    advantages: list[float]
    sources: list[str]
    drops: dict[str, tuple[str, str]]
    filtered: bool
    """No rollout counts, or (train.filter_zero_variance) all got the same reward: it is not batched."""


class GroupScoring:
    """The run's way of scoring groups: train.advantage_estimator, train.filter_zero_variance and
    reward.function (a bad one is a ValueError here, when the service starts)."""

    def __init__(self, advantage_estimator: str = "grpo", filter_zero_variance: bool = False,
                 reward_function: str | None = None) -> None:
        self.advantage_estimator = advantage_estimator
        self.filter_zero_variance = filter_zero_variance
        self.reward_function = reward_function
        self.score = resolve_reward_function(reward_function) if reward_function else None

    @property
    def uses_grades(self) -> bool:
        """Whether a rollout that needs a sandbox grade is rewarded with it (no reward.function scores every
        rollout instead): its group then waits for it."""
        return self.score is None

    def score_group(self, state: dict[str, dict]) -> GroupScore:
        """Rewards and advantages of the rollouts that count, and why each of the others is left out."""
        finished = state["finished"]
        # A rollout whose grading failed was never judged: it gets no reward, stays out of the batch and
        # the group's advantages, and its sample slot goes back to the dispatcher. So does one whose
        # events were dead-lettered or whose grade never came.
        drops = dict(state["dropped"])
        for rollout, envelope in finished.items():
            if rollout not in drops and self.uses_grades and envelope.payload.needs_grade \
                    and rollout not in state["grade"]:
                drops[rollout] = ("grading_failed", state["grading-failed"][rollout].payload.reason)
        rollouts = sorted(set(finished) - set(drops))
        rewarded = [self.reward_of(finished[rollout].payload, state["grade"].get(rollout))
                    for rollout in rollouts]
        rewards = [reward for reward, _ in rewarded]
        group_advantages = advantages(rewards, self.advantage_estimator) if rewards else []
        filtered = not rollouts or (self.filter_zero_variance and min(rewards) == max(rewards))
        if filtered and rollouts:
            no_signal = ("filtered", "every rollout of its group got the same reward: no learning signal")
            drops.update((rollout, no_signal) for rollout in rollouts)
        sources = [source for _, source in rewarded]
        return GroupScore(rollouts, rewards, group_advantages, sources, drops, filtered)

    def reward_of(self, event: TrajectoryFinished, grade: Envelope | None) -> tuple[float, str]:
        """A rollout's reward and where it came from."""
        if event.status == "failed":
            return 0.0, "failed"
        if self.score is not None:
            return float(self.score(event.response_text, event.label)), self.reward_function
        if event.needs_grade:
            return grade.payload.score, "sandbox"
        if event.reward is not None:
            return event.reward, "given"
        return reward_for(event.reward_fn, event.response_text, event.label), event.reward_fn


def count_group(score: GroupScore) -> None:
    """The group's outcome, rewards, advantages and drops in the service's metrics."""
    GROUPS.labels("filtered" if score.filtered else "batched").inc()
    for reward, advantage, source in zip(score.rewards, score.advantages, score.sources):
        REWARDS.labels(source).observe(reward)
        ADVANTAGES.observe(advantage)
    for cause, _ in score.drops.values():
        DROPPED.labels(cause).inc()
