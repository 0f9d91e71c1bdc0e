"""Tool calls out of the model's text while it is still being sampled (hermes format).

`ToolCallStreamParser` is fed the decoded text as tokens arrive and hands back what can already be
shown: text at once, except a tail that may be the start of `<tool_call>`, and each call as a whole
once its `</tool_call>` has been sampled. Each block is decoded by the repository's hermes parser,
so a call means the same thing here as in a complete turn; a block that does not decode (bad JSON,
no name, or never closed) is given back as text, so nothing the model wrote is lost.

The text is stripped at both ends, as `HermesFormat.parse` strips a turn: leading whitespace is
dropped and trailing whitespace is held until more text follows it. Whatever the pieces the text
arrives in, the deltas add up to the same content and calls (`canonical.split_tool_calls` is this
parser fed the whole text at once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollstream.shared.agent.tool_calls import HermesFormat
from rollstream.shared.agent.tools import ToolCall

_HERMES = HermesFormat()
OPEN, CLOSE = HermesFormat.OPEN, HermesFormat.CLOSE


@dataclass(frozen=True)
class TextDelta:
    """Text of the assistant message, to be appended to what came before."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One complete call; `index` counts the calls of the turn from 0."""

    index: int
    call: ToolCall


def _partial_open_tag(text: str) -> int:
    """Length of the longest end of `text` that `OPEN` starts with (the start of a tag not yet complete)."""
    for length in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-length:]):
            return length
    return 0


class ToolCallStreamParser:
    def __init__(self, turn: int) -> None:
        self.turn = turn
        self._unresolved = ""
        """Outside a call: a possible partial `<tool_call>`; inside one: the call's body so far."""
        self._in_call = False
        self._calls = 0
        self._text_started = False
        self._held_whitespace = ""

    def feed(self, text: str) -> list[TextDelta | ToolCallDelta]:
        out: list[TextDelta | ToolCallDelta] = []
        buffer = self._unresolved + text
        while True:
            if not self._in_call:
                start = buffer.find(OPEN)
                if start == -1:
                    keep = _partial_open_tag(buffer)
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
        self._unresolved, self._in_call, self._held_whitespace = "", False, ""
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
        if not self._text_started:
            text = text.lstrip()
            self._text_started = bool(text)
        visible = text.rstrip()
        if visible:
            out.append(TextDelta(self._held_whitespace + visible))
            self._held_whitespace = text[len(visible):]
        else:
            self._held_whitespace += text
