"""OpenAI Responses requests into the canonical form, and generations back into `response` objects.
(What the official SDK makes of our answers and streams is in test_api_sdk_clients.py.)"""

from __future__ import annotations

import pytest

from rollstream.services.gateway.apis.canonical import Generation, ToolCall
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.apis.openai_responses import parse_responses
from rollstream.services.gateway.apis.openai_responses_output import (
    decode_reasoning,
    encode_reasoning,
    responses_response,
)

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


SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"],
                        "additionalProperties": False}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
          "tools": [SPAWN, {**SPAWN, "name": "wait_agent", "description": "Wait for one."}]}


def test_a_first_request_shaped_like_codexs():
    """Developer and user messages with ids, strict function tools, a namespace of tools, a hosted tool,
    and the fields Codex adds to every request."""
    request = parse_responses(body(
        input=[
            {"type": "message", "id": "msg_a", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "id": "msg_b", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: read-only."},
                         {"type": "input_text", "text": "Approvals: never."}]},
            {"type": "message", "id": "msg_c", "role": "user",
             "content": [{"type": "input_text",
                          "text": "<environment_context>cwd /repo</environment_context>"}]},
            {"type": "message", "id": "msg_d", "role": "user",
             "content": [{"type": "input_text", "text": "fix the median"}]},
        ],
        tools=[SHELL, AGENTS, {"type": "web_search", "external_web_access": False},
               {**SHELL, "name": "get_goal"}],
        tool_choice="auto", parallel_tool_calls=True, reasoning={"summary": "auto"}, store=False,
        include=["reasoning.encrypted_content"], prompt_cache_key="thread-1",
        client_metadata={"thread_id": "thread-1"}, stream=True, previous_response_id=None,
    ))
    assert request.messages == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "system", "content": "Sandbox: read-only.\nApprovals: never."},
        {"role": "user", "content": "<environment_context>cwd /repo</environment_context>"},
        {"role": "user", "content": "fix the median"},
    ]
    assert [tool["function"]["name"] for tool in request.tools] == \
        ["shell", "multi_agent_v1.spawn_agent", "multi_agent_v1.wait_agent", "get_goal"]
    assert request.tools[1]["function"] == {
        "name": "multi_agent_v1.spawn_agent", "description": "Start a sub-agent.",
        "parameters": SPAWN["parameters"]}
    assert request.tool_namespaces == {"multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent"),
                                       "multi_agent_v1.wait_agent": ("multi_agent_v1", "wait_agent")}
    assert request.ignored_tools == ["web_search"]
    assert (request.thinking, request.reasoning_summary, request.encrypted_reasoning, request.stream) == \
        (True, True, True, True)


