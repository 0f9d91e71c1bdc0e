"""An episode's roles in the agent-runner, on real Redis: the loop is given the run's roles and the prompt's
role, each segment is published under its role (the episode's where the loop named none), and an episode
that names a role the run does not have is dead-lettered at once with the reason, published nowhere, while
the replica goes on.

    python -m pytest tests/unit/services/agent_runner/test_episode_roles.py -q
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from rollstream.services.agent_runner.main import GROUP, PROMPTS, EpisodeRunner, Replica
from rollstream.shared.agent.loop import AGENTS, AgentContext, Segment
from rollstream.shared.contract.events import DeadLettered, PromptIssued, TrajectorySegment
from rollstream.shared.runtime.config import Settings

AGENT = "roles_under_test"
IDS = {"trajectory_id": "r1", "rollout_id": "r1", "group_id": "g1", "session_id": "r1"}
ROLES = {"roles": {"names": {"planner": {}, "solver": {}}}, "train": {"lora_rank": 8}}


def segment(role: str | None) -> Segment:
    return Segment(tokens=[1, 2], prompt_length=1, loss_mask=[0, 1], rollout_logprobs=[0.0, -0.5],
                   turn_policy_versions=[], status="completed", response_text=str(role), role=role)


@pytest.fixture
def run_prompt(bus, tmp_path, monkeypatch):
    """Runs a prompt naming `role` with `loop` as its agent through a replica, as the agent-runner takes it
    from `prompts`; returns the contexts the loop was given."""
    contexts: list[AgentContext] = []

    def run(loop, role: str | None) -> list[AgentContext]:
        async def agent(task, ctx):
            contexts.append(ctx)
            return loop(ctx)

        monkeypatch.setitem(AGENTS, AGENT, agent)
        settings = Settings(run_id=bus.keys.run_id, storage_uri=str(tmp_path), **ROLES)
        bus.ensure_group(PROMPTS, GROUP.name)
        bus.publish("prompts", PromptIssued(sample_index=0, group_size=1, messages=[{"role": "user",
                                                                                     "content": "go"}],
                                            agent=AGENT, policy_version=0, role=role), **IDS)
        (delivery,) = bus.consume(PROMPTS, GROUP.name, "runner-1", 1)
        runtime = SimpleNamespace(log=logging.getLogger("agent-runner-test"), stopping=False, status={},
                                  not_ready=None)
        runner = EpisodeRunner(settings, bus, fleet=None, tokenizer=None)
        asyncio.run(Replica(settings, runtime, bus, None, runner).handle(delivery))
        return contexts

    return run


def published_roles(bus) -> list[str | None]:
    return [d.event.role for d in bus.read_all("trajectories") if isinstance(d.event, TrajectorySegment)]


def pending(bus) -> int:
    return bus.redis.xpending(bus.keys.stream("prompts"), GROUP.name)["pending"]


def test_each_segment_is_published_under_its_role_and_one_naming_none_under_the_episodes(bus, run_prompt):
    (ctx,) = run_prompt(lambda ctx: [segment("planner"), segment(None), segment("solver")], role="solver")
    assert ctx.role == "solver" and ctx.roles.names == ("planner", "solver") and ctx.roles.lora
    assert published_roles(bus) == ["planner", "solver", "solver"]
    assert pending(bus) == 0


def test_a_prompt_naming_no_role_is_the_run_defaults(bus, run_prompt):
    (ctx,) = run_prompt(lambda ctx: segment(None), role=None)
    assert ctx.role is None and ctx.resolved_role() == "planner"
    assert published_roles(bus) == ["planner"]


@pytest.mark.parametrize(("loop", "role"), [
    (lambda ctx: [segment("planner"), segment("coder")], None),  # a segment the loop made
    (lambda ctx: ctx.as_role("coder"), None),  # a role the loop asked for
    (lambda ctx: segment(None), "coder"),  # the prompt's role
], ids=["segment", "loop", "prompt"])
def test_an_unknown_role_dead_letters_the_prompt_at_once_with_the_reason(bus, run_prompt, loop, role):
    run_prompt(loop, role)
    assert published_roles(bus) == [] and bus.read_all("trajectories") == []
    (dead,) = [d for d in bus.read_all("dead") if isinstance(d.event, DeadLettered)]
    assert dead.event.stream == "prompts" and dead.envelope.rollout_id == "r1"
    assert dead.event.error == ("UnknownRole: role 'coder' is not one of this run's roles (planner, solver; "
                                "roles.names)")
    assert pending(bus) == 0  # not retried: every try would be refused the same
