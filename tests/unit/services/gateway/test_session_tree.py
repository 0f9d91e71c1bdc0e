"""A gateway session's turn tree on real Redis with the project's tokenizer: prompts continue earlier turns
with their exact ids, edited and branched histories fork, and a finished session's leaves become samples."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rollstream.services.gateway.apis.canonical import ChatRequest, assistant_message, split_turn
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.prompts import ChatTemplate, answer_key
from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import ROOT, SessionSpec, TurnNode
from rollstream.shared.contract.events import TrajectoryFinished, TrajectorySegment
from tests.unit.services.gateway.stores import plan, session_store

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(),
                                reason="the tiny model is built by make setup")
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def template():
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(MODEL))


@pytest.fixture
def in_session(bus, redis_url):
    """Runs a test's coroutine with a store that holds one open session, s1, and that session."""
    async def run(scenario):
        async with session_store(bus, redis_url) as store:
            spec = SessionSpec(rollout_id="r1", group_id="g1", trajectory_id="r1", session_id="s1",
                               group_size=1, grader={"kind": "harbor", "task_dir": "/tasks/fix-add"})
            created, _ = await store.create(spec)
            assert await store.create(spec) is None  # an id is taken once
            return await scenario(store, created)

    return lambda scenario: asyncio.run(run(scenario))


async def sample(template, store, messages, answer_text, *, tools=None, finish="stop"):
    """One turn as the gateway runs it, with `answer_text` standing in for what vLLM sampled."""
    request = ChatRequest(model="m", messages=messages, tools=tools)
    planned = await plan(template, store, "s1", request, max_prompt_tokens=4096)
    sampled = template.encode(answer_text + ("<|im_end|>" if finish == "stop" else ""))
    turn = split_turn(template.tokenizer.decode(sampled, skip_special_tokens=True), 0)
    content, calls = turn.content, turn.calls
    answer = assistant_message(content, calls)
    node = TurnNode(parent=planned.parent, appended_ids=planned.appended_ids, response_ids=sampled,
                    logprobs=[-0.5] * len(sampled), policy_version=3, policy_version_end=3,
                    finish_reason=finish, server_url="http://vllm-a", response_text=content,
                    created_at=time.time())
    assert await store.add_turn("s1", answer_key(request, planned, answer), node)
    return planned, sampled, answer


def test_a_turn_that_extends_the_last_continues_its_exact_ids(template, in_session):
    async def scenario(store, _):
        first = [{"role": "user", "content": "what is 2+3?"}]
        planned, sampled, answer = await sample(template, store, first, "Let me see", tools=TOOLS)
        assert planned.parent == ROOT
        rendered = template.render(first, TOOLS, add_generation_prompt=True)
        assert planned.appended_ids == template.encode(rendered)

        second = first + [answer, {"role": "user", "content": "go on"}]
        request = ChatRequest(model="m", messages=second, tools=TOOLS)
        following = await plan(template, store, "s1", request, max_prompt_tokens=4096)
        assert following.parent != ROOT
        assert following.prompt_ids[: len(planned.prompt_ids) + len(sampled)] == planned.prompt_ids + sampled
        # after the sampled <|im_end|>: the template's newline, the new user turn, the generation prompt
        assert template.tokenizer.decode(following.appended_ids) == (
            "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")

    in_session(scenario)


def test_a_tool_call_sent_back_with_other_spacing_and_ids_still_continues_the_turn(template, in_session):
    async def scenario(store, _):
        first = [{"role": "user", "content": "2+3?"}]
        call = '<tool_call>{"name": "calc", "arguments": {"e": "2+3"}}</tool_call>'
        _, sampled, answer = await sample(template, store, first, call, tools=TOOLS)
        assert answer["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"e": "2+3"}}
        echoed = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "my-own-id", "function": {"name": "calc", "arguments": {"e": "2+3"}}}]}
        history = first + [echoed, {"role": "tool", "tool_call_id": "my-own-id", "content": "5"}]
        request = ChatRequest(model="m", messages=history, tools=TOOLS)
        following = await plan(template, store, "s1", request, 4096)
        assert following.parent != ROOT and following.prefix_ids[-len(sampled):] == sampled

    in_session(scenario)


def test_an_answer_cut_by_the_token_limit_gets_the_whole_turn_close_as_glue(template, in_session):
    async def scenario(store, _):
        first = [{"role": "user", "content": "count"}]
        _, _, answer = await sample(template, store, first, "1 2 3", finish="length")
        request = ChatRequest(model="m", messages=first + [answer, {"role": "user", "content": "ok"}])
        following = await plan(template, store, "s1", request, 4096)
        glued = template.tokenizer.decode(following.appended_ids)
        assert glued.startswith("<|im_end|>\n<|im_start|>user\nok")

    in_session(scenario)


