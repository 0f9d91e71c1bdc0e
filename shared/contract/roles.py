"""The roles of a run as the contract uses them: which role a sample belongs to, the model name its turns are
sampled under, and where the fleet records the version of that role each server holds.

Every sample (TrajectorySegment, a batch row) carries its role; None stands for the run's default role
(roles.default), as in every run recorded before roles existed, so that those still replay. A role the run
does not have is an UnknownRole error that names the run's roles, wherever it enters: an agent loop's
segment, a gateway session, a dataset row, a batch row.

The fleet's versions (run_facts.FLEET_VERSIONS) are one hash: the whole policy's version a server holds
under the server's URL, an adapter's under `<role>@<url>` (version_field).

    python -m pytest tests/unit/shared/contract/test_roles.py -q
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rollstream.shared.errors import UnknownRole
from rollstream.shared.runtime.config import Settings


@dataclass(frozen=True)
class RunRoles:
    """A run's roles, from its settings (roles.*, train.lora_rank, model.served_name)."""

    names: tuple[str, ...]
    trained: tuple[str, ...]
    default: str
    lora: bool
    """Whether the trained roles are adapters over a frozen base model (train.lora_rank > 0)."""
    base_model: str
    """The name the servers serve the base model under (model.served_name)."""

    @classmethod
    def of(cls, settings: Settings) -> RunRoles:
        roles = settings.roles
        return cls(names=tuple(roles.names), trained=tuple(roles.trained), default=roles.default_role,
                   lora=settings.train.lora, base_model=settings.model.served_name)

    def resolve(self, role: str | None) -> str:
        """The role a sample naming `role` belongs to: the default for None; UnknownRole for one the run does
        not have."""
        if role is None:
            return self.default
        if role not in self.names:
            raise UnknownRole(f"role {role!r} is not one of this run's roles ({', '.join(self.names)}; "
                              "roles.names)")
        return role

    def is_trained(self, role: str | None) -> bool:
        return self.resolve(role) in self.trained

    def is_adapter(self, role: str | None) -> bool:
        """Whether the role's turns are sampled from an adapter of its own (a trained role of a LoRA run)."""
        return self.lora and self.is_trained(role)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The roles served as adapters: every trained role of a LoRA run, none of a full fine-tune."""
        return self.trained if self.lora else ()

    def served_model(self, role: str | None) -> str:
        """The model name a request for the role's turn names: its adapter, or the base model."""
        resolved = self.resolve(role)
        return resolved if self.is_adapter(resolved) else self.base_model

    def version_field(self, url: str, role: str | None) -> str:
        """The field of FLEET_VERSIONS that holds the version of the role's policy served by `url`."""
        resolved = self.resolve(role)
        return version_field(url, resolved if self.is_adapter(resolved) else None)

    def served_version(self, versions: Mapping[str, int], url: str, role: str | None) -> int:
        """The version of the role's policy that `url` serves, as FLEET_VERSIONS holds it (0: none recorded,
        the starting one; a frozen role's is always 0)."""
        if not self.is_trained(role):
            return 0
        return versions.get(self.version_field(url, role), 0)


ONE_POLICY = RunRoles.of(Settings.model_construct())
"""The roles of a run that configures none (the defaults, read from no environment): one trained role, the
whole policy."""


def version_field(url: str, adapter: str | None) -> str:
    """The field of FLEET_VERSIONS for the whole policy (adapter None) or an adapter served by `url`."""
    return url if adapter is None else f"{adapter}@{url}"


def served_versions(url: str, version: int, adapters: Mapping[str, int]) -> dict[str, int]:
    """The FLEET_VERSIONS fields of a server at `url` that serves the policy's `version` and each adapter of
    `adapters` (role -> version) at its version."""
    return {url: version, **{version_field(url, role): adapter for role, adapter in adapters.items()}}


def split_version_field(field: str) -> tuple[str, str | None]:
    """(url, adapter or None) of a FLEET_VERSIONS field."""
    adapter, at, url = field.partition("@")
    if at and "://" not in adapter:
        return url, adapter
    return field, None
