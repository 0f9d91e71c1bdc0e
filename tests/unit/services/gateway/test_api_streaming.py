"""Reasoning and tool calls out of text that arrives a few characters at a time: whatever the pieces,
the same reasoning, content and calls as the whole turn parsed at once, with text shown as soon as it
cannot be a tag."""

from __future__ import annotations

import random

import pytest

from rollstream.services.gateway.apis.canonical import SampledTurn, split_turn
from rollstream.services.gateway.apis.streaming import (
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallStreamParser,
    TurnStreamParser,
)
from rollstream.shared.agent.tool_calls import get_format
from rollstream.shared.agent.tools import ToolCall

WELL_FORMED = [
    "The answer is 19.",
    ('  Let me compute both.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n'
     '</tool_call>\n<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>\n'),
    '<tool_call>{"name": "read_file", "arguments": {"path": "src/<tool_call>.py"}}</tool_call>',
    ('Ça coûte 3 € — voyons 🚀\n<tool_call>{"name": "search", "arguments": {"q": "naïve café"}}</tool_call>'
     "\nthen I will answer."),
    '<tool_call>{"name": "list_files"}</tool_call>',
    "a < b, and <tool is not a tag, nor is <tool_cal or <tool_calls>.",
    "",
    "   \n ",
]
MALFORMED = [
    'Trying.\n<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call> after',
    ('<tool_call>{"arguments": {"x": 1}}</tool_call> no name; '
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    'ok <tool_call>{"name": "f", "arguments": {}}</tool_call> then cut off <tool_call>{"name": "g", "argu',
    "ends on a partial tag <tool_ca",
]


def stream(text: str, pieces: list[str], turn: int = 4) -> list[TextDelta | ToolCallDelta]:
    assert "".join(pieces) == text
    parser = ToolCallStreamParser(turn)
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def split_tool_calls(text: str, turn: int) -> tuple[str, list[ToolCall]]:
    """The content and the calls of a whole turn, fed to the tool-call parser at once."""
    parser = ToolCallStreamParser(turn)
    pieces = parser.feed(text) + parser.finish()
    return ("".join(piece.text for piece in pieces if isinstance(piece, TextDelta)),
            [piece.call for piece in pieces if isinstance(piece, ToolCallDelta)])


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, max(1, len(text) // 2))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("text", WELL_FORMED + MALFORMED)
def test_any_split_of_a_turn_gives_the_content_and_calls_of_the_whole_turn(text):
    content, calls = split_tool_calls(text, turn=4)
    rng = random.Random(text)
    splits = [list(text), [text]] + [random_pieces(text, rng) for _ in range(300)]
    for pieces in splits:
        out = stream(text, pieces)
        assert "".join(d.text for d in out if isinstance(d, TextDelta)) == content, pieces
        assert [d.call for d in out if isinstance(d, ToolCallDelta)] == calls, pieces
        assert [d.index for d in out if isinstance(d, ToolCallDelta)] == list(range(len(calls)))
        assert all(isinstance(d, ToolCallDelta) or d.text for d in out), "no empty text deltas"


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_turns_split_as_the_repository_parser_parses_them(text):
    parsed = get_format("hermes").parse(text, turn=4)
    assert split_tool_calls(text, turn=4) == (parsed.content, parsed.calls)


def test_a_malformed_call_stays_in_the_content_as_the_model_wrote_it():
    text = ('Trying.\n<tool_call>{"name": "calc", "arguments": {"x": </tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": {"x": 2}}</tool_call>\n<tool_call>{"name": "late"')
    content, calls = split_tool_calls(text, turn=1)
    assert content == ('Trying.\n<tool_call>{"name": "calc", "arguments": {"x": </tool_call>\n\n'
                       '<tool_call>{"name": "late"')
    # the malformed block is not a call, so the well-formed one is call 0 of the turn
    assert calls == [ToolCall(id="call_1_0", name="calc", arguments={"x": 2})]


def test_text_is_emitted_at_once_and_only_a_possible_tag_is_held_back():
    parser = ToolCallStreamParser(turn=0)
    assert parser.feed("Let me") == [TextDelta("Let me")]
    assert parser.feed(" look <to") == [TextDelta(" look")]  # the space waits for what follows it
    assert parser.feed("ol_call>") == []
    assert parser.feed('{"name": "ls", "arguments": {"path": "."}}</tool') == []
    assert parser.feed("_call>") == [ToolCallDelta(0, ToolCall("call_0_0", "ls", {"path": "."}))]
    # the space held before the call comes out with the text after it, as in the whole turn's content
    assert parser.feed(" <b>done</b>") == [TextDelta("  <b>done</b>")]
    assert parser.finish() == []


def test_a_near_tag_is_released_as_text_once_it_turns_out_not_to_be_one():
    parser = ToolCallStreamParser(turn=0)
    assert parser.feed("x <tool_") == [TextDelta("x")]
    assert parser.feed("result>") == [TextDelta(" <tool_result>")]


def test_whitespace_at_the_ends_of_the_turn_is_never_emitted():
    parser = ToolCallStreamParser(turn=0)
    out = [delta for piece in ("\n\n  ", "Hi", " there \n", "\n") for delta in parser.feed(piece)]
    assert out + parser.finish() == [TextDelta("Hi"), TextDelta(" there")]


CALL = '<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>'
LS = ToolCall("call_2_0", "ls", {"path": "."})
REASONING_TURNS = [
    # (text, the template opened the block, reasoning, content, calls)
    ("<think>\nList first.\n</think>\n\nListing.\n" + CALL, False, "List first.", "Listing.", [LS]),
    ("  \n<think>Only thought, then cut off by max_tok", False, "Only thought, then cut off by max_tok", "",
     []),
    ("<think>\n\n</think>\n\nNo reasoning at all.", False, "", "No reasoning at all.", []),
    ("The answer, with <think>in the middle</think> of it.", False, "",
     "The answer, with <think>in the middle</think> of it.", []),
    ("<thinking>is not the marker</thinking>", False, "", "<thinking>is not the marker</thinking>", []),
    ("<thin", False, "", "<thin", []),
    (CALL, False, "", "", [LS]),
    ("Opened by the prompt.\n</think>\n\nDone.", True, "Opened by the prompt.", "Done.", []),
    ("Opened by the prompt, a </thi", True, "Opened by the prompt, a </thi", "", []),
    ("Tests 1 < 2 and a </ b.</think>" + CALL, True, "Tests 1 < 2 and a </ b.", "", [LS]),
]


@pytest.mark.parametrize("text, reasoning_open, reasoning, content, calls", REASONING_TURNS)
def test_any_split_of_a_reasoning_turn_gives_the_reasoning_content_and_calls_of_the_whole(
        text, reasoning_open, reasoning, content, calls):
    assert split_turn(text, turn=2, reasoning_open=reasoning_open) == SampledTurn(reasoning, content, calls)
    rng = random.Random(text)
    for pieces in [list(text), [text]] + [random_pieces(text, rng) for _ in range(300)]:
        parser = TurnStreamParser(turn=2, reasoning_open=reasoning_open)
        out = [piece for chunk in pieces for piece in parser.feed(chunk)] + parser.finish()
        assert "".join(d.text for d in out if isinstance(d, ReasoningDelta)) == reasoning, pieces
        assert "".join(d.text for d in out if isinstance(d, TextDelta)) == content, pieces
        assert [d.call for d in out if isinstance(d, ToolCallDelta)] == calls, pieces
        assert all(isinstance(d, ToolCallDelta) or d.text for d in out), "no empty deltas"
        answer_starts = next((i for i, d in enumerate(out) if not isinstance(d, ReasoningDelta)), len(out))
        assert not any(isinstance(d, ReasoningDelta) for d in out[answer_starts:]), "reasoning comes first"


def test_a_turn_without_reasoning_splits_as_before():
    for text in WELL_FORMED + MALFORMED:
        assert split_turn(text, turn=4) == SampledTurn("", *split_tool_calls(text, turn=4))


def test_reasoning_is_emitted_at_once_and_only_a_possible_marker_is_held_back():
    parser = TurnStreamParser(turn=0)
    assert parser.feed("  <thi") == []
    assert parser.feed("nk>\nStep one") == [ReasoningDelta("Step one")]
    assert parser.feed(", step two.\n</th") == [ReasoningDelta(", step two.")]
    assert parser.feed("ink>\n\nAnswer") == [TextDelta("Answer")]
    assert parser.finish() == []
