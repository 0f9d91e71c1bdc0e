"""Server-sent event streams: the framing of one event, and the one loop that turns a generation's
stream events (canonical.StreamEvent) into any API's event stream.

Each API supplies an `EventRenderer`, the events of its own wire format for each stream event;
`render_sse` drives it: the opening events, then the events of each reasoning delta, text delta and
tool call as the generation produces them, then the closing events of StreamEnd. The 200 has gone
out by the time the generation fails, so a failure (or a generation that ends without StreamEnd)
becomes the API's error event, never a cut connection.

    python -m pytest tests/unit/services/gateway -q -k "sse or sdk"
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from rollstream.services.gateway.apis.canonical import (
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
)
from rollstream.services.gateway.apis.errors import RequestError, request_error_of


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; JSON escapes line breaks, so the data is always a single line."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class EventRenderer(Protocol):
    """One API's events for one streamed generation, each method giving the framed events to send, in
    order; a renderer keeps whatever its format needs to know of what it sent before."""

    def start(self) -> list[str]:
        """What opens the stream, before the generation's first event."""

    def reasoning(self, text: str) -> list[str]: ...

    def text(self, text: str) -> list[str]: ...

    def tool_call(self, delta: ToolCallDelta) -> list[str]: ...

    def end(self, end: StreamEnd) -> list[str]:
        """What closes the stream: the finish reason and usage."""

    def fail(self, error: RequestError) -> list[str]:
        """What ends a stream whose generation failed: the API's error event."""


def _render(renderer: EventRenderer, event: StreamEvent) -> list[str]:
    if isinstance(event, ReasoningDelta):
        return renderer.reasoning(event.text)
    if isinstance(event, TextDelta):
        return renderer.text(event.text)
    if isinstance(event, ToolCallDelta):
        return renderer.tool_call(event)
    return renderer.end(event)


async def render_sse(events: AsyncIterator[StreamEvent], renderer: EventRenderer) -> AsyncIterator[str]:
    """The API's event stream of a generation, through StreamEnd."""
    for line in renderer.start():
        yield line
    try:
        async for event in events:
            for line in _render(renderer, event):
                yield line
            if isinstance(event, StreamEnd):
                return
        raise RuntimeError("the generation ended without a finish reason")
    except Exception as e:  # the 200 is out: every failure must reach the client as an event
        for line in renderer.fail(request_error_of(e)):
            yield line
