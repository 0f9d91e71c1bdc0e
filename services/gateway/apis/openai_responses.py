"""OpenAI Responses (`POST /v1/responses`): the request into a `ChatRequest`, a generation back as a
`response` object or as the Responses event stream.

The gateway keeps no responses, so every request carries the whole conversation in `input`:
`previous_response_id`, `conversation` and `item_reference` items are refused with a 400 saying so.

`input` is a string (one user message) or a list of items: messages (`input_text` / `output_text`
parts or a plain string; system and developer messages, wherever they are, as system messages),
`function_call` items (`arguments` a JSON string), `custom_tool_call` items (`input` a string) and their
`function_call_output` and `custom_tool_call_output` items. Calls and
assistant text in a row form one assistant turn, as the gateway produced them: a turn's text, its
calls, and any text the model wrote after a call (streamed as a message item of its own). A
`reasoning` item opens the turn it belongs to and becomes its `reasoning_content`: read from the
`encrypted_content` the gateway wrote, else from its `reasoning_text` content, else its summary;
another provider's encrypted reasoning, with nothing readable, is skipped. `instructions` is the
first system message.

Tools are function tools in the flat Responses shape `{"type": "function", "name", "description",
"parameters"}`, and namespaces of them (`{"type": "namespace", "name", "tools": [...]}`), whose
members the model sees as `namespace.name` (a dot is never in an OpenAI function name, so it cannot
collide) and whose calls go back as OpenAI returns them, `{"type": "function_call", "name",
"namespace", ...}`. Custom (freeform) tools `{"type": "custom", "name", "description", "format"}` are
functions of one string to the model (client_tools.py), and their calls go back as `custom_tool_call`
items with that string as `input`. Any other tool (hosted ones such as web_search, file_search,
code_interpreter, image_generation, mcp) is left out of what the model sees. `reasoning.effort` "none"
asks the model not to reason, another effort or a `reasoning.summary` to reason.

Reasoning the model wrote comes back as a `reasoning` item before the message: its text as
`reasoning_text` content, as the summary too when `reasoning.summary` asks for one, and encoded in
`encrypted_content` when `include` asks for "reasoning.encrypted_content" (an encoding, not a
secret: what lets the gateway read the reasoning again when the client sends the item back).

Refused with a 400: images and files, structured output (`text.format` other than text), stored
prompts and background mode.

A generation cut by `max_output_tokens` is a response with status "incomplete" and
`incomplete_details.reason` "max_output_tokens"; its stream ends with `response.incomplete`, not
`response.completed`, as OpenAI's does.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncIterator
from typing import Any

from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    FinishReason,
    Generation,
    StreamEnd,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Tools,
    canonical_tool_call,
    name_tool_messages,
)
from rollstream.services.gateway.apis.client_tools import freeform_arguments, freeform_input, freeform_tool
from rollstream.services.gateway.apis.errors import RequestError
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
    thinking_of_effort,
    tool_list,
    unsupported,
)

STATELESS = "this gateway keeps no responses, so send the whole conversation in `input`"
TEXT_PARTS = ("input_text", "output_text")
MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
NAMESPACE_SEPARATOR = "."
ENCRYPTED_REASONING = "rollstream-reasoning:"
"""How the gateway's `encrypted_content` starts: base64 of the reasoning follows."""
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
IGNORED_TOOLS_METADATA = "rollstream_ignored_tools"


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
    tools, tool_namespaces, freeform_tools, ignored_tools = _tools(body.get("tools"))
    tool_choice, tools = _tool_choice(body.get("tool_choice"), tools)
    reasoning = require_object(body.get("reasoning") or {}, "reasoning")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    thinking = thinking_of_effort(reasoning.get("effort"), "reasoning.effort")
    if thinking is None and summary is not None:
        thinking = True  # a summary asks for reasoning, unless the effort turns it off
    include = require_list(body.get("include") or [], "include")
    return ChatRequest(
        model=model,
        messages=name_tool_messages(messages),
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=int_field(body, "max_output_tokens", minimum=1),
        temperature=number_field(body, "temperature", minimum=0, maximum=2),
        top_p=number_field(body, "top_p", minimum=0, maximum=1),
        stream=bool_field(body, "stream"),
        thinking=thinking,
        ignored_tools=ignored_tools,
        reasoning_summary=summary is not None,
        encrypted_reasoning=ENCRYPTED_REASONING_INCLUDE in include,
        tool_namespaces=tool_namespaces,
        freeform_tools=freeform_tools,
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


def _last_assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message when it is the assistant's: no tool output or user message came after it."""
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _open_assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a call belongs to: the last message when it is the assistant's, else a
    new one."""
    turn = _last_assistant_turn(messages)
    if turn is None:
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    return turn


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(400, f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}",
                               f"{param}.role")
        role = MESSAGE_ROLES[role]
        content = _content(item.get("content"), f"{param}.content", role=role)
        turn = _last_assistant_turn(messages)
        # Text the model wrote after a call, or the text of a turn its reasoning item opened: the same turn.
        if role == "assistant" and turn is not None and (turn.get("tool_calls") or not turn["content"]):
            turn["content"] += content
        else:
            messages.append({"role": role, "content": content})
    elif kind in ("function_call", "custom_tool_call"):
        turn = _open_assistant_turn(messages)
        name = require_str(item.get("name"), f"{param}.name", non_empty=True)
        if item.get("namespace") is not None:
            name = _namespaced(require_str(item["namespace"], f"{param}.namespace", non_empty=True), name)
        if kind == "function_call":
            arguments = arguments_from_json(item.get("arguments", ""), f"{param}.arguments")
        else:
            arguments = freeform_arguments(item.get("input"), f"{param}.input")
        turn.setdefault("tool_calls", []).append(canonical_tool_call(
            require_str(item.get("call_id"), f"{param}.call_id", non_empty=True), name, arguments))
    elif kind == "reasoning":
        reasoning = _reasoning_of(item, param)
        if reasoning:
            # Reasoning comes first in its turn: it opens one, unless another reasoning item just did.
            turn = _last_assistant_turn(messages)
            if turn is None or turn["content"] or turn.get("tool_calls"):
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            turn["reasoning_content"] = turn.get("reasoning_content", "") + reasoning
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = require_str(item.get("call_id"), f"{param}.call_id", non_empty=True)
        output = _content(item.get("output"), f"{param}.output", role="tool")
        messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
    elif kind == "item_reference":
        raise RequestError(400, f"item_reference is not supported: {STATELESS}", f"{param}.type")
    else:
        raise unsupported(f"input item type {kind!r}", f"{param}.type",
                          "only message, function_call, custom_tool_call, their outputs and reasoning "
                          "items are")


def _reasoning_of(item: dict[str, Any], param: str) -> str:
    """The text of a reasoning item sent back ("" when there is none the gateway can read)."""
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        decoded = decode_reasoning(require_str(encrypted, f"{param}.encrypted_content"))
        if decoded is not None:
            return decoded
    for key, kind, joiner in (("content", "reasoning_text", ""), ("summary", "summary_text", "\n\n")):
        parts = [require_object(part, f"{param}.{key}[{j}]")
                 for j, part in enumerate(require_list(item.get(key) or [], f"{param}.{key}"))]
        texts = [require_str(part.get("text"), f"{param}.{key}[{j}].text")
                 for j, part in enumerate(parts) if part.get("type") == kind]
        if texts:
            return joiner.join(texts)
    return ""


def encode_reasoning(reasoning: str) -> str:
    return ENCRYPTED_REASONING + base64.b64encode(reasoning.encode()).decode()


def decode_reasoning(encrypted: str) -> str | None:
    """The reasoning `encode_reasoning` encoded; None for anything else (another provider's)."""
    if not encrypted.startswith(ENCRYPTED_REASONING):
        return None
    try:
        return base64.b64decode(encrypted[len(ENCRYPTED_REASONING):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _namespaced(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


class _ToolList:
    """The functions the model is shown for a request's tools, and how their calls go back."""

    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.namespaced: dict[str, tuple[str, str]] = {}
        self.freeform: set[str] = set()
        self.ignored: list[str] = []

    def add(self, tool: dict[str, Any], param: str, namespace: str | None = None) -> None:
        """A function or custom tool (a member of `namespace` when given); any other is left out."""
        if tool.get("type") not in ("function", "custom"):
            leave_out_tool(self.ignored, tool.get("type"), f"{param}.type")
            return
        member = require_str(tool.get("name"), f"{param}.name", non_empty=True)
        name = member if namespace is None else _namespaced(namespace, member)
        if tool["type"] == "function":
            self.functions.append(function_tool(name, tool.get("description"), tool.get("parameters"), param))
        else:
            self.functions.append(freeform_tool(name, tool.get("description"), tool.get("format"), param))
            self.freeform.add(name)
        if namespace is not None:
            self.namespaced[name] = (namespace, member)


def _tools(tools: Any) -> tuple[Tools, dict[str, tuple[str, str]], set[str], list[str]]:
    """The function and custom tools (namespaces' members flattened) as the request's tools, the namespaced
    names, the custom tools' names, and the types of the tools left out."""
    found = _ToolList()
    for i, tool in enumerate(require_list(tools if tools is not None else [], "tools")):
        tool = require_object(tool, f"tools[{i}]")
        if tool.get("type") == "namespace":
            namespace = require_str(tool.get("name"), f"tools[{i}].name", non_empty=True)
            for j, member in enumerate(require_list(tool.get("tools"), f"tools[{i}].tools")):
                member_param = f"tools[{i}].tools[{j}]"
                found.add(require_object(member, member_param), member_param, namespace)
        else:
            found.add(tool, f"tools[{i}]")
    return tool_list(found.functions, "tools"), found.namespaced, found.freeform, found.ignored


def _tool_choice(choice: Any, tools: Tools) -> tuple[ToolChoice, Tools]:
    if choice is None:
        return "auto", tools
    if choice in ("auto", "none", "required"):
        return choose_tools(choice, tools, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return named_tool_choice(choice.get("name"), tools, "tool_choice.name"), tools
    raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            f"{{'type': 'function' or 'custom', 'name': ...}}, not {choice!r}", "tool_choice")


# --- responses ------------------------------------------------------------------------------------


def _response(request: ChatRequest, response_id: str, created: int, *, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    # OpenAI echoes the request's settings here; agents read the output, not these, so tools,
    # tool_choice and sampling are left at neutral values, while every field the SDK's Response type
    # requires is present. `metadata` (string values only) names the tools the model was not shown.
    metadata = {IGNORED_TOOLS_METADATA: ",".join(request.ignored_tools)} if request.ignored_tools else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "model": request.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "metadata": metadata,
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


def _reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def _reasoning_item(item_id: str, reasoning: str | None, request: ChatRequest) -> dict[str, Any]:
    """A reasoning item; `reasoning` None while it is still being streamed."""
    if reasoning is None:
        return {"id": item_id, "type": "reasoning", "summary": [], "content": []}
    item = {"id": item_id, "type": "reasoning",
            "summary": [_summary_part(reasoning)] if request.reasoning_summary else [],
            "content": [_reasoning_text_part(reasoning)]}
    if request.encrypted_reasoning:
        item["encrypted_content"] = encode_reasoning(reasoning)
    return item


def _call_payload(call: ToolCall, request: ChatRequest) -> tuple[str, str]:
    """A call's item type and what it carries: a function call's arguments as JSON, a custom call's input."""
    if call.name in request.freeform_tools:
        return "custom_tool_call", freeform_input(call.arguments)
    return "function_call", json.dumps(call.arguments, ensure_ascii=False)


def _call_item(item_id: str, call: ToolCall, payload: str, status: str,
               request: ChatRequest) -> dict[str, Any]:
    """A function_call item (`payload` its arguments) or custom_tool_call item (`payload` its input); a
    call of a namespace's member names the namespace and the member apart."""
    kind, _ = _call_payload(call, request)
    item = {"id": item_id, "type": kind, "status": status, "call_id": call.id, "name": call.name,
            "arguments" if kind == "function_call" else "input": payload}
    if call.name in request.tool_namespaces:
        item["namespace"], item["name"] = request.tool_namespaces[call.name]
    return item


def responses_response(gen: Generation, request: ChatRequest, *, response_id: str,
                       created: int) -> dict[str, Any]:
    """The `response` object: a reasoning item when the model reasoned, a message item with the text
    (none without text), a function_call item per call; status "incomplete" when the token limit cut
    the turn."""
    status = _status(gen.finish_reason)
    output = []
    if gen.reasoning:
        output.append(_reasoning_item(_item_id("rs", response_id, 0), gen.reasoning, request))
    if gen.text:
        output.append(_message_item(_item_id("msg", response_id, len(output)), gen.text, status))
    for call in gen.tool_calls:
        output.append(_call_item(_item_id("fc", response_id, len(output)), call,
                                 _call_payload(call, request)[1], "completed", request))
    return _response(request, response_id, created, status=status, output=output,
                     usage=_usage(gen.prompt_tokens, gen.completion_tokens))


class _ResponseStream:
    """The events of one streamed response, numbered, and the output items they have completed
    (sse.EventRenderer)."""

    def __init__(self, request: ChatRequest, response_id: str, created: int) -> None:
        self.request, self.response_id, self.created = request, response_id, created
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.open_item: str | None = None
        """"reasoning" or "message" while deltas are being added to the item at index len(output)."""
        self.item_text = ""
        """The open item's text so far."""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(data, kind)

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return _response(self.request, self.response_id, self.created, status=status,
                         output=list(self.output), usage=usage)

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def _open(self, kind: str) -> tuple[list[str], str, int]:
        """The item of `kind` deltas go to (opened now, after closing another, if it is not open): the
        events that did so, its id and its output index."""
        events = [] if self.open_item == kind else self._close("completed")
        output_index = len(self.output)
        item_id = _item_id("rs" if kind == "reasoning" else "msg", self.response_id, output_index)
        if self.open_item == kind:
            return events, item_id, output_index
        self.open_item, self.item_text = kind, ""
        if kind == "reasoning":
            events += [self.event("response.output_item.added", output_index=output_index,
                                  item=_reasoning_item(item_id, None, self.request)),
                       self.event("response.content_part.added", item_id=item_id, output_index=output_index,
                                  content_index=0, part=_reasoning_text_part(""))]
            if self.request.reasoning_summary:
                events.append(self.event("response.reasoning_summary_part.added", item_id=item_id,
                                         output_index=output_index, summary_index=0, part=_summary_part("")))
        else:
            events += [self.event("response.output_item.added", output_index=output_index,
                                  item=_message_item(item_id, None, "in_progress")),
                       self.event("response.content_part.added", item_id=item_id, output_index=output_index,
                                  content_index=0, part=_text_part(""))]
        return events, item_id, output_index

    def reasoning(self, text: str) -> list[str]:
        events, item_id, output_index = self._open("reasoning")
        self.item_text += text
        events.append(self.event("response.reasoning_text.delta", item_id=item_id, output_index=output_index,
                                 content_index=0, delta=text))
        if self.request.reasoning_summary:
            events.append(self.event("response.reasoning_summary_text.delta", item_id=item_id,
                                     output_index=output_index, summary_index=0, delta=text))
        return events

    def text(self, text: str) -> list[str]:
        events, item_id, output_index = self._open("message")
        self.item_text += text
        events.append(self.event("response.output_text.delta", item_id=item_id, output_index=output_index,
                                 content_index=0, delta=text, logprobs=[]))
        return events

    def _close(self, status: str) -> list[str]:
        """The events that complete the open item, if any; `status` is a message item's."""
        if self.open_item is None:
            return []
        output_index, text = len(self.output), self.item_text
        if self.open_item == "reasoning":
            item = _reasoning_item(_item_id("rs", self.response_id, output_index), text, self.request)
            events = [self.event("response.reasoning_text.done", item_id=item["id"],
                                 output_index=output_index, content_index=0, text=text),
                      self.event("response.content_part.done", item_id=item["id"], output_index=output_index,
                                 content_index=0, part=_reasoning_text_part(text))]
            if self.request.reasoning_summary:
                events += [self.event("response.reasoning_summary_text.done", item_id=item["id"],
                                      output_index=output_index, summary_index=0, text=text),
                           self.event("response.reasoning_summary_part.done", item_id=item["id"],
                                      output_index=output_index, summary_index=0, part=_summary_part(text))]
        else:
            item = _message_item(_item_id("msg", self.response_id, output_index), text, status)
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=output_index,
                                 content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=output_index,
                                 content_index=0, part=_text_part(text))]
        self.output.append(item)
        self.open_item = None
        return [*events, self.event("response.output_item.done", output_index=output_index, item=item)]

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        call = delta.call
        events = self._close("completed")
        output_index = len(self.output)
        item_id = _item_id("fc", self.response_id, output_index)
        kind, payload = _call_payload(call, self.request)
        item = _call_item(item_id, call, payload, "completed", self.request)
        self.output.append(item)
        events_of = "function_call_arguments" if kind == "function_call" else "custom_tool_call_input"
        field = "arguments" if kind == "function_call" else "input"
        return [
            *events,
            self.event("response.output_item.added", output_index=output_index,
                       item=_call_item(item_id, call, "", "in_progress", self.request)),
            self.event(f"response.{events_of}.delta", item_id=item_id, output_index=output_index,
                       delta=payload),
            self.event(f"response.{events_of}.done", item_id=item_id, output_index=output_index,
                       **{field: payload}),
            self.event("response.output_item.done", output_index=output_index, item=item),
        ]

    def end(self, end: StreamEnd) -> list[str]:
        status = _status(end.finish_reason)
        events = self._close(status)
        final = self.response(status, _usage(end.prompt_tokens, end.completion_tokens))
        return [*events, self.event(f"response.{status}", response=final)]

    def fail(self, error: RequestError) -> list[str]:
        failed = self.response("failed")
        failed["error"] = {"code": "server_error", "message": error.message}
        return [self.event("response.failed", response=failed)]


def responses_sse(events: AsyncIterator[StreamEvent], request: ChatRequest, *, response_id: str,
                  created: int) -> AsyncIterator[str]:
    """The Responses event stream, each event as `event: <type>\\ndata: {...}\\n\\n` with its
    `sequence_number`: `response.created`, `response.in_progress`, a reasoning item when the model
    reasons (`output_item.added`, `content_part.added`, `reasoning_text.delta`..., `reasoning_text.done`,
    `content_part.done`, and the `reasoning_summary_*` events too when a summary is asked for, then
    `output_item.done`), a message item for the text (`output_item.added`, `content_part.added`,
    `output_text.delta`..., `output_text.done`, `content_part.done`, `output_item.done`), a
    function_call item per call (`output_item.added`, `function_call_arguments.delta` / `.done`,
    `output_item.done`; a custom_tool_call item's `custom_tool_call_input.delta` / `.done`), then
    `response.completed` (or `response.incomplete`). A failure of the generation ends it with
    `response.failed`."""
    return render_sse(events, _ResponseStream(request, response_id, created))
