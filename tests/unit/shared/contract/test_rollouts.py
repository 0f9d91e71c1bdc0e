"""Publishing a rollout on real Redis (and Valkey): the events and their ids, and one transaction for all
of them.

    python -m pytest tests/unit/shared/contract/test_rollouts.py -q
"""

from __future__ import annotations

import pydantic
import pytest
import redis

from rollstream.shared.contract.events import (
    SampleGrading,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
)
from rollstream.shared.contract.rollouts import RolloutFinish, Segment, publish_rollout

IDS = {"trajectory_id": "t1", "rollout_id": "r1", "group_id": "g1", "session_id": "s1"}
GRADING = SampleGrading(sample_index=2, group_size=4, label="5", reward_fn="exact_match",
                        sandbox_check="true", grader={"kind": "harbor", "task_dir": "/tasks/t"})
FINISH = RolloutFinish(status="completed", response_text="5", reward=1.0, artifacts={"diff": "d"}, error=None)


def turn(number: int, segment_index: int, offset: int, appended: int) -> TrajectoryTurn:
    return TrajectoryTurn(turn=number, segment_index=segment_index, offset=offset,
                          appended_ids=[1] * appended, response_ids=[2], logprobs=[-0.5], policy_version=3,
                          policy_version_end=3, finish_reason="stop", server_url="http://vllm")


def segment(turns: list[TrajectoryTurn], tools: tuple[TrajectoryTool, ...] = (), **metadata) -> Segment:
    tokens = [t for each in turns for t in each.appended_ids + each.response_ids]
    mask = [m for each in turns for m in [0] * len(each.appended_ids) + [1]]
    return Segment(tokens=tokens, prompt_length=len(turns[0].appended_ids), loss_mask=mask,
                   rollout_logprobs=[-0.5 if m else 0.0 for m in mask],
                   turn_policy_versions=[3] * len(turns), status="completed", response_text="5", turns=turns,
                   tools=list(tools), metadata=metadata)


def two_segments() -> list[Segment]:
    call = TrajectoryTool(turn=0, call_id="call-a", name="calc", arguments={}, ok=True, content="5")
    # turns numbered as their producer liked: the events number them by their place in the rollout
    return [segment([turn(5, 9, 2, 2), turn(6, 9, 4, 1)], [call], kept="segment's"),
            segment([turn(0, 0, 1, 1)])]


def publish(bus, segments: list[Segment], pipe=None, grading=GRADING) -> tuple[str, object]:
    pipe = pipe or bus.redis.pipeline(transaction=True)
    attempt = publish_rollout(bus, pipe, IDS, grading, segments, FINISH,
                              metadata={"kept": "rollout's", "task": 1}, server_url="http://vllm")
    return attempt, pipe


def test_every_event_id_names_the_rollout_the_attempt_and_the_events_place(bus):
    attempt, pipe = publish(bus, two_segments())
    pipe.execute()
    published = bus.read_all("trajectories")
    prefix = f"r1:{attempt}"
    assert [d.envelope.event_id for d in published] == [
        f"{prefix}:started", f"{prefix}:turn:0:0", f"{prefix}:turn:0:1", f"{prefix}:tool:0:call-a",
        f"{prefix}:segment:0", f"{prefix}:turn:1:0", f"{prefix}:segment:1", f"{prefix}:finished"]
    assert all({name: getattr(d.envelope, name) for name in IDS} == IDS for d in published)
    turns = [d.event for d in published if isinstance(d.event, TrajectoryTurn)]
    assert [(t.segment_index, t.turn, t.offset) for t in turns] == [(0, 0, 2), (0, 1, 4), (1, 0, 1)]
    started, finished = published[0].event, published[-1].event
    assert started == TrajectoryStarted(sample_index=2, server_url="http://vllm")
    assert finished == TrajectoryFinished(**dict(GRADING), status="completed", attempt=attempt,
                                          segment_count=2, response_text="5", reward=1.0,
                                          artifacts={"diff": "d"})
    segments = [d.event for d in published if isinstance(d.event, TrajectorySegment)]
    assert [(s.segment_index, s.attempt, s.sample_index, s.group_size) for s in segments] == [
        (0, attempt, 2, 4), (1, attempt, 2, 4)]
    assert segments[0].response_length == 3 and segments[0].tokens == [1, 1, 2, 1, 2]
    assert segments[0].metadata == {"kept": "segment's", "task": 1}  # a segment's own metadata wins
    assert segments[1].metadata == {"kept": "rollout's", "task": 1}


def test_each_segment_carries_its_role_and_one_without_belongs_to_the_default(bus):
    planner, solver = two_segments()
    planner.role = "planner"
    attempt, pipe = publish(bus, [planner, solver])
    pipe.execute()
    segments = [d.event for d in bus.read_all("trajectories") if isinstance(d.event, TrajectorySegment)]
    assert [s.role for s in segments] == ["planner", None]


def test_each_publication_is_an_attempt_of_its_own(bus):
    first, pipe = publish(bus, two_segments())
    second, _ = publish(bus, two_segments(), pipe=pipe)
    pipe.execute()
    assert first != second
    finished = [d.event for d in bus.read_all("trajectories") if isinstance(d.event, TrajectoryFinished)]
    assert [f.attempt for f in finished] == [first, second]


def test_only_the_sample_grading_fields_of_a_richer_model_are_read(bus):
    class Spec(SampleGrading):
        session_id: str

    attempt, pipe = publish(bus, two_segments(), grading=Spec(**dict(GRADING), session_id="s1"))
    pipe.execute()
    assert bus.read_all("trajectories")[-1].event.grader == GRADING.grader


def test_nothing_is_published_until_the_transaction_runs_and_nothing_when_it_fails(bus, redis_url):
    watched = bus.keys.state("test", "session")
    pipe = bus.redis.pipeline(transaction=True)
    pipe.watch(watched)
    pipe.multi()
    publish(bus, two_segments(), pipe=pipe)
    assert bus.redis.xlen(bus.keys.stream("trajectories")) == 0  # queued, not sent
    other = redis.Redis.from_url(redis_url)
    other.set(watched, "changed meanwhile")  # e.g. a session finished by another replica
    other.close()
    with pytest.raises(redis.WatchError):
        pipe.execute()
    assert bus.redis.xlen(bus.keys.stream("trajectories")) == 0


def test_a_rollout_that_cannot_be_published_leaves_nothing_behind(bus):
    broken = two_segments()
    broken[1].loss_mask = broken[1].loss_mask[:-1]  # misaligned with its tokens: no TrajectorySegment
    pipe = bus.redis.pipeline(transaction=True)
    with pytest.raises(pydantic.ValidationError, match="must have the same length"):
        publish(bus, broken, pipe=pipe)
    pipe.reset()
    assert bus.redis.xlen(bus.keys.stream("trajectories")) == 0
