"""What the agent-runner publishes for an episode, on real Redis: an agent that returns two segments stands in
for the model, and the trajectory's events are read back, ids and payloads, as the reward service reads them.

    python -m pytest tests/unit/services/agent_runner/test_episode_runner.py -q
"""

from __future__ import annotations

import asyncio

import pytest

from rollstream.services.agent_runner.main import EpisodeRunner
from rollstream.shared.agent.loop import AGENTS, Segment
from rollstream.shared.contract.bus import Delivery
from rollstream.shared.contract.events import (
    PromptIssued,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
    make_envelope,
)
from rollstream.shared.runtime.config import Settings

IDS = {"trajectory_id": "t9", "rollout_id": "r9", "group_id": "g9", "session_id": "s9"}
GRADER = {"kind": "harbor", "task_dir": "/data/tasks/fix-add"}
AGENT = "two_fixed_segments"


def turn(offset: int, appended: list[int], response: list[int], server: str, version: int) -> TrajectoryTurn:
    # turn 9 of segment 7: a published turn is numbered by its place in the rollout, whatever the agent said
    return TrajectoryTurn(turn=9, segment_index=7, offset=offset, appended_ids=appended,
                          response_ids=response, logprobs=[-0.5] * len(response), policy_version=version,
                          policy_version_end=version + 1, finish_reason="stop", server_url=server)


def two_segments() -> list[Segment]:
    compacted = Segment(tokens=[1, 2, 3, 4, 5, 6], prompt_length=2, loss_mask=[0, 0, 1, 0, 1, 1],
                        rollout_logprobs=[0.0, 0.0, -0.5, 0.0, -0.5, -0.5], turn_policy_versions=[1, 1],
                        status="completed", response_text="half way",
                        turns=[turn(2, [1, 2], [3], "http://a", 1), turn(4, [4], [5, 6], "http://a", 1)],
                        tools=[TrajectoryTool(turn=0, call_id="c1", name="calc",
                                              arguments={"e": "2+3"}, ok=True, error_kind=None, content="5")],
                        metadata={"compacted": True, "shared": "segment's"})
    final = Segment(tokens=[1, 9, 8], prompt_length=2, loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.5],
                    turn_policy_versions=[2], status="truncated", response_text="5",
                    turns=[turn(2, [1, 9], [8], "http://b", 2)],
                    metadata={"shared": "final's", "artifacts": {"diff": "runs/r9.diff"},
                              "error": "out of turns"})
    return [compacted, final]


@pytest.fixture
def published(bus, tmp_path, monkeypatch):
    async def agent(task, ctx):
        return two_segments()

    monkeypatch.setitem(AGENTS, AGENT, agent)
    prompt = PromptIssued(sample_index=5, group_size=4,
                          messages=[{"role": "user", "content": "2+3?"}], label="5", reward_fn="exact_match",
                          sandbox_check="test -f done", agent=AGENT, policy_version=1,
                          metadata={"grader": GRADER, "shared": "prompt's", "source": "unit"})
    delivery = Delivery("prompts", "1-0", make_envelope(prompt, run_id=bus.keys.run_id, **IDS))
    settings = Settings(run_id=bus.keys.run_id, storage_uri=str(tmp_path))
    asyncio.run(EpisodeRunner(settings, bus, fleet=None, tokenizer=None).run(delivery))
    return bus.read_all("trajectories")


def test_every_event_of_the_episode_is_published_once_with_its_idempotency_id(published):
    started = published[0].envelope.event_id
    rollout, attempt, _ = started.split(":")
    assert rollout == "r9" and len(attempt) == 12
    prefix = f"r9:{attempt}"
    assert [d.envelope.event_id for d in published] == [
        f"{prefix}:started", f"{prefix}:turn:0:0", f"{prefix}:turn:0:1", f"{prefix}:tool:0:c1",
        f"{prefix}:segment:0", f"{prefix}:turn:1:0", f"{prefix}:segment:1", f"{prefix}:finished"]
    for delivery in published:
        assert {name: getattr(delivery.envelope, name) for name in IDS} == IDS


def test_the_events_carry_the_segments_and_the_prompts_grading(published):
    attempt = published[0].envelope.event_id.split(":")[1]
    events = [d.event for d in published]
    assert events == [
        TrajectoryStarted(sample_index=5, server_url="http://b"),  # the final segment's first server
        TrajectoryTurn(turn=0, segment_index=0, offset=2, appended_ids=[1, 2], response_ids=[3],
                       logprobs=[-0.5], policy_version=1, policy_version_end=2, finish_reason="stop",
                       server_url="http://a"),
        TrajectoryTurn(turn=1, segment_index=0, offset=4, appended_ids=[4], response_ids=[5, 6],
                       logprobs=[-0.5] * 2, policy_version=1, policy_version_end=2, finish_reason="stop",
                       server_url="http://a"),
        TrajectoryTool(turn=0, call_id="c1", name="calc", arguments={"e": "2+3"}, ok=True, error_kind=None,
                       content="5"),
        TrajectorySegment(segment_index=0, attempt=attempt, tokens=[1, 2, 3, 4, 5, 6], response_length=4,
                          loss_mask=[0, 0, 1, 0, 1, 1], rollout_logprobs=[0.0, 0.0, -0.5, 0.0, -0.5, -0.5],
                          turn_policy_versions=[1, 1], status="completed", response_text="half way",
                          sample_index=5, group_size=4, metadata={"grader": GRADER, "shared": "segment's",
                                                                  "source": "unit",
                                                  "compacted": True}, role="policy"),
        TrajectoryTurn(turn=0, segment_index=1, offset=2, appended_ids=[1, 9], response_ids=[8],
                       logprobs=[-0.5], policy_version=2, policy_version_end=3, finish_reason="stop",
                       server_url="http://b"),
        TrajectorySegment(segment_index=1, attempt=attempt, tokens=[1, 9, 8], response_length=1,
                          loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.5], turn_policy_versions=[2],
                          status="truncated", response_text="5", sample_index=5, group_size=4,
                          metadata={"grader": GRADER, "shared": "final's", "source": "unit",
                                    "artifacts": {"diff": "runs/r9.diff"}, "error": "out of turns"},
                          role="policy"),  # the run's one role, by name: the segments named none
        TrajectoryFinished(status="truncated", attempt=attempt, segment_count=2, group_size=4, sample_index=5,
                           sandbox_check="test -f done", grader=GRADER, response_text="5", label="5",
                           reward_fn="exact_match", reward=None, artifacts={"diff": "runs/r9.diff"},
                           error="out of turns"),
    ]
