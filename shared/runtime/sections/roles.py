"""The roles of a run (`roles.*`, RS_ROLES__*): who produces an episode's turns, and what of it is trained.

A role names a policy an agent's turns are sampled from. With a full fine-tune (train.lora_rank 0) the run
has one trained role, the policy itself. With LoRA (train.lora_rank > 0) every trained role is an adapter of
its own over the one base model, named after the role, served by the same fleet (each request names its
adapter as the model), trained on its own turns with an optimizer state of its own, and synced on its own;
a frozen role is served by the base model without an adapter, and is never trained or synced.

An agent loop chooses the role of each segment (shared/agent/loop.py), a gateway session is opened for a role,
a dataset row may name the role its episode's turns take; none named: `roles.default`.

    python -m pytest tests/unit/shared/runtime/test_config.py -q -k role
"""

from __future__ import annotations

import re

from pydantic import field_validator, model_validator

from rollstream.shared.runtime.sections import Section

ROLE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
"""A role's name: also its adapter's name on the servers, a Parquet value and a metric label."""


class RoleSettings(Section):
    trained: bool = True
    """False: a frozen role, sampled from the base model (train.lora_rank > 0), never trained or synced: a
    judge, a user simulator, a fixed opponent."""
    reward_function: str | None = None
    """How the role's samples are scored, when not by the rollout's reward: a reward function (a built-in
    name or module:function, as reward.function) of the text of the role's last segment in the rollout and the
    prompt's label. None: the role's samples get the rollout's reward (a team's shared outcome)."""


class RolesSettings(Section):
    names: dict[str, RoleSettings] = {"policy": RoleSettings()}
    """The run's roles by name (lowercase letters, digits, - and _). JSON in the environment:
    RS_ROLES__NAMES='{"planner": {}, "solver": {}, "critic": {"trained": false}}'. Several trained roles need
    train.lora_rank > 0 (one adapter each)."""
    default: str | None = None
    """The role of a turn whose agent, session or row names none; None: the first of `names`."""

    @field_validator("names")
    @classmethod
    def _role_names(cls, names: dict[str, RoleSettings]) -> dict[str, RoleSettings]:
        if not names:
            raise ValueError("roles.names needs at least one role")
        for name in names:
            if not ROLE_NAME.match(name):
                raise ValueError(f"role name {name!r}: use lowercase letters, digits, - and _ (up to 40, "
                                 "starting with a letter)")
        if not any(role.trained for role in names.values()):
            raise ValueError("roles.names has no trained role: at least one must be trained")
        return names

    @model_validator(mode="after")
    def _default_is_a_role(self) -> RolesSettings:
        if self.default is not None and self.default not in self.names:
            raise ValueError(f"roles.default {self.default!r} is not one of roles.names "
                             f"({', '.join(self.names)})")
        return self

    @property
    def default_role(self) -> str:
        return self.default or next(iter(self.names))

    @property
    def trained(self) -> list[str]:
        """The trained roles, in the order they are listed."""
        return [name for name, role in self.names.items() if role.trained]
