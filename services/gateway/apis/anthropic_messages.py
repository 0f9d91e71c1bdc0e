"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request into a
`ChatRequest`, a generation back as a `message` object or as the Messages event stream.

`system` is a string or text blocks (joined with newlines), and so is a `system` message inside
`messages` (Claude Code sends some mid-conversation): each is a system message where it stands. A
user turn's `tool_result` blocks become canonical `tool` messages, in the order of the blocks, and
its text blocks a user message (a result marked `is_error` has its content prefixed with "Error: ",
the only way the template can tell the model). An assistant turn's `tool_use` blocks become its tool
calls, its text blocks its content, joined with nothing between (the gateway splits one sampled text
into blocks around the calls), and its `thinking` blocks its `reasoning_content` (`redacted_thinking`
holds nothing the gateway can read: skipped). Tools are custom tools `{name, description,
input_schema}` and Anthropic's client tools bash and text editor (`bash_20250124`, `text_editor_20250728`,
...), shown with the schemas Anthropic defines for them (client_tools.py); a tool with another `type`
(server tools such as web_search_20250305, the computer-use tool) is left out of what the model sees.
`tool_choice` auto, any (as "required"), tool, none (tools dropped). `thinking` type "disabled" asks
the model not to reason, any other type to reason; its budget, `output_config.effort`, `metadata`,
`context_management`, `cache_control` and the like are accepted and ignored.

Reasoning the model wrote comes back as a `thinking` block before the text, with a `signature` (a
digest of the thinking: Anthropic's clients expect one and send it back; the gateway reads the text).

Refused with a 400 that says so: images and documents, `top_k`, structured output
(`output_config.format`, `output_format`), and a missing `max_tokens` on `/v1/messages`.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    FinishReason,
    Generation,
    StreamEnd,
    StreamEvent,
    ToolCallDelta,
    ToolChoice,
    Tools,
    canonical_tool_call,
    name_tool_messages,
)
from rollstream.services.gateway.apis.client_tools import anthropic_client_tool
from rollstream.services.gateway.apis.errors import RequestError, anthropic_error
from rollstream.services.gateway.apis.sse import render_sse, sse
from rollstream.services.gateway.apis.validation import (
    bool_field,
    choose_tools,
    function_tool,
    int_field,
    leave_out_tool,
    model_field,
    named_tool_choice,
    number_field,
    require_list,
    require_object,
    require_str,
    stop_field,
    tool_list,
    unsupported,
)

ERROR_PREFIX = "Error: "
CUSTOM_TOOL_TYPES = (None, "custom")


def parse_messages(body: Any) -> ChatRequest:
    return _parse(body, max_tokens_required=True)


def parse_count_tokens(body: Any) -> ChatRequest:
    """The body of `/v1/messages/count_tokens`: a Messages request without `max_tokens`."""
    return _parse(body, max_tokens_required=False)


def _parse(body: Any, *, max_tokens_required: bool) -> ChatRequest:
    body = require_object(body, "body")
    model = model_field(body)
    if max_tokens_required and body.get("max_tokens") is None:
        raise RequestError(400, "max_tokens is required", "max_tokens")
    if body.get("top_k") is not None:
        raise unsupported("top_k", "top_k")
    _refuse_structured_output(body)
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text(body["system"], "system", joiner="\n")
        if system:
            messages.append({"role": "system", "content": system})
    for i, message in enumerate(require_list(body.get("messages"), "messages", non_empty=True)):
        messages += _turn(require_object(message, f"messages[{i}]"), f"messages[{i}]")
    tools, ignored_tools = _tools(body.get("tools"))
    tool_choice, tools = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        model=model,
        messages=name_tool_messages(messages),
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=int_field(body, "max_tokens", minimum=1),
        temperature=number_field(body, "temperature", minimum=0, maximum=1),
        top_p=number_field(body, "top_p", minimum=0, maximum=1),
        stop=stop_field(body, "stop_sequences"),
        stream=bool_field(body, "stream"),
        thinking=_thinking(body.get("thinking")),
        ignored_tools=ignored_tools,
    )


