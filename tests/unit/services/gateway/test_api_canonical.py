"""The canonical form the three APIs share: message identity across re-serialisation, error bodies."""

from __future__ import annotations

import logging

import pytest

from rollstream.services.gateway.apis.canonical import (
    ToolCall,
    assistant_message,
    final_finish_reason,
    message_key,
)
from rollstream.services.gateway.apis.errors import (
    RequestError,
    anthropic_error,
    openai_error,
    request_error_of,
)
from rollstream.shared.errors import RollstreamError


def call(name: str, arguments: dict, call_id: str = "call_3_0") -> dict:
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


def test_message_key_ignores_what_clients_change_when_they_send_a_turn_back():
    recorded = assistant_message("Let me look.",
                                 [ToolCall("call_3_0", "read", {"path": "a.py", "lines": [1, 2]})])
    echoed = {"role": "assistant", "content": "Let me look.\n",
              "tool_calls": [call("read", {"lines": [1, 2], "path": "a.py"}, call_id="toolu_client_made")]}
    assert message_key(echoed) == message_key(recorded)
    assert message_key({"role": "assistant", "content": None, "tool_calls": recorded["tool_calls"]}) \
        == message_key({"role": "assistant", "content": "", "tool_calls": recorded["tool_calls"]})
    hash(message_key(recorded))


def test_message_key_ignores_the_reasoning_clients_alter_or_drop():
    recorded = assistant_message("Done.", [ToolCall("call_3_0", "read", {"path": "a.py"})],
                                 reasoning="Think.")
    assert recorded["reasoning_content"] == "Think."
    assert "reasoning_content" not in assistant_message("Done.", [])
    for echoed_reasoning in ({}, {"reasoning_content": "A summary of it."}, {"reasoning_content": ""}):
        assert message_key({**recorded, **echoed_reasoning}) == message_key(recorded)
    without = {key: value for key, value in recorded.items() if key != "reasoning_content"}
    assert message_key(without) == message_key(recorded)


@pytest.mark.parametrize("changed", [
    {"role": "user", "content": "Let me look."},
    {"role": "assistant", "content": "Let me look again."},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [call("read", {"path": "b.py"})]},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [call("write", {"path": "a.py"})]},
    {"role": "assistant", "content": "Let me look."},
])
def test_message_key_tells_different_turns_apart(changed):
    recorded = assistant_message("Let me look.", [ToolCall("call_3_0", "read", {"path": "a.py"})])
    assert message_key(changed) != message_key(recorded)


def test_message_key_of_tool_results_includes_the_call_they_answer():
    result = {"role": "tool", "content": "42", "tool_call_id": "call_1_0", "name": "calc"}
    assert message_key(result) == message_key({"role": "tool", "content": " 42 ", "tool_call_id": "call_1_0"})
    assert message_key(result) != message_key({**result, "tool_call_id": "call_1_1"})


def test_a_cut_off_turn_stays_length_and_calls_make_tool_calls():
    assert final_finish_reason("length", True) == "length"
    assert final_finish_reason("stop", True) == "tool_calls"
    assert final_finish_reason("tool_calls", False) == "stop"


def test_request_errors_are_rollstream_errors_with_a_status():
    error = RequestError(400, "messages must not be empty", "messages")
    assert isinstance(error, RollstreamError) and isinstance(error, ValueError)
    assert (error.status, error.message, error.param, error.kind, str(error)) == \
        (400, "messages must not be empty", "messages", "invalid_request_error", "messages must not be empty")


def test_openai_error_bodies():
    assert openai_error(400, "n must be 1", "n") == \
        {"error": {"message": "n must be 1", "type": "invalid_request_error", "param": "n", "code": None}}
    assert openai_error(503, "no server")["error"]["type"] == "server_error"
    limited = openai_error(429, "slow down", kind="rate_limit_exceeded", code="rate_limit_exceeded")
    assert limited["error"] == {"message": "slow down", "type": "rate_limit_exceeded", "param": None,
                                "code": "rate_limit_exceeded"}


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (529, "overloaded_error"), (422, "invalid_request_error"), (502, "api_error"),
])
def test_anthropic_error_types_follow_the_status(status, kind):
    assert anthropic_error(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_a_failure_inside_a_stream_is_reported_as_a_500_and_logged(caplog):
    error = RequestError(413, "prompt too long")
    assert request_error_of(error) is error
    with caplog.at_level(logging.ERROR):
        wrapped = request_error_of(ConnectionError("vLLM went away"))
    assert (wrapped.status, wrapped.message) == (500, "generation failed: ConnectionError: vLLM went away")
    assert "vLLM went away" in caplog.text
