"""The reward service's group bookkeeping and batching, on real Redis."""

import pytest

from shared.batches import read_batch
from shared.bus import Delivery
from shared.events import GradeReported, TrajectoryFinished, TrajectorySegment, make_envelope
from shared.storage import Storage

from services.reward.main import RewardBook


def deliveries_for(run_id, group, rollout, sample_index, answer, label="7", check=None, group_size=2,
                   segments=1, attempt="a1"):
    ids = dict(run_id=run_id, group_id=group, rollout_id=rollout, trajectory_id=rollout, session_id=rollout)
    out = []
    for index in range(segments):
        segment = TrajectorySegment(segment_index=index, attempt=attempt, tokens=[1, 2, 3 + index], response_length=1,
                                    loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.3], turn_policy_versions=[0],
                                    status="completed", response_text=answer, sample_index=sample_index,
                                    group_size=group_size)
        out.append(Delivery("trajectories", "0-1", make_envelope(segment, **ids)))
    finished = TrajectoryFinished(status="completed", attempt=attempt, segment_count=segments, group_size=group_size,
                                  sample_index=sample_index, response_text=answer, label=label, sandbox_check=check)
    return out + [Delivery("trajectories", "0-2", make_envelope(finished, **ids))]


def grade(run_id, group, rollout, score):
    event = GradeReported(score=score, passed=score == 1.0, reason="exit 0" if score else "exit 1", duration_s=0.1)
    return Delivery("grades", "0-3", make_envelope(event, run_id=run_id, group_id=group, rollout_id=rollout))


def feed(book, deliveries):
    completed = []
    for d in deliveries:
        group = book.record(d)
        if group and book.complete_if_ready(group):
            completed.append(group)
    return completed


