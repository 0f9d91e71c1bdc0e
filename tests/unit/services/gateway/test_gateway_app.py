"""The gateway's HTTP app with the project's tokenizer and real Redis, vLLM replaced by a scripted fleet:
first requests shaped like Claude Code's and Codex's are served, what the model was not shown is named,
max_tokens is held to the context, and a Codex turn sent back continues the session token-exactly."""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollstream.services.gateway.agent_api import IGNORED_TOOLS_HEADER
from rollstream.services.gateway.prompts import ChatTemplate
from rollstream.services.gateway.turns import prompt_opens_reasoning
from rollstream.shared.contract.events import TrajectorySegment
from tests.unit.services.gateway.scripted_app import CONTEXT, MODEL

pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(),
                                reason="the tiny model is built by make setup")
SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
          "properties": {"path": {"type": "string"}}, "required": ["path"], "additionalProperties": False}


def open_session(client: TestClient) -> tuple[str, dict[str, str]]:
    created = client.post("/v1/sessions", json={"rollout_id": "r1", "group_id": "g1"})
    assert created.status_code == 201, created.text
    session = created.json()
    return session["session_id"], {"x-api-key": session["api_key"],
                                   "authorization": f"Bearer {session['api_key']}"}


def events_of(stream_text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in stream_text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_the_base_urls_answer_a_probe_without_a_key(gateway_app):
    client, _, _ = gateway_app()
    for path in ("/s/any-session", "/s/any-session/v1"):
        assert client.head(path).status_code == 200
        assert client.get(path).status_code == 200


def claude_code_request(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "billing: header"},
                   {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<reminder>today</reminder>"},
                                         {"type": "text", "text": "fix the median",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Agent types: explorer."}],
        "tools": [{"name": "Read", "description": "Read a file.", "input_schema": SCHEMA},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": '{"device_id": "d1"}'}, **fields}


def test_claude_codes_first_request_is_served_within_the_context(caplog, gateway_app):
    client, fleet, _ = gateway_app()
    session_id, key = open_session(client)
    fleet.texts = ["I will read stats.py first."]
    with caplog.at_level(logging.INFO, logger="gateway-test"):
        response = client.post(f"/s/{session_id}/v1/messages?beta=true", json=claude_code_request(),
                               headers=key)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_TOOLS_HEADER] == "web_search_20250305"
    (logged,) = [r for r in caplog.records if r.name == "gateway-test"]
    assert (logged.getMessage(), logged.tool_types) == ("tools left out of the prompt", "web_search_20250305")
    events = events_of(response.text)
    assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == \
        "I will read stats.py first."
    (asked,) = fleet.asked
    assert asked["max_tokens"] == CONTEXT - len(asked["prompt_ids"]) < 32000
    assert events[-2]["usage"]["output_tokens"] == len(asked["response_ids"])


def test_a_runs_cap_on_a_turn_wins_over_what_the_agent_asks(gateway_app):
    client, fleet, _ = gateway_app(gateway={"max_tokens_per_turn": 64})
    session_id, key = open_session(client)
    fleet.texts = ["I will read stats.py first."]
    response = client.post(f"/s/{session_id}/v1/messages?beta=true", json=claude_code_request(), headers=key)
    assert response.status_code == 200, response.text
    (asked,) = fleet.asked
    assert asked["max_tokens"] == 64  # not the 32000 asked for, nor the room the context leaves


def test_the_messages_stream_opens_with_the_prompts_tokens(gateway_app):
    client, fleet, _ = gateway_app()
    session_id, key = open_session(client)
    fleet.texts = ["Five."]
    response = client.post(f"/s/{session_id}/v1/messages", headers=key, json={
        "model": "tiny", "max_tokens": 16, "stream": True,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}]})
    assert response.status_code == 200, response.text
    events = events_of(response.text)
    (asked,) = fleet.asked
    assert events[0]["type"] == "message_start"
    assert events[0]["message"]["usage"]["input_tokens"] == len(asked["prompt_ids"]) > 0
    assert events[-2]["usage"]["input_tokens"] == len(asked["prompt_ids"])


def test_a_model_that_reasons_answers_claude_code_with_a_thinking_block(gateway_app):
    client, fleet, _ = gateway_app()
    session_id, key = open_session(client)
    fleet.texts = ["<think>\nThe median needs sorting.\n</think>\n\nSorting first."]
    response = client.post(f"/s/{session_id}/v1/messages", headers=key,
                           json=claude_code_request(stream=False, max_tokens=100))
    assert response.status_code == 200, response.text
    content = response.json()["content"]
    assert [(block["type"], block.get("thinking", block.get("text"))) for block in content] == \
        [("thinking", "The median needs sorting."), ("text", "Sorting first.")]
    assert fleet.asked[0]["max_tokens"] == 100


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}},
                        "required": ["task"]}}]},
    {"type": "web_search", "external_web_access": False},
]
CODEX_INPUT = [
    {"type": "message", "id": "m1", "role": "developer",
     "content": [{"type": "input_text", "text": "Be a coder."}]},
    {"type": "message", "id": "m2", "role": "user",
     "content": [{"type": "input_text", "text": "fix the median"}]},
]


