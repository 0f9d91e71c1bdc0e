"""OpenAI Chat Completions requests into the canonical form, and generations back into the wire format.
(What the official SDK makes of our answers is in test_api_sdk_clients.py.)"""

from __future__ import annotations

import pytest

from rollstream.services.gateway.apis.canonical import Generation, ToolCall
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.apis.openai_chat import chat_completion_response, parse_chat_completions

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def body(**fields) -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_an_agent_conversation_with_tool_calls_and_results():
    request = parse_chat_completions({
        "model": "policy",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                         {"type": "text", "text": "and Rome?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_0_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{ "city" : "Rome" }'}}]},
            {"role": "tool", "tool_call_id": "call_0_0", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_0_1", "content": [{"type": "text", "text": "24C"}]},
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_completion_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": "END",
        "seed": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "parallel_tool_calls": True,
        "user": "someone",
    })
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris\nand Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_0_0",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "id": "call_0_1",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ]},
        {"role": "tool", "content": "18C", "tool_call_id": "call_0_0", "name": "get_weather"},
        {"role": "tool", "content": "24C", "tool_call_id": "call_0_1", "name": "get_weather"},
    ]
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    assert (request.model, request.tool_choice, request.max_tokens, request.temperature, request.top_p,
            request.stop, request.seed, request.stream, request.include_usage) == \
        ("policy", "auto", 256, 0.7, 0.9, ["END"], 7, True, True)


def test_defaults_and_the_older_max_tokens():
    request = parse_chat_completions(body(max_tokens=64))
    assert (request.max_tokens, request.tools, request.tool_choice, request.stop, request.stream,
            request.include_usage, request.temperature) == (64, None, "auto", [], False, False, None)


def test_system_and_developer_messages_anywhere_and_reasoning_sent_back():
    request = parse_chat_completions(body(
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "Checking.", "reasoning_content": "Paris means France.",
                   "tool_calls": [{"id": "call_0_0", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call_0_0", "content": "18C"},
                  {"role": "developer", "content": [{"type": "text", "text": "Answer in Celsius."},
                                                    {"type": "text", "text": "One line."}]}],
        tools=TOOLS + [{"type": "custom", "custom": {"name": "apply_patch"}}, {"type": "web_search_preview"}],
        reasoning_effort="high"))
    assert [(m["role"], m["content"]) for m in request.messages] == [
        ("system", "Be brief."), ("user", "Weather in Paris?"), ("assistant", "Checking."), ("tool", "18C"),
        ("system", "Answer in Celsius.\nOne line.")]
    assert request.messages[2]["reasoning_content"] == "Paris means France."
    assert [tool["function"]["name"] for tool in request.tools] == ["get_weather", "apply_patch"]
    assert request.freeform_tools == {"apply_patch"}
    assert (request.ignored_tools, request.thinking) == (["web_search_preview"], True)


@pytest.mark.parametrize("effort, thinking", [
    ("none", False), ("minimal", True), ("high", True), (None, None)])
def test_reasoning_effort_asks_the_model_to_reason_or_not(effort, thinking):
    assert parse_chat_completions(body(reasoning_effort=effort)).thinking is thinking


def test_tool_choice_none_hides_the_tools_and_a_named_one_is_kept():
    assert parse_chat_completions(body(tools=TOOLS, tool_choice="none")).tools is None
    named = parse_chat_completions(body(tools=TOOLS, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}))
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert parse_chat_completions(body(tools=TOOLS, tool_choice="required")).tool_choice == "required"


@pytest.mark.parametrize("fields, status, message, param", [
    ({"model": None}, 400, "model must be a string, not null", "model"),
    ({"messages": []}, 400, "messages must not be empty", "messages"),
    ({"messages": "Hi"}, 400, "messages must be an array, not a string", "messages"),
    ({"n": 2}, 400, "n must be 1 (got 2)", "n"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "content part type 'image_url' is not supported by this gateway; only text parts are",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1'}}]}]},
     400, "messages[0].tool_calls[0].function.arguments is not valid JSON",
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     400, "must encode a JSON object, not an array", "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "18C"}]}, 400, "messages[0].tool_call_id must be a string",
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, 400, "messages[0].role must be one of",
     "messages[0].role"),
    ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, 400, "legacy `function` role",
     "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content is required for a user message", "messages[0].content"),
    ({"functions": [{"name": "f"}]}, 400, "legacy `functions`", "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, 400, "structured output",
     "response_format"),
    ({"frequency_penalty": 0.5}, 400, "non-zero frequency_penalty", "frequency_penalty"),
    ({"temperature": 3}, 400, "temperature must be between 0 and 2, got 3", "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens must be at least 1, got 0", "max_tokens"),
    ({"max_completion_tokens": "100"}, 400, "max_completion_tokens must be an integer, not a string",
     "max_completion_tokens"),
    ({"stop": ["a", 3]}, 400, "stop[1] must be a string", "stop[1]"),
    ({"tools": [{"function": {"name": "f"}}]}, 400, "tools[0].type must be a string, not null",
     "tools[0].type"),
    ({"modalities": ["text", "audio"]}, 400, "output modalities ['text', 'audio'] is not supported",
     "modalities"),
    ({"reasoning_effort": 3}, 400, "reasoning_effort must be a string", "reasoning_effort"),
    ({"tools": TOOLS + TOOLS}, 400, "the tool name 'get_weather' is given twice", "tools[1].name"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, 400,
     "tool_choice names the tool 'nope', which is not among the request's tools",
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, 400, "tool_choice requires a tool call but the request has no tools",
     "tool_choice"),
])
def test_bad_requests_are_refused_with_the_reason(fields, status, message, param):
    with pytest.raises(RequestError) as caught:
        parse_chat_completions(body(**fields))
    assert (caught.value.status, caught.value.param) == (status, param)
    assert message in caught.value.message


def test_a_body_that_is_not_an_object():
    with pytest.raises(RequestError, match="body must be a JSON object, not an array"):
        parse_chat_completions([])


def test_a_completion_with_tool_calls():
    gen = Generation("Checking.", [ToolCall("call_2_0", "get_weather", {"city": "Paris"})], "stop", 31, 12)
    response = chat_completion_response(gen, model="policy", response_id="chatcmpl-1", created=1700000000)
    assert response == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "policy",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Checking.", "refusal": None,
            "tool_calls": [{"id": "call_2_0", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}],
        "usage": {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43},
        "system_fingerprint": None,
    }


def test_a_completion_that_reasoned_carries_reasoning_content():
    gen = Generation("Sunny.", [], "stop", 31, 12, reasoning="Look it up first.")
    response = chat_completion_response(gen, model="policy", response_id="r", created=0)
    message = response["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Look it up first.", "Sunny.")
    plain = chat_completion_response(Generation("Sunny.", [], "stop", 1, 1), model="m", response_id="r",
                                     created=0)
    assert "reasoning_content" not in plain["choices"][0]["message"]


def test_a_turn_of_calls_only_has_null_content_and_a_cut_off_turn_says_length():
    calls_only = chat_completion_response(Generation("", [ToolCall("call_0_0", "f", {})], "stop", 1, 1),
                                          model="m", response_id="r", created=0)
    assert calls_only["choices"][0]["message"]["content"] is None
    cut = chat_completion_response(Generation("Once upon", [], "length", 1, 2), model="m", response_id="r",
                                   created=0)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in cut["choices"][0]["message"]
