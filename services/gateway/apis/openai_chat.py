"""OpenAI Chat Completions (`POST /v1/chat/completions`): the request into a `ChatRequest`, a
generation back as a `chat.completion` object or a stream of `chat.completion.chunk` events.

Accepted as sent: roles system, developer (as system), user, assistant, tool, wherever they are;
content as a string or a list of text parts; `tool_calls` with `arguments` as a JSON string; an
assistant message's `reasoning_content` (vLLM's and DeepSeek's field for the reasoning);
`max_completion_tokens` or the older `max_tokens`; `stop`, `seed`, `temperature`, `top_p`,
`tool_choice`, `stream_options.include_usage`; `reasoning_effort` ("none" asks the model not to
reason, another effort to reason). Custom (freeform) tools `{"type": "custom", "custom": {"name",
"description", "format"}}` are functions of one string to the model (client_tools.py), and their calls
go back as `{"type": "custom", "custom": {"name", "input"}}` tool calls, as the client sends them
back. Tools of any other type are left out of what the model sees. Reasoning the model wrote comes
back as the message's `reasoning_content` (streamed as `delta.reasoning_content`), as vLLM serves
reasoning models.

Refused with a 400 that says so: images, audio and files, and audio output (`modalities`); more than
one choice (`n`); the legacy `functions` / `function_call` / `function` role; structured output
(`response_format` other than text); sampling changes the gateway does not make
(`frequency_penalty`, `presence_penalty`, `logit_bias`). Other fields (`user`, `metadata`, `store`,
`parallel_tool_calls`, `logprobs`, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from typing import Any

from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    Generation,
    StreamEnd,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Tools,
    canonical_tool_call,
    final_finish_reason,
    name_tool_messages,
)
from rollstream.services.gateway.apis.client_tools import freeform_arguments, freeform_input, freeform_tool
from rollstream.services.gateway.apis.errors import RequestError, openai_error
from rollstream.services.gateway.apis.sse import render_sse, sse
from rollstream.services.gateway.apis.validation import (
    arguments_from_json,
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
    thinking_of_effort,
    tool_list,
    unsupported,
)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def parse_chat_completions(body: Any) -> ChatRequest:
    body = require_object(body, "body")
    model = model_field(body)
    _refuse_unsupported(body)
    messages = [_message(message, f"messages[{i}]")
                for i, message in enumerate(require_list(body.get("messages"), "messages", non_empty=True))]
    tools, freeform_tools, ignored_tools = _tools(body.get("tools"))
    tool_choice, tools = _tool_choice(body.get("tool_choice"), tools)
    stream_options = require_object(body.get("stream_options") or {}, "stream_options")
    max_completion_tokens = int_field(body, "max_completion_tokens", minimum=1)
    return ChatRequest(
        model=model,
        messages=name_tool_messages(messages),
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_completion_tokens if max_completion_tokens is not None
        else int_field(body, "max_tokens", minimum=1),
        temperature=number_field(body, "temperature", minimum=0, maximum=2),
        top_p=number_field(body, "top_p", minimum=0, maximum=1),
        stop=stop_field(body, "stop"),
        seed=int_field(body, "seed", minimum=-(2**63)),
        stream=bool_field(body, "stream"),
        include_usage=bool_field(stream_options, "include_usage"),
        thinking=thinking_of_effort(body.get("reasoning_effort"), "reasoning_effort"),
        ignored_tools=ignored_tools,
        freeform_tools=freeform_tools,
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = int_field(body, "n", minimum=1)
    if n not in (None, 1):
        raise RequestError(400, f"n must be 1 (got {n}): this gateway samples one choice per request", "n")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise unsupported("the legacy `functions` / `function_call` parameters",
                          "functions" if body.get("functions") is not None else "function_call",
                          "use `tools` and `tool_choice`")
    response_format = body.get("response_format")
    if response_format is not None \
            and require_object(response_format, "response_format").get("type") != "text":
        raise unsupported(f"response_format {response_format.get('type')!r}", "response_format",
                          "there is no structured output: describe the format in the prompt")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if number_field(body, penalty, minimum=-2, maximum=2):
            raise unsupported(f"a non-zero {penalty}", penalty)
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias")
    modalities = require_list(body.get("modalities") or [], "modalities")
    if any(modality != "text" for modality in modalities):
        raise unsupported(f"output modalities {modalities!r}", "modalities", "the model writes text only")


def _text(content: Any, param: str, *, role: str) -> str:
    """Content as a string: given as one, as null (an assistant turn of tool calls only), or as a
    list of text parts, joined with newlines (the parts of an assistant turn with nothing between)."""
    if content is None:
        if role == "assistant":
            return ""
        raise RequestError(400, f"{param} is required for a {role} message", param)
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(require_list(content, param)):
        part = require_object(part, f"{param}[{i}]")
        if part.get("type") != "text":
            raise unsupported(f"content part type {part.get('type')!r}", f"{param}[{i}].type",
                              "only text parts are")
        texts.append(require_str(part.get("text"), f"{param}[{i}].text"))
    return ("" if role == "assistant" else "\n").join(texts)


def _message(message: Any, param: str) -> dict[str, Any]:
    message = require_object(message, param)
    role = message.get("role")
    if role == "function":
        raise unsupported("the legacy `function` role", f"{param}.role",
                          "answer tool calls with `tool` messages")
    if role not in ROLES:
        raise RequestError(400, f"{param}.role must be one of {', '.join(ROLES)}, not {role!r}",
                           f"{param}.role")
    role = ROLES[role]
    canonical: dict[str, Any] = {"role": role, "content": _text(message.get("content"), f"{param}.content",
                                                                role=role)}
    if role == "assistant":
        if message.get("function_call") is not None:
            raise unsupported("the legacy assistant `function_call`", f"{param}.function_call",
                              "use `tool_calls`")
        wire_calls = require_list(message.get("tool_calls") or [], f"{param}.tool_calls")
        calls = [_tool_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(wire_calls)]
        if calls:
            canonical["tool_calls"] = calls
        reasoning = message.get("reasoning_content")
        if reasoning:
            canonical["reasoning_content"] = require_str(reasoning, f"{param}.reasoning_content")
    elif role == "tool":
        canonical["tool_call_id"] = require_str(message.get("tool_call_id"), f"{param}.tool_call_id",
                                                non_empty=True)
    return canonical


def _tool_call(call: Any, param: str) -> dict[str, Any]:
    call = require_object(call, param)
    kind = call.get("type", "function")
    if kind not in ("function", "custom"):
        raise unsupported(f"tool call type {kind!r}", f"{param}.type", "only function and custom calls are")
    function = require_object(call.get(kind), f"{param}.{kind}")
    if kind == "function":
        arguments = arguments_from_json(function.get("arguments", ""), f"{param}.function.arguments")
    else:
        arguments = freeform_arguments(function.get("input"), f"{param}.custom.input")
    return canonical_tool_call(require_str(call.get("id"), f"{param}.id", non_empty=True),
                               require_str(function.get("name"), f"{param}.{kind}.name", non_empty=True),
                               arguments)


def _tools(tools: Any) -> tuple[Tools, set[str], list[str]]:
    """The function and custom tools as the request's tools, the custom tools' names, and the types of the
    others (left out)."""
    canonical: list[dict[str, Any]] = []
    freeform: set[str] = set()
    ignored: list[str] = []
    for i, tool in enumerate(require_list(tools if tools is not None else [], "tools")):
        tool = require_object(tool, f"tools[{i}]")
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            leave_out_tool(ignored, kind, f"tools[{i}].type")
            continue
        spec = require_object(tool.get(kind), f"tools[{i}].{kind}")
        if kind == "function":
            canonical.append(function_tool(spec.get("name"), spec.get("description"), spec.get("parameters"),
                                           f"tools[{i}].function"))
        else:
            canonical.append(freeform_tool(spec.get("name"), spec.get("description"), spec.get("format"),
                                           f"tools[{i}].custom"))
            freeform.add(canonical[-1]["function"]["name"])
    return tool_list(canonical, "tools"), freeform, ignored


def _tool_choice(choice: Any, tools: Tools) -> tuple[ToolChoice, Tools]:
    if choice is None:
        return "auto", tools
    if choice in ("auto", "none", "required"):
        return choose_tools(choice, tools, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        kind = choice["type"]
        function = require_object(choice.get(kind), f"tool_choice.{kind}")
        return named_tool_choice(function.get("name"), tools, f"tool_choice.{kind}.name"), tools
    raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': ...}}}}, not {choice!r}",
                       "tool_choice")


# --- responses ------------------------------------------------------------------------------------


def _wire_tool_call(call: ToolCall, freeform_tools: AbstractSet[str],
                    index: int | None = None) -> dict[str, Any]:
    wire: dict[str, Any] = {} if index is None else {"index": index}
    if call.name in freeform_tools:
        return wire | {"id": call.id, "type": "custom",
                       "custom": {"name": call.name, "input": freeform_input(call.arguments)}}
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return wire | {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion_response(gen: Generation, *, model: str, response_id: str, created: int,
                             freeform_tools: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    # OpenAI sends null content for a turn of tool calls only; clients such as LangChain expect it.
    message: dict[str, Any] = {"role": "assistant", "content": gen.text or (None if gen.tool_calls else ""),
                               "refusal": None}
    if gen.reasoning:
        message["reasoning_content"] = gen.reasoning
    if gen.tool_calls:
        message["tool_calls"] = [_wire_tool_call(call, freeform_tools) for call in gen.tool_calls]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": final_finish_reason(gen.finish_reason, bool(gen.tool_calls))}],
        "usage": _usage(gen.prompt_tokens, gen.completion_tokens),
        "system_fingerprint": None,
    }


class _Chunks:
    """`chat.completion.chunk` events (sse.EventRenderer)."""

    def __init__(self, model: str, response_id: str, created: int, include_usage: bool,
                 freeform_tools: AbstractSet[str]) -> None:
        self.model, self.response_id, self.created = model, response_id, created
        self.include_usage = include_usage
        self.freeform_tools = freeform_tools
        self.called_tools = False

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        data: dict[str, Any] = {
            "id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            data["usage"] = None  # every chunk but the last carries a null usage when usage is asked for
        return sse(data)

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def reasoning(self, text: str) -> list[str]:
        return [self._chunk({"reasoning_content": text})]

    def text(self, text: str) -> list[str]:
        return [self._chunk({"content": text})]

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        self.called_tools = True
        return [self._chunk({"tool_calls": [_wire_tool_call(delta.call, self.freeform_tools, delta.index)]})]

    def end(self, end: StreamEnd) -> list[str]:
        lines = [self._chunk({}, final_finish_reason(end.finish_reason, self.called_tools))]
        if self.include_usage:
            lines.append(sse({"id": self.response_id, "object": "chat.completion.chunk",
                              "created": self.created, "model": self.model, "system_fingerprint": None,
                              "choices": [], "usage": _usage(end.prompt_tokens, end.completion_tokens)}))
        return [*lines, "data: [DONE]\n\n"]

    def fail(self, error: RequestError) -> list[str]:
        return [sse(openai_error(error.status, error.message, error.param, error.kind))]


def chat_completion_sse(events: AsyncIterator[StreamEvent], *, model: str, response_id: str, created: int,
                        include_usage: bool = False,
                        freeform_tools: AbstractSet[str] = frozenset()) -> AsyncIterator[str]:
    """The stream of a generation: a chunk with the role, one per reasoning delta, text delta and tool
    call, one with the finish reason, the usage chunk when asked for, then `data: [DONE]`. A failure of the
    generation ends the stream with an OpenAI error object (the SDK raises it as an APIError)."""
    return render_sse(events, _Chunks(model, response_id, created, include_usage, freeform_tools))
