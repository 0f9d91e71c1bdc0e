"""A chat template that drops earlier turns' reasoning (as Qwen3's does once a new user message follows): a
multi-turn tool session stays token-exact. The prompt of every turn is the ids recorded for the turns before
it, reasoning included, then the new messages as the template renders them; the one sample says which turns
continued a history the template rewrote. Real Redis, the project's tokenizer with such a template."""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path

import pytest

from rollstream.services.gateway.apis.canonical import ChatRequest
from rollstream.services.gateway.prompts import ChatTemplate, answer_key
from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import ROOT, SessionSpec, TurnNode
from rollstream.shared.contract.events import TrajectorySegment
from tests.unit.services.gateway.stores import plan, session_store

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(),
                                reason="the tiny model is built by make setup")

# Reasoning is shown only for answers after the last user message, as Qwen3's template does; an answer there
# without reasoning still gets an empty think block.
REASONING_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_start|>system\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- set ns2 = namespace(text=message.content or '') -%}
        {%- for call in (message.tool_calls or []) -%}
            {%- set ns2.text = ns2.text + '<tool_call>{"name": ' + (call.function.name | tojson)
                + ', "arguments": ' + (call.function.arguments | tojson) + '}</tool_call>' -%}
        {%- endfor -%}
        {%- if loop.index0 > ns.last_user -%}
            {%- set ns2.text = '<think>\n' + (message.reasoning_content or '') + '\n</think>\n\n'
                + ns2.text -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' + ns2.text + '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>tool\n<tool_response>' + message.content + '</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""
TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def template():
    from transformers import AutoTokenizer

    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(MODEL))
    tokenizer.chat_template = REASONING_TEMPLATE
    return ChatTemplate(tokenizer)


async def turn(template, store, messages, sampled_text, answer, **planning):
    """One turn as the gateway runs it: `sampled_text` stands in for what vLLM sampled, `answer` is the
    assistant message the client gets (and sends back)."""
    request = ChatRequest(model="m", messages=messages, tools=TOOLS)
    planned = await plan(template, store, "s1", request, max_prompt_tokens=8192, **planning)
    sampled = template.encode(sampled_text + "<|im_end|>")
    node = TurnNode(parent=planned.parent, appended_ids=planned.appended_ids, response_ids=sampled,
                    logprobs=[-0.5] * len(sampled), policy_version=1, policy_version_end=1,
                    finish_reason="stop", server_url="http://vllm", response_text=answer["content"],
                    created_at=time.time(), history_rewritten=planned.history_rewritten)
    assert await store.add_turn("s1", answer_key(request, planned, answer), node)
    return planned, sampled


def call_answer(reasoning: str, cmd: str) -> dict:
    return {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
        {"type": "function", "id": f"call-{cmd}", "function": {"name": "run", "arguments": {"cmd": cmd}}}]}


def tool_call_text(reasoning: str, cmd: str) -> str:
    return (f'<think>\n{reasoning}\n</think>\n\n'
            f'<tool_call>{{"name": "run", "arguments": {{"cmd": "{cmd}"}}}}</tool_call>')


async def session_of_three_turns(template, store, **planning):
    """Call a tool, get its result and call another; then a new user message, which makes the template drop
    both answers' reasoning."""
    await store.create(SessionSpec(rollout_id="r1", group_id="g1", trajectory_id="r1", session_id="s1"))
    history = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "fix calc.py"}]
    planned = []
    for cmd in ("ls", "cat calc.py"):
        reasoning = f"I should run {cmd}"
        plan, sampled = await turn(template, store, history, tool_call_text(reasoning, cmd),
                             call_answer(reasoning, cmd), **planning)
        planned.append((plan, sampled))
        history += [call_answer(reasoning, cmd),
                    {"role": "tool", "tool_call_id": f"call-{cmd}", "content": "ok"}]
    history += [{"role": "user", "content": "and now?"}]
    planned.append(await turn(template, store, history, "<think>\ndone\n</think>\n\nFixed.",
                        {"role": "assistant", "content": "Fixed.", "reasoning_content": "done"}, **planning))
    return history, planned


def test_the_template_does_rewrite_the_history_and_the_session_stays_one_exact_sample(template, bus,
                                                                                       redis_url):
    async def scenario():
        async with session_store(bus, redis_url) as store:
            history, planned = await session_of_three_turns(template, store)
            return history, planned, await store.get("s1"), store.samples("s1")

    history, planned, session, samples = asyncio.run(scenario())
    rendered = template.render(history, TOOLS, add_generation_prompt=True)
    assert "I should run ls" not in rendered, \
        "the template drops earlier reasoning once a user message follows"

    (first, first_ids), (second, second_ids), (third, _) = planned
    assert first.parent == ROOT and second.parent != ROOT and third.parent != ROOT
    assert not second.history_rewritten and third.history_rewritten
    # each prompt is the earlier turns' ids exactly as sampled, reasoning included
    assert second.prefix_ids == first.prompt_ids + first_ids
    assert third.prefix_ids == second.prompt_ids + second_ids
    assert "I should run ls" in template.tokenizer.decode(third.prefix_ids)
    assert template.tokenizer.decode(third.appended_ids) == (
        "\n<|im_start|>tool\n<tool_response>ok</tool_response><|im_end|>\n"
        "<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n")

    pipe = bus.redis.pipeline(transaction=True)
    publish_samples(bus, pipe, session, samples, status="completed", reward=1.0, response_text=None,
                    artifacts={}, error=None)
    pipe.execute()
    (segment,) = [d.event for d in bus.read_all("trajectories") if isinstance(d.event, TrajectorySegment)]
    assert segment.metadata["history_rewritten_turns"] == [2]
    assert segment.tokens[: len(third.prompt_ids)] == third.prompt_ids


def test_fork_mode_starts_a_new_conversation_where_the_template_rewrote_the_history(template, bus, redis_url):
    async def scenario():
        async with session_store(bus, redis_url) as store:
            history, planned = await session_of_three_turns(template, store, on_rewritten_history="fork")
            return history, planned, store.samples("s1")

    history, planned, samples = asyncio.run(scenario())
    (_, _), (second, _), (third, _) = planned
    assert second.parent != ROOT
    assert third.parent == ROOT and not third.history_rewritten
    assert third.appended_ids == template.encode(template.render(history, TOOLS, add_generation_prompt=True))
    assert len(samples) == 2
