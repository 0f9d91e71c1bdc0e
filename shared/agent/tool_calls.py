"""Tool calls out of the model's sampled text, in the format the config names (`agent.tool_format`).

Each format turns one turn's text into a `ParsedTurn`: the text without the call markup, the calls,
and one error message per call the model tried to write but got wrong. A malformed call is data for
the episode (the model is told, and the trajectory keeps it), never an exception.

Formats:
  hermes   <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>
           One block per call, several per turn, text around them allowed (Qwen 2.5 / 3, Hermes).
  mistral  [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+3"}}, ...]
           A JSON array of calls after the marker (Mistral's v3 tokenizer). `[TOOL_CALLS]` is a
           special token there: decode the sampled ids with special tokens kept.

In both, `arguments` may be left out for a call without arguments; when present it must be a JSON
object. Call ids are deterministic, `call_{turn}_{index}`, index counting the well-formed calls of
the turn from 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from rollstream.shared.agent.tools import ToolCall

EXCERPT_CHARS = 80


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The text with tool-call markup removed, stripped."""
    calls: list[ToolCall]
    errors: list[str]
    """One message per malformed call: what was wrong, with a short excerpt."""


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str, turn: int) -> ParsedTurn: ...

    def describe(self) -> str:
        """A short instruction for the system prompt saying how to call tools in this format."""
        ...


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "...")


class _Calls:
    """Collects the calls and errors of one turn and numbers the calls."""

    def __init__(self, turn: int) -> None:
        self.turn = turn
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []

    def add(self, call: Any, source: str) -> None:
        """`call` is one decoded JSON value that should be {"name": str, "arguments": {...}}."""
        if not isinstance(call, dict):
            self.errors.append("a tool call must be a JSON object with name and arguments: "
                               f"{_excerpt(source)}")
            return
        name = call.get("name")
        if not isinstance(name, str) or not name.strip():
            self.errors.append(f"tool call without a name: {_excerpt(source)}")
            return
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            self.errors.append(f"arguments of {name} must be a JSON object, not {type(arguments).__name__}: "
                               f"{_excerpt(source)}")
            return
        self.calls.append(ToolCall(id=f"call_{self.turn}_{len(self.calls)}", name=name.strip(),
                                   arguments=arguments))

    def turn_of(self, pieces: list[str]) -> ParsedTurn:
        return ParsedTurn(content="".join(pieces).strip(), calls=self.calls, errors=self.errors)


class HermesFormat:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, turn: int) -> ParsedTurn:
        found = _Calls(turn)
        content: list[str] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            if end == -1:
                found.errors.append(f"unclosed {self.OPEN} (no {self.CLOSE}): {_excerpt(text[start:])}")
                pos = len(text)
                break
            body = text[body_start:end]
            try:
                call = json.loads(body)
            except json.JSONDecodeError as e:
                found.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): "
                                    f"{_excerpt(body)}")
            else:
                found.add(call, body)
            pos = end + len(self.CLOSE)
        content.append(text[pos:])
        return found.turn_of(content)

    def describe(self) -> str:
        return ('To call a tool, write <tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON '
                "object>}}</tool_call>. Put each call in its own <tool_call> block; you may make several "
                "calls in one turn. The results come back in the next message.")


class MistralFormat:
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: a JSON array of calls after the marker."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, turn: int) -> ParsedTurn:
        found = _Calls(turn)
        content: list[str] = []
        decoder = json.JSONDecoder()
        pos = 0
        while (start := text.find(self.MARKER, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(self.MARKER)
            while body_start < len(text) and text[body_start].isspace():
                body_start += 1
            try:
                value, end = decoder.raw_decode(text, body_start)
            except json.JSONDecodeError as e:
                # Without valid JSON there is no telling where the calls end: the rest of the turn is the
                # call.
                found.errors.append(f"tool calls after {self.MARKER} are not valid JSON ({e.msg}): "
                                    f"{_excerpt(text[body_start:])}")
                pos = len(text)
                break
            source = text[body_start:end]
            for call in value if isinstance(value, list) else [value]:  # a lone object is one call
                found.add(call, json.dumps(call) if isinstance(value, list) else source)
            if isinstance(value, list) and not value:
                found.errors.append(f"{self.MARKER} followed by an empty list of calls")
            pos = end
        content.append(text[pos:])
        return found.turn_of(content)

    def describe(self) -> str:
        return ('To call tools, write [TOOL_CALLS] followed by a JSON list of calls: [TOOL_CALLS][{"name": '
                '"<tool name>", "arguments": {<arguments as a JSON object>}}]. You may put several calls in '
                "the list. The results come back in the next message.")


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), MistralFormat())}


def get_format(name: str) -> ToolCallFormat:
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; "
                         f"known formats: {', '.join(TOOL_CALL_FORMATS)}") from None
