"""One turn of a session: plan the prompt, stream the generation from the fleet, record the node.

`run_turn` plans the prompt, so its length is known before anything is sampled (Anthropic's stream opens
with it), and hands back the API-neutral stream events (apis/canonical.py), which come as vLLM produces
tokens: reasoning and text as they are decoded, a tool call once its closing tag is sampled, and StreamEnd
last. The turn is recorded in the session (sessions.py) before StreamEnd is yielded, so an agent that sends
its next request as soon as it has the answer finds its turn there. A non-streamed request asks vLLM for the
whole generation in one response (no chunk per token to send, parse and decode), which then takes the same
path as one delta: both record the same ids. A turn whose client went away before the end is not recorded:
the agent never saw that answer.

A turn is sampled as a role of the run (`turn_role`): its session's, or the one its request's model names
(a sub-agent's requests may name another role than the agent's). The request to the fleet names the role's
served model (its LoRA adapter, or the base model), and the turn's node records its role. The versions of
that role's policy are read from the fleet version record before and after the generation, as the
agent-runner does for its own turns, so a turn sampled across a weight sync says so: before, with the
session (SessionStore.get), after, as the turn is recorded (SessionStore.add_turn).

A request asks for at most what is left of the model's context after its prompt: agents ask for a fixed 32000
whatever the model, which vLLM would refuse. The context is the longest a vLLM server of the fleet reports on
its /v1/models (FleetClient.longest_context), not a setting: a server started with a longer --max-model-len
than model.max_model_len takes the longer prompts it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Histogram

from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    Generation,
    StreamEnd,
    StreamEvent,
    assistant_message,
    final_finish_reason,
    split_turn,
)
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.apis.streaming import THINK_OPEN, TurnStreamParser
from rollstream.services.gateway.prompts import ChatTemplate, History, PlannedTurn, answer_key, plan_turn
from rollstream.services.gateway.sessions import Session, SessionStore, TurnNode
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.inference.fleet import StreamDelta
from rollstream.shared.runtime.config import Settings

TURNS = Counter("rollstream_gateway_turns_total", "Turns the gateway served", ["api", "stream"])
SAMPLED_TOKENS = Counter("rollstream_gateway_sampled_tokens_total", "Tokens vLLM sampled for gateway turns")
FORKS = Counter("rollstream_gateway_conversations_started_total",
                "Turns that started a conversation in their session, by cause: first_turn, or "
                "history_changed (a history that does not continue the session's recorded tokens: "
                "compaction, an edit, a branch, a sub-agent)", ["cause"])
CAPPED_TURNS = Counter("rollstream_gateway_max_tokens_capped_total",
                       "Turns whose max_tokens was lowered, by what capped it: context (what the model's "
                       "context leaves after the prompt) or run (gateway.max_tokens_per_turn)", ["cap"])
log = logging.getLogger(__name__)
PROMPT_TAIL_TOKENS = 8
"""How many of the prompt's last ids are read to tell whether the template opened a reasoning block."""
TURN_SECONDS = Histogram("rollstream_gateway_turn_seconds", "Wall time of a turn, from request to last token",
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


class IncrementalText:
    """The text of sampled ids as they arrive. Decodes a short window, not the whole answer each time,
    and holds back a character whose bytes are not all sampled yet."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        seen = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        if len(now) <= len(seen) or now.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        piece = now[len(seen):]
        self.emitted += piece
        return piece

    def flush(self) -> str:
        """What the windowed decode has not given yet, judged against one decode of every id."""
        full = self._decode(self.ids)
        piece = full[len(self.emitted):] if full.startswith(self.emitted) else ""
        self.emitted += piece
        return piece


@dataclass
class Gateway:
    """What every turn needs; one per gateway process."""

    settings: Settings
    store: SessionStore
    template: ChatTemplate
    fleet: Any
    """rollstream.shared.inference.fleet.FleetClient"""
    roles: RunRoles = field(init=False)
    """The run's roles, from `settings`."""

    def __post_init__(self) -> None:
        self.roles = RunRoles.of(self.settings)


def turn_role(roles: RunRoles, session: Session, planned: PlannedTurn) -> str:
    """The role a turn is sampled as and trains: the one its request's model names, else its session's."""
    return roles.resolve(planned.named_role or session.spec.role)


def sampling_for(session: Session, request: ChatRequest, settings: Settings, prompt_tokens: int,
                 context: int) -> dict[str, Any]:
    """The turn's sampling: the request's values, else the session's defaults, else the run's; max_tokens
    no more than the `context` (the model's, as the servers report it) leaves after the prompt, nor than
    gateway.max_tokens_per_turn."""
    defaults = session.spec.sampling
    temperature = request.temperature if request.temperature is not None else defaults.get(
        "temperature", settings.rollout.temperature)
    if prompt_tokens >= context:
        raise RequestError(400, f"the prompt is {prompt_tokens} tokens; the model's context is {context}, "
                                "which leaves no room for an answer", param="messages")
    asked = request.max_tokens or defaults.get("max_tokens") or settings.rollout.max_tokens
    run_cap = settings.gateway.max_tokens_per_turn or context
    max_tokens = min(asked, context - prompt_tokens, run_cap)
    if max_tokens < asked:
        CAPPED_TURNS.labels("run" if max_tokens == run_cap else "context").inc()
    extra: dict[str, Any] = {}
    top_p = request.top_p if request.top_p is not None else defaults.get("top_p")
    if top_p is not None:
        extra["top_p"] = top_p
    if request.stop:
        extra["stop"] = list(request.stop)
    extra.update({key: defaults[key] for key in ("min_tokens", "ignore_eos") if key in defaults})
    seed = request.seed if request.seed is not None else defaults.get("seed")
    return {"temperature": float(temperature), "max_tokens": int(max_tokens),
            "seed": int(seed) if seed is not None else None, "extra": extra}


def prompt_opens_reasoning(template: ChatTemplate, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a reasoning block: templates of models that always reason end the
    generation prompt with `<think>`, so the model's text starts with its reasoning, unmarked."""
    tail = template.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_OPEN)


@dataclass
class Answer:
    """The turn's answer as recorded: what a non-streamed response carries."""

    content: str = ""
    calls: list = field(default_factory=list)
    reasoning: str = ""


def whole_generation(fleet):
    """fleet.stream's signature, served by fleet.complete: the generation as one delta."""

    async def one_delta(prompt_ids: list[int], **sampling: Any) -> AsyncIterator[StreamDelta]:
        done = await fleet.complete(prompt_ids, **sampling)
        yield StreamDelta(token_ids=done.token_ids, logprobs=done.logprobs, server_url=done.server_url,
                          finish_reason=done.finish_reason)

    return one_delta


@dataclass
class Turn:
    """A turn whose prompt is planned: the prompt's length, and the generation's events (`run_turn`)."""

    prompt_tokens: int
    events: AsyncIterator[StreamEvent]


async def run_turn(gateway: Gateway, session: Session, request: ChatRequest, history: History, api: str,
                   answer_out: Answer | None = None) -> Turn:
    """Plans the turn's prompt (raising what makes the request one the gateway will not serve), in `session`
    as read with the nodes of `history.answered`; the generation starts when its events are first read."""
    started = time.monotonic()
    template = gateway.template.with_thinking(request.thinking)
    limits = gateway.settings.gateway
    planned = await plan_turn(template, gateway.store, session, request, history, limits.max_prompt_tokens,
                              limits.on_rewritten_history)
    role = turn_role(gateway.roles, session, planned)
    events = _generation(gateway, session, request, api, planned, role, started, answer_out)
    return Turn(len(planned.prompt_ids), events)


@dataclass
class SampledTurn:
    """What the fleet sampled for a turn, as its deltas arrive."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    """Each server that sampled some of it, in order (more than one after a failover mid-stream)."""
    finish_reason: str = "length"

    def add(self, delta: StreamDelta) -> None:
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.server_url not in self.servers:
            self.servers.append(delta.server_url)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason


async def _generation(gateway: Gateway, session: Session, request: ChatRequest, api: str,
                      planned: PlannedTurn, role: str, started: float,
                      answer_out: Answer | None) -> AsyncIterator[StreamEvent]:
    context = await gateway.fleet.longest_context()
    sampling = sampling_for(session, request, gateway.settings, len(planned.prompt_ids), context)
    text = IncrementalText(gateway.template.tokenizer)
    reasoning_open = prompt_opens_reasoning(gateway.template, planned.prompt_ids)
    parser = TurnStreamParser(turn=session.turns, reasoning_open=reasoning_open)
    sampled = SampledTurn()
    generate_with = gateway.fleet.stream if request.stream else whole_generation(gateway.fleet)
    async for delta in generate_with(planned.prompt_ids, max_tokens=sampling["max_tokens"],
                                     temperature=sampling["temperature"], session_id=session.spec.session_id,
                                     seed=sampling["seed"], extra=sampling["extra"],
                                     model=gateway.roles.served_model(role)):
        sampled.add(delta)
        for event in parser.feed(text.push(list(delta.token_ids))):
            yield event
    for event in parser.feed(text.flush()) + parser.finish():
        yield event

    reasoning, content, calls = split_turn(text.emitted, session.turns, reasoning_open)
    if request.thinking and not reasoning:
        log.info("the request asks the model to reason, but it wrote no reasoning block: the reasoning "
                 "parameters are ignored", extra={"session_id": session.spec.session_id})
    if answer_out is not None:
        answer_out.content, answer_out.calls, answer_out.reasoning = content, calls, reasoning
    answer = assistant_message(content, calls, reasoning)
    await _record_turn(gateway, session, planned, sampled, answer_key(request, planned, answer), content,
                       role)
    TURNS.labels(api=api, stream=str(request.stream).lower()).inc()
    SAMPLED_TOKENS.inc(len(sampled.ids))
    if not planned.prefix_ids:
        FORKS.labels("first_turn" if session.turns == 0 else "history_changed").inc()
    TURN_SECONDS.observe(time.monotonic() - started)
    finish = "length" if sampled.finish_reason == "length" else "stop"
    yield StreamEnd(finish_reason=final_finish_reason(finish, bool(calls)),
                    prompt_tokens=len(planned.prompt_ids), completion_tokens=len(sampled.ids))


async def _record_turn(gateway: Gateway, session: Session, planned: PlannedTurn, sampled: SampledTurn,
                       key: str, content: str, role: str) -> None:
    """Records the turn in its session as its node, with the versions of its role's policy; 410 when the
    session was finished meanwhile."""
    # A failover mid-stream: the versions of the first server before, of the last one after (add_turn).
    roles = gateway.roles
    version = roles.served_version(session.fleet_versions, sampled.servers[0], role) if sampled.servers else 0
    server_url = sampled.servers[-1] if sampled.servers else ""
    node = TurnNode(parent=planned.parent, appended_ids=planned.appended_ids, response_ids=sampled.ids,
                    logprobs=sampled.logprobs, policy_version=version, policy_version_end=version,
                    finish_reason=sampled.finish_reason, server_url=server_url, response_text=content,
                    created_at=time.time(), history_rewritten=planned.history_rewritten, role=role)
    session_id = session.spec.session_id
    if not await gateway.store.add_turn(session_id, key, node, roles.version_field(server_url, role),
                                        synced=roles.is_trained(role)):
        raise RequestError(410, f"session {session_id} was finished while this turn ran; the turn is not "
                                "recorded")


async def generate(gateway: Gateway, session: Session, request: ChatRequest, history: History,
                   api: str) -> Generation:
    """A whole turn, for a request that did not ask for a stream."""
    answer = Answer()
    turn = await run_turn(gateway, session, request, history, api, answer)
    async for event in turn.events:
        if isinstance(event, StreamEnd):
            return Generation(text=answer.content, tool_calls=answer.calls, finish_reason=event.finish_reason,
                              prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                              reasoning=answer.reasoning)
    raise RuntimeError("a turn ended without StreamEnd")
