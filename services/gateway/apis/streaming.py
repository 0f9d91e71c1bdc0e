"""Reasoning and tool calls out of the model's text while it is still being sampled (hermes format).

`ToolCallStreamParser` is fed the decoded text as tokens arrive and hands back what can already be
shown: text at once, except a tail that may be the start of `<tool_call>`, and each call as a whole
once its `</tool_call>` has been sampled. Each block is decoded by the repository's hermes parser,
so a call means the same thing here as in a complete turn; a block that does not decode (bad JSON,
no name, or never closed) is given back as text, so nothing the model wrote is lost.

The text is stripped at both ends, as `HermesFormat.parse` strips a turn: leading whitespace is
dropped and trailing whitespace is held until more text follows it. Whatever the pieces the text
arrives in, the deltas add up to the same content and calls as the whole text fed at once.

`TurnStreamParser` puts a reasoning block in front of that: a turn that opens with `<think>` (Qwen3,
DeepSeek-R1 and most open reasoning models) gives its reasoning as `ReasoningDelta` up to `</think>`,
and only the text after it goes through `ToolCallStreamParser`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollstream.shared.agent.tool_calls import HermesFormat
from rollstream.shared.agent.tools import ToolCall

_HERMES = HermesFormat()
OPEN, CLOSE = HermesFormat.OPEN, HermesFormat.CLOSE
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
"""The markers of a reasoning block, as the open reasoning models write them."""


@dataclass(frozen=True)
class TextDelta:
    """Text of the assistant message, to be appended to what came before."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning the model wrote before its answer, to be appended to what came before."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One complete call; `index` counts the calls of the turn from 0."""

    index: int
    call: ToolCall


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (the start of a tag not yet complete)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class _StrippedText:
    """Text stripped at both ends while it arrives: leading whitespace is dropped, trailing whitespace is
    held until more text follows it (and dropped if none does)."""

    def __init__(self) -> None:
        self.started = False
        self.held_whitespace = ""

    def push(self, text: str) -> str:
        """What of `text` can be shown now ("" when nothing)."""
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        visible = text.rstrip()
        if not visible:
            self.held_whitespace += text
            return ""
        piece = self.held_whitespace + visible
        self.held_whitespace = text[len(visible):]
        return piece


class ToolCallStreamParser:
    def __init__(self, turn: int) -> None:
        self.turn = turn
        self._unresolved = ""
        """Outside a call: a possible partial `<tool_call>`; inside one: the call's body so far."""
        self._in_call = False
        self._calls = 0
        self._content = _StrippedText()

    def feed(self, text: str) -> list[TextDelta | ToolCallDelta]:
        out: list[TextDelta | ToolCallDelta] = []
        buffer = self._unresolved + text
        while True:
            if not self._in_call:
                start = buffer.find(OPEN)
                if start == -1:
                    keep = _partial_tag(buffer, OPEN)
                    self._text(buffer[: len(buffer) - keep], out)
                    self._unresolved = buffer[len(buffer) - keep:]
                    return out
                self._text(buffer[:start], out)
                buffer = buffer[start + len(OPEN):]
                self._in_call = True
            else:
                end = buffer.find(CLOSE)
                if end == -1:
                    self._unresolved = buffer
                    return out
                self._block(buffer[:end], out)
                buffer = buffer[end + len(CLOSE):]
                self._in_call = False

    def finish(self) -> list[TextDelta | ToolCallDelta]:
        """What is left once sampling has ended: a call never closed, or a partial tag, as text."""
        out: list[TextDelta | ToolCallDelta] = []
        self._text(OPEN + self._unresolved if self._in_call else self._unresolved, out)
        self._unresolved, self._in_call, self._content.held_whitespace = "", False, ""
        return out

    def _block(self, body: str, out: list[TextDelta | ToolCallDelta]) -> None:
        block = OPEN + body + CLOSE
        parsed = _HERMES.parse(block, self.turn)
        if not parsed.calls:
            self._text(block, out)
            return
        # Parsed alone, the block is always call 0; the id must count the turn's earlier calls,
        # as `HermesFormat.parse` numbers them over the whole turn.
        call = dataclasses.replace(parsed.calls[0], id=f"call_{self.turn}_{self._calls}")
        out.append(ToolCallDelta(index=self._calls, call=call))
        self._calls += 1

    def _text(self, text: str, out: list[TextDelta | ToolCallDelta]) -> None:
        piece = self._content.push(text)
        if piece:
            out.append(TextDelta(piece))


TurnPiece = ReasoningDelta | TextDelta | ToolCallDelta


class TurnStreamParser:
    """A whole turn as it arrives: its reasoning block, then its text and calls (`ToolCallStreamParser`).

    The text reasons when it starts, after whitespace, with `<think>`; a `<think>` later on is text of
    the answer. `reasoning_open` says the prompt opened the block already (templates of models that
    always reason end the generation prompt with `<think>`): the text then starts inside it. The
    reasoning is stripped at both ends like the answer; a block never closed (the turn was cut by
    max_tokens) is reasoning to its end.
    """

    def __init__(self, turn: int, reasoning_open: bool = False) -> None:
        self._answer = ToolCallStreamParser(turn)
        self._state = "reasoning" if reasoning_open else "start"
        """start (not yet known whether the turn reasons), reasoning, or answer"""
        self._unresolved = ""
        """At the start: whitespace or part of `<think>`; in the reasoning: part of `</think>`."""
        self._reasoning = _StrippedText()

    def feed(self, text: str) -> list[TurnPiece]:
        out: list[TurnPiece] = []
        buffer, self._unresolved = self._unresolved + text, ""
        if self._state == "start":
            opening = buffer.lstrip()
            if opening.startswith(THINK_OPEN):
                self._state, buffer = "reasoning", opening[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(opening):
                self._unresolved = buffer
                return out
            else:
                self._state = "answer"
        if self._state == "reasoning":
            end = buffer.find(THINK_CLOSE)
            if end == -1:
                keep = _partial_tag(buffer, THINK_CLOSE)
                self._add_reasoning(buffer[: len(buffer) - keep], out)
                self._unresolved = buffer[len(buffer) - keep:]
                return out
            self._add_reasoning(buffer[:end], out)
            self._state, buffer = "answer", buffer[end + len(THINK_CLOSE):]
        return out + self._answer.feed(buffer)

    def finish(self) -> list[TurnPiece]:
        """What is left once sampling has ended: an unclosed block's tail as reasoning, else text."""
        out: list[TurnPiece] = []
        if self._state == "reasoning":
            self._add_reasoning(self._unresolved, out)
        else:
            out += self._answer.feed(self._unresolved)
        self._unresolved = ""
        return out + self._answer.finish()

    def _add_reasoning(self, text: str, out: list[TurnPiece]) -> None:
        piece = self._reasoning.push(text)
        if piece:
            out.append(ReasoningDelta(piece))
