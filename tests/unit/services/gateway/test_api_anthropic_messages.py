"""Anthropic Messages requests into the canonical form, and generations back into `message` objects.
(What the official SDK makes of our answers and streams is in test_api_sdk_clients.py.)"""

from __future__ import annotations

import pytest

from rollstream.services.gateway.apis.anthropic_messages import (
    count_tokens_response,
    messages_response,
    parse_count_tokens,
    parse_messages,
    thinking_signature,
)
from rollstream.services.gateway.apis.canonical import Generation, ToolCall
from rollstream.services.gateway.apis.errors import RequestError

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
        ], "reasoning_content": "Let me think."},
        {"role": "tool", "content": "Error: 1 failed", "tool_call_id": "toolu_1", "name": "Bash"},
        {"role": "tool", "content": "clean\non main", "tool_call_id": "toolu_2", "name": "Bash"},
        {"role": "user", "content": "Fix it."},
    ]
    assert request.tools == [{"type": "function", "function": {
        "name": "Bash", "description": "Run a shell command.", "parameters": BASH["input_schema"]}}]
    assert (request.max_tokens, request.stop, request.temperature, request.top_p, request.stream,
            request.tool_choice, request.thinking) == (1024, ["\n\nHuman:"], 0.3, 0.95, True, "auto", True)


SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
          "properties": {"path": {"type": "string"}}, "required": ["path"], "additionalProperties": False}


def test_a_first_request_shaped_like_claude_codes():
    """System blocks with cache_control, a user turn of two text blocks, a system message inside
    `messages`, custom tools beside server tools, and the fields Claude Code adds to every request."""
    request = parse_messages(body(
        system=[{"type": "text", "text": "billing: header"},
                {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Work carefully.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "<reminder>today is Monday</reminder>\n\n"},
                                         {"type": "text", "text": "fix the bug",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Agent types you may start: explorer, planner."},
        ],
        tools=[{"name": "Read", "description": "Read a file.", "input_schema": SCHEMA},
               {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
               {"name": "Write", "description": "Write a file.", "input_schema": SCHEMA},
               {"type": "code_execution_20250825", "name": "code_execution"},
               {"type": "web_search_20250305", "name": "web_search_again"}],
        max_tokens=32000, stream=True, thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"}, metadata={"user_id": '{"device_id": "d1"}'},
    ))
    assert request.messages == [
        {"role": "system", "content": "billing: header\nYou are an agent.\nWork carefully."},
        {"role": "user", "content": "<reminder>today is Monday</reminder>\n\n\nfix the bug"},
        {"role": "system", "content": "Agent types you may start: explorer, planner."},
    ]
    assert [tool["function"]["name"] for tool in request.tools] == ["Read", "Write"]
    assert request.tools[0]["function"]["parameters"] == SCHEMA
    assert request.ignored_tools == ["web_search_20250305", "code_execution_20250825"]
    assert (request.max_tokens, request.stream, request.thinking) == (32000, True, True)


def test_a_system_message_inside_messages_stays_where_it_is():
    request = parse_messages(body(system="First.", messages=[
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "Going."},
        {"role": "system", "content": [
            {"type": "text", "text": "Mid-way rule."},
            {"type": "text", "text": "Another.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "And now?"}]))
    assert [(m["role"], m["content"]) for m in request.messages] == [
        ("system", "First."), ("user", "Go."), ("assistant", "Going."), ("system", "Mid-way rule.\nAnother."),
        ("user", "And now?")]


@pytest.mark.parametrize("thinking, expected", [
    ({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False), (None, None)])
def test_thinking_asks_the_model_to_reason_or_not(thinking, expected):
    assert parse_messages(body(thinking=thinking)).thinking is expected


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
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be 'user', 'assistant' or "
                                                        "'system', not 'robot'", "messages[0].role"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]},
     "content block type 'image' in messages[0].content", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content must not be empty",
     "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash",
                                                      "input": "ls"}]}]},
     "messages[0].content[0].input must be a JSON object, not a string", "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id must be a string", "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "bash 2025\n", "name": "bash"}]}, "tools[0].type 'bash 2025\\n' is not a tool type",
     "tools[0].type"),
    ({"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {}}}},
     "structured output is not supported", "output_config.format"),
    ({"output_format": {"type": "json_schema", "schema": {}}}, "structured output", "output_format"),
    ({"thinking": {"budget_tokens": 10}}, "thinking.type must be a string", "thinking.type"),
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


def test_a_message_that_reasoned_starts_with_a_signed_thinking_block():
    gen = Generation("Done.", [], "stop", 40, 9, reasoning="The user wants it short.")
    content = messages_response(gen, model="policy", message_id="msg_1")["content"]
    assert content == [{"type": "thinking", "thinking": "The user wants it short.",
                        "signature": thinking_signature("The user wants it short.")},
                       {"type": "text", "text": "Done."}]
    assert content[0]["signature"] and thinking_signature("other") != content[0]["signature"]


@pytest.mark.parametrize("gen, stop_reason, stop_sequence", [
    (Generation("Done.", [], "stop", 1, 1), "end_turn", None),
    (Generation("Once", [], "length", 1, 1), "max_tokens", None),
    (Generation("Done.", [], "stop", 1, 1, stop_sequence="END"), "stop_sequence", "END"),
    (Generation("", [ToolCall("call_0_0", "Bash", {})], "length", 1, 1), "max_tokens", None),
])
def test_stop_reasons(gen, stop_reason, stop_sequence):
    message = messages_response(gen, model="m", message_id="msg_1")
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)
