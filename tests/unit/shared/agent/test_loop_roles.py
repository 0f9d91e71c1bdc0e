"""An agent loop's roles (shared/agent/loop.py): each segment is sampled under its role's served model (its
LoRA adapter, or the base model) and records its role, each turn the version of that role's policy its
server held; an unknown role is refused before anything is sampled. The fleet is the real FleetClient, its
server a fake that serves the base model and the run's adapters as vLLM does (another model name: 404).

    python -m pytest tests/unit/shared/agent/test_loop_roles.py -q
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from rollstream.shared.agent.loop import AgentContext, Limits, Segment, Task, tool_agent
from rollstream.shared.agent.tool_calls import get_format
from rollstream.shared.agent.tools import Episode, ToolSet, tool
from rollstream.shared.contract.roles import RunRoles, version_field
from rollstream.shared.errors import UnknownRole
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.config import Settings
from tests.unit.shared.inference.served_models import answering_models

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(),
                                reason="the tiny model is built by make setup")
URL = "http://vllm-a"
TASK = Task(messages=[{"role": "user", "content": "What is 2 + 3?"}], label="5")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


class AdapterServer:
    """A vLLM server with LoRA adapters: answers each completion with "done" and the end-of-turn token,
    under any model it serves; `asked` keeps the model each request named. A request for `syncs_during`
    moves that FLEET_VERSIONS field on by one while it is sampled (a weight sync during the turn)."""

    def __init__(self, tokenizer, serves: set[str], versions: dict[str, int]) -> None:
        self.answer = tokenizer.encode("done", add_special_tokens=False) + [tokenizer.eos_token_id]
        self.serves = serves
        self.versions = versions
        self.asked: list[str] = []
        self.syncs_during: dict[str, str] = {}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        model = body.get("model")  # none: the one model the server serves
        if model not in self.serves:
            return httpx.Response(404, json={"error": {"message": f"The model `{model}` does not exist."}})
        self.asked.append(model)
        if model in self.syncs_during:
            self.versions[self.syncs_during[model]] += 1
        choice = {"token_ids": self.answer, "logprobs": {"token_logprobs": [-0.25] * len(self.answer)},
                  "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice]})


def run_loop(tokenizer, settings: Settings | None, versions: dict[str, int], loop, *, role: str | None = None,
             syncs_during: dict[str, str] | None = None, tools: ToolSet | None = None):
    """Runs `loop(task, ctx)` against an AdapterServer serving the run's adapters; (result, server). Without
    settings the context has no roles, and the fleet client names no model."""
    roles = RunRoles.of(settings) if settings is not None else None
    server = AdapterServer(tokenizer, {roles.base_model, *roles.adapters} if roles else {None}, versions)
    server.syncs_during = syncs_during or {}

    async def go():
        async with FleetClient([URL], model=roles.base_model if roles else None,
                               transport=httpx.MockTransport(answering_models(server.handle))) as fleet:
            async def fleet_versions() -> dict[str, int]:
                return dict(versions)

            ctx = AgentContext(fleet=fleet, tokenizer=tokenizer, tools=tools or ToolSet([]),
                               tool_format=get_format("hermes"), limits=Limits(max_turns=2),
                               episode=Episode(episode_id="r1"), session_id="r1",
                               policy_versions=fleet_versions, roles=roles, role=role)
            return await loop(TASK, ctx)

    return asyncio.run(go()), server


def two_adapters() -> Settings:
    return Settings(roles={"names": {"planner": {}, "solver": {}, "judge": {"trained": False}}},
                    train={"lora_rank": 8})


async def plan_then_solve(task: Task, ctx: AgentContext) -> list[Segment]:
    """The planner/solver loop of loop.py's docstring."""
    plan = await tool_agent(task, ctx.as_role("planner"))
    solve = Task([*task.messages, {"role": "assistant", "content": plan.response_text},
                  {"role": "user", "content": "Now carry out the plan."}], task.label, task.metadata)
    solution = await tool_agent(solve, ctx.as_role("solver"), segment_index=1)
    return [plan, solution]


def test_a_planner_then_a_solver_segment_sample_their_adapters_and_record_their_versions(tokenizer):
    versions = {URL: 11, version_field(URL, "planner"): 2, version_field(URL, "solver"): 7}
    (plan, solution), server = run_loop(tokenizer, two_adapters(), versions, plan_then_solve,
                                        syncs_during={"solver": version_field(URL, "solver")})
    assert server.asked == ["planner", "solver"]
    assert [plan.role, solution.role] == ["planner", "solver"]
    assert [plan.status, solution.status] == ["completed", "completed"]
    assert [(t.policy_version, t.policy_version_end) for t in plan.turns] == [(2, 2)]
    # the solver's adapter was synced while its turn was sampled: the turn says so
    assert [(t.policy_version, t.policy_version_end) for t in solution.turns] == [(7, 8)]
    assert plan.turn_policy_versions == [2] and solution.turn_policy_versions == [7]


def test_a_segment_samples_as_the_episodes_role_unless_the_loop_names_another(tokenizer):
    versions = {URL: 11, version_field(URL, "planner"): 2, version_field(URL, "solver"): 7}
    segment, server = run_loop(tokenizer, two_adapters(), versions, tool_agent, role="solver")
    assert (segment.role, server.asked, segment.turn_policy_versions) == ("solver", ["solver"], [7])

    async def as_judge(task, ctx):
        return await tool_agent(task, ctx, role="judge")

    segment, server = run_loop(tokenizer, two_adapters(), versions, as_judge, role="solver")
    # a frozen role is the base model, never synced: version 0 whatever the fleet holds
    assert (segment.role, server.asked, segment.turn_policy_versions) == ("judge", ["tiny"], [0])
    segment, server = run_loop(tokenizer, two_adapters(), versions, tool_agent)
    assert (segment.role, server.asked) == ("planner", ["planner"])  # roles.default: the first role


def test_a_full_fine_tune_samples_the_model_itself_and_records_the_servers_version(tokenizer):
    segment, server = run_loop(tokenizer, Settings(), {URL: 5}, tool_agent)
    assert (segment.role, server.asked, segment.turn_policy_versions) == ("policy", ["tiny"], [5])


def test_a_context_without_roles_samples_the_fleets_own_model_as_before(tokenizer):
    segment, server = run_loop(tokenizer, None, {URL: 5, version_field(URL, "solver"): 9}, tool_agent)
    assert (segment.role, server.asked, segment.turn_policy_versions) == (None, [None], [5])
    with pytest.raises(UnknownRole, match="this context has no roles"):
        run_loop(tokenizer, None, {}, tool_agent, role="solver")


def test_an_unknown_role_is_refused_before_anything_is_sampled_or_started(tokenizer):
    started = []

    @tool
    def probe() -> str:
        """Never called."""
        return ""

    class Watched(ToolSet):
        async def start(self, episode):
            started.append(episode.episode_id)

    async def as_coder(task, ctx):
        return await tool_agent(task, ctx, role="coder")

    with pytest.raises(UnknownRole, match=r"role 'coder' is not one of this run's roles \(planner, solver, "
                                          r"judge"):
        run_loop(tokenizer, two_adapters(), {}, as_coder, tools=Watched([probe]))
    assert started == []

    async def plans_as_coder(task, ctx):
        return ctx.as_role("coder")

    with pytest.raises(UnknownRole, match="role 'coder'"):
        run_loop(tokenizer, two_adapters(), {}, plans_as_coder)
