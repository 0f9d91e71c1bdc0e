"""The one form every API's request is parsed into, and what the gateway core hands back to be rendered.

Messages are in the shape the model's chat template takes (HF / OpenAI):

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"type": "function", "id": str, "function": {"name": str, "arguments": dict}}],
     "tool_call_id": str, "name": str, "reasoning_content": str}

`content` is always a string (never None, never a list of parts); `tool_calls` appears only on
assistant messages that call tools, `tool_call_id` and `name` only on tool messages (`name` when the
call it answers is in the history), `reasoning_content` only on assistant messages whose reasoning
the client sent back (the key HF templates such as Qwen3's read). A message's text blocks or parts
are joined with "\n", an assistant turn's with nothing between (they are pieces of one sampled
text). System and developer messages are system messages wherever they are in the history, in
their order; the template decides how one in the middle is shown. Tools are OpenAI function
schemas, `{"type": "function", "function": {"name", "description", "parameters"}}`, keys in that
order (the template writes them with `tojson`, which keeps the order).

`tool_choice` is "auto", "required", or `{"type": "function", "function": {"name": ...}}` for one
named tool. A request that forbids tools ("none" in any API) is parsed with its tools dropped, so the
model is not shown tools it may not call.

What a request may carry beyond that, the same rule in every API:
- A field the gateway does not know, or knows and has no use for, is ignored: metadata, caching and
  context-management hints, store, service tier, user ids, parallel_tool_calls, stream_options,
  effort and thinking budgets, previous_response_id when null, ...
- A field that asks for a different output than one free-text turn, sampled with the request's
  temperature, top_p, stop and seed, is a 400 that names it: more than one choice (`n`), a format
  the output must follow (`response_format`, `text.format`, `output_config.format`), sampling the
  gateway does not do (`logit_bias`, penalties, `top_k`), state kept on the server
  (`previous_response_id`, `conversation`, stored prompts), background mode, audio output.
- Tools the client runs are functions: JSON-schema functions as they are, OpenAI's custom (freeform)
  tools and Anthropic's bash and text editor tools as the functions client_tools.py makes of them.
  Tools the model cannot be shown as functions (those the API provider runs itself: web search,
  code execution, file search, computer use, MCP, ...; and any other kind) are left out and listed
  in `ChatRequest.ignored_tools`, never a 400 (unless the gateway's strict_tools).
- Reasoning switches (Anthropic `thinking`, Responses `reasoning`, Chat `reasoning_effort`) set
  `ChatRequest.thinking`; a model that reasons writes `<think>...</think>` first (streaming.py), and
  that reasoning goes back to the client in the API's own shape.

The checks the three API parsers share on the way to this form are in validation.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from rollstream.services.gateway.apis.streaming import (
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    TurnStreamParser,
)
from rollstream.shared.agent.tools import ToolCall

__all__ = [
    "ChatRequest", "FinishReason", "Generation", "ReasoningDelta", "SampledTurn", "StreamEnd",
    "StreamEvent", "TextDelta", "ToolCall", "ToolCallDelta", "ToolChoice", "Tools",
    "assistant_message", "final_finish_reason", "message_key", "split_turn",
]

FinishReason = Literal["stop", "length", "tool_calls"]
ToolChoice = Literal["auto", "required"] | dict[str, Any]
Tools = list[dict[str, Any]] | None
"""A request's tools in the canonical shape, None when it has none."""


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: Tools = None
    tool_choice: ToolChoice = "auto"
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    """OpenAI Chat Completions' `stream_options.include_usage`: end the stream with a usage chunk."""
    thinking: bool | None = None
    """Whether the client asks the model to reason first (True) or not to (False); None when it does not
    say. The chat template gets it as `enable_thinking` (hybrid reasoning templates read it)."""
    ignored_tools: list[str] = field(default_factory=list)
    """The types of the request's tools the model is not shown (hosted tools, any kind but a function),
    each once, in the order given."""
    reasoning_summary: bool = False
    """OpenAI Responses' `reasoning.summary`: reasoning items carry the reasoning as their summary too."""
    encrypted_reasoning: bool = False
    """OpenAI Responses' `include: ["reasoning.encrypted_content"]`: reasoning items carry it encoded in
    `encrypted_content`, which is all a client that keeps no reasoning text (Codex) sends back."""
    tool_namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    """OpenAI Responses' namespace tools: the name the model is shown for each member ->
    (namespace, name), how a call of it goes back to the client."""
    freeform_tools: set[str] = field(default_factory=set)
    """The names of OpenAI's custom (freeform) tools, shown to the model as functions of one string
    (client_tools.py): a call of one goes back to the client as a custom tool call."""


@dataclass(frozen=True)
class Generation:
    """One sampled assistant turn: `text` without the reasoning and the tool-call markup (see
    `split_turn`)."""

    text: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    """The request's stop string that ended the turn, if one did (Anthropic reports it)."""
    reasoning: str = ""
    """What the model reasoned before `text` (its `<think>` block), "" when it did not."""


@dataclass(frozen=True)
class StreamEnd:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None


StreamEvent = ReasoningDelta | TextDelta | ToolCallDelta | StreamEnd
"""What the core feeds the event streams (sse.py): reasoning, text and calls from `TurnStreamParser`,
then one StreamEnd."""


class SampledTurn(NamedTuple):
    """A sampled turn's text taken apart: what the model reasoned, its content and its calls."""

    reasoning: str
    content: str
    calls: list[ToolCall]


def split_turn(text: str, turn: int, reasoning_open: bool = False) -> SampledTurn:
    """The reasoning, content and calls of a complete turn: `TurnStreamParser` fed the whole text."""
    parser = TurnStreamParser(turn, reasoning_open)
    pieces = parser.feed(text) + parser.finish()
    return SampledTurn("".join(piece.text for piece in pieces if isinstance(piece, ReasoningDelta)),
                       "".join(piece.text for piece in pieces if isinstance(piece, TextDelta)),
                       [piece.call for piece in pieces if isinstance(piece, ToolCallDelta)])


def final_finish_reason(finish_reason: FinishReason, called_tools: bool) -> FinishReason:
    """A turn cut by the token limit stays "length" even when it called tools (the client should know
    the turn is incomplete); otherwise calls make it "tool_calls", whatever the core sampled."""
    if finish_reason == "length":
        return "length"
    return "tool_calls" if called_tools else "stop"


def canonical_tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


def assistant_message(content: str, tool_calls: Sequence[ToolCall], reasoning: str = "") -> dict[str, Any]:
    """The canonical message of a generated turn: what the gateway records, and what a client's
    echo of the response parses back to (equal under `message_key`)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [canonical_tool_call(call.id, call.name, call.arguments)
                                 for call in tool_calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_key(message: dict[str, Any]) -> tuple:
    """What makes two canonical messages the same turn for the model, blind to what clients change
    when they send a turn back: whitespace around the content, None for "", the spacing and key
    order of call arguments, call ids (some clients make their own), and the reasoning (clients drop
    it, summarise it, or send back only an opaque copy)."""
    calls = tuple((call["function"]["name"], _canonical_json(call["function"]["arguments"]))
                  for call in message.get("tool_calls") or ())
    return (message["role"], (message.get("content") or "").strip(), calls, message.get("tool_call_id") or "")


def name_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gives each tool message the name of the call it answers, when that call is in the history."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and message["tool_call_id"] in names:
            message["name"] = names[message["tool_call_id"]]
    return messages

