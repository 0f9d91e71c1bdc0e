"""Agent loops: how an episode turns into trainable samples, token-exactly.

An agent loop is an async function `agent(task, ctx) -> Segment | list[Segment]`. The agent-runner
picks it per dataset row by the row's `agent` name (`AGENTS`, `register_agent`) or an import path
(`package.module:function`). A loop that returns several segments (subagent branches, the context
before a compaction, the final segment) returns one rollout: they share its rollout id, reward and
advantage.

A segment (shared/contract/rollouts.py) records each generation as the TrajectoryTurn and each tool call
as the TrajectoryTool the agent-runner publishes for it.

`TokenTrajectory` keeps the one rule: tokens the model sampled are appended as sampled, with their
logprobs and loss_mask 1, never re-tokenized; messages appended by the loop (tool results, user
turns) are tokenized once, as the chat template's delta, with loss_mask 0. At the end the whole
conversation is re-rendered and compared: a difference is reported (metric and metadata), never
trained on.

`tool_agent` is the built-in loop: generate, parse tool calls, run them (concurrently, bounded),
append the observations, repeat until the model answers or a budget ends the episode.

Roles (shared/contract/roles.py): every segment is sampled as one role of the run, and trains that role's
policy. A context samples as its `role`: the episode's (its prompt's `role`; None: roles.default) unless the
loop chooses another. `sample_turn` names the role's served model in each request (its LoRA adapter, or the
base model) and records, as each turn's policy_version and policy_version_end, the version of that role's
policy its server held. A loop plays several roles by running each segment under `ctx.as_role(name)` (or
`tool_agent(..., role=name)`); the segment records the role's name, and a role the run does not have is an
UnknownRole error, raised before anything is sampled. A planner then a solver, one rollout of two samples:

    @register_agent("plan_then_solve")
    async def plan_then_solve(task: Task, ctx: AgentContext) -> list[Segment]:
        plan = await tool_agent(task, ctx.as_role("planner"))
        solve = Task([*task.messages, {"role": "assistant", "content": plan.response_text},
                      {"role": "user", "content": "Now carry out the plan."}], task.label, task.metadata)
        solution = await tool_agent(solve, ctx.as_role("solver"), segment_index=1)
        return [plan, solution]

    python -m pytest tests/unit/shared/agent/test_loop_roles.py -q
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from rollstream.shared.agent.tool_calls import ToolCallFormat
from rollstream.shared.agent.tools import Episode, ToolCall, ToolResult, ToolSet
from rollstream.shared.contract.events import TrajectoryTool, TrajectoryTurn
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.contract.rollouts import Segment
from rollstream.shared.errors import TemplateError, UnknownRole

RETOKENIZATION_MISMATCHES = Counter(
    "rollstream_retokenization_mismatches_total",
    "Episodes whose token ids differ from a full re-render of their conversation")


@dataclass
class Limits:
    max_turns: int = 4
    """Model turns per episode."""
    max_tokens_per_turn: int = 64
    """Tokens sampled per turn."""
    max_total_tokens: int = 1024
    """Context budget of the whole segment (prompt, responses and observations)."""


@dataclass
class Task:
    """What the loop gets from the dispatcher's prompt."""

    messages: list[dict[str, Any]]
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentContext:
    """What a loop may use: the fleet, the tokenizer, the episode's tools, its limits."""

    fleet: Any
    """rollstream.shared.inference.fleet.FleetClient"""
    tokenizer: Any
    tools: ToolSet
    tool_format: ToolCallFormat
    limits: Limits
    episode: Episode
    session_id: str
    temperature: float = 1.0
    sampling: dict[str, Any] = field(default_factory=dict)
    """Extra sampling parameters for every generation (top_p, stop, logit_bias, ...)."""
    policy_versions: Callable[[], Awaitable[dict[str, int]]] | None = None
    """The fleet's versions (run_facts.FLEET_VERSIONS: the whole policy's by server url, an adapter's by
    `<role>@<url>`), read before and after each turn."""
    roles: RunRoles | None = None
    """The run's roles (RunRoles.of(settings)), which a service always gives. None: a context outside a run
    (a warm-up, a benchmark) that samples the fleet client's own model as the one role there is."""
    role: str | None = None
    """The role this context samples as: the episode's, or the one `as_role` chose; None: the default."""

    async def versions(self) -> dict[str, int]:
        return await self.policy_versions() if self.policy_versions else {}

    def as_role(self, role: str | None) -> AgentContext:
        """This context, sampling as `role` (None: the run's default): UnknownRole for one the run does not
        have."""
        copy = dataclasses.replace(self, role=role)
        copy.resolved_role()
        return copy

    def resolved_role(self) -> str | None:
        """The name of the role this context samples as (None only without roles)."""
        if self.roles is None:
            if self.role is not None:
                raise UnknownRole(f"role {self.role!r}: this context has no roles to sample it from "
                                  "(AgentContext.roles)")
            return None
        return self.roles.resolve(self.role)

    def served_model(self) -> str | None:
        """The model a request for this context's turns names (None: the fleet client's own)."""
        return self.roles.served_model(self.role) if self.roles is not None else None

    def served_version(self, versions: dict[str, int], url: str) -> int:
        """The version of this context's role's policy that `url` serves, as `versions` (FLEET_VERSIONS) holds
        it."""
        if self.roles is None:
            return versions.get(url, 0)
        return self.roles.served_version(versions, url, self.role)


