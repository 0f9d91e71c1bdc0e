"""OpenAI Responses (`POST /v1/responses`): a generation back as a `response` object, or as the Responses
event stream; the request is read by openai_responses.py.

Output items, in order: a `reasoning` item when the model reasoned, a message item with the text (none
without text), a `function_call` item per call (a `custom_tool_call` item, with the call's string as
`input`, for a custom tool; a namespace member's call names the namespace and the member apart).

Reasoning the model wrote comes back as a `reasoning` item before the message: its text as
`reasoning_text` content, as the summary too when `reasoning.summary` asks for one, and encoded in
`encrypted_content` when `include` asks for "reasoning.encrypted_content" (an encoding, not a
secret: what lets the gateway read the reasoning again when the client sends the item back).

A generation cut by `max_output_tokens` is a response with status "incomplete" and
`incomplete_details.reason` "max_output_tokens"; its stream ends with `response.incomplete`, not
`response.completed`, as OpenAI's does.

    python -m pytest tests/unit/services/gateway/test_api_openai_responses.py -q
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
)
from rollstream.services.gateway.apis.client_tools import freeform_input
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.apis.sse import render_sse, sse

ENCRYPTED_REASONING = "rollstream-reasoning:"
"""How the gateway's `encrypted_content` starts: base64 of the reasoning follows."""
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
IGNORED_TOOLS_METADATA = "rollstream_ignored_tools"


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
