"""OpenAI Responses (`POST /v1/responses`): the request into a `ChatRequest`, a generation back as a
`response` object or as the Responses event stream.

The gateway keeps no responses, so every request carries the whole conversation in `input`:
`previous_response_id`, `conversation` and `item_reference` items are refused with a 400 saying so.

`input` is a string (one user message) or a list of items: messages (`input_text` / `output_text`
parts or a plain string; developer as system), `function_call` items (`arguments` a JSON string) and
`function_call_output` items. Calls and assistant text in a row form one assistant turn, as the
gateway produced them: a turn's text, its calls, and any text the model wrote after a call (streamed
as a message item of its own). `reasoning` items are skipped (the model sees no reasoning of an
earlier turn). `instructions` is the first system message. Tools are function tools in the flat
Responses shape `{"type": "function", "name", "description", "parameters"}`; hosted tools, images
and files, and structured output (`text.format` other than text) are refused with a 400.

A generation cut by `max_output_tokens` is a response with status "incomplete" and
`incomplete_details.reason` "max_output_tokens"; its stream ends with `response.incomplete`, not
`response.completed`, as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    FinishReason,
    Generation,
    RequestError,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Tools,
    arguments_from_json,
    bool_field,
    canonical_tool_call,
    choose_tools,
    function_tool,
    int_field,
    model_field,
    name_tool_messages,
    named_tool_choice,
    number_field,
    require_list,
    require_object,
    require_str,
    sse,
    tool_list,
    unsupported,
)
from rollstream.services.gateway.apis.errors import request_error_of

STATELESS = "this gateway keeps no responses, so send the whole conversation in `input`"
TEXT_PARTS = ("input_text", "output_text")
MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def parse_responses(body: Any) -> ChatRequest:
    body = require_object(body, "body")
    model = model_field(body)
    for stateful in ("previous_response_id", "conversation"):
        if body.get(stateful) is not None:
            raise RequestError(400, f"{stateful} is not supported: {STATELESS}", stateful)
    if body.get("prompt") is not None:
        raise unsupported("a stored prompt template (`prompt`)", "prompt")
    if bool_field(body, "background"):
        raise unsupported("background mode", "background")
    text = require_object(body.get("text") or {}, "text")
    text_format = require_object(text.get("format") or {}, "text.format")
    if text_format.get("type", "text") != "text":
        raise unsupported(f"text.format {text_format.get('type')!r}", "text.format",
                          "there is no structured output: describe the format in the prompt")

    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": require_str(body["instructions"], "instructions")})
    if "input" not in body:
        raise RequestError(400, "input is required", "input")
    if isinstance(body["input"], str):
        messages.append({"role": "user", "content": body["input"]})
    else:
        for i, item in enumerate(require_list(body["input"], "input", non_empty=True)):
            _add_item(messages, require_object(item, f"input[{i}]"), f"input[{i}]")
    tools = _tools(body.get("tools"))
    tool_choice, tools = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        model=model,
        messages=name_tool_messages(messages),
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=int_field(body, "max_output_tokens", minimum=1),
        temperature=number_field(body, "temperature", minimum=0, maximum=2),
        top_p=number_field(body, "top_p", minimum=0, maximum=1),
        stream=bool_field(body, "stream"),
    )


def _content(content: Any, param: str, *, role: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(require_list(content, param)):
        part = require_object(part, f"{param}[{i}]")
        if part.get("type") not in TEXT_PARTS:
            raise unsupported(f"content part type {part.get('type')!r}", f"{param}[{i}].type",
                              "only input_text and output_text parts are")
        texts.append(require_str(part.get("text"), f"{param}[{i}].text"))
    # An assistant turn's parts are pieces of one sampled text; a user's are paragraphs of their own.
    return ("" if role == "assistant" else "\n").join(texts)


def _open_assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a call or more assistant text belongs to: the last message when it is
    the assistant's (no tool output came in between), else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(400, f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}",
                               f"{param}.role")
        role = MESSAGE_ROLES[role]
        content = _content(item.get("content"), f"{param}.content", role=role)
        if role == "assistant" and messages and messages[-1]["role"] == "assistant" \
                and messages[-1].get("tool_calls"):
            messages[-1]["content"] += content  # text the model wrote after a call, in the same turn
        else:
            messages.append({"role": role, "content": content})
    elif kind == "function_call":
        turn = _open_assistant_turn(messages)
        turn.setdefault("tool_calls", []).append(canonical_tool_call(
            require_str(item.get("call_id"), f"{param}.call_id", non_empty=True),
            require_str(item.get("name"), f"{param}.name", non_empty=True),
            arguments_from_json(item.get("arguments", ""), f"{param}.arguments")))
    elif kind == "function_call_output":
        call_id = require_str(item.get("call_id"), f"{param}.call_id", non_empty=True)
        output = _content(item.get("output"), f"{param}.output", role="tool")
        messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
    elif kind == "reasoning":
        pass  # another model's reasoning (often encrypted) means nothing to this one
    elif kind == "item_reference":
        raise RequestError(400, f"item_reference is not supported: {STATELESS}", f"{param}.type")
    else:
        raise unsupported(f"input item type {kind!r}", f"{param}.type",
                          "only message, function_call, function_call_output and reasoning items are")


def _tools(tools: Any) -> Tools:
    if tools is None:
        return None
    canonical = []
    for i, tool in enumerate(require_list(tools, "tools")):
        tool = require_object(tool, f"tools[{i}]")
        if tool.get("type") != "function":
            raise unsupported(f"tool type {tool.get('type')!r}", f"tools[{i}].type",
                              "only function tools are")
        canonical.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"),
                                       f"tools[{i}]"))
    return tool_list(canonical, "tools")


def _tool_choice(choice: Any, tools: Tools) -> tuple[ToolChoice, Tools]:
    if choice is None:
        return "auto", tools
    if choice in ("auto", "none", "required"):
        return choose_tools(choice, tools, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        return named_tool_choice(choice.get("name"), tools, "tool_choice.name"), tools
    raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            f"{{'type': 'function', 'name': ...}}, not {choice!r}", "tool_choice")


# --- responses ------------------------------------------------------------------------------------


def _response(model: str, response_id: str, created: int, *, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
    # OpenAI echoes the request's settings here; the builders are given the model only, so tools,
    # tool_choice and sampling are left at neutral values (agents read the output, not these), while
    # every field the SDK's Response type requires is present.
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "metadata": {},
        "usage": usage,
    }


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _status(finish_reason: FinishReason) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _item_id(prefix: str, response_id: str, output_index: int) -> str:
    return f"{prefix}_{response_id.removeprefix('resp_')}_{output_index}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": arguments}


def responses_response(gen: Generation, *, model: str, response_id: str, created: int) -> dict[str, Any]:
    """The `response` object: a message item with the text (none without text), a function_call item
    per call; status "incomplete" when the token limit cut the turn."""
    status = _status(gen.finish_reason)
    output = []
    if gen.text:
        output.append(_message_item(_item_id("msg", response_id, 0), gen.text, status))
    for call in gen.tool_calls:
        output.append(_call_item(_item_id("fc", response_id, len(output)), call,
                                 json.dumps(call.arguments, ensure_ascii=False), "completed"))
    return _response(model, response_id, created, status=status, output=output,
                     usage=_usage(gen.prompt_tokens, gen.completion_tokens))


class _ResponseStream:
    """The events of one streamed response, numbered, and the output items they have completed."""

    def __init__(self, model: str, response_id: str, created: int) -> None:
        self.model, self.response_id, self.created = model, response_id, created
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.message_id: str | None = None
        """The message item text is being added to, while one is open."""
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(data, kind)

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return _response(self.model, self.response_id, self.created, status=status,
                         output=list(self.output), usage=usage)

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def text_delta(self, text: str) -> list[str]:
        events = []
        output_index = len(self.output)
        if self.message_id is None:
            self.message_id, self.text = _item_id("msg", self.response_id, output_index), ""
            events += [self.event("response.output_item.added", output_index=output_index,
                                  item=_message_item(self.message_id, None, "in_progress")),
                       self.event("response.content_part.added", item_id=self.message_id,
                                  output_index=output_index, content_index=0, part=_text_part(""))]
        self.text += text
        events.append(self.event("response.output_text.delta", item_id=self.message_id,
                                 output_index=output_index, content_index=0, delta=text, logprobs=[]))
        return events

    def close_message(self, status: str) -> list[str]:
        if self.message_id is None:
            return []
        output_index, item_id = len(self.output), self.message_id
        item = _message_item(item_id, self.text, status)
        self.output.append(item)
        self.message_id = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=output_index,
                           content_index=0, text=self.text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=output_index,
                           content_index=0, part=_text_part(self.text)),
                self.event("response.output_item.done", output_index=output_index, item=item)]

    def call(self, call: ToolCall) -> list[str]:
        events = self.close_message("completed")
        output_index = len(self.output)
        item_id = _item_id("fc", self.response_id, output_index)
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        item = _call_item(item_id, call, arguments, "completed")
        self.output.append(item)
        return [
            *events,
            self.event("response.output_item.added", output_index=output_index,
                       item=_call_item(item_id, call, "", "in_progress")),
            self.event("response.function_call_arguments.delta", item_id=item_id, output_index=output_index,
                       delta=arguments),
            self.event("response.function_call_arguments.done", item_id=item_id, output_index=output_index,
                       arguments=arguments),
            self.event("response.output_item.done", output_index=output_index, item=item),
        ]

    def end(self, end: StreamEnd) -> list[str]:
        status = _status(end.finish_reason)
        events = self.close_message(status)
        final = self.response(status, _usage(end.prompt_tokens, end.completion_tokens))
        return [*events, self.event(f"response.{status}", response=final)]

    def fail(self, error: RequestError) -> list[str]:
        failed = self.response("failed")
        failed["error"] = {"code": "server_error", "message": error.message}
        return [self.event("response.failed", response=failed)]


async def responses_sse(events: AsyncIterator[StreamEvent], *, model: str, response_id: str,
                        created: int) -> AsyncIterator[str]:
    """The Responses event stream, each event as `event: <type>\\ndata: {...}\\n\\n` with its
    `sequence_number`: `response.created`, `response.in_progress`, a message item for the text
    (`output_item.added`, `content_part.added`, `output_text.delta`..., `output_text.done`,
    `content_part.done`, `output_item.done`), a function_call item per call (`output_item.added`,
    `function_call_arguments.delta` / `.done`, `output_item.done`), then `response.completed` (or
    `response.incomplete`). A failure of the generation ends it with `response.failed`."""
    stream = _ResponseStream(model, response_id, created)
    for event in stream.start():
        yield event
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                produced = stream.text_delta(event.text)
            elif isinstance(event, ToolCallDelta):
                produced = stream.call(event.call)
            else:
                produced = stream.end(event)
            for line in produced:
                yield line
            if isinstance(event, StreamEnd):
                return
        raise RuntimeError("the generation ended without a finish reason")
    except Exception as e:  # noqa: BLE001 - the 200 is out: every failure must reach the client as response.failed
        for line in stream.fail(request_error_of(e)):
            yield line
