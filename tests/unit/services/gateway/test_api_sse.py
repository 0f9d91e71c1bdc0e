"""The one loop behind every API's event stream: each stream event reaches the renderer in order, the
stream ends at StreamEnd, and a failure or a missing StreamEnd becomes the renderer's error event."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from rollstream.services.gateway.apis.canonical import (
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolCallDelta,
)
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.apis.sse import render_sse, sse

CALL = ToolCallDelta(index=0, call=ToolCall("call_1_0", "read", {"path": "a.py"}))
END = StreamEnd("tool_calls", prompt_tokens=5, completion_tokens=3)


class Recorder:
    """Renders each event as one line naming it."""

    def start(self) -> list[str]:
        return ["start"]

    def reasoning(self, text: str) -> list[str]:
        return [f"reasoning {text}"]

    def text(self, text: str) -> list[str]:
        return [f"text {text}"]

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        return [f"call {delta.index} {delta.call.name}"]

    def end(self, end: StreamEnd) -> list[str]:
        return [f"end {end.finish_reason} {end.prompt_tokens}", "done"]

    def fail(self, error: RequestError) -> list[str]:
        return [f"fail {error.status} {error.message}"]


def rendered(events: list[StreamEvent], failure: Exception | None = None) -> list[str]:
    async def generation() -> AsyncIterator[StreamEvent]:
        for event in events:
            yield event
        if failure is not None:
            raise failure

    async def collect() -> list[str]:
        return [line async for line in render_sse(generation(), Recorder())]

    return asyncio.run(collect())


def test_every_event_is_rendered_in_order_through_stream_end():
    events = [ReasoningDelta("think"), TextDelta("Reading."), CALL, END, TextDelta("never sent")]
    assert rendered(events) == ["start", "reasoning think", "text Reading.", "call 0 read",
                                "end tool_calls 5", "done"]


def test_a_failure_after_the_start_is_the_renderers_error_event(caplog):
    with caplog.at_level(logging.ERROR):
        lines = rendered([TextDelta("Partial")], ConnectionError("vLLM server went away"))
    assert lines == ["start", "text Partial",
                     "fail 500 generation failed: ConnectionError: vLLM server went away"]
    assert rendered([], RequestError(410, "finished meanwhile")) == ["start", "fail 410 finished meanwhile"]


def test_a_generation_without_stream_end_is_a_failure(caplog):
    with caplog.at_level(logging.ERROR):
        lines = rendered([TextDelta("cut")])
    assert lines == ["start", "text cut",
                     "fail 500 generation failed: RuntimeError: the generation ended without a finish reason"]


def test_an_event_is_one_line_of_data_with_an_optional_name():
    assert sse({"text": "a\nb", "n": 1}) == 'data: {"text":"a\\nb","n":1}\n\n'
    assert sse({"type": "ping"}, "ping") == 'event: ping\ndata: {"type":"ping"}\n\n'