def codex_request(input_items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "tiny", "stream": True, "input": input_items, "tools": CODEX_TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
            "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "t1",
            "client_metadata": {"thread_id": "t1"}}


def test_codex_turn_and_the_next_continue_one_conversation_token_exactly(gateway_app):
    client, fleet, store = gateway_app()
    session_id, key = open_session(client)
    fleet.texts = ['<think>\nDelegate the tests.\n</think>\n\nDelegating.\n<tool_call>{"name": '
                   '"multi_agent_v1.spawn_agent", "arguments": {"task": "run tests"}}</tool_call>',
                   "The agent started."]
    first = client.post(f"/s/{session_id}/v1/responses", json=codex_request(CODEX_INPUT), headers=key)
    assert first.status_code == 200, first.text
    assert first.headers[IGNORED_TOOLS_HEADER] == "web_search"
    completed = events_of(first.text)[-1]
    assert completed["type"] == "response.completed"
    assert completed["response"]["metadata"] == {"rollstream_ignored_tools": "web_search"}
    reasoning, message, call = completed["response"]["output"]
    assert (reasoning["type"], reasoning["summary"][0]["text"]) == ("reasoning", "Delegate the tests.")
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == \
        ("spawn_agent", "multi_agent_v1", {"task": "run tests"})

    # Codex keeps the reasoning's summary and encrypted copy, not its reasoning_text.
    sent_back = {key: reasoning[key] for key in ("type", "id", "summary", "encrypted_content")}
    second = client.post(f"/s/{session_id}/v1/responses", headers=key, json=codex_request([
        *CODEX_INPUT, sent_back, message, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "agent a1 started"}]))
    assert second.status_code == 200, second.text
    turn_one, turn_two = fleet.asked
    assert turn_two["prompt_ids"][:len(turn_one["prompt_ids"]) + len(turn_one["response_ids"])] == \
        turn_one["prompt_ids"] + turn_one["response_ids"]
    (conversation,) = store.samples(session_id)
    assert len(conversation) == 2


def test_a_turn_records_its_servers_versions_before_and_after_a_weight_sync_it_spans(bus, gateway_app):
    client, fleet, store = gateway_app()
    versions = bus.keys.fleet_versions
    bus.redis.hset(versions, "http://vllm", 2)
    session_id, key = open_session(client)
    fleet.texts = ["first", "second"]
    fleet.during = lambda: bus.redis.hset(versions, "http://vllm", 3)  # the sync ends while the turn samples
    messages = [{"role": "user", "content": "hi"}]
    first = client.post(f"/s/{session_id}/v1/chat/completions", headers=key,
                        json={"model": "m", "messages": messages})
    assert first.status_code == 200, first.text
    fleet.during = lambda: bus.redis.hset(versions, "http://vllm", 4)
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    second = client.post(f"/s/{session_id}/v1/chat/completions", headers=key,
                         json={"model": "m", "messages": messages, "stream": True})
    assert second.status_code == 200, second.text
    (conversation,) = store.samples(session_id)
    assert [(node.policy_version, node.policy_version_end) for node in conversation] == [(2, 3), (3, 4)]


def test_a_malformed_request_gets_the_sessions_refusal_first(gateway_app):
    client, _, _ = gateway_app()
    session_id, key = open_session(client)
    malformed = {"model": "m", "messages": "not a list"}
    askers = (("nobody", key), (session_id, {"x-api-key": "wrong"}), (session_id, key))
    refused = [client.post(f"/s/{session}/v1/chat/completions", json=malformed, headers=headers).status_code
               for session, headers in askers]
    assert refused == [404, 401, 400]


