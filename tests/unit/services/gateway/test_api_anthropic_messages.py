"""Anthropic Messages requests into the canonical form, and generations back into `message` objects.
(What the official SDK makes of our answers and streams is in test_api_sdk_clients.py.)"""

from __future__ import annotations

import pytest

from rollstream.services.gateway.apis.anthropic_messages import (
    count_tokens_response,
    messages_response,
    parse_count_tokens,
    parse_messages,
)
from rollstream.services.gateway.apis.canonical import Generation, RequestError, ToolCall

BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]},
        "cache_control": {"type": "ephemeral"}}


def body(**fields) -> dict:
    return {"model": "policy", "max_tokens": 1024, "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_a_coding_agent_turn_as_claude_code_sends_it():
    request = parse_messages(body(
        system=[{"type": "text", "text": "You are a coding agent."},
                {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "<reminder>tests exist</reminder>"},
                                         {"type": "text", "text": "Run the tests."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Let me think.", "signature": "sig"},
                {"type": "text", "text": "Running them."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "pytest -q"}},
                {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "git status"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1 failed", "is_error": True},
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "clean"}, {"type": "text", "text": "on main"}]},
                {"type": "text", "text": "Fix it."}]},
        ],
        tools=[BASH], tool_choice={"type": "auto", "disable_parallel_tool_use": False},
        stop_sequences=["\n\nHuman:"], temperature=0.3, top_p=0.95, stream=True,
        thinking={"type": "enabled", "budget_tokens": 2000}, metadata={"user_id": "u1"},
    ))
    assert request.messages == [
        {"role": "system", "content": "You are a coding agent.\nBe careful."},
        {"role": "user", "content": "<reminder>tests exist</reminder>\nRun the tests."},
        {"role": "assistant", "content": "Running them.", "tool_calls": [
            {"type": "function", "id": "toolu_1",
             "function": {"name": "Bash", "arguments": {"command": "pytest -q"}}},
            {"type": "function", "id": "toolu_2",
             "function": {"name": "Bash", "arguments": {"command": "git status"}}},
        ]},
        {"role": "tool", "content": "Error: 1 failed", "tool_call_id": "toolu_1", "name": "Bash"},
        {"role": "tool", "content": "clean\non main", "tool_call_id": "toolu_2", "name": "Bash"},
        {"role": "user", "content": "Fix it."},
    ]
    assert request.tools == [{"type": "function", "function": {
        "name": "Bash", "description": "Run a shell command.", "parameters": BASH["input_schema"]}}]
    assert (request.max_tokens, request.stop, request.temperature, request.top_p, request.stream,
            request.tool_choice) == (1024, ["\n\nHuman:"], 0.3, 0.95, True, "auto")


def test_the_text_blocks_of_an_assistant_turn_join_without_a_separator():
    request = parse_messages(body(messages=[
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "call_0_0", "name": "Bash", "input": {"command": "ls"}},
            {"type": "text", "text": "\n\nThen more."}]}]))
    assert request.messages[1]["content"] == "Looking.\n\nThen more."


@pytest.mark.parametrize("choice, expected", [
    ({"type": "any"}, "required"),
    ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
])
def test_tool_choice_forms(choice, expected):
    assert parse_messages(body(tools=[BASH], tool_choice=choice)).tool_choice == expected


def test_tool_choice_none_hides_the_tools():
    assert parse_messages(body(tools=[BASH], tool_choice={"type": "none"})).tools is None


def test_count_tokens_needs_no_max_tokens():
    request = parse_count_tokens({"model": "policy", "messages": [{"role": "user", "content": "Hi"}]})
    assert (request.max_tokens, request.messages) == (None, [{"role": "user", "content": "Hi"}])
    assert count_tokens_response(12) == {"input_tokens": 12}


@pytest.mark.parametrize("fields, message, param", [
    ({"max_tokens": None}, "max_tokens is required", "max_tokens"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "content block type 'image' in a user turn is not supported", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "content block type 'image'",
     "messages[0].content[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "use the top-level `system`", "messages[0].role"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content must not be empty",
     "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash",
                                                      "input": "ls"}]}]},
     "messages[0].content[0].input must be a JSON object, not a string", "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id must be a string", "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tool type 'bash_20250124' is not supported",
     "tools[0].type"),
    ({"tools": [{"name": "Bash"}]}, "tools[0].input_schema is required", "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool", "name": "Edit"}, "tools": [BASH]}, "tool_choice names the tool 'Edit'",
     "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice requires a tool call but the request has no tools",
     "tool_choice"),
    ({"temperature": 1.5}, "temperature must be between 0 and 1", "temperature"),
    ({"top_k": 40}, "top_k is not supported", "top_k"),
    ({"stop_sequences": ["END", ""]}, "stop_sequences[1] must not be empty", "stop_sequences[1]"),
])
def test_bad_requests_are_refused_with_the_reason(fields, message, param):
    with pytest.raises(RequestError) as caught:
        parse_messages(body(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message


def test_a_message_with_text_and_tool_use():
    gen = Generation("Running it.", [ToolCall("call_1_0", "Bash", {"command": "ls"})], "stop", 40, 9)
    assert messages_response(gen, model="policy", message_id="msg_1") == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "policy",
        "content": [{"type": "text", "text": "Running it."},
                    {"type": "tool_use", "id": "call_1_0", "name": "Bash", "input": {"command": "ls"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 40, "output_tokens": 9, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0},
    }


@pytest.mark.parametrize("gen, stop_reason, stop_sequence", [
    (Generation("Done.", [], "stop", 1, 1), "end_turn", None),
    (Generation("Once", [], "length", 1, 1), "max_tokens", None),
    (Generation("Done.", [], "stop", 1, 1, stop_sequence="END"), "stop_sequence", "END"),
    (Generation("", [ToolCall("call_0_0", "Bash", {})], "length", 1, 1), "max_tokens", None),
])
def test_stop_reasons(gen, stop_reason, stop_sequence):
    message = messages_response(gen, model="m", message_id="msg_1")
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)
