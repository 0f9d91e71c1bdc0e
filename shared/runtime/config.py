"""Configuration of a run: one settings model that every service and the local run read.

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
from typing import Any, Literal, get_args
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from rollstream.shared.runtime.console_settings import ConsoleSettings
from rollstream.shared.runtime.sections import Section


class BusSettings(Section):
    max_deliveries: int = Field(5, ge=1)
    """Deliveries of one entry before it goes to the run's dead-letter stream."""
    reclaim_idle_ms: int = Field(30_000, ge=100)
    """An entry pending this long on a consumer is taken over by a live one (XAUTOCLAIM)."""
    block_ms: int = Field(500, ge=1)
    """How long one read waits for new entries."""
    read_count: int = Field(64, ge=1)
    """Entries fetched per read."""
    cluster: bool = False
    """The Redis URL names a node of a Redis Cluster: the client finds the others and routes each command to
    the node holding its key (every key of a run is in one hash slot: `rs:{<run_id>}:...`)."""
    job_queue_url: str | None = None
    """A Redis of its own for the sandbox-grader's job queue (RQ), redis://host:port/db with no credentials
    (the bus's user and password are used there too): RQ does not run on a Redis Cluster, so a run on one
    needs it. None: the bus's Redis."""

    @field_validator("job_queue_url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss", "unix") or parts.username or parts.password:
                raise ValueError("bus.job_queue_url is a redis:// URL without credentials (the bus's are "
                                 "used)")
        return url


class ModelSettings(Section):
    path: Path = Path("models/tiny-llama-warm")
    """HF model directory the run starts from; the default, the tiny model after a short supervised warm-up
    (`rollstream build-model`, `rollstream warmup`), is made by `rollstream run` when missing."""
    served_name: str = "tiny"
    """Model name the vLLM servers serve it under."""
    max_model_len: int = Field(1024, ge=16)
    """The served context length, as vLLM's --max-model-len (the local run starts vLLM with it); the gateway
    asks for no more tokens than the prompt leaves of it."""
    vllm_args: list[str] = []
    """Further command-line arguments of every vLLM server rollstream starts (the local run, `rollstream
    serve-policy`, Compose's CPU server), as vLLM spells them: ["--max-num-seqs", "64"]. A compilation
    argument (-O, -cc, --compilation-config) replaces the CPU build's --enforce-eager. What rollstream sets
    itself (the model, its name, host, port, context length, dtype) comes from its own settings instead."""

    @field_validator("vllm_args")
    @classmethod
    def _not_what_rollstream_sets(cls, args: list[str]) -> list[str]:
        return vllm_args_rollstream_does_not_set(args, "model")


def vllm_args_rollstream_does_not_set(args: list[str], section: str) -> list[str]:
    """`args`, unless one is a vLLM argument rollstream sets from its own settings (those of `section`)."""
    owned = {"--model": f"{section}.path", "--served-model-name": f"{section}.served_name",
             "--host": "listen_host", "--port": "the server's port",
             "--max-model-len": f"{section}.max_model_len",
             "--dtype": "float32, which the trainer's parity probe needs"}
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in owned:
            raise ValueError(f"{name} is set by rollstream ({owned[name]}), not in {section}.vllm_args")
    return args


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
    """vLLM servers (OpenAI-compatible, started with VLLM_SERVER_DEV_MODE=1 for weight sync)."""
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


class DataSettings(Section):
    path: Path | None = None
    """Prompt dataset (.parquet or .jsonl, a `prompt` column); None: the synthetic arithmetic task."""
    samples_per_prompt: int = Field(8, ge=1)
    """Samples per prompt group (n)."""
    synthetic_prompts: int = Field(1000, ge=1)
    """Size of the synthetic arithmetic dataset."""
    synthetic_sandbox_every: int = Field(4, ge=0)
    """Every k-th synthetic prompt is graded by a sandboxed check instead of a rule; 0: none."""
    seed: int = 0
    """Seed of the synthetic dataset and of the prompt order."""


