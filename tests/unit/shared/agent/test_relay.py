"""The relay example (shared/agent/environments/relay.py): the planner's segment then the solver's, each
sampled under its own adapter, the solver handed the planner's result; each role's reward as the example's
reward functions give it; its dataset as a run reads it (cli/examples.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from rollstream.cli.examples import example_settings
from rollstream.shared.agent.environments.relay import final_answer, first_step, relay, relay_dataset
from rollstream.shared.agent.loop import AgentContext, Limits, Task
from rollstream.shared.agent.tool_calls import get_format
from rollstream.shared.agent.tools import Episode, ToolSet
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.tasks.datasets import load_dataset
from tests.unit.shared.inference.served_models import answering_models

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(),
                                reason="the tiny model is built by make setup")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def run_relay(tokenizer, tmp_path, answers: dict[str, str]):
    """The relay's episode on 'What is 24 + 48 + 26?', each adapter answering with answers[its role]; the
    segments and the prompt each request sent."""
    settings = example_settings("relay", "relay-test", storage_uri=str(tmp_path))
    row = load_dataset(settings.data.path)[0]
    prompts: list[tuple[str, str]] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts.append((body["model"], tokenizer.decode(body["prompt"])))
        answer = tokenizer.encode(answers[body["model"]], add_special_tokens=False) + [tokenizer.eos_token_id]
        choice = {"token_ids": answer, "logprobs": {"token_logprobs": [-0.5] * len(answer)},
                  "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice]})

    async def go():
        roles = RunRoles.of(settings)
        async with FleetClient(["http://vllm"], model="tiny",
                               transport=httpx.MockTransport(answering_models(handle))) as fleet:
            ctx = AgentContext(fleet=fleet, tokenizer=tokenizer, tools=ToolSet([]),
                               tool_format=get_format("hermes"), limits=Limits(max_turns=2),
                               episode=Episode(episode_id="r1"), session_id="r1", roles=roles)
            return await relay(Task(row.messages, row.label, row.metadata), ctx)

    return asyncio.run(go()), prompts, row


def test_the_planner_hands_its_result_to_the_solver_each_on_its_adapter(tokenizer, tmp_path):
    (plan, solve), prompts, row = run_relay(tokenizer, tmp_path, {"planner": "72", "solver": "98"})
    assert [plan.role, solve.role] == ["planner", "solver"]
    assert [model for model, _ in prompts] == ["planner", "solver"]
    assert "What is 24 + 48?" in prompts[0][1] and "What is 72 + 26?" in prompts[1][1]
    assert first_step(plan.response_text, row.label) == 1.0
    assert final_answer(solve.response_text, row.label) == 1.0


def test_a_wrong_first_step_costs_both_and_no_number_ends_the_relay(tokenizer, tmp_path):
    (plan, solve), prompts, row = run_relay(tokenizer, tmp_path, {"planner": "70", "solver": "96"})
    assert "What is 70 + 26?" in prompts[1][1]  # the solver works on what it was handed
    assert first_step(plan.response_text, row.label) == 0.1  # a number, the wrong one
    assert final_answer(solve.response_text, row.label) == 0.1
    segments, prompts, row = run_relay(tokenizer, tmp_path, {"planner": "no idea", "solver": "98"})
    assert [s.role for s in segments] == ["planner"] and len(prompts) == 1
    assert final_answer(segments[0].response_text, row.label) == 0.0


def test_the_relay_example_is_a_lora_run_of_two_roles_with_a_reward_each(tmp_path):
    settings = example_settings("relay", "relay-settings", storage_uri=str(tmp_path))
    assert RunRoles.of(settings).adapters == ("planner", "solver")
    assert settings.roles.names["planner"].reward_function.endswith("relay:first_step")
    assert settings.reward.function.endswith("relay:final_answer")
    rows = load_dataset(settings.data.path)
    assert len(rows) == 1000 and rows == relay_dataset(1000, settings.data.seed)
    with pytest.raises(ValueError, match="no example 'nope'; the examples: relay"):
        example_settings("nope", "x", storage_uri=str(tmp_path))
    with pytest.raises(ValueError, match="a relay label is JSON"):
        final_answer("12", "12")