def test_branches_and_compactions_fork_and_every_leaf_becomes_a_sample(template, in_session, bus):
    async def scenario(store, created):
        first = [{"role": "user", "content": "plan"}]
        _, sampled_1, answer_1 = await sample(template, store, first, "step one")
        for follow_up in ("try A", "try B"):  # two branches from the same turn
            branch = first + [answer_1, {"role": "user", "content": follow_up}]
            await sample(template, store, branch, f"did {follow_up}")
        compacted = [{"role": "user", "content": "summary: planned, tried A and B. Finish."}]
        planned, _, _ = await sample(template, store, compacted, "done")
        assert planned.parent == ROOT  # a history that extends no turn starts a new conversation

        def publish(pipe, samples):
            publish_samples(bus, pipe, created, samples, status="completed", reward=None, response_text=None,
                            artifacts={"diff": "runs/x.diff"}, error=None)

        assert store.finish("s1", publish)
        assert not store.finish("s1", publish)  # once
        late = TurnNode(ROOT, [1], [2], [-0.1], 0, 0, "stop", "u", "", 0.0)
        assert not await store.add_turn("s1", "late", late)
        return sampled_1

    sampled_1 = in_session(scenario)
    first = [{"role": "user", "content": "plan"}]
    events = [d for d in bus.read_all("trajectories")]
    segments = [d.event for d in events if isinstance(d.event, TrajectorySegment)]
    (finished,) = [d.event for d in events if isinstance(d.event, TrajectoryFinished)]
    assert len(segments) == 3 and finished.segment_count == 3
    assert {d.envelope.rollout_id for d in events} == {"r1"}
    assert finished.grader == {"kind": "harbor", "task_dir": "/tasks/fix-add"}
    assert finished.artifacts == {"diff": "runs/x.diff"}
    assert finished.response_text == "done"
    branch_a, branch_b, summary = segments
    for segment in (branch_a, branch_b):  # both branches hold the shared first turn's sampled ids, trainable
        start = segment.tokens.index(sampled_1[0], len(template.encode(template.render(first, None, True))))
        assert segment.tokens[start:start + len(sampled_1)] == sampled_1
        assert segment.loss_mask[start:start + len(sampled_1)] == [1] * len(sampled_1)
    for segment in segments:
        trainable = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
        sampled_logprobs = [lp for lp, m in zip(segment.rollout_logprobs, segment.loss_mask) if m]
        assert sum(segment.loss_mask) == len(trainable) and all(lp == -0.5 for lp in sampled_logprobs)
    assert summary.turn_policy_versions == [3]


def test_a_prompt_over_the_limit_is_refused_with_its_length(template, in_session):
    async def scenario(store, _):
        request = ChatRequest(model="m", messages=[{"role": "user", "content": "word " * 200}])
        refused = r"the prompt is \d+ tokens; this gateway takes at most 50"
        with pytest.raises(RequestError, match=refused) as info:
            await plan(template, store, "s1", request, max_prompt_tokens=50)
        assert info.value.status == 400

    in_session(scenario)


def test_a_prefilled_assistant_turn_is_refused(template, in_session):
    async def scenario(store, _):
        prefilled = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
        with pytest.raises(RequestError, match="prefilled"):
            await plan(template, store, "s1", ChatRequest(model="m", messages=prefilled), 4096)

    in_session(scenario)


def test_a_long_request_is_rendered_and_tokenized_off_the_event_loop(template, in_session, monkeypatch):
    offloaded = []
    to_thread = asyncio.to_thread

    async def counted(work, *args):
        offloaded.append(work.__name__)
        return await to_thread(work, *args)

    monkeypatch.setattr(asyncio, "to_thread", counted)

    async def scenario(store, _):
        short = ChatRequest(model="m", messages=[{"role": "user", "content": "word " * 100}])
        long = ChatRequest(model="m", messages=[{"role": "user", "content": "word " * 500}])
        planned = [await plan(template, store, "s1", request, 4096) for request in (short, long)]
        assert offloaded == ["_render_turn"]  # the long one only: the short one takes less than the hop
        rendered = [template.render(request.messages, None, True) for request in (short, long)]
        assert [p.appended_ids for p in planned] == [template.encode(text) for text in rendered]

    in_session(scenario)