class RolloutSettings(Section):
    max_tokens: int = Field(32, ge=1)
    """Tokens generated per turn."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    concurrency: int = Field(32, ge=1)
    """Episodes one agent-runner replica runs at once."""
    seed: int | None = None
    """Black-box episodes: when set, every turn of a rollout's gateway session is sampled with a seed derived
    from it and the rollout id (the sample's metadata says it: sampling_seed), so a recorded turn can be sampled
    again, id for id. None: vLLM draws its own."""


class AgentSettings(Section):
    default: str = "tool_agent"
    """Agent loop of rows that name none: a registered name or package.module:function."""
    tool_format: str = "hermes"
    """How the model writes tool calls (see shared/agent/tool_calls.py)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode."""
    max_total_tokens: int = Field(1024, ge=16)
    """Context budget of one segment: prompt, responses and observations."""
    tool_concurrency: int = Field(8, ge=1)
    """Tool calls of one episode run at once."""
    max_tool_output_chars: int = Field(16_384, ge=64)
    """Tool results are cut to this length before the model sees them."""
    tool_timeout_s: float = Field(60.0, gt=0)
    """Time limit of one tool call."""
    tools_yaml: Path | None = None
    """Extra tools from a YAML file (see shared/agent/tools.py)."""
    command: str | None = None
    """Command line of black-box episodes (rows whose agent is `command`) that name none in metadata["command"]:
    an unmodified agent run in the task's sandbox, in its repository, through the gateway, `{task_file}` and
    `{model}` filled in (see services/agent_runner/blackbox.py)."""
    command_time_budget_s: float = Field(600.0, gt=0)
    """Wall-clock budget of a black-box episode whose row sets no metadata["time_budget_s"]; then its command is
    killed and the episode is truncated."""
    command_sandbox: Literal["bubblewrap", "docker"] | None = None
    """Sandbox a black-box episode's command runs in (its own network-less sandbox with the task's workspace at the
    task's WORKDIR; see services/agent_runner/agent_sandbox.py): bubblewrap or docker (the task's image); None: the
    grader's, grader.backend."""
    command_memory_mb: int = Field(8192, ge=256)
    """Memory of a black-box episode's sandbox: under bubblewrap what each process may map writable
    (RLIMIT_DATA), under docker the container's memory limit. Claude Code 2.1 (Bun) needs more than 512 MiB to
    start (`claude --version`), the grader's default."""
    command_runtime_dir: Path | None = None
    """Host directory holding the black-box agent's own runtime (a node_modules with its CLI, a virtualenv made with
    the sandbox's python3, static binaries in bin/), mounted read-only at /opt/agent in the sandbox, with
    /opt/agent/bin and /opt/agent/node_modules/.bin first on PATH. None: the command finds only what the sandbox
    has (bubblewrap: the host's /usr; docker: the task's image)."""


class TrainSettings(Section):
    batch_size: int = Field(32, ge=1)
    """Samples per train batch (B); a multiple of data.samples_per_prompt."""
    max_staleness: int = Field(1, ge=0)
    """eta: samples may be this many policy versions old; 0 is synchronous on-policy training."""
    total_versions: int = Field(30, ge=1)
    """Policy versions (train steps) in the run; the dispatcher admits batch_size x this samples."""
    learning_rate: float = Field(3e-4, ge=0)
    """Adam learning rate; 0 leaves the weights as they are (a control run: same pipeline, no learning)."""
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range."""
    loss_aggregation: Literal["token", "rollout"] = "token"
    """token: every sampled token weighs the same; rollout: every rollout (all its segments) weighs the same."""
    decoupled: bool = True
    """Decoupled PPO (AReaL): clip against the trainer's policy before the step (proximal), correct for the
    rollout policy with an importance weight; off: clip against the rollout logprobs (plain PPO)."""
    importance_weight_cap: float | None = Field(5.0, gt=0)
    """Truncation of the proximal/behaviour importance weight; None: no cap."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per batch: the batch's rollouts are split into this many minibatches."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch; gradients accumulate over a minibatch's micro-batches."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (starting) model; 0: no reference model is loaded."""
    advantage_estimator: Literal["grpo", "dr_grpo"] = "grpo"
    """grpo: (r - mean) / std over a group's rollouts; dr_grpo: r - mean (no std scaling)."""
    filter_zero_variance: bool = False
    """Leave out groups whose rollouts all got the same reward (no signal); their samples are re-admitted."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Trainer backend: plain torch (CPU or one GPU) or DeepSpeed ZeRO."""
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage when backend is deepspeed."""
    ranks: int = Field(1, ge=1)
    """Data-parallel trainer processes on this node (one per GPU): rollstream-trainer starts them under
    torchrun, which starts them all again when one fails. Several need backend deepspeed. Under a launcher of
    your own (torchrun or deepspeed over several nodes) its WORLD_SIZE counts instead."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
    """Where training metrics go; TensorBoard logs to <storage>/<run>/tensorboard. wandb and mlflow need their
    package installed and are configured by their own environment variables (WANDB_*, MLFLOW_*)."""
    parity_tolerance: float = Field(1e-3, gt=0)
    """Max |vLLM - trainer| prompt logprob on the probe after a weight sync."""
    sync_concurrency: int = Field(16, ge=1)
    """Servers a weight sync reloads and probes at once (each paused only while it loads); 1: one by one."""
    seed: int = 0
    """Seed of the trainer."""

    @model_validator(mode="after")
    def _several_ranks_need_deepspeed(self) -> TrainSettings:
        if self.ranks > 1 and self.backend != "deepspeed":
            raise ValueError(f"train.ranks={self.ranks} needs train.backend='deepspeed': the torch backend "
                             "trains on one process")
        return self


