"""Configuration of a run: one settings model that every service and the local run read, `Settings`: the run's
own fields (its id, Redis, storage, where services listen) and one section per concern, each in a module of
its own (sections/: bus, model, roles, fleet, data, rollout, agent, train, grader, reward, recorder, gateway,
console, security).

Values come, highest first, from environment variables (`RS_` prefix, `__` between sections:
`RS_TRAIN__BATCH_SIZE=32`), from the JSON file named by `RS_CONFIG_FILE` (the local run writes
the resolved config there for its services), and from the defaults below.
`rollstream config` prints the resolved values; `rollstream config --markdown` the reference table.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any, get_args
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_core import to_jsonable_python
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from rollstream.shared.runtime.sections import Section
from rollstream.shared.runtime.sections.agent import AgentSettings
from rollstream.shared.runtime.sections.bus import BusSettings
from rollstream.shared.runtime.sections.console import ConsoleSettings
from rollstream.shared.runtime.sections.data import DataSettings
from rollstream.shared.runtime.sections.fleet import FleetSettings, ServerGroupSettings
from rollstream.shared.runtime.sections.gateway import GatewaySettings
from rollstream.shared.runtime.sections.grader import GraderSettings
from rollstream.shared.runtime.sections.model import ModelSettings
from rollstream.shared.runtime.sections.recorder import RecorderSettings
from rollstream.shared.runtime.sections.reward import RewardSettings
from rollstream.shared.runtime.sections.roles import RoleSettings, RolesSettings
from rollstream.shared.runtime.sections.rollout import RolloutSettings
from rollstream.shared.runtime.sections.security import SecuritySettings, secret_input
from rollstream.shared.runtime.sections.train import TrainSettings

__all__ = [
    "Settings", "reference_markdown", "settings_json_without_secrets", "secret_environment", "redact_url",
    # its sections (sections/), in the order Settings holds them
    "BusSettings", "ModelSettings", "RolesSettings", "RoleSettings", "FleetSettings", "ServerGroupSettings",
    "DataSettings", "RolloutSettings",
    "AgentSettings", "TrainSettings", "GraderSettings", "RewardSettings", "RecorderSettings",
    "GatewaySettings", "ConsoleSettings", "SecuritySettings",
]


class Settings(BaseSettings):
    """Everything a run is configured by."""

    # hide_input_in_errors: a rejected redis_password must not be echoed into a log by the validation error
    model_config = SettingsConfigDict(
        env_prefix="RS_", env_nested_delimiter="__", extra="forbid", use_attribute_docstrings=True,
        hide_input_in_errors=True,
    )

    run_id: str = "local"
    """Run namespace: streams are rs:{<run_id>}:* (the braces make every key of a run one Redis Cluster hash
    slot)."""
    redis_url: str | None = None
    """Redis to use, without credentials (a user and password written in it move to the two fields below);
    unset: the local run starts an embedded one."""
    redis_username: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[^\s:@/]+$")
    """Redis ACL user the service connects as (compose: one per service, infra/redis-users.acl); unset:
    Redis's default user."""
    redis_password: SecretStr | None = Field(None, min_length=1, max_length=1024)
    """Password of that user; unset: none (the local run's embedded Redis then asks for none)."""
    storage_uri: str = "runs"
    """Where batches, checkpoints and logs go (a directory)."""
    health_port: int = Field(0, ge=0)
    """Port of a service's /healthz and /metrics; 0: any free port."""
    listen_host: str = "127.0.0.1"
    """IP address the services' /healthz and /metrics and the gateway's APIs listen on. 127.0.0.1: this
    machine alone (the local run, a service started by hand); 0.0.0.0 (:: for IPv6): every interface, for a
    network of its own (docker-compose.yml sets it for its containers); set the security tokens where others
    can reach it."""
    log_level: str = "INFO"
    """Log level of the services."""
    bus: BusSettings = BusSettings()
    model: ModelSettings = ModelSettings()
    roles: RolesSettings = RolesSettings()
    fleet: FleetSettings = FleetSettings()
    data: DataSettings = DataSettings()
    rollout: RolloutSettings = RolloutSettings()
    agent: AgentSettings = AgentSettings()
    train: TrainSettings = TrainSettings()
    grader: GraderSettings = GraderSettings()
    reward: RewardSettings = RewardSettings()
    recorder: RecorderSettings = RecorderSettings()
    gateway: GatewaySettings = GatewaySettings()
    console: ConsoleSettings = ConsoleSettings()
    security: SecuritySettings = SecuritySettings()

    @field_validator("redis_password", mode="before")
    @classmethod
    def _no_masked_or_empty_password(cls, value: Any) -> Any:
        return secret_input(value)

    @field_validator("listen_host")
    @classmethod
    def _an_ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"listen_host {value!r} is not an IP address "
                             "(127.0.0.1, 0.0.0.0, ::1, ...)") from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_the_url(cls, data: Any) -> Any:
        """redis://user:password@host/0 works as users write it, but the password is kept in redis_password
        (a secret, masked wherever settings are shown) and the URL keeps only where Redis is."""
        if not isinstance(data, dict) or not isinstance(data.get("redis_url"), str):
            return data
        parts = urlsplit(data["redis_url"])
        if parts.username is None and parts.password is None:
            return data
        for field, value in (("redis_username", parts.username), ("redis_password", parts.password)):
            if value:
                if data.get(field) not in (None, ""):
                    raise ValueError(f"{field} is set twice, in redis_url and on its own: keep one")
                data = {**data, field: unquote(value)}
        host = parts.netloc.rpartition("@")[2]
        return {**data, "redis_url": urlunsplit(parts._replace(netloc=host))}

    @model_validator(mode="after")
    def _batch_holds_whole_groups(self) -> Settings:
        if self.train.batch_size % self.data.samples_per_prompt:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of "
                f"data.samples_per_prompt ({self.data.samples_per_prompt}): batches hold whole groups"
            )
        if self.train.filter_zero_variance and self.data.samples_per_prompt < 2:
            raise ValueError("train.filter_zero_variance needs data.samples_per_prompt >= 2: a group of one "
                             "rollout has no reward variance, so every sample would be filtered out")
        return self

    @model_validator(mode="after")
    def _roles_the_model_can_serve(self) -> Settings:
        roles = self.roles
        if not self.train.lora:
            trained = roles.trained
            if len(trained) > 1:
                raise ValueError(f"roles {', '.join(trained)} are all trained, but a full fine-tune trains "
                                 "one policy: set train.lora_rank (e.g. 16) to train an adapter per role")
            frozen = [name for name, role in roles.names.items() if not role.trained]
            if frozen:
                raise ValueError(f"frozen role {frozen[0]!r} is served by the base model, which a full "
                                 "fine-tune changes: set train.lora_rank to train adapters over a frozen "
                                 "base")
        if self.model.served_name in roles.names:
            raise ValueError(f"role {self.model.served_name!r} has the name the base model is served under "
                             "(model.served_name): the servers could not tell the adapter from the model")
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _ConfigFileSource(settings_cls)

    @property
    def redis(self) -> str:
        """The URL to connect with, credentials included: hand it to a client, never print it (redis_url
        says where Redis is)."""
        if not self.redis_url:
            raise RuntimeError("no Redis configured: set RS_REDIS_URL "
                               "(the local run sets it for its services)")
        if self.redis_username is None and self.redis_password is None:
            return self.redis_url
        userinfo = quote(self.redis_username or "", safe="")
        if self.redis_password is not None:
            userinfo += ":" + quote(self.redis_password.get_secret_value(), safe="")
        parts = urlsplit(self.redis_url)
        return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))

    def run_dir(self) -> Path:
        return Path(self.storage_uri) / self.run_id

    def policy_servers(self) -> dict[str, int]:
        """The policy's servers, fleet.urls and the policy groups', each with its context length."""
        servers = dict.fromkeys(self.fleet.urls, self.model.max_model_len)
        for group in self.fleet.groups.values():
            if group.policy:
                servers.update(dict.fromkeys(group.urls, group.max_model_len))
        return servers

    @property
    def url_host(self) -> str:
        """The host of a URL by which a process on this machine reaches what listens on listen_host: loopback
        for a wildcard address, an IPv6 address in brackets."""
        address = ipaddress.ip_address(self.listen_host)
        if address.is_unspecified:
            address = ipaddress.ip_address("127.0.0.1" if address.version == 4 else "::1")
        return str(address) if address.version == 4 else f"[{address}]"


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The JSON file named by RS_CONFIG_FILE."""

    def get_field_value(self, field, field_name):  # unused: __call__ returns the whole file
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("RS_CONFIG_FILE")
        if not path:
            return {}
        try:
            return json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"RS_CONFIG_FILE={path}: {exc}") from exc


def _secret_fields(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the SecretStr fields of a settings model, sections included."""
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            out += _secret_fields(annotation, (*path, name))
        elif annotation is SecretStr or SecretStr in get_args(annotation):
            out.append((*path, name))
    return out


