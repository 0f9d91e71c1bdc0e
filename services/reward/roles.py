"""How the reward service scores the roles of a group (roles.*): which role each segment belongs to, each
role's reward in a rollout (its own reward function's, roles.names.<role>.reward_function, of the text of
the role's last segment in the rollout and the prompt's label; else the rollout's reward), its advantage
over that role's samples of the group (the rollouts with at least one segment of the role), and whether any
role of the group has a learning signal. scoring.py applies it to each complete group; a run of one role
(every run recorded before roles existed) scores as it did: its role's rewards and advantages are the
rollouts'.

A segment naming a role the run does not have keeps that role as written: it is scored like a role without
a reward function of its own, and its batch rows carry it, for the trainer to refuse; the reward service
does not stop on it.

Tests: tests/unit/services/reward/test_role_rewards.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rollstream.services.reward.rewards import RewardFunction, advantages, resolve_reward_function
from rollstream.shared.contract.roles import ONE_POLICY, RunRoles
from rollstream.shared.errors import UnknownRole
from rollstream.shared.runtime.sections.roles import RolesSettings

UNKNOWN_ROLE_LABEL = "unknown"
"""The metric label of a role the run does not have: a segment's role is not a label's to multiply."""

SegmentTexts = Callable[[list[tuple[str, int]]], list[str]]
"""The response texts of segments of the rollouts' finished attempts, by (rollout id, segment index)."""


@dataclass(frozen=True)
class RoleScore:
    """A role's part in one rollout: what its segments are trained with."""

    reward: float
    advantage: float
    """Relative to the role's rewards in the other rollouts of the group that have the role."""
    source: str
    """Where the reward came from: the role's own reward function, or the rollout's reward's source."""
    own: bool
    """Scored by the role's own reward function, not given the rollout's reward."""


@dataclass(frozen=True)
class RolloutRoles:
    """What scoring a rollout's roles needs of it."""

    segment_roles: list[str]
    """The role of each of its segments, by segment index, resolved (RoleScoring.role_of)."""
    reward: float
    source: str
    failed: bool
    """A failed rollout's roles are rewarded 0, as the rollout is, whatever their reward function."""
    label: str | None


def role_reward_functions(roles: RolesSettings) -> dict[str, str]:
    """Each role that has a reward function of its own -> the function's spec."""
    return {name: role.reward_function for name, role in roles.names.items() if role.reward_function}


class RoleScoring:
    """The run's roles and the reward functions of those that have their own, resolved when the service
    starts (a bad one is a ValueError that names the role)."""

    def __init__(self, roles: RunRoles | None = None, reward_functions: Mapping[str, str] | None = None,
                 advantage_estimator: str = "grpo") -> None:
        self.roles = roles or ONE_POLICY  # a book built without settings
        self.reward_functions = dict(reward_functions or {})
        self.advantage_estimator = advantage_estimator
        self.scores: dict[str, RewardFunction] = {}
        for role, spec in self.reward_functions.items():
            if role not in self.roles.names:
                raise ValueError(f"reward function {spec!r} of role {role!r}: the run has no such role "
                                 f"({', '.join(self.roles.names)})")
            try:
                self.scores[role] = resolve_reward_function(spec)
            except ValueError as exc:
                raise ValueError(f"roles.names.{role}.reward_function: {exc}") from exc

    def role_of(self, written: str | None) -> str:
        """The role a segment naming `written` belongs to: the default for None, an unknown one as written."""
        try:
            return self.roles.resolve(written)
        except UnknownRole:
            return written

    def label_of(self, role: str) -> str:
        """The role as a metric label."""
        return role if role in self.roles.names else UNKNOWN_ROLE_LABEL

    def score(self, rollouts: Mapping[str, RolloutRoles], texts: SegmentTexts) -> list[dict[str, RoleScore]]:
        """Each rollout's roles (in the order of `rollouts`) -> their rewards and advantages, each role's
        advantages over the rollouts that have it."""
        own = self.own_rewards(rollouts, texts)
        by_role: dict[str, list[tuple[int, float, str, bool]]] = {}
        for position, (rollout, scored) in enumerate(rollouts.items()):
            for role in sorted(set(scored.segment_roles)):
                if role in own[rollout]:
                    entry = (position, own[rollout][role], self.source_of(role, scored), True)
                else:
                    entry = (position, scored.reward, scored.source, False)
                by_role.setdefault(role, []).append(entry)
        out: list[dict[str, RoleScore]] = [{} for _ in rollouts]
        for role, entries in sorted(by_role.items()):
            role_advantages = advantages([reward for _, reward, _, _ in entries], self.advantage_estimator)
            for (position, reward, source, is_own), advantage in zip(entries, role_advantages):
                out[position][role] = RoleScore(reward, advantage, source, is_own)
        return out

    def source_of(self, role: str, scored: RolloutRoles) -> str:
        return "failed" if scored.failed else self.reward_functions[role]

    def own_rewards(self, rollouts: Mapping[str, RolloutRoles],
                    texts: SegmentTexts) -> dict[str, dict[str, float]]:
        """Each rollout -> the reward of each of its roles that has a reward function of its own: that
        function of the text of the role's last segment in the rollout and the prompt's label (0 in a failed
        rollout). A function's error propagates, as reward.function's does: it is never a reward."""
        out: dict[str, dict[str, float]] = {rollout: {} for rollout in rollouts}
        wanted: list[tuple[str, str, int]] = []
        for rollout, scored in rollouts.items():
            last = {role: index for index, role in enumerate(scored.segment_roles) if role in self.scores}
            if scored.failed:
                out[rollout].update((role, 0.0) for role in last)
            else:
                wanted.extend((rollout, role, index) for role, index in sorted(last.items()))
        if not wanted:
            return out
        for (rollout, role, _), text in zip(wanted, texts([(rollout, index) for rollout, _, index in wanted]),
                                            strict=True):
            out[rollout][role] = float(self.scores[role](text, rollouts[rollout].label))
        return out


def has_signal(scores: list[dict[str, RoleScore]]) -> bool:
    """Whether some role's rewards differ between the rollouts that have it."""
    rewards: dict[str, set[float]] = {}
    for roles in scores:
        for role, score in roles.items():
            rewards.setdefault(role, set()).add(score.reward)
    return any(len(values) > 1 for values in rewards.values())