def test_group_completes_once_with_grpo_advantages_and_batches_whole_groups(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=4)
    first = deliveries_for(run, "g1", "r1", 0, "7") + deliveries_for(run, "g1", "r2", 1, "nothing")
    assert feed(book, first[:3]) == []  # r2 not finished yet
    assert feed(book, first[3:]) == ["g1"]
    assert feed(book, first) == []  # a re-delivery changes nothing
    rewards = {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")}
    assert rewards["r1"].reward == 1.0 and rewards["r2"].reward == 0.0
    assert rewards["r1"].advantage > 0 > rewards["r2"].advantage
    assert book.flush_batches(run) == []  # 2 of 4 rollouts

    second = deliveries_for(run, "g2", "r3", 2, "3", check="test 1") + deliveries_for(run, "g2", "r4", 3, "x", check="x")
    assert feed(book, second) == []  # waits for the sandbox grades
    assert feed(book, [grade(run, "g2", "r3", 1.0), grade(run, "g2", "r4", 0.0)]) == ["g2"]
    (batch,) = book.flush_batches(run)
    assert batch.group_ids == ["g1", "g2"] and batch.sample_count == 4
    rows = read_batch(book.storage, batch.uri)
    assert [r.rollout_id for r in rows] == ["r1", "r2", "r3", "r4"]
    assert [r.reward for r in rows] == [1.0, 0.0, 1.0, 0.0]
    assert rows[0].tokens == [1, 2, 3] and rows[0].loss_mask == [0, 0, 1]
    assert book.flush_batches(run) == []
    assert [d.event.batch_id for d in bus.read_all("batches")] == [batch.batch_id]


def test_fan_out_rollouts_get_one_advantage_computed_over_rollouts_not_segments(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=3)
    deliveries = (deliveries_for(run, "g", "r1", 0, "7", group_size=3, segments=3)
                  + deliveries_for(run, "g", "r2", 1, "7", group_size=3, segments=1)
                  + deliveries_for(run, "g", "r3", 2, "nope", group_size=3, segments=1))
    assert feed(book, deliveries) == ["g"]
    (batch,) = book.flush_batches(run)
    rows = read_batch(book.storage, batch.uri)
    assert [(r.rollout_id, r.segment_index) for r in rows] == [("r1", 0), ("r1", 1), ("r1", 2), ("r2", 0),
                                                                ("r3", 0)]
    advantage = {r.rollout_id: r.advantage for r in rows}
    assert all(r.advantage == advantage[r.rollout_id] for r in rows)
    # rewards 1, 1, 0 over three rollouts: mean 2/3, so r1 and r2 get the same positive advantage
    assert advantage["r1"] == advantage["r2"] > 0 > advantage["r3"]
    assert abs(sum(advantage.values())) < 1e-5
    assert abs(sum(r.advantage for r in rows)) > 0.1  # per-segment normalisation would have differed


def test_only_the_first_finished_attempt_of_a_rollout_is_batched(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    first = deliveries_for(run, "g", "r1", 0, "7", segments=1, attempt="first")
    # the prompt was reclaimed and ran again: two segments this time, published after the first attempt
    second = deliveries_for(run, "g", "r1", 0, "7", segments=2, attempt="second")
    other = deliveries_for(run, "g", "r2", 1, "3")
    assert feed(book, first + second + other) == ["g"]
    (batch,) = book.flush_batches(run)
    rows = read_batch(book.storage, batch.uri)
    assert [(r.rollout_id, r.segment_index) for r in rows] == [("r1", 0), ("r2", 0)]


def test_dr_grpo_advantages_are_reward_minus_the_group_mean(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=3, advantage_estimator="dr_grpo")
    deliveries = (deliveries_for(run, "g", "r1", 0, "7", group_size=3)
                  + deliveries_for(run, "g", "r2", 1, "8", group_size=3)
                  + deliveries_for(run, "g", "r3", 2, "none", group_size=3))
    assert feed(book, deliveries) == ["g"]
    rewards = {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")}
    mean = (1.0 + 0.1 + 0.0) / 3
    assert {r: e.advantage for r, e in rewards.items()} == pytest.approx({"r1": 1 - mean, "r2": 0.1 - mean,
                                                                          "r3": -mean})
    (batch,) = book.flush_batches(run)
    assert [r.advantage for r in read_batch(book.storage, batch.uri)] == pytest.approx([1 - mean, 0.1 - mean, -mean])


def test_a_group_with_one_reward_for_all_is_recorded_but_not_batched_when_filtering(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, filter_zero_variance=True)
    same = deliveries_for(run, "g1", "r1", 0, "7") + deliveries_for(run, "g1", "r2", 1, "the answer is 7")
    assert feed(book, same) == ["g1"]
    assert feed(book, same) == []  # a re-delivery neither completes nor counts it again
    rewards = {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")}
    assert {r: (e.reward, e.advantage, e.source) for r, e in rewards.items()} == {
        "r1": (1.0, 0.0, "exact_match"), "r2": (1.0, 0.0, "exact_match")}
    assert book.flush_batches(run) == []
    assert int(bus.redis.get(bus.keys.filtered)) == 2 and book.filtered_groups() == 1
    assert not bus.redis.exists(book.group_key("g1"))

    mixed = deliveries_for(run, "g2", "r3", 2, "7") + deliveries_for(run, "g2", "r4", 3, "nope")
    assert feed(book, mixed) == ["g2"]
    (batch,) = book.flush_batches(run)
    assert batch.group_ids == ["g2"]
    assert [r.rollout_id for r in read_batch(book.storage, batch.uri)] == ["r3", "r4"]
    assert int(bus.redis.get(bus.keys.filtered)) == 2 and book.filtered_groups() == 1


def test_without_filtering_a_group_with_one_reward_for_all_is_batched(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    assert feed(book, deliveries_for(run, "g", "r1", 0, "1") + deliveries_for(run, "g", "r2", 1, "2")) == ["g"]
    (batch,) = book.flush_batches(run)
    assert [r.advantage for r in read_batch(book.storage, batch.uri)] == [0.0, 0.0]
    assert bus.redis.get(bus.keys.filtered) is None and book.filtered_groups() == 0