class GraderSettings(Section):
    backend: Literal["bubblewrap", "docker"] = "bubblewrap"
    """Sandbox of the grader: bubblewrap (no daemon needed) or docker (an engine must be reachable)."""
    queue: str = "sandbox"
    """RQ queue of sandbox jobs."""
    retries: int = Field(3, ge=0)
    """Retries of a grading job whose sandbox failed to run (never of failing tests)."""
    wall_time_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one check."""
    memory_mb: int = Field(512, ge=16)
    """Memory limit of one check (per process under bubblewrap: RLIMIT_DATA)."""
    job_timeout_s: int = Field(60, ge=1)
    """RQ job timeout."""
    probe_interval_s: float = Field(30.0, gt=0)
    """How often a grading sandbox-grader runs a trivial command in a real sandbox to tell whether its backend
    still works (/healthz 503 with the reason when not); one that is not ready yet tries every 5 s."""


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


SECRET_MASK = "**********"
"""How pydantic prints a SecretStr; read back as a value, it is a dump's mask, never the secret."""


def _secret_input(value: Any) -> Any:
    """An empty secret is no secret (compose writes `${VAR:-}` as ""); a masked one is refused, because a
    dump of the settings read back would otherwise connect with the mask as its password."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value == "":
        return None
    if value == SECRET_MASK:
        raise ValueError("this is the masked form of a secret (a dump of the settings read back): "
                         "set the secret itself, e.g. through its environment variable")
    return value


class SecuritySettings(Section):
    # a rejected value must not be echoed into a log by the validation error
    model_config = ConfigDict(hide_input_in_errors=True)

    http_token: SecretStr | None = Field(None, min_length=16, max_length=4096)
    """Bearer token (`Authorization: Bearer <token>`) every HTTP route of a service asks for, except /healthz
    and /openapi.json; unset: the routes are open."""
    metrics_token: SecretStr | None = Field(None, min_length=16, max_length=4096)
    """Bearer token of /metrics when a scraper has its own; unset: /metrics asks for http_token."""
    metrics_open: bool = False
    """Serve /metrics without a token even when tokens are set (a scraper on a trusted network)."""

    @field_validator("http_token", "metrics_token", mode="before")
    @classmethod
    def _no_masked_or_empty_secrets(cls, value: Any) -> Any:
        return _secret_input(value)


class GatewaySettings(Section):
    url: str = "http://127.0.0.1:8300"
    """Where agents and the black-box agent-runner reach the gateway (its sessions API and the per-session
    OpenAI / Anthropic endpoints under /s/{session}/)."""
    port: int = Field(8300, ge=0, le=65535)
    """Port the gateway serves its APIs on; 0: any free port."""
    session_ttl_s: int = Field(86_400, ge=60)
    """How long a session's state stays in Redis after its last request (a session with a time budget: no
    longer than finish_grace_s past its deadline); a finished session's turns are deleted once its samples are
    published."""
    finish_grace_s: float = Field(300.0, gt=0)
    """How long a session with a time budget can still be finished after its deadline (turns are refused from
    the deadline on): the agent-runner finishes it once the budget has killed the agent, its log is stored and
    its diff taken. Then the session ends, finished or not (its agent-runner may have died): its state expires
    and nothing of it is published."""
    max_prompt_tokens: int = Field(32_768, ge=16)
    """Longest prompt a turn may send (history plus new messages); longer gets 400, never a truncation."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """The most tokens one turn samples, whatever the agent asks for (coding agents ask 32000 a turn): the
    run's cap on a response, as rollout.max_tokens is for rollstream's own agents; a turn it cuts ends as the
    API's max-tokens stop. None: what the agent asks, up to the room the context leaves."""
    strict_tools: bool = False
    """Refuse (400) a request with tools the model cannot be shown as functions (hosted tools such as web
    search or code execution, which the API provider would run); False: leave them out, say so in the log and
    in the response's x-rollstream-ignored-tools header."""
    on_rewritten_history: Literal["continue", "fork"] = "continue"
    """When the chat template renders a session's answered history differently once more follows (Qwen3-style
    templates drop earlier turns' reasoning): "continue" keeps the recorded ids, exactly what the model saw
    and sampled, and says so in the sample's metadata (history_rewritten_turns); "fork" starts a new
    conversation rendered as the template now renders it (one more sample of the rollout)."""