Agent = Callable[[Task, AgentContext], Awaitable["Segment | list[Segment]"]]
AGENTS: dict[str, Agent] = {}


def register_agent(name: str) -> Callable[[Agent], Agent]:
    def register(fn: Agent) -> Agent:
        AGENTS[name] = fn
        return fn

    return register


def resolve_agent(spec: str) -> Agent:
    """A registered name, or `package.module:function`."""
    if ":" not in spec:
        try:
            return AGENTS[spec]
        except KeyError:
            raise ValueError(f"unknown agent {spec!r}; registered: {', '.join(sorted(AGENTS))}; "
                             "or give an import path package.module:function") from None
    module_name, _, attr = spec.partition(":")
    try:
        agent = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load agent {spec!r}: {exc}") from exc
    if not callable(agent):
        raise ValueError(f"agent {spec!r} is not callable")
    return agent


class TokenTrajectory:
    """The token sequence of one segment, built turn by turn."""

    def __init__(self, tokenizer, messages: Sequence[dict[str, Any]],
                 tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_schemas = tools or None
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.text = self.render(self.messages, add_generation_prompt=True)
        ids = self.encode(self.text)
        self.prompt_length = len(ids)
        self.tokens = list(ids)
        self.loss_mask = [0] * len(ids)
        self.logprobs = [0.0] * len(ids)
        self.pending_ids: list[int] = list(ids)
        """Tokens appended since the last sampled turn (reported with the next turn)."""

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tool_schemas, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def append_sampled(self, ids: Sequence[int], logprobs: Sequence[float]) -> str:
        """Add what the model sampled, as sampled; returns its text (special tokens dropped)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
        self.tokens.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.text += self.tokenizer.decode(list(ids), skip_special_tokens=False)
        content = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": content})
        self.pending_ids = []
        return content

    def append_messages(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Add messages the model did not sample, tokenized as the template's delta (loss_mask 0)."""
        self.messages.extend(dict(m) for m in messages)
        target = self.render(self.messages, add_generation_prompt=True)
        if not target.startswith(self.text):
            raise TemplateError("the chat template re-renders earlier turns differently; "
                                f"diverges at character {_first_difference(target, self.text)}")
        ids = self.encode(target[len(self.text):])
        self.text = target
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.pending_ids.extend(ids)
        return ids

    def retokenization_mismatch(self) -> dict[str, int] | None:
        """Compare with a full re-render of the text; None when they agree."""
        full = self.encode(self.text)
        if full == self.tokens:
            return None
        return {"first_difference": _first_difference(full, self.tokens), "rerendered_length": len(full),
                "sampled_length": len(self.tokens)}

    def segment(self, status: str, response_text: str, turns: list[TrajectoryTurn],
                tools: list[TrajectoryTool], metadata: dict[str, Any], role: str | None = None) -> Segment:
        """The segment, as sampled by `role` (AgentContext.resolved_role(); None: the episode's)."""
        mismatch = self.retokenization_mismatch()
        if mismatch:
            RETOKENIZATION_MISMATCHES.inc()
            metadata = {**metadata, "retokenization_mismatch": mismatch}
        return Segment(tokens=list(self.tokens), prompt_length=self.prompt_length,
                       loss_mask=list(self.loss_mask), rollout_logprobs=list(self.logprobs),
                       turn_policy_versions=[t.policy_version for t in turns], status=status,
                       response_text=response_text, turns=turns, tools=tools, metadata=metadata, role=role)


def _first_difference(a: Sequence, b: Sequence) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def _tool_message(result: ToolResult) -> dict[str, Any]:
    return {"role": "tool", "name": result.name, "tool_call_id": result.call_id, "content": result.content}


async def sample_turn(trajectory: TokenTrajectory, ctx: AgentContext, turn: int, segment_index: int,
                      budget: int) -> tuple[TrajectoryTurn, str]:
    """Sample one turn from the fleet as ctx's role and append it to the trajectory: the turn's record (with
    the versions of the role's policy its server held before and after) and the text it decodes to."""
    model = ctx.served_model()
    named = {"model": model} if model is not None else {}  # none: the fleet's own, as any fleet takes it
    before = await ctx.versions()
    completion = await ctx.fleet.complete(trajectory.tokens, session_id=ctx.session_id,
                                          max_tokens=min(ctx.limits.max_tokens_per_turn, budget),
                                          temperature=ctx.temperature, extra=ctx.sampling, **named)
    after = await ctx.versions()
    appended, offset = trajectory.pending_ids, len(trajectory.tokens)
    text = trajectory.append_sampled(completion.token_ids, completion.logprobs)
    version = ctx.served_version(before, completion.server_url)
    # a version the record no longer holds after the turn (its server left the fleet): the one before
    end = ctx.served_version({**before, **after}, completion.server_url)
    record = TrajectoryTurn(turn=turn, segment_index=segment_index, offset=offset, appended_ids=appended,
                            response_ids=list(completion.token_ids), logprobs=list(completion.logprobs),
                            policy_version=version, policy_version_end=end,
                            finish_reason=completion.finish_reason, server_url=completion.server_url)
    return record, text


def _tool_records(turn: int, calls: Sequence[ToolCall],
                  results: Sequence[ToolResult]) -> list[TrajectoryTool]:
    """One record per tool result of a turn, with the arguments of the call it answers."""
    arguments = {call.id: call.arguments for call in calls}
    return [TrajectoryTool(turn=turn, call_id=r.call_id, name=r.name, arguments=arguments.get(r.call_id, {}),
                           ok=r.ok, error_kind=r.error_kind, content=r.content) for r in results]


@register_agent("tool_agent")
async def tool_agent(task: Task, ctx: AgentContext, segment_index: int = 0,
                     role: str | None = None) -> Segment:
    """Generate; run the tool calls the model makes; append their results; until it answers. Sampled as
    `role` (None: ctx's role), which the segment records."""
    if role is not None:
        ctx = ctx.as_role(role)
    role_name = ctx.resolved_role()  # an unknown role is refused before the tools start
    trajectory = TokenTrajectory(ctx.tokenizer, task.messages, ctx.tools.schemas())
    turns: list[TrajectoryTurn] = []
    tool_calls: list[TrajectoryTool] = []
    status, answer, error = "truncated", "", None
    metadata: dict[str, Any] = {}
    await ctx.tools.start(ctx.episode)
    try:
        for turn in range(ctx.limits.max_turns):
            budget = ctx.limits.max_total_tokens - len(trajectory.tokens)
            if budget <= 0:
                break
            sampled, text = await sample_turn(trajectory, ctx, turn, segment_index, budget)
            turns.append(sampled)
            parsed = ctx.tool_format.parse(text, turn)
            answer = parsed.content
            if sampled.finish_reason == "length":
                break
            if not parsed.calls and not parsed.errors:
                status = "completed"
                break
            results = await ctx.tools.execute(parsed.calls, ctx.episode)
            results += [ctx.tools.malformed(f"call_{turn}_malformed_{i}", problem)
                        for i, problem in enumerate(parsed.errors)]
            tool_calls += _tool_records(turn, parsed.calls, results)
            trajectory.append_messages([_tool_message(r) for r in results])
    except TemplateError as exc:
        status, error = "failed", str(exc)
    finally:
        await ctx.tools.close(ctx.episode)
    if error:
        metadata["error"] = error
    metadata["turns"] = len(turns)
    metadata["tool_calls"] = len(tool_calls)
    metadata["tool_errors"] = sum(not call.ok for call in tool_calls)
    if ctx.episode.artifacts:
        metadata["artifacts"] = dict(ctx.episode.artifacts)
    return trajectory.segment(status, answer, turns, tool_calls, metadata, role=role_name)
