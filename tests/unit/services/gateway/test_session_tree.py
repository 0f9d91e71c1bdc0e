"""A gateway session's turn tree on real Redis with the project's tokenizer: prompts continue earlier turns
with their exact ids, edited and branched histories fork, and a finished session's leaves become samples."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollstream.services.gateway.apis.canonical import ChatRequest, assistant_message, split_turn
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.prompts import ChatTemplate, answer_key, plan_turn
from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import ROOT, SessionSpec, SessionStore, TurnNode
from rollstream.shared.contract.events import TrajectoryFinished, TrajectorySegment

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="the tiny model is built by make setup")
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def template():
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(MODEL))


@pytest.fixture
def session(bus):
    store = SessionStore(bus, ttl_s=600, finish_grace_s=60)
    spec = SessionSpec(rollout_id="r1", group_id="g1", trajectory_id="r1", session_id="s1", group_size=1,
                       grader={"kind": "harbor", "task_dir": "/tasks/fix-add"})
    created, api_key = store.create(spec)
    assert store.create(spec) is None  # an id is taken once
    return store, created


def sample(template, store, session, messages, answer_text, *, tools=None, finish="stop"):
    """One turn as the gateway runs it, with `answer_text` standing in for what vLLM sampled."""
    request = ChatRequest(model="m", messages=messages, tools=tools)
    planned = plan_turn(template, store, "s1", request, max_prompt_tokens=4096)
    sampled = template.encode(answer_text + ("<|im_end|>" if finish == "stop" else ""))
    turn = split_turn(template.tokenizer.decode(sampled, skip_special_tokens=True), 0)
    content, calls = turn.content, turn.calls
    answer = assistant_message(content, calls)
    node = TurnNode(parent=planned.parent, appended_ids=planned.appended_ids, response_ids=sampled,
                    logprobs=[-0.5] * len(sampled), policy_version=3, policy_version_end=3, finish_reason=finish,
                    server_url="http://vllm-a", response_text=content, created_at=time.time())
    assert store.add_turn("s1", answer_key(request, planned, answer), node)
    return planned, sampled, answer


def test_a_turn_that_extends_the_last_continues_its_exact_ids(template, session):
    store, _ = session
    first = [{"role": "user", "content": "what is 2+3?"}]
    planned, sampled, answer = sample(template, store, session, first, "Let me see", tools=TOOLS)
    assert planned.parent == ROOT
    assert planned.appended_ids == template.encode(template.render(first, TOOLS, add_generation_prompt=True))

    second = first + [answer, {"role": "user", "content": "go on"}]
    request = ChatRequest(model="m", messages=second, tools=TOOLS)
    following = plan_turn(template, store, "s1", request, max_prompt_tokens=4096)
    assert following.parent != ROOT
    assert following.prompt_ids[: len(planned.prompt_ids) + len(sampled)] == planned.prompt_ids + sampled
    # after the sampled <|im_end|>: the template's newline, then the new user turn and the generation prompt
    assert template.tokenizer.decode(following.appended_ids) == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_call_sent_back_with_other_spacing_and_ids_still_continues_the_turn(template, session):
    store, _ = session
    first = [{"role": "user", "content": "2+3?"}]
    _, sampled, answer = sample(template, store, session, first,
                                '<tool_call>{"name": "calc", "arguments": {"e": "2+3"}}</tool_call>', tools=TOOLS)
    assert answer["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"e": "2+3"}}
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "my-own-id", "function": {"name": "calc", "arguments": {"e": "2+3"}}}]}
    history = first + [echoed, {"role": "tool", "tool_call_id": "my-own-id", "content": "5"}]
    following = plan_turn(template, store, "s1", ChatRequest(model="m", messages=history, tools=TOOLS), 4096)
    assert following.parent != ROOT and following.prefix_ids[-len(sampled):] == sampled


def test_an_answer_cut_by_the_token_limit_gets_the_whole_turn_close_as_glue(template, session):
    store, _ = session
    first = [{"role": "user", "content": "count"}]
    _, sampled, answer = sample(template, store, session, first, "1 2 3", finish="length")
    following = plan_turn(template, store, "s1",
                          ChatRequest(model="m", messages=first + [answer, {"role": "user", "content": "ok"}]), 4096)
    assert template.tokenizer.decode(following.appended_ids).startswith("<|im_end|>\n<|im_start|>user\nok")


def test_branches_and_compactions_fork_and_every_leaf_becomes_a_sample(template, session, bus):
    store, created = session
    first = [{"role": "user", "content": "plan"}]
    _, sampled_1, answer_1 = sample(template, store, session, first, "step one")
    for follow_up in ("try A", "try B"):  # two branches from the same turn
        sample(template, store, session, first + [answer_1, {"role": "user", "content": follow_up}], f"did {follow_up}")
    compacted = [{"role": "user", "content": "summary: planned, tried A and B. Finish."}]
    planned, _, _ = sample(template, store, session, compacted, "done")
    assert planned.parent == ROOT  # a history that extends no turn starts a new conversation

    def publish(pipe, samples):
        publish_samples(bus, pipe, created, samples, status="completed", reward=None, response_text=None,
                        artifacts={"diff": "runs/x.diff"}, error=None)

    assert store.finish("s1", publish)
    assert not store.finish("s1", publish)  # once
    assert not store.add_turn("s1", "late", TurnNode(ROOT, [1], [2], [-0.1], 0, 0, "stop", "u", "", 0.0))
    events = [d for d in bus.read_all("trajectories")]
    segments = [d.event for d in events if isinstance(d.event, TrajectorySegment)]
    (finished,) = [d.event for d in events if isinstance(d.event, TrajectoryFinished)]
    assert len(segments) == 3 and finished.segment_count == 3
    assert {d.envelope.rollout_id for d in events} == {"r1"}
    assert finished.grader == {"kind": "harbor", "task_dir": "/tasks/fix-add"} and finished.artifacts == {"diff": "runs/x.diff"}
    assert finished.response_text == "done"
    branch_a, branch_b, summary = segments
    for segment in (branch_a, branch_b):  # both branches hold the shared first turn's sampled ids, trainable
        start = segment.tokens.index(sampled_1[0], len(template.encode(template.render(first, None, True))))
        assert segment.tokens[start:start + len(sampled_1)] == sampled_1
        assert segment.loss_mask[start:start + len(sampled_1)] == [1] * len(sampled_1)
    for segment in segments:
        trainable = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
        assert sum(segment.loss_mask) == len(trainable) and all(lp == -0.5 for lp, m in
                                                                 zip(segment.rollout_logprobs, segment.loss_mask) if m)
    assert summary.turn_policy_versions == [3]


def test_a_prompt_over_the_limit_is_refused_with_its_length(template, session):
    store, _ = session
    request = ChatRequest(model="m", messages=[{"role": "user", "content": "word " * 200}])
    with pytest.raises(RequestError, match=r"the prompt is \d+ tokens; this gateway takes at most 50") as info:
        plan_turn(template, store, "s1", request, max_prompt_tokens=50)
    assert info.value.status == 400


def test_a_prefilled_assistant_turn_is_refused(template, session):
    store, _ = session
    request = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}])
    with pytest.raises(RequestError, match="prefilled"):
        plan_turn(template, store, "s1", request, max_prompt_tokens=4096)