def settings_json_without_secrets(settings: Settings) -> str:
    """The resolved settings as JSON for a config file (RS_CONFIG_FILE), every secret left out: the
    processes that read it get their secrets from `secret_environment`."""
    exclude: dict[str, Any] = {}
    for path in _secret_fields(Settings):
        node = exclude
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = True
    return settings.model_dump_json(indent=2, exclude=exclude)


def secret_environment(settings: Settings) -> dict[str, str]:
    """The configured secrets as the RS_* variables that set them, for a child process's environment."""
    out = {}
    for path in _secret_fields(Settings):
        value: Any = settings
        for part in path:
            value = getattr(value, part)
        if value is not None:
            out["RS_" + "__".join(path).upper()] = value.get_secret_value()
    return out


def redact_url(url: str) -> str:
    """A URL fit for a message: its password, if it has one, replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}"))


_MARKDOWN_SPECIALS = str.maketrans({"|": r"\|", "<": "&lt;", ">": "&gt;", "*": r"\*"})


def _markdown_cell(text: str) -> str:
    """A description as one table cell: its code spans kept as written, the rest escaped, so that a `|` does
    not end the cell, `<run_id>` is not taken for an HTML tag and `WANDB_*` does not start emphasis."""
    pieces = text.split("`")
    return "`".join(piece if inside_code else piece.translate(_MARKDOWN_SPECIALS)
                    for piece, inside_code in zip(pieces, [False, True] * len(pieces)))


def reference_markdown() -> str:
    """The configuration reference as a Markdown table (docs/configuration.md)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                walk(annotation, f"{prefix}{name.upper()}__")
                continue
            default = field.default
            shown = json.dumps(to_jsonable_python(default)) if not isinstance(default, Path) else str(default)
            meaning = _markdown_cell(" ".join((field.description or "").split()))
            rows.append(f"| `{prefix}{name.upper()}` | `{shown}` | {meaning} |")

    walk(Settings, "RS_")
    return "\n".join(rows)
