"""How the reward service scores a complete group: each rollout's reward and where it came from (its
sandbox grade, reward.function, a reward the episode was given, or the rule its prompt names), the group's
advantages over the rollouts that count, each role's reward and advantage in each rollout (roles.py), and
why each other rollout is left out. The book (services/reward/book.py) reads the group, and publishes and
counts what this decides.

Tests: tests/unit/services/reward/test_reward_book.py, tests/unit/services/reward/test_role_rewards.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from rollstream.services.reward.rewards import advantages, resolve_reward_function, reward_for
from rollstream.services.reward.roles import RoleScore, RoleScoring, RolloutRoles, SegmentTexts, has_signal
from rollstream.shared.contract.events import Envelope, TrajectoryFinished
from rollstream.shared.contract.roles import RunRoles

GROUPS = Counter("rollstream_reward_groups_completed_total",
                 "Prompt groups scored, by what became of them: batched, or filtered (no learning signal, or "
                 "every rollout dropped).", ["outcome"])
REWARDS = Histogram("rollstream_reward_value",
                    "Rewards of the roles of the rollouts that count (a role's own, or its rollout's), by "
                    "where each came from (sandbox, a rule's name, given, failed) and role.",
                    ["source", "role"],
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
    """No rollout counts, or (train.filter_zero_variance) no role's rewards differ between its rollouts: it
    is not batched."""
    roles: list[dict[str, RoleScore]]
    """Each rollout that counts: its roles (of its segments) -> their rewards and advantages."""


class GroupScoring:
    """The run's way of scoring groups: train.advantage_estimator, train.filter_zero_variance,
    reward.function, the run's roles and their own reward functions (a bad function is a ValueError here,
    when the service starts)."""

    def __init__(self, advantage_estimator: str = "grpo", filter_zero_variance: bool = False,
                 reward_function: str | None = None, roles: RunRoles | None = None,
                 role_reward_functions: Mapping[str, str] | None = None) -> None:
        self.advantage_estimator = advantage_estimator
        self.filter_zero_variance = filter_zero_variance
        self.reward_function = reward_function
        self.score = resolve_reward_function(reward_function) if reward_function else None
        self.roles = RoleScoring(roles, role_reward_functions, advantage_estimator)

    @property
    def uses_grades(self) -> bool:
        """Whether a rollout that needs a sandbox grade is rewarded with it (no reward.function scores every
        rollout instead): its group then waits for it."""
        return self.score is None

    def score_group(self, state: dict[str, dict], texts: SegmentTexts) -> GroupScore:
        """Rewards and advantages of the rollouts that count and of their roles, and why each of the others
        is left out. `texts` gives the response texts of the segments a role's own reward function scores."""
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
        roles = self.roles.score({rollout: self.rollout_roles(state, rollout, reward, source)
                                  for rollout, (reward, source) in zip(rollouts, rewarded)}, texts)
        filtered = not rollouts or (self.filter_zero_variance and not has_signal(roles))
        if filtered and rollouts:
            drops.update((rollout, ("filtered", no_signal(roles))) for rollout in rollouts)
        sources = [source for _, source in rewarded]
        return GroupScore(rollouts, rewards, group_advantages, sources, drops, filtered, roles)

    def rollout_roles(self, state: dict[str, dict], rollout: str, reward: float, source: str) -> RolloutRoles:
        """The rollout's segments' roles, as the ledger keeps them (`role` fields; none kept: the default
        role), and what its roles are scored with."""
        event: TrajectoryFinished = state["finished"][rollout].payload
        written = state.get("role", {})
        segment_roles = [self.roles.role_of(written.get(segment_field(rollout, event.attempt, index)))
                         for index in range(event.segment_count)]
        return RolloutRoles(segment_roles, reward, source, failed=event.status == "failed", label=event.label)

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


def no_signal(roles: list[dict[str, RoleScore]]) -> str:
    """Why a group without a learning signal is filtered out."""
    if len({role for rollout_roles in roles for role in rollout_roles}) > 1:
        return "each role of its group got the same reward in every rollout that has it: no learning signal"
    return "every rollout of its group got the same reward: no learning signal"


def count_group(score: GroupScore, role_scoring: RoleScoring) -> None:
    """The group's outcome, rewards (of each role of each rollout), advantages and drops in the service's
    metrics."""
    GROUPS.labels("filtered" if score.filtered else "batched").inc()
    for advantage, roles in zip(score.advantages, score.roles):
        for role, role_score in roles.items():
            REWARDS.labels(role_score.source, role_scoring.label_of(role)).observe(role_score.reward)
        ADVANTAGES.observe(advantage)
    for cause, _ in score.drops.values():
        DROPPED.labels(cause).inc()


def segment_field(rollout: str, attempt: str, index: int) -> str:
    """A segment's field in its group's segments hash (and, after `role:`, in its ledger)."""
    return f"{rollout}:{attempt}:{index}"
