"""The built-in tool agent against real vLLM on the CPU: multi-turn, token-exact, errors as messages.

The random tiny model does not write tool calls by itself, so the episode's turns are steered by a
scripted tool-call format (the parsers have their own tests); everything else is real: the chat
template, the tokenizer, vLLM's sampled ids and logprobs, the tools.
"""

from __future__ import annotations

import asyncio

import pytest

from rollstream.shared.agent.environments.calculator import calculator
from rollstream.shared.agent.loop import AgentContext, Limits, Task, TokenTrajectory, tool_agent
from rollstream.shared.agent.tool_calls import ParsedTurn
from rollstream.shared.agent.tools import Episode, ToolCall, ToolSet, tool
from rollstream.shared.inference.fleet import FleetClient
from tests.support import revive

pytestmark = pytest.mark.integration


@tool
def explode(reason: str) -> str:
    """A tool that always fails."""
    raise RuntimeError(f"exploded because {reason}")


class ScriptedFormat:
    """Turn 0: a calculator call and a failing tool; turn 1: a malformed call; turn 2: an answer."""

    name = "scripted"

    def describe(self) -> str:
        return ""

    def parse(self, text: str, turn: int) -> ParsedTurn:
        if turn == 0:
            return ParsedTurn(content="", errors=[], calls=[
                ToolCall(id="call_0_0", name="calculator", arguments={"expression": "6 * 7"}),
                ToolCall(id="call_0_1", name="explode", arguments={"reason": "testing"})])
        if turn == 1:
            return ParsedTurn(content="", calls=[], errors=["unterminated JSON in <tool_call>"])
        return ParsedTurn(content=text, calls=[], errors=[])


@pytest.fixture(scope="module")
def served(tiny_model, vllm_pair):
    return tiny_model, revive(vllm_pair)[0].url


@pytest.fixture(scope="module")
def episode(served):
    from transformers import AutoTokenizer

    model, url = served
    tokenizer = AutoTokenizer.from_pretrained(model)

    async def run():
        fleet = FleetClient([url])
        tools = ToolSet([calculator, explode])
        ctx = AgentContext(fleet=fleet, tokenizer=tokenizer, tools=tools, tool_format=ScriptedFormat(),
                           limits=Limits(max_turns=5, max_tokens_per_turn=16, max_total_tokens=2048),
                           episode=Episode(episode_id="e1"), session_id="s1",
                           # the random model rarely ends a turn: favour <|im_end|> so turns end on their own
                           sampling={"logit_bias": {str(tokenizer.eos_token_id): 6.0}})
        task = Task(messages=[{"role": "user", "content": "What is 6 * 7?"}], label="42")
        segment = await tool_agent(task, ctx)
        # vLLM scores the finished sequence: the logprob of each sampled token in exactly this context
        scored = await fleet.prompt_logprobs(url, segment.tokens)
        await fleet.aclose()
        return segment, tools, scored

    segment, tools, scored = asyncio.run(run())
    return {"segment": segment, "tools": tools, "scored": scored, "tokenizer": tokenizer}


def test_three_turns_and_the_episode_completes(episode):
    segment = episode["segment"]
    assert segment.status == "completed"
    assert len(segment.turns) == 3
    assert segment.turn_policy_versions == [0, 0, 0]


def test_model_tokens_are_vllms_ids_turn_by_turn_and_the_only_ones_trained(episode):
    segment = episode["segment"]
    trained = [i for i, m in enumerate(segment.loss_mask) if m]
    expected = []
    rebuilt = []
    for turn in segment.turns:
        assert segment.tokens[turn.offset: turn.offset + len(turn.response_ids)] == turn.response_ids
        assert segment.rollout_logprobs[turn.offset: turn.offset + len(turn.response_ids)] == turn.logprobs
        expected += range(turn.offset, turn.offset + len(turn.response_ids))
        rebuilt += turn.appended_ids + turn.response_ids
    assert trained == expected
    assert segment.tokens[: len(rebuilt)] == rebuilt
    assert all(segment.rollout_logprobs[i] == 0.0 for i, m in enumerate(segment.loss_mask) if not m)


def test_sampled_logprobs_match_vllm_scoring_the_whole_sequence(episode):
    """If any context had been re-tokenized, vLLM would score the sampled tokens differently."""
    segment, scored = episode["segment"], episode["scored"]
    for index, sampled in enumerate(segment.loss_mask):
        if sampled:
            assert scored[index - 1] == pytest.approx(segment.rollout_logprobs[index], abs=2e-3)


def test_observations_are_in_the_sequence_with_loss_mask_zero(episode):
    segment, tokenizer = episode["segment"], episode["tokenizer"]
    observations = tokenizer.decode(segment.turns[1].appended_ids)
    assert "42" in observations  # the calculator's result
    assert "exploded because testing" in observations  # the raising tool, as a message
    assert "could not be parsed" in tokenizer.decode(segment.turns[2].appended_ids)
    for turn in segment.turns[1:]:
        start = turn.offset - len(turn.appended_ids)
        assert segment.loss_mask[start: turn.offset] == [0] * len(turn.appended_ids)


def test_tool_errors_are_recorded_and_counted(episode):
    segment, tools = episode["segment"], episode["tools"]
    outcomes = [(r.name, r.ok, r.error_kind) for r in segment.tools]
    assert outcomes == [("calculator", True, None), ("explode", False, "raised"),
                        ("invalid_tool_call", False, "malformed")]
    assert tools.counts[("explode", "raised")] == 1
    assert tools.counts[("invalid_tool_call", "malformed")] == 1
    assert segment.metadata["tool_errors"] == 2


def test_a_template_delta_equals_a_full_rerender_of_appended_messages(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[0])
    trajectory = TokenTrajectory(tokenizer, [{"role": "user", "content": "hi"}], [calculator.schema()])
    answer = (tokenizer.encode("ok", add_special_tokens=False)
              + [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    trajectory.append_sampled(answer, [-0.5] * len(answer))
    trajectory.append_messages([{"role": "tool", "name": "calculator", "content": "5"}])
    assert trajectory.retokenization_mismatch() is None
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
         {"role": "tool", "name": "calculator", "content": "5"}],
        tools=[calculator.schema()], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert trajectory.tokens == list(full)


def test_a_sampled_split_that_retokenizes_differently_is_reported(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[0])
    trajectory = TokenTrajectory(tokenizer, [{"role": "user", "content": "hi"}])
    word = tokenizer.encode("calculator", add_special_tokens=False)
    assert len(word) == 1, "the probe needs a word the tokenizer merges into one token"
    pieces = [tokenizer.convert_tokens_to_ids(c) for c in tokenizer.convert_ids_to_tokens(word)[0]]
    trajectory.append_sampled(pieces, [-1.0] * len(pieces))  # the model spelled it out letter by letter
    mismatch = trajectory.retokenization_mismatch()
    assert mismatch is not None and mismatch["first_difference"] == trajectory.prompt_length