def test_a_later_turn_as_codex_sends_it_back():
    """The previous output items in `input`: a reasoning item (only its summary and the encrypted copy;
    Codex drops the reasoning_text), a namespaced call, its output, then a system message mid-way."""
    request = parse_responses(body(input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Split the work."}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Delegate the tests."}],
         "encrypted_content": encode_reasoning("Delegate the tests.")},
        {"type": "function_call", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": '{"task": "run tests"}', "call_id": "call_0_0"},
        {"type": "function_call_output", "call_id": "call_0_0", "output": "agent a1 started"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Budget: low."}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Now wait."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Waiting."}]},
        {"type": "function_call", "name": "wait_agent", "namespace": "multi_agent_v1",
         "arguments": '{"task": "a1"}', "call_id": "call_1_0"},
        {"type": "function_call_output", "call_id": "call_1_0", "output": "done"},
    ], tools=[AGENTS]))
    assert request.messages == [
        {"role": "user", "content": "Split the work."},
        {"role": "assistant", "content": "", "reasoning_content": "Delegate the tests.", "tool_calls": [
            {"type": "function", "id": "call_0_0",
             "function": {"name": "multi_agent_v1.spawn_agent", "arguments": {"task": "run tests"}}}]},
        {"role": "tool", "content": "agent a1 started", "tool_call_id": "call_0_0",
         "name": "multi_agent_v1.spawn_agent"},
        {"role": "system", "content": "Budget: low."},
        {"role": "assistant", "content": "Waiting.", "reasoning_content": "Now wait.", "tool_calls": [
            {"type": "function", "id": "call_1_0",
             "function": {"name": "multi_agent_v1.wait_agent", "arguments": {"task": "a1"}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "call_1_0", "name": "multi_agent_v1.wait_agent"},
    ]


@pytest.mark.parametrize("item, reasoning", [
    ({"encrypted_content": encode_reasoning("exact"),
      "content": [{"type": "reasoning_text", "text": "other"}],
      "summary": [{"type": "summary_text", "text": "short"}]}, "exact"),
    ({"encrypted_content": "gAAAAB-another-provider",
      "content": [{"type": "reasoning_text", "text": "a"}, {"type": "reasoning_text", "text": "b"}]}, "ab"),
    ({"summary": [{"type": "summary_text", "text": "One."}, {"type": "summary_text", "text": "Two."}]},
     "One.\n\nTwo."),
])
def test_reasoning_sent_back_is_read_from_what_the_item_holds(item, reasoning):
    request = parse_responses(body(input=[{"role": "user", "content": "Go."}, {"type": "reasoning", **item},
                                          {"role": "assistant", "content": "Done."}]))
    assert request.messages[1] == {"role": "assistant", "content": "Done.", "reasoning_content": reasoning}


def test_reasoning_only_another_provider_can_read_is_skipped():
    request = parse_responses(body(input=[{"role": "user", "content": "Go."},
                                          {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"},
                                          {"role": "assistant", "content": "Done."}]))
    assert request.messages[1] == {"role": "assistant", "content": "Done."}


def test_the_gateways_encrypted_reasoning_reads_back_and_nothing_else_does():
    assert decode_reasoning(encode_reasoning("Ça va — 🚀")) == "Ça va — 🚀"
    assert decode_reasoning("gAAAAB") is None
    assert decode_reasoning(encode_reasoning("x")[:-2] + "!!") is None


@pytest.mark.parametrize("reasoning, thinking", [
    ({"effort": "none"}, False), ({"effort": "low"}, True), ({"summary": "detailed"}, True),
    ({"effort": None, "summary": None}, None), (None, None)])
def test_reasoning_asks_the_model_to_reason_or_not(reasoning, thinking):
    assert parse_responses(body(reasoning=reasoning)).thinking is thinking


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
    ({"tools": [{"name": "shell"}]}, "tools[0].type must be a string, not null", "tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": {"type": "function"}}]},
     "tools[0].tools must be an array", "tools[0].tools"),
    ({"tools": [{"type": "namespace", "tools": []}]}, "tools[0].name must be a string", "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "a"},
                                                              {"type": "function", "name": "a"}]}]},
     "the tool name 'ns.a' is given twice", "tools[1].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "a", "namespace": 7, "arguments": "{}"}]},
     "input[0].namespace must be a string", "input[0].namespace"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]}]},
     "input[0].summary[0].text must be a string", "input[0].summary[0].text"),
    ({"reasoning": {"effort": 1}}, "reasoning.effort must be a string", "reasoning.effort"),
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
    response = responses_response(gen, parse_responses(body()), response_id="resp_abc", created=1700000000)
    assert response["output"] == [
        {"id": "msg_abc_0", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Running it.", "annotations": [], "logprobs": []}]},
        {"id": "fc_abc_1", "type": "function_call", "status": "completed", "call_id": "call_1_0",
         "name": "shell", "arguments": '{"cmd": "ls -la"}'},
    ]
    assert (response["object"], response["status"], response["incomplete_details"], response["model"],
            response["metadata"]) == ("response", "completed", None, "policy", {})
    assert response["usage"] == {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 49}


def test_a_response_cut_by_the_token_limit_is_incomplete():
    response = responses_response(Generation("Once upon a", [], "length", 5, 50), parse_responses(body()),
                                  response_id="resp_1", created=0)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_a_response_that_reasoned_and_called_a_namespaced_tool():
    request = parse_responses(body(tools=[AGENTS, {"type": "web_search"}, {"type": "file_search"}],
                                   reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"]))
    gen = Generation("Delegating.", [ToolCall("call_2_0", "multi_agent_v1.spawn_agent", {"task": "tests"})],
                     "stop", 40, 9, reasoning="Tests take long: delegate.")
    response = responses_response(gen, request, response_id="resp_abc", created=0)
    assert response["output"][0] == {
        "id": "rs_abc_0", "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "Tests take long: delegate."}],
        "content": [{"type": "reasoning_text", "text": "Tests take long: delegate."}],
        "encrypted_content": encode_reasoning("Tests take long: delegate.")}
    assert response["output"][1]["id"] == "msg_abc_1"
    assert response["output"][2] == {"id": "fc_abc_2", "type": "function_call", "status": "completed",
                                     "call_id": "call_2_0", "name": "spawn_agent",
                                     "namespace": "multi_agent_v1", "arguments": '{"task": "tests"}'}
    assert response["metadata"] == {"rollstream_ignored_tools": "web_search,file_search"}

    plain = responses_response(gen, parse_responses(body(tools=[AGENTS])), response_id="resp_abc", created=0)
    assert (plain["output"][0]["summary"], "encrypted_content" in plain["output"][0]) == ([], False)
