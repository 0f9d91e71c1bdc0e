"""What the gateway publishes when a session finishes, on real Redis: each leaf's chain of turn nodes is one
segment of the session's rollout, with the same events and idempotency ids an agent-runner episode has.

    python -m pytest tests/unit/services/gateway/test_samples.py -q
"""

from __future__ import annotations

import asyncio

from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import ROOT, SessionSpec, TurnNode
from rollstream.shared.contract.events import (
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTurn,
)
from tests.unit.services.gateway.stores import session_store

GRADER = {"kind": "swebench", "instance_id": "x__y-1"}


def node(parent: str, appended: list[int], response: list[int], text: str, created_at: float, *,
         server: str = "http://vllm-a", rewritten: bool = False) -> TurnNode:
    return TurnNode(parent=parent, appended_ids=appended, response_ids=response,
                    logprobs=[-0.25] * len(response), policy_version=4, policy_version_end=5,
                    finish_reason="stop", server_url=server, response_text=text, created_at=created_at,
                    history_rewritten=rewritten)


def finish(bus, redis_url, **finished) -> tuple[list, str]:
    """A session of two conversations (the second a fork of the first's first turn), finished; its events
    and the attempt they share."""
    spec = SessionSpec(rollout_id="r3", group_id="g3", trajectory_id="t3", session_id="s3", sample_index=6,
                       group_size=2, label="42", reward_fn="numeric_match", sandbox_check=None, grader=GRADER,
                       metadata={"task": "fix"}, sampling={"seed": 11})

    async def scenario():
        async with session_store(bus, redis_url) as store:
            session, _ = await store.create(spec)
            assert await store.add_turn("s3", "a", node(ROOT, [1, 2], [3, 4], "first", 1.0, server=""))
            assert await store.add_turn("s3", "b", node("a", [5], [6], "second", 2.0, rewritten=True))
            forked = node("a", [7, 8], [9], "forked", 3.0, server="http://vllm-b")
            assert await store.add_turn("s3", "c", forked)
            assert store.finish("s3", lambda pipe, samples: publish_samples(bus, pipe, session, samples,
                                                                            **finished))

    asyncio.run(scenario())
    published = bus.read_all("trajectories")
    return published, published[0].envelope.event_id.split(":")[1]


def test_a_finished_session_publishes_its_leaves_as_one_rollout_with_idempotency_ids(bus, redis_url):
    published, attempt = finish(bus, redis_url, status="truncated", reward=0.5, response_text=None,
                                artifacts={"diff": "runs/r3.diff"}, error=None)
    prefix = f"r3:{attempt}"
    assert [d.envelope.event_id for d in published] == [
        f"{prefix}:started", f"{prefix}:turn:0:0", f"{prefix}:turn:0:1", f"{prefix}:segment:0",
        f"{prefix}:turn:1:0", f"{prefix}:turn:1:1", f"{prefix}:segment:1", f"{prefix}:finished"]
    ids = {"trajectory_id": "t3", "rollout_id": "r3", "group_id": "g3", "session_id": "s3"}
    assert all({name: getattr(d.envelope, name) for name in ids} == ids for d in published)

    metadata = {"task": "fix", "gateway_session": "s3", "conversations": 2, "sampling_seed": 11}
    first = TrajectoryTurn(turn=0, segment_index=0, offset=2, appended_ids=[1, 2], response_ids=[3, 4],
                           logprobs=[-0.25] * 2, policy_version=4, policy_version_end=5, finish_reason="stop",
                           server_url="")
    assert [d.event for d in published] == [
        TrajectoryStarted(sample_index=6, server_url=None),  # the first node's server, where it has one
        first,
        TrajectoryTurn(turn=1, segment_index=0, offset=5, appended_ids=[5], response_ids=[6],
                       logprobs=[-0.25], policy_version=4, policy_version_end=5, finish_reason="stop",
                       server_url="http://vllm-a"),
        TrajectorySegment(segment_index=0, attempt=attempt, tokens=[1, 2, 3, 4, 5, 6], response_length=4,
                          loss_mask=[0, 0, 1, 1, 0, 1],
                          rollout_logprobs=[0.0, 0.0, -0.25, -0.25, 0.0, -0.25], turn_policy_versions=[4, 4],
                          status="completed", response_text="second", sample_index=6, group_size=2,
                          metadata={**metadata, "history_rewritten_turns": [1]}),
        first.model_copy(update={"segment_index": 1}),
        TrajectoryTurn(turn=1, segment_index=1, offset=6, appended_ids=[7, 8], response_ids=[9],
                       logprobs=[-0.25], policy_version=4, policy_version_end=5, finish_reason="stop",
                       server_url="http://vllm-b"),
        TrajectorySegment(segment_index=1, attempt=attempt, tokens=[1, 2, 3, 4, 7, 8, 9], response_length=5,
                          loss_mask=[0, 0, 1, 1, 0, 0, 1],
                          rollout_logprobs=[0.0, 0.0, -0.25, -0.25, 0.0, 0.0, -0.25],
                          turn_policy_versions=[4, 4], status="truncated", response_text="forked",
                          sample_index=6, group_size=2, metadata=metadata),
        TrajectoryFinished(status="truncated", attempt=attempt, segment_count=2, group_size=2, sample_index=6,
                           sandbox_check=None, grader=GRADER, response_text="forked", label="42",
                           reward_fn="numeric_match", reward=0.5, artifacts={"diff": "runs/r3.diff"},
                           error=None),
    ]


def test_the_finish_may_name_the_final_answer_and_the_error(bus, redis_url):
    published, _ = finish(bus, redis_url, status="failed", reward=None, response_text="the answer",
                          artifacts={}, error="boom")
    finished = published[-1].event
    assert isinstance(finished, TrajectoryFinished)
    assert (finished.status, finished.response_text, finished.error, finished.reward) == (
        "failed", "the answer", "boom", None)
    assert published[-2].event.response_text == "forked"  # the segment keeps its own last answer