def _refuse_structured_output(body: dict[str, Any]) -> None:
    output_config = require_object(body.get("output_config") or {}, "output_config")
    for fmt, param in ((output_config.get("format"), "output_config.format"),
                       (body.get("output_format"), "output_format")):
        if fmt is not None:
            raise unsupported("structured output", param, "describe the format in the prompt")


def _thinking(thinking: Any) -> bool | None:
    if thinking is None:
        return None
    kind = require_str(require_object(thinking, "thinking").get("type"), "thinking.type", non_empty=True)
    return kind != "disabled"


def _text(content: Any, param: str, *, joiner: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(require_list(content, param)):
        block = require_object(block, f"{param}[{i}]")
        if block.get("type") != "text":
            raise unsupported(f"content block type {block.get('type')!r} in {param}", f"{param}[{i}].type",
                              "only text blocks are")
        texts.append(require_str(block.get("text"), f"{param}[{i}].text"))
    return joiner.join(texts)


def _turn(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise RequestError(400, f"{param}.role must be 'user', 'assistant' or 'system', not {role!r}",
                           f"{param}.role")
    if role == "system":
        return [{"role": "system", "content": _text(message.get("content"), f"{param}.content", joiner="\n")}]
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [require_object(block, f"{param}.content[{j}]")
              for j, block in enumerate(require_list(content, f"{param}.content", non_empty=True))]
    return _assistant_turn(blocks, param) if role == "assistant" else _user_turn(blocks, param)


def _assistant_turn(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    texts, calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(require_str(block.get("text"), f"{where}.text"))
        elif kind == "tool_use":
            calls.append(canonical_tool_call(require_str(block.get("id"), f"{where}.id", non_empty=True),
                                             require_str(block.get("name"), f"{where}.name", non_empty=True),
                                             require_object(block.get("input", {}), f"{where}.input")))
        elif kind == "thinking":
            thinking.append(require_str(block.get("thinking"), f"{where}.thinking"))
        elif kind != "redacted_thinking":
            raise unsupported(f"content block type {kind!r} in an assistant turn", f"{where}.type",
                              "only text, tool_use and thinking blocks are")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    reasoning = "".join(thinking)
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message]


def _user_turn(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(require_str(block.get("text"), f"{where}.text"))
        elif kind == "tool_result":
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = _text(block.get("content", ""), f"{where}.content", joiner="\n")
            if bool_field(block, "is_error"):
                result = ERROR_PREFIX + result
            messages.append({"role": "tool", "content": result,
                             "tool_call_id": require_str(block.get("tool_use_id"), f"{where}.tool_use_id",
                                                         non_empty=True)})
        else:
            raise unsupported(f"content block type {kind!r} in a user turn", f"{where}.type",
                              "only text and tool_result blocks are")
    if texts:
        messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def _tools(tools: Any) -> tuple[Tools, list[str]]:
    """The custom and client tools as the request's tools, and the types of the others (left out)."""
    if tools is None:
        return None, []
    canonical: list[dict[str, Any]] = []
    ignored: list[str] = []
    for i, tool in enumerate(require_list(tools, "tools")):
        tool = require_object(tool, f"tools[{i}]")
        if tool.get("type") not in CUSTOM_TOOL_TYPES:
            client_tool = anthropic_client_tool(tool, f"tools[{i}]")
            if client_tool is None:
                leave_out_tool(ignored, tool.get("type"), f"tools[{i}].type")
            else:
                canonical.append(client_tool)
            continue
        if tool.get("input_schema") is None:
            raise RequestError(400, f"tools[{i}].input_schema is required", f"tools[{i}].input_schema")
        canonical.append(function_tool(tool.get("name"), tool.get("description"), tool["input_schema"],
                                       f"tools[{i}]"))
    return tool_list(canonical, "tools"), ignored


def _tool_choice(choice: Any, tools: Tools) -> tuple[ToolChoice, Tools]:
    if choice is None:
        return "auto", tools
    kind = require_object(choice, "tool_choice").get("type")
    if kind in ("auto", "none", "any"):
        return choose_tools("required" if kind == "any" else kind, tools, "tool_choice")
    if kind == "tool":
        return named_tool_choice(choice.get("name"), tools, "tool_choice.name"), tools
    raise RequestError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}",
                       "tool_choice.type")


# --- responses ------------------------------------------------------------------------------------


def _stop_reason(finish_reason: FinishReason, called_tools: bool, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called_tools:
        return "tool_use"
    return "end_turn" if stop_sequence is None else "stop_sequence"


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def thinking_signature(thinking: str) -> str:
    """The `signature` of a thinking block: a digest of its text (clients send it back unread)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def messages_response(gen: Generation, *, model: str, message_id: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if gen.reasoning:
        content.append({"type": "thinking", "thinking": gen.reasoning,
                        "signature": thinking_signature(gen.reasoning)})
    if gen.text:
        content.append({"type": "text", "text": gen.text})
    content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
                for call in gen.tool_calls]
    stop_reason = _stop_reason(gen.finish_reason, bool(gen.tool_calls), gen.stop_sequence)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": gen.stop_sequence if stop_reason == "stop_sequence" else None,
            "usage": _usage(gen.prompt_tokens, gen.completion_tokens)}


def count_tokens_response(input_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens}


class _MessageEvents:
    """The Messages API's stream events (sse.EventRenderer)."""

    def __init__(self, model: str, message_id: str, prompt_tokens: int) -> None:
        self.model, self.message_id, self.prompt_tokens = model, message_id, prompt_tokens
        self.blocks = 0
        """How many content blocks were started; the last one's index is one less."""
        self.open_block: str | None = None
        """The type of the last block while it is open: deltas may still be added to it."""
        self.thinking = ""
        self.called_tools = False

    def start(self) -> list[str]:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(self.prompt_tokens, 0)}
        return [sse({"type": "message_start", "message": message}, "message_start"),
                sse({"type": "ping"}, "ping")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta},
                   "content_block_delta")

    def _close(self) -> list[str]:
        """The events that close the open block, if any: a thinking block ends with its signature."""
        if self.open_block is None:
            return []
        lines = []
        if self.open_block == "thinking":
            signature = thinking_signature(self.thinking)
            lines.append(self._delta({"type": "signature_delta", "signature": signature}))
        lines.append(sse({"type": "content_block_stop", "index": self.blocks - 1}, "content_block_stop"))
        self.open_block = None
        return lines

    def _open(self, content_block: dict[str, Any]) -> list[str]:
        """The events that make a block of this type the open one, unless it is already."""
        if self.open_block == content_block["type"]:
            return []
        lines = self._close()
        lines.append(sse({"type": "content_block_start", "index": self.blocks,
                          "content_block": content_block}, "content_block_start"))
        self.open_block = content_block["type"]
        self.blocks += 1
        return lines

    def reasoning(self, text: str) -> list[str]:
        lines = self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thinking += text
        return [*lines, self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        lines = self._open({"type": "text", "text": ""})
        return [*lines, self._delta({"type": "text_delta", "text": text})]

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        self.called_tools = True
        call = delta.call
        lines = self._open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        lines.append(self._delta({"type": "input_json_delta",
                                  "partial_json": json.dumps(call.arguments, ensure_ascii=False)}))
        return [*lines, *self._close()]

    def end(self, end: StreamEnd) -> list[str]:
        stop_reason = _stop_reason(end.finish_reason, self.called_tools, end.stop_sequence)
        delta = {"stop_reason": stop_reason,
                 "stop_sequence": end.stop_sequence if stop_reason == "stop_sequence" else None}
        return [*self._close(),
                sse({"type": "message_delta", "delta": delta,
                     "usage": _usage(end.prompt_tokens, end.completion_tokens)}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]

    def fail(self, error: RequestError) -> list[str]:
        return [sse(anthropic_error(error.status, error.message), "error")]


def messages_sse(events: AsyncIterator[StreamEvent], *, model: str, message_id: str,
                 prompt_tokens: int) -> AsyncIterator[str]:
    """The Messages event stream: `message_start` (its usage counts the prompt's tokens), `ping`, per
    block `content_block_start`, `content_block_delta` (`thinking_delta`s then one `signature_delta`,
    `text_delta`s, or one `input_json_delta` with a call's whole input), `content_block_stop`, then
    `message_delta` with the stop reason and the final usage, and `message_stop`. Text after a call
    opens a new text block. A failure of the generation ends it with an `error` event (the SDK raises
    it)."""
    return render_sse(events, _MessageEvents(model, message_id, prompt_tokens))
