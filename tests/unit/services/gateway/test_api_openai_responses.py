"""OpenAI Responses requests into the canonical form, and generations back into `response` objects.
(What the official SDK makes of our answers and streams is in test_api_sdk_clients.py.)"""

from __future__ import annotations

import pytest

from rollstream.services.gateway.apis.canonical import Generation, RequestError, ToolCall
from rollstream.services.gateway.apis.openai_responses import parse_responses, responses_response

SHELL = {"type": "function", "name": "shell", "description": "Run a command.", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def body(**fields) -> dict:
    return {"model": "policy", "input": "Hi", **fields}


def test_a_string_input_with_instructions():
    request = parse_responses(body(instructions="Be brief.", max_output_tokens=128, temperature=0.5,
                                   stream=True))
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (request.max_tokens, request.temperature, request.stream, request.tools) == (128, 0.5, True, None)


def test_an_agent_loop_as_codex_sends_it():
    request = parse_responses(body(
        instructions="You are a coding agent.",
        input=[
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "cwd: /repo"}]},
            {"role": "user", "content": "List the files."},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Listing.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_0_0", "name": "shell",
             "arguments": '{"cmd":"ls"}', "status": "completed"},
            {"type": "function_call_output", "call_id": "call_0_0", "output": "a.py\nb.py"},
            {"type": "function_call", "call_id": "call_1_0", "name": "shell",
             "arguments": '{"cmd": "cat a.py"}'},
            {"type": "function_call_output", "call_id": "call_1_0",
             "output": [{"type": "input_text", "text": "print(1)"}]},
        ],
        tools=[SHELL], tool_choice="auto", parallel_tool_calls=False, store=False,
        reasoning={"effort": "low"}, include=["reasoning.encrypted_content"],
    ))
    assert request.messages == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "system", "content": "cwd: /repo"},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"type": "function", "id": "call_0_0",
             "function": {"name": "shell", "arguments": {"cmd": "ls"}}}]},
        {"role": "tool", "content": "a.py\nb.py", "tool_call_id": "call_0_0", "name": "shell"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_1_0",
             "function": {"name": "shell", "arguments": {"cmd": "cat a.py"}}}]},
        {"role": "tool", "content": "print(1)", "tool_call_id": "call_1_0", "name": "shell"},
    ]
    assert request.tools == [{"type": "function", "function": {
        "name": "shell", "description": "Run a command.", "parameters": SHELL["parameters"]}}]


def test_text_written_after_a_call_belongs_to_the_same_turn():
    request = parse_responses(body(input=[
        {"role": "user", "content": "Go."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_0_0", "name": "shell", "arguments": "{}"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "\n\nThen more."}]},
    ]))
    assert request.messages[1:] == [{"role": "assistant", "content": "Looking.\n\nThen more.", "tool_calls": [
        {"type": "function", "id": "call_0_0", "function": {"name": "shell", "arguments": {}}}]}]


def test_tool_choice_forms():
    assert parse_responses(body(tools=[SHELL], tool_choice="none")).tools is None
    named = parse_responses(body(tools=[SHELL], tool_choice={"type": "function", "name": "shell"}))
    assert named.tool_choice == {"type": "function", "function": {"name": "shell"}}


@pytest.mark.parametrize("fields, message, param", [
    ({"previous_response_id": "resp_1"},
     "previous_response_id is not supported: this gateway keeps no responses, so send the whole conversation",
     "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation is not supported", "conversation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference is not supported",
     "input[0].type"),
    ({"input": []}, "input must not be empty", "input"),
    ({"input": None}, "input must be an array, not null", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "content part type 'input_image' is not supported by this gateway", "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{cmd: ls}"}]},
     "input[0].arguments is not valid JSON", "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id must be a string",
     "input[0].call_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input item type 'web_search_call'",
     "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tool type 'web_search' is not supported", "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "shell"}}]}, "tools[0].name must be a string",
     "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format 'json_schema'",
     "text.format"),
    ({"max_output_tokens": -1}, "max_output_tokens must be at least 1", "max_output_tokens"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice must be", "tool_choice"),
])
def test_bad_requests_are_refused_with_the_reason(fields, message, param):
    with pytest.raises(RequestError) as caught:
        parse_responses(body(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message


def test_a_response_with_text_and_calls():
    gen = Generation("Running it.", [ToolCall("call_1_0", "shell", {"cmd": "ls -la"})], "tool_calls", 40, 9)
    response = responses_response(gen, model="policy", response_id="resp_abc", created=1700000000)
    assert response["output"] == [
        {"id": "msg_abc_0", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Running it.", "annotations": [], "logprobs": []}]},
        {"id": "fc_abc_1", "type": "function_call", "status": "completed", "call_id": "call_1_0",
         "name": "shell", "arguments": '{"cmd": "ls -la"}'},
    ]
    assert (response["object"], response["status"], response["incomplete_details"], response["model"]) == \
        ("response", "completed", None, "policy")
    assert response["usage"] == {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 49}


def test_a_response_cut_by_the_token_limit_is_incomplete():
    response = responses_response(Generation("Once upon a", [], "length", 5, 50), model="policy",
                                  response_id="resp_1", created=0)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