@pytest.mark.parametrize(("path", "anthropic"), [("v1/chat/completions", False), ("v1/messages", True)])
def test_a_body_that_is_not_json_is_refused_in_the_apis_shape_after_the_sessions_refusals(gateway_app, path,
                                                                                         anthropic):
    client, _, _ = gateway_app()
    session_id, key = open_session(client)
    not_json = b'{"model": "m", "messages": ['
    askers = (("nobody", key), (session_id, {"x-api-key": "wrong"}), (session_id, key))
    refused = [client.post(f"/s/{session}/{path}", content=not_json, headers=headers)
               for session, headers in askers]
    assert [answer.status_code for answer in refused] == [404, 401, 400]
    error = refused[-1].json()
    assert (error.get("type") == "error") == anthropic  # Anthropic's errors say so; OpenAI's have no type
    assert error["error"]["message"].startswith("invalid request: the body is not JSON")
    listed = client.post(f"/s/{session_id}/{path}", json=[{"role": "user", "content": "hi"}], headers=key)
    assert listed.status_code == 400 and "body" in listed.json()["error"]["message"]


def test_a_prompt_that_fills_the_context_is_refused_with_both_sizes(gateway_app):
    client, fleet, _ = gateway_app()
    session_id, key = open_session(client)
    response = client.post(f"/s/{session_id}/v1/chat/completions", headers=key, json={
        "model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "word " * CONTEXT}]})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("the prompt is ") and f"tokens; the model's context is {CONTEXT}" in message
    assert fleet.asked == []


def test_a_session_refuses_turns_from_its_deadline_and_ends_its_grace_later(bus, gateway_app):
    client, fleet, _ = gateway_app(gateway={"finish_grace_s": 0.5})
    created = client.post("/v1/sessions",
                          json={"rollout_id": "r1", "group_id": "g1", "time_budget_s": 0.5}).json()
    assert created["ends_at"] == created["deadline"] + 0.5
    session_id, key = created["session_id"], {"x-api-key": created["api_key"]}
    chat = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    fleet.texts = ["hello"]
    assert client.post(f"/s/{session_id}/v1/chat/completions", json=chat, headers=key).status_code == 200
    time.sleep(max(0.0, created["deadline"] - time.time()) + 0.05)
    late = client.post(f"/s/{session_id}/v1/chat/completions", json=chat, headers=key)
    assert late.status_code == 403 and "time budget of 0.5 s is spent" in late.json()["error"]["message"]
    time.sleep(max(0.0, created["ends_at"] - time.time()) + 0.05)
    finish = client.post(f"/v1/sessions/{session_id}/finish", json={"status": "truncated"})
    assert finish.status_code == 404 and "ends gateway.finish_grace_s after its deadline" in finish.text
    assert bus.read_all("trajectories") == []


def test_strict_tools_refuses_the_tools_the_model_cannot_be_shown(gateway_app):
    client, fleet, _ = gateway_app(gateway={"strict_tools": True})
    session_id, key = open_session(client)
    response = client.post(f"/s/{session_id}/v1/responses", json=codex_request(CODEX_INPUT), headers=key)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert "type web_search" in response.json()["error"]["message"]
    assert fleet.asked == []


HYBRID_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% if enable_thinking is defined and not enable_thinking %}"
                   "<think>\n\n</think>\n\n{% endif %}"
                   "{% endif %}")
"""What a hybrid reasoning template (Qwen3's) does with `enable_thinking`, cut down to it."""