class RecorderSettings(Section):
    enabled: bool = True
    """Archive every stream of the run to Parquet under <storage>/<run>/archive (the local run starts the
    recorder service)."""
    flush_s: float = Field(5.0, gt=0)
    """Seconds between flushes of every stream to the archive."""
    part_entries: int = Field(2000, ge=1)
    """Most entries per Parquet part; a stream this far behind is flushed at once."""
    trim: bool = True
    """Trim live streams behind the archive and the slowest consumer group (Redis memory stays bounded)."""


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
    """IP address the services' /healthz and /metrics and the gateway's APIs listen on. 127.0.0.1: this machine
    alone (the local run, a service started by hand); 0.0.0.0 (:: for IPv6): every interface, for a network of
    its own (docker-compose.yml sets it for its containers); set the security tokens where others can reach it."""
    log_level: str = "INFO"
    """Log level of the services."""
    bus: BusSettings = BusSettings()
    model: ModelSettings = ModelSettings()
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
        return _secret_input(value)

    @field_validator("listen_host")
    @classmethod
    def _an_ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"listen_host {value!r} is not an IP address (127.0.0.1, 0.0.0.0, ::1, ...)") from None
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
    def _batch_holds_whole_groups(self) -> "Settings":
        if self.train.batch_size % self.data.samples_per_prompt:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of "
                f"data.samples_per_prompt ({self.data.samples_per_prompt}): batches hold whole groups"
            )
        if self.train.filter_zero_variance and self.data.samples_per_prompt < 2:
            raise ValueError("train.filter_zero_variance needs data.samples_per_prompt >= 2: a group of one "
                             "rollout has no reward variance, so every sample would be filtered out")
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
            raise RuntimeError("no Redis configured: set RS_REDIS_URL (the local run sets it for its services)")
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

    def longest_policy_context(self) -> int:
        """The longest context a policy server holds (model.max_model_len, or a policy group's)."""
        return max([self.model.max_model_len,
                    *(group.max_model_len for group in self.fleet.groups.values() if group.policy)])

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


def reference_markdown() -> str:
    """The configuration reference as a Markdown table (for the README)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                walk(annotation, f"{prefix}{name.upper()}__")
                continue
            default = field.default
            shown = json.dumps(default) if not isinstance(default, Path) else str(default)
            meaning = " ".join((field.description or "").split())
            rows.append(f"| `{prefix}{name.upper()}` | `{shown}` | {meaning} |")

    walk(Settings, "RS_")
    return "\n".join(rows)
