"""The fleet's settings (`fleet.*`, RS_FLEET__*): the policy's vLLM servers, how requests reach them, and the
server groups beside them (models of their own, or more policy servers with a context of their own).

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from rollstream.shared.runtime.sections import Section
from rollstream.shared.runtime.sections.model import vllm_args_rollstream_does_not_set


class ServerGroupSettings(Section):
    policy: bool = False
    """True: the group's servers serve the policy beside fleet.urls (weight-synced with them), with the
    group's own context length and vLLM arguments, e.g. a long-context group: a session goes to a server whose
    context holds its turn. False: a model of its own (`path`), asked by name."""
    urls: list[str] = []
    """The group's servers (OpenAI-compatible, e.g. vLLM). Empty: `rollstream run` starts one."""
    path: Path | None = None
    """The model its servers serve (not for a policy group): what `rollstream serve-vllm --group NAME` and a
    local run start."""
    served_name: str | None = None
    """The model name its servers serve it under; None: the group's name."""
    max_model_len: int = Field(1024, ge=16)
    """Its servers' context length (vLLM's --max-model-len)."""
    vllm_args: list[str] = []
    """Further vLLM arguments of its servers (model.vllm_args are the policy's, not a group's)."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Timeout of one request to it."""

    @field_validator("vllm_args")
    @classmethod
    def _not_what_rollstream_sets(cls, args: list[str]) -> list[str]:
        return vllm_args_rollstream_does_not_set(args, "fleet.groups.<name>")

    @model_validator(mode="after")
    def _servers_or_a_model(self) -> ServerGroupSettings:
        if self.policy and (self.path is not None or self.served_name is not None):
            raise ValueError("a policy group serves the run's model (model.path, model.served_name): "
                             "it takes no path or served_name of its own")
        if not self.policy and not self.urls and self.path is None:
            raise ValueError("a model group needs its servers' urls, or the path of a model to serve")
        return self


class FleetSettings(Section):
    urls: list[str] = ["http://127.0.0.1:8000"]
    """vLLM servers (OpenAI-compatible, started with VLLM_SERVER_DEV_MODE=1 for weight sync). With `registry`
    they may be none: the servers that register are the fleet."""
    registry: bool = False
    """True: policy servers join and leave the fleet while the run runs. Each that `rollstream serve-policy`
    starts registers itself in the run's Redis once it answers /health, and renews that by a heartbeat; the
    fleet's clients (agent-runners, gateway, trainer) route to the registered servers besides `urls`, and the
    trainer syncs each from the next version on (shared/inference/fleet_registry.py)."""
    member_ttl_s: float = Field(10.0, ge=1, le=3600)
    """A registered server whose heartbeat (every third of this) has not renewed its registration for this
    long has left the fleet: it was killed, or its machine is gone."""
    members_refresh_s: float = Field(2.0, gt=0, le=600)
    """How often a fleet client reads which servers are registered."""
    advertise_url: str | None = Field(None, pattern=r"^https?://[^/\s]+$")
    """The URL a policy server registers, at which the other services reach it; None: http://<the address of
    this host's name>:<its port>, a container's own address in Compose, a pod's in Kubernetes."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one completion request."""
    routing_header: str = Field("X-SMG-Routing-Key", pattern=r"^[A-Za-z0-9-]+$")
    """Header that carries a session's id on every request (besides X-Session-ID), for a router in front of
    the fleet (vLLM's production-stack router, llm-d, SGLang's model gateway) to keep each session on one
    server."""
    groups: dict[str, ServerGroupSettings] = {}
    """Server groups by name: models served beside the policy (a judge, a reward model), never weight-synced,
    asked by reward functions through rollstream.shared.inference.model_groups.model_group(name); and, with
    `policy`, more policy servers with their own context length and vLLM arguments. JSON in the environment:
    RS_FLEET__GROUPS='{"judge": {"urls": ["http://judge:8000"]}, "long": {"policy": true, "max_model_len":
    32768}}'."""

    @field_validator("groups")
    @classmethod
    def _group_names(cls, groups: dict[str, ServerGroupSettings]) -> dict[str, ServerGroupSettings]:
        for name in groups:
            if not name or not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"server group name {name!r}: use letters, digits, - and _")
        return groups

    @property
    def has_policy_servers(self) -> bool:
        """Whether the run has policy servers to route to and sync: listed ones (urls, a policy group's) or
        those that register."""
        return self.registry or bool(self.urls) or any(g.policy and g.urls for g in self.groups.values())