def test_a_request_that_turns_reasoning_off_renders_with_enable_thinking_false(template):
    tokenizer = copy.deepcopy(template.tokenizer)
    tokenizer.chat_template = HYBRID_TEMPLATE
    hybrid = ChatTemplate(tokenizer)
    question = [{"role": "user", "content": "2+3?"}]
    assert hybrid.with_thinking(None) is hybrid
    assert hybrid.with_thinking(False).render(question, None, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert hybrid.with_thinking(True).render(question, None, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")
    assert hybrid.template_kwargs == {}


def test_a_prompt_that_ends_inside_a_reasoning_block_is_told_apart(template):
    assert prompt_opens_reasoning(template, template.encode("<|im_start|>assistant\n<think>\n"))
    assert not prompt_opens_reasoning(template, template.encode("<|im_start|>assistant\n"))
    closed = template.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning(template, closed)


AGENT_TOOL = {"name": "Agent", "description": "Launch a sub-agent.", "input_schema": {
    "type": "object", "properties": {"description": {"type": "string"}, "prompt": {"type": "string"},
                                     "subagent_type": {"type": "string"}}, "required": ["prompt"]}}
READ_TOOL = {"name": "Read", "description": "Read a file.", "input_schema": SCHEMA}


def claude_turn(client, session_id: str, key: dict[str, str], system: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed Messages request as Claude Code sends it; the assistant message it gets back."""
    response = client.post(f"/s/{session_id}/v1/messages?beta=true", headers=key, json={
        "model": "tiny", "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
        "system": [{"type": "text", "text": "billing: header"}, {"type": "text", "text": system}],
        "messages": messages, "tools": tools})
    assert response.status_code == 200, response.text
    blocks: dict[int, dict[str, Any]] = {}
    for event in events_of(response.text):
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "input_json_delta":
                block["partial"] = block.get("partial", "") + delta["partial_json"]
    content = []
    for _, block in sorted(blocks.items()):
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial", "") or "{}")
        content.append(block)
    return {"role": "assistant", "content": content}


def tool_result(answer: dict[str, Any], text: str) -> dict[str, Any]:
    (call,) = [block for block in answer["content"] if block["type"] == "tool_use"]
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                         "content": [{"type": "text", "text": text}]}]}


def test_claude_codes_sub_agent_and_compaction_become_samples_of_one_rollout(bus, gateway_app):
    """The request sequence Claude Code sends when its main conversation delegates to a sub-agent (the
    Agent tool: a separate conversation with its own system prompt and tools, in the same session), takes
    the sub-agent's report as the tool's result, then compacts (a summary request over the whole history,
    then a new conversation that starts from the summary)."""
    client, fleet, store = gateway_app()
    session_id, key = open_session(client)
    main_tools, sub_tools = [AGENT_TOOL, READ_TOOL], [READ_TOOL]
    fleet.texts = [
        '<tool_call>{"name": "Agent", "arguments": {"prompt": "Find the median bug", "subagent_type": '
        '"Explore"}}</tool_call>',
        '<tool_call>{"name": "Read", "arguments": {"path": "stats.py"}}</tool_call>',
        "The bug: no sort.",
        "Fixed the median.",
        "Summary: the median was fixed.",
        "Nothing left to do.",
    ]
    task = [{"role": "user", "content": [{"type": "text", "text": "fix the median"}]}]
    delegate = claude_turn(client, session_id, key, "You are the main agent.", task, main_tools)
    assert delegate["content"][-1]["name"] == "Agent"

    sub_task = [{"role": "user", "content": [{"type": "text", "text": "Find the median bug"}]}]
    read = claude_turn(client, session_id, key, "You are a search agent.", sub_task, sub_tools)
    report = claude_turn(client, session_id, key, "You are a search agent.",
                         sub_task + [read, tool_result(read, "def median(x): return x[len(x) // 2]")],
                         sub_tools)

    main = task + [delegate, tool_result(delegate, report["content"][0]["text"])]
    fixed = claude_turn(client, session_id, key, "You are the main agent.", main, main_tools)
    summary_request = main + [fixed, {"role": "user", "content": "Summarize the conversation so far."}]
    claude_turn(client, session_id, key, "You are the main agent.", summary_request, main_tools)
    claude_turn(client, session_id, key, "You are the main agent.", [
        {"role": "user", "content": "This session continues an earlier one. Summary: the median was fixed."}],
        main_tools)

    asked = fleet.asked
    chains = store.samples(session_id)
    assert sorted(len(chain) for chain in chains) == [1, 2, 3], "sub-agent, main up to the summary, after it"
    # every later turn of a conversation is prompted with the earlier turn's exact ids
    for earlier, later in ((0, 3), (3, 4), (1, 2)):
        done = asked[earlier]["prompt_ids"] + asked[earlier]["response_ids"]
        assert asked[later]["prompt_ids"][: len(done)] == done

    finished = client.post(f"/v1/sessions/{session_id}/finish", json={"status": "completed"})
    assert finished.status_code == 200, finished.text
    assert finished.json()["samples"] == 3
    segments = [d for d in bus.read_all("trajectories") if isinstance(d.event, TrajectorySegment)]
    assert len(segments) == 3 and {d.envelope.rollout_id for d in segments} == {"r1"}
