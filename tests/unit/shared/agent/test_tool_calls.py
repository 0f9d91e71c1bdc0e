"""Parsing tool calls out of sampled text, in both formats."""

from __future__ import annotations

import pytest

from rollstream.shared.agent.tool_calls import TOOL_CALL_FORMATS, HermesFormat, MistralFormat, get_format
from rollstream.shared.agent.tools import ToolCall

hermes = HermesFormat()
mistral = MistralFormat()


def test_formats_are_found_by_name():
    assert get_format("hermes") is TOOL_CALL_FORMATS["hermes"]
    assert get_format("mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; known formats: hermes, mistral"):
        get_format("xml")


@pytest.mark.parametrize("fmt", [hermes, mistral])
def test_each_format_describes_itself_for_the_system_prompt(fmt):
    text = fmt.describe()
    assert ("<tool_call>" if fmt is hermes else "[TOOL_CALLS]") in text
    assert '"arguments"' in text


@pytest.mark.parametrize("fmt", [hermes, mistral])
def test_text_without_calls_is_all_content(fmt):
    parsed = fmt.parse("  The answer is 19.\n", turn=0)
    assert (parsed.content, parsed.calls, parsed.errors) == ("The answer is 19.", [], [])


# ------------------------------------------------------------------------------------ hermes
def test_hermes_several_calls_with_text_around_them():
    text = ('Let me compute both.\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>\n'
            'Waiting for results.')
    parsed = hermes.parse(text, turn=2)
    assert parsed.calls == [
        ToolCall(id="call_2_0", name="calculator", arguments={"expression": "12+7"}),
        ToolCall(id="call_2_1", name="calculator", arguments={"expression": "3*4"}),
    ]
    assert parsed.content == "Let me compute both.\n\n\nWaiting for results."
    assert parsed.errors == []


def test_hermes_a_call_without_arguments_has_empty_arguments():
    parsed = hermes.parse('<tool_call>{"name": "list_files"}</tool_call>', turn=0)
    assert parsed.calls == [ToolCall(id="call_0_0", name="list_files", arguments={})]


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ('{"arguments": {"expression": "1+1"}}', "tool call without a name"),
    ('{"name": "", "arguments": {}}', "tool call without a name"),
    ('{"name": "calculator", "arguments": "1+1"}', "arguments of calculator must be a JSON object, not str"),
    ('{"name": "calculator", "arguments": [1]}', "arguments of calculator must be a JSON object, not list"),
    ('["calculator"]', "must be a JSON object with name and arguments"),
])
def test_hermes_malformed_calls_are_errors_and_well_formed_ones_still_count(body, error):
    text = (f'First <tool_call>{body}</tool_call> then '
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call> done')
    parsed = hermes.parse(text, turn=1)
    assert len(parsed.errors) == 1 and error in parsed.errors[0]
    # an excerpt of what was written
    assert "calculator" in parsed.errors[0] or "arguments" in parsed.errors[0]
    assert parsed.calls == [ToolCall(id="call_1_0", name="calculator", arguments={"expression": "2+2"})]
    assert parsed.content == "First  then  done"


def test_hermes_unclosed_tag_is_an_error_and_not_content():
    text = 'Computing <tool_call>{"name": "calculator", "arguments": {"expression": "9*9"}}'
    parsed = hermes.parse(text, turn=0)
    assert parsed.calls == []
    assert parsed.content == "Computing"
    assert len(parsed.errors) == 1
    assert "unclosed <tool_call>" in parsed.errors[0] and "calculator" in parsed.errors[0]


def test_long_malformed_calls_are_excerpted():
    parsed = hermes.parse("<tool_call>{" + "x" * 5000 + "</tool_call>", turn=0)
    assert len(parsed.errors[0]) < 200 and "..." in parsed.errors[0]


# ------------------------------------------------------------------------------------ mistral
def test_mistral_several_calls_with_text_around_them():
    text = ('I will use the calculator. [TOOL_CALLS] [{"name": "calculator", "arguments": '
            '{"expression": "12+7"}}, {"name": "calculator", "arguments": {"expression": "3*4"}}] '
            'Then I answer.')
    parsed = mistral.parse(text, turn=3)
    assert parsed.calls == [
        ToolCall(id="call_3_0", name="calculator", arguments={"expression": "12+7"}),
        ToolCall(id="call_3_1", name="calculator", arguments={"expression": "3*4"}),
    ]
    assert parsed.content == "I will use the calculator.  Then I answer."
    assert parsed.errors == []


def test_mistral_a_single_object_is_one_call():
    parsed = mistral.parse('[TOOL_CALLS]{"name": "calculator", "arguments": {"expression": "1"}}', turn=0)
    assert parsed.calls == [ToolCall(id="call_0_0", name="calculator", arguments={"expression": "1"})]


@pytest.mark.parametrize("element, error", [
    ('{"arguments": {"expression": "1+1"}}', "tool call without a name"),
    ('{"name": "calculator", "arguments": "1+1"}', "arguments of calculator must be a JSON object, not str"),
    ('"calculator"', "must be a JSON object with name and arguments"),
])
def test_mistral_malformed_elements_are_errors_and_the_others_still_count(element, error):
    text = f'[TOOL_CALLS][{element}, {{"name": "calculator", "arguments": {{"expression": "2+2"}}}}]'
    parsed = mistral.parse(text, turn=0)
    assert len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.calls == [ToolCall(id="call_0_0", name="calculator", arguments={"expression": "2+2"})]
    assert parsed.content == ""


def test_mistral_malformed_json_is_an_error_and_not_content():
    parsed = mistral.parse('Sure. [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1+1"}',
                           turn=0)
    assert parsed.calls == []
    assert parsed.content == "Sure."
    assert len(parsed.errors) == 1
    assert "not valid JSON" in parsed.errors[0] and "calculator" in parsed.errors[0]


def test_mistral_marker_with_no_calls_is_an_error():
    parsed = mistral.parse("[TOOL_CALLS][]", turn=0)
    assert parsed.calls == [] and "empty list" in parsed.errors[0]
