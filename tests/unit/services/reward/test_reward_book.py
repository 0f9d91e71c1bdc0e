"""The reward service's group bookkeeping and batching, on real Redis."""

import time

import pytest

from rollstream.services.reward import book as book_module
from rollstream.services.reward.book import RewardBook
from rollstream.shared.contract import codec
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import Bus, Delivery
from rollstream.shared.contract.events import (
    DeadLettered,
    GradeReported,
    GradingFailed,
    RewardAssigned,
    RolloutDropped,
    TrajectoryFinished,
    TrajectorySegment,
    make_envelope,
)
from rollstream.shared.runtime.storage import Storage


def deliveries_for(run_id, group, rollout, sample_index, answer, label="7", check=None, group_size=2,
                   segments=1, attempt="a1", status="completed", reward=None):
    ids = dict(run_id=run_id, group_id=group, rollout_id=rollout, trajectory_id=rollout, session_id=rollout)
    out = []
    for index in range(segments):
        segment = TrajectorySegment(segment_index=index, attempt=attempt, tokens=[1, 2, 3 + index],
                                    response_length=1, loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.3],
                                    turn_policy_versions=[0], status=status, response_text=answer,
                                    sample_index=sample_index, group_size=group_size)
        out.append(Delivery("trajectories", "0-1", make_envelope(segment, **ids)))
    finished = TrajectoryFinished(status=status, attempt=attempt, segment_count=segments,
                                  group_size=group_size, sample_index=sample_index, response_text=answer,
                                  label=label, sandbox_check=check, reward=reward)
    return out + [Delivery("trajectories", "0-2", make_envelope(finished, **ids))]


def pair(run_id, group, first, answers, check=None):
    """Both rollouts of a group of two, r<first> and r<first+1>, the run's samples first-1 and first."""
    return [d for i, answer in enumerate(answers)
            for d in deliveries_for(run_id, group, f"r{first + i}", first - 1 + i, answer, check=check)]


def grade(run_id, group, rollout, score):
    event = GradeReported(score=score, passed=score == 1.0, reason="exit 0" if score else "exit 1",
                          duration_s=0.1)
    return Delivery("grades", "0-3", make_envelope(event, run_id=run_id, group_id=group, rollout_id=rollout))


def grading_failed(run_id, group, rollout):
    event = GradingFailed(reason="grading failed and no retry is left: BackendUnavailable: no engine",
                          attempts=4)
    return Delivery("grades", "0-3", make_envelope(event, run_id=run_id, group_id=group, rollout_id=rollout))


def feed(book, deliveries):
    completed = []
    for d in deliveries:
        group = book.record(d)
        if group and book.complete_if_ready(group):
            completed.append(group)
    return completed


def serve(book, deliveries):
    """Handle deliveries as the service does (record, complete, flush after each); returns the batches."""
    batches = []
    for d in deliveries:
        group = book.record(d)
        if group:
            book.complete_if_ready(group)
        batches.extend(book.flush_batches(book.bus.keys.run_id))
    return batches


def assigned_events(bus):
    return {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")
            if isinstance(d.event, RewardAssigned)}


def assigned(bus):
    return {d.envelope.rollout_id: (d.event.reward, d.event.advantage, d.event.source)
            for d in bus.read_all("rewards") if isinstance(d.event, RewardAssigned)}


def answer_length(response: str, label: str | None) -> float:
    """A reward function outside the package, loaded by its import path (reward.function)."""
    return float(len(response))


@pytest.fixture
def replay_bus(bus):
    """A second run on the same server, to handle the same events again."""
    other = Bus(bus.redis, f"{bus.keys.run_id}-replay", bus.settings)
    yield other
    other.delete_run()


def four_groups(run):
    """(trajectories, grades): four groups finishing in the order g1..g4; g1 and g3 are graded in a
    sandbox."""
    trajectories = (pair(run, "g1", 1, ("3", "4"), check="test") + pair(run, "g2", 3, ("7", "nope"))
                    + pair(run, "g3", 5, ("5", "6"), check="test") + pair(run, "g4", 7, ("x", "7")))
    grades = {"g1": [grade(run, "g1", "r1", 1.0), grade(run, "g1", "r2", 0.0)],
              "g3": [grade(run, "g3", "r5", 0.0), grade(run, "g3", "r6", 1.0)]}
    return trajectories, grades


def graded_as_they_finish(run):
    trajectories, grades = four_groups(run)
    return trajectories[:4] + grades["g1"] + trajectories[4:12] + grades["g3"] + trajectories[12:]


def graded_late_in_reverse(run):
    trajectories, grades = four_groups(run)
    return trajectories + grades["g3"] + grades["g1"]


def test_group_completes_once_with_grpo_advantages_and_batches_whole_groups(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=4)
    first = deliveries_for(run, "g1", "r1", 0, "7") + deliveries_for(run, "g1", "r2", 1, "nothing")
    assert feed(book, first[:3]) == []  # r2 not finished yet
    assert feed(book, first[3:]) == ["g1"]
    assert feed(book, first) == []  # a re-delivery changes nothing
    rewards = assigned_events(bus)
    assert rewards["r1"].reward == 1.0 and rewards["r2"].reward == 0.0
    assert rewards["r1"].advantage > 0 > rewards["r2"].advantage
    assert book.flush_batches(run) == []  # 2 of 4 rollouts

    second = (deliveries_for(run, "g2", "r3", 2, "3", check="test 1")
              + deliveries_for(run, "g2", "r4", 3, "x", check="x"))
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
    rewards = assigned_events(bus)
    mean = (1.0 + 0.1 + 0.0) / 3
    assert {r: e.advantage for r, e in rewards.items()} == pytest.approx({"r1": 1 - mean, "r2": 0.1 - mean,
                                                                          "r3": -mean})
    (batch,) = book.flush_batches(run)
    assert [r.advantage for r in read_batch(book.storage, batch.uri)] == pytest.approx(
        [1 - mean, 0.1 - mean, -mean])


def test_a_group_with_one_reward_for_all_is_recorded_but_not_batched_when_filtering(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, filter_zero_variance=True)
    same = deliveries_for(run, "g1", "r1", 0, "7") + deliveries_for(run, "g1", "r2", 1, "the answer is 7")
    assert feed(book, same) == ["g1"]
    assert feed(book, same) == []  # a re-delivery neither completes nor counts it again
    rewards = assigned_events(bus)
    assert {r: (e.reward, e.advantage, e.source) for r, e in rewards.items()} == {
        "r1": (1.0, 0.0, "exact_match"), "r2": (1.0, 0.0, "exact_match")}
    assert book.flush_batches(run) == []
    assert int(bus.redis.get(bus.keys.filtered)) == 2 and book.filtered_groups() == 1
    assert not bus.redis.exists(bus.keys.reward.group("g1"))

    mixed = deliveries_for(run, "g2", "r3", 2, "7") + deliveries_for(run, "g2", "r4", 3, "nope")
    assert feed(book, mixed) == ["g2"]
    (batch,) = book.flush_batches(run)
    assert batch.group_ids == ["g2"]
    assert [r.rollout_id for r in read_batch(book.storage, batch.uri)] == ["r3", "r4"]
    assert int(bus.redis.get(bus.keys.filtered)) == 2 and book.filtered_groups() == 1


def test_without_filtering_a_group_with_one_reward_for_all_is_batched(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    both = deliveries_for(run, "g", "r1", 0, "1") + deliveries_for(run, "g", "r2", 1, "2")
    assert feed(book, both) == ["g"]
    (batch,) = book.flush_batches(run)
    assert [r.advantage for r in read_batch(book.storage, batch.uri)] == [0.0, 0.0]
    assert bus.redis.get(bus.keys.filtered) is None and book.filtered_groups() == 0


def test_in_finish_order_batches_do_not_depend_on_when_grades_arrive(bus, replay_bus, tmp_path):
    first = RewardBook(bus, Storage(str(tmp_path / "first")), batch_size=4)
    replay = RewardBook(replay_bus, Storage(str(tmp_path / "replay")), batch_size=4)
    batches = serve(first, graded_as_they_finish(bus.keys.run_id))
    replayed = serve(replay, graded_late_in_reverse(replay_bus.keys.run_id))

    # the groups completed in another order ...
    assert list(assigned(bus)) == ["r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8"]
    assert list(assigned(replay_bus)) == ["r3", "r4", "r7", "r8", "r5", "r6", "r1", "r2"]
    # ... and still made the same batches, of the same rows, with the same rewards
    assert [b.group_ids for b in batches] == [["g1", "g2"], ["g3", "g4"]]
    assert [b.batch_id for b in replayed] == [b.batch_id for b in batches]
    for batch, again in zip(batches, replayed):
        assert read_batch(replay.storage, again.uri) == read_batch(first.storage, batch.uri)
    assert assigned(replay_bus) == assigned(bus)
    assert assigned(bus)["r1"] == (1.0, pytest.approx(1.0, abs=1e-4), "sandbox")


def test_in_completion_order_a_group_that_completes_first_is_batched_first(bus, tmp_path):
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=4, batch_order="completed")
    batches = serve(book, graded_late_in_reverse(bus.keys.run_id))
    assert [b.group_ids for b in batches] == [["g2", "g4"], ["g3", "g1"]]


def test_a_group_waiting_for_a_grade_holds_back_the_groups_that_finished_after_it(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    waiting = pair(run, "g1", 1, ("3", "4"), check="test")
    later = pair(run, "g2", 3, ("7", "nope"))
    assert feed(book, waiting + later) == ["g2"]
    assert set(assigned(bus)) == {"r3", "r4"}  # its rewards are out, but it is not batched ahead of g1
    assert book.flush_batches(run) == []
    assert book.status() == {"groups_filtered": 0, "rollouts_dropped": {}, "groups_waiting_in_order": 2,
                             "groups_awaiting_grades": 1}
    assert feed(book, [grade(run, "g1", "r1", 0.0)]) == [] and book.flush_batches(run) == []
    assert feed(book, [grade(run, "g1", "r2", 1.0)]) == ["g1"]
    assert [b.group_ids for b in book.flush_batches(run)] == [["g1"], ["g2"]]


def test_a_filtered_group_keeps_its_place_in_finish_order_without_being_batched(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, filter_zero_variance=True)
    waiting = pair(run, "g1", 1, ("3", "4"), check="test")
    same = pair(run, "g2", 3, ("7", "7"))
    mixed = pair(run, "g3", 5, ("7", "nope"))
    assert serve(book, waiting + same + mixed) == []
    assert book.filtered_groups() == 1  # counted when it completes, as its slots can be admitted again
    batches = serve(book, [grade(run, "g1", "r1", 0.0), grade(run, "g1", "r2", 1.0)])
    assert [b.group_ids for b in batches] == [["g1"], ["g3"]]
    assert book.flush_batches(run) == [] and book.filtered_groups() == 1


def test_a_completed_group_is_remembered_by_an_expiring_marker_not_a_growing_set(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, done_ttl_s=600)

    def without_expiry():
        return {k for k in bus.redis.scan_iter(match=f"{bus.keys.prefix}:*") if bus.redis.ttl(k) == -1}

    g1 = pair(run, "g1", 1, ("7", "3"))
    assert len(serve(book, g1)) == 1
    assert feed(book, g1[-1:]) == []  # a late redelivery of its last TrajectoryFinished ...
    assert not bus.redis.exists(bus.keys.reward.group("g1"))  # ... opens no group again
    assert book.flush_batches(run) == [] and len(bus.read_all("rewards")) == 2
    assert 0 < bus.redis.ttl(bus.keys.reward.done("g1")) <= 600
    kept = without_expiry()

    more = (pair(run, "g2", 3, ("7", "3")) + pair(run, "g3", 5, ("7", "3"), check="test")
            + [grade(run, "g3", "r5", 1.0), grade(run, "g3", "r6", 0.0)])
    assert len(serve(book, more)) == 2
    assert without_expiry() == kept  # what outlives the groups does not grow with them


@pytest.mark.parametrize("spec, r1, r2", [("exact_match", 1.0, 0.0), (f"{__name__}:answer_length", 1.0, 4.0)])
def test_a_reward_function_scores_every_rollout_without_waiting_for_grades(bus, tmp_path, spec, r1, r2):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=3, reward_function=spec)
    deliveries = (deliveries_for(run, "g", "r1", 0, "7", check="test", group_size=3)
                  + deliveries_for(run, "g", "r2", 1, "nope", check="test", group_size=3)
                  + deliveries_for(run, "g", "r3", 2, "7", group_size=3, status="failed"))
    assert feed(book, deliveries) == ["g"]  # no grade was reported
    assert {r: (reward, source) for r, (reward, _, source) in assigned(bus).items()} == {
        "r1": (r1, spec), "r2": (r2, spec), "r3": (0.0, "failed")}
    assert feed(book, [grade(run, "g", "r1", 0.0)]) == []
    (batch,) = book.flush_batches(run)
    assert [r.reward for r in read_batch(book.storage, batch.uri)] == [r1, r2, 0.0]


@pytest.mark.parametrize("setting, error", [
    (dict(reward_function="bleu"), "unknown reward function 'bleu'"),
    (dict(reward_function="no_such_module:score"), "cannot import module 'no_such_module'"),
    (dict(batch_order="random"), "unknown batch order 'random'; use one of finished, completed"),
])
def test_a_bad_setting_stops_the_book_at_start(bus, tmp_path, setting, error):
    with pytest.raises(ValueError, match=error):
        RewardBook(bus, Storage(str(tmp_path)), batch_size=2, **setting)


def test_a_rollout_whose_grading_failed_gets_no_reward_and_is_left_out_of_the_batch(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=3)
    group = [d for i, answer in enumerate(("3", "4", "5"))
             for d in deliveries_for(run, "g1", f"r{i + 1}", i, answer, check="test", group_size=3)]
    assert feed(book, group + [grade(run, "g1", "r1", 1.0), grade(run, "g1", "r2", 0.0)]) == []
    assert feed(book, [grading_failed(run, "g1", "r3")]) == ["g1"]
    rewards = assigned(bus)
    assert set(rewards) == {"r1", "r2"}  # no reward, not even 0, for the rollout nobody judged
    assert rewards["r1"][1] > 0 > rewards["r2"][1] and rewards["r1"][1] == -rewards["r2"][1]
    assert book.dropped() == {"grading_failed": 1}
    assert int(bus.redis.get(bus.keys.filtered)) == 1  # its sample slot goes back to the dispatcher
    assert book.flush_batches(run) == []  # two rollouts are not a batch of three
    more = deliveries_for(run, "g2", "r4", 3, "7", group_size=1)
    (batch,) = serve(book, more)
    rows = read_batch(book.storage, batch.uri)
    assert [r.rollout_id for r in rows] == ["r1", "r2", "r4"] and batch.group_ids == ["g1", "g2"]
    assert feed(book, [grading_failed(run, "g1", "r3")]) == [] and book.dropped() == {"grading_failed": 1}


def test_a_group_whose_every_grading_failed_is_never_batched_and_holds_nothing_back(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    broken = pair(run, "g1", 1, ("3", "4"), check="test")
    later = pair(run, "g2", 3, ("7", "nope"))
    assert serve(book, broken + later) == []  # g2 waits behind g1 in finish order
    batches = serve(book, [grading_failed(run, "g1", "r1"), grading_failed(run, "g1", "r2")])
    assert [b.group_ids for b in batches] == [["g2"]]
    assert set(assigned(bus)) == {"r3", "r4"}
    assert book.dropped() == {"grading_failed": 2} and book.filtered_groups() == 0
    assert int(bus.redis.get(bus.keys.filtered)) == 2


def test_a_batch_that_overshoots_b_gives_the_surplus_back_so_the_last_batch_can_fill(bus, tmp_path):
    """Batches hold whole groups, so a group that lost a rollout makes one overshoot B. The dispatcher admits
    B x versions samples that were not given back: the surplus must be given back, or the run's last batch
    waits for samples that are never admitted."""
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=4)
    short = (pair(run, "g1", 1, ("3", "7"), check="test")
             + [grading_failed(run, "g1", "r1"), grade(run, "g1", "r2", 1.0)])
    (batch,) = serve(book, short + pair(run, "g2", 3, ("7", "nope")) + pair(run, "g3", 5, ("x", "7")))
    assert batch.group_ids == ["g1", "g2", "g3"] and batch.sample_count == 5
    admitted, given_back = 6, int(bus.redis.get(bus.keys.filtered))
    assert given_back == 2  # r1's slot, and the one sample the batch holds beyond B
    assert admitted - given_back == 4 * 1  # what the dispatcher counts: B per batch written
    assert serve(book, pair(run, "g4", 7, ("7", "1")) + pair(run, "g5", 9, ("2", "7"))) != []
    assert int(bus.redis.get(bus.keys.filtered)) == 2  # a batch of exactly B gives nothing back


def test_a_reward_the_episode_was_finished_with_is_used_when_no_sandbox_grades_it(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    given = [d for index, reward in enumerate((0.25, 1.0))
             for d in deliveries_for(run, "g1", f"r{index + 1}", index, "no label to match", label=None,
                                     reward=reward)]
    (batch,) = serve(book, given)
    rewards = assigned(bus)
    assert {r: (reward, source) for r, (reward, _, source) in rewards.items()} == {"r1": (0.25, "given"),
                                                                                 "r2": (1.0, "given")}
    assert batch.mean_reward == 0.625


def dead_letter(run, group, rollout, stream="prompts", consumer_group="agent-runner",
                event_type="PromptIssued"):
    """The dead letter of one of a rollout's events, as Bus.dead_letter publishes it (with the entry's
    ids)."""
    event = DeadLettered(stream=stream, entry_id="1-0", group=consumer_group, deliveries=6,
                         error="gave up after 5 failed deliveries; last error: ValueError: bad tool spec",
                         fields={"type": event_type})
    return Delivery("dead", "0-4", make_envelope(event, run_id=run, group_id=group, rollout_id=rollout))


def dropped_events(bus):
    return {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")
            if isinstance(d.event, RolloutDropped)}


def test_a_rollout_whose_prompt_was_dead_lettered_is_dropped_and_its_group_completes(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, group_size=3)
    group = [d for i, answer in enumerate(("7", "4"))
             for d in deliveries_for(run, "g1", f"r{i + 1}", i, answer, group_size=3)]
    later = pair(run, "g2", 4, ("7", "nope"))
    assert [b.group_ids for b in serve(book, group + later)] == [["g2"]]  # g1 waits for r3
    assert [b.group_ids for b in serve(book, [dead_letter(run, "g1", "r3")])] == [["g1"]]
    assert set(assigned(bus)) == {"r1", "r2", "r4", "r5"}
    (drop,) = dropped_events(bus).values()
    assert drop.cause == "dead_lettered"
    assert "PromptIssued dead-lettered on prompts by agent-runner" in drop.reason
    assert book.dropped() == {"dead_lettered": 1} and int(bus.redis.get(bus.keys.filtered)) == 1


def test_a_group_known_only_from_dead_letters_gives_every_slot_back(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, group_size=2)
    assert feed(book, [dead_letter(run, "g1", "r1")]) == []
    assert feed(book, [dead_letter(run, "g1", "r2")]) == ["g1"]
    assert set(dropped_events(bus)) == {"r1", "r2"} and assigned(bus) == {}
    assert int(bus.redis.get(bus.keys.filtered)) == 2 and book.flush_batches(run) == []


def test_a_dead_letter_of_an_event_the_pipeline_does_not_wait_for_drops_nothing(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, group_size=2)
    assert book.record(dead_letter(run, "g1", "r1", stream="batches", consumer_group="trainer",
                                   event_type="BatchReady")) is None
    assert book.record(Delivery("dead", "0-5", make_envelope(
        DeadLettered(stream="prompts", entry_id="1-0", group="agent-runner", deliveries=1,
                     error="not msgpack", fields={"type": "PromptIssued", "body": "b'\\x80'"}),
        run_id=run))) is None  # no ids: nothing to drop


def test_a_grade_that_never_comes_is_dropped_after_the_timeout_and_releases_the_groups_behind(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, grade_timeout_s=600)
    waiting = pair(run, "g1", 1, ("3", "4"), check="test")
    later = pair(run, "g2", 3, ("7", "nope"))
    assert serve(book, waiting + later + [grade(run, "g1", "r1", 1.0)]) == []
    assert book.expire_overdue() == []  # not yet overdue
    assert book.expire_overdue(now=time.time() + 601) == ["g1"]
    (drop,) = dropped_events(bus).values()
    assert drop.cause == "grade_timeout" and drop.reason == "its grade did not come within 600 s"
    assert set(assigned(bus)) == {"r1", "r3", "r4"} and book.dropped() == {"grade_timeout": 1}
    assert [b.group_ids for b in book.flush_batches(run)] == [["g1", "g2"]]
    assert feed(book, [grade(run, "g1", "r2", 1.0)]) == []  # the late grade changes nothing
    assert book.expire_overdue(now=time.time() + 6000) == []


def test_an_arrival_decodes_no_other_event_of_its_group_whatever_the_groups_size(bus, tmp_path,
                                                                                 monkeypatch):
    """What a group member's arrival costs does not grow with its group: it decodes at most its rollout's
    TrajectoryFinished, never an earlier segment; the group's events are decoded once to score it and its
    segments once to batch it, each on decode()'s fast path."""
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=8)
    group = [d for i in range(8) for d in deliveries_for(run, "g", f"r{i}", i, str(i % 2 * 7), group_size=8,
                                                          segments=2)]
    decoded = []
    counted = codec.decode

    def counting(fields):
        decoded.append(fields[b"type"].decode())
        return counted(fields)

    def slow_path(fields):
        raise AssertionError(f"{fields} decoded on the slow path")

    monkeypatch.setattr(book_module, "decode", counting)
    monkeypatch.setattr(codec, "_checked_decode", slow_path)
    per_arrival = []
    for delivery in group:
        decoded.clear()
        assert feed(book, [delivery]) == ([] if delivery is not group[-1] else ["g"])
        per_arrival.append(list(decoded))
    # each rollout's two segments, then its TrajectoryFinished; the last arrival reads the ledger to score
    assert per_arrival[:-1] == [[], [], ["TrajectoryFinished"]] * 7 + [[], []]
    assert sorted(per_arrival[-1]) == ["TrajectoryFinished"] * 9
    decoded.clear()
    (batch,) = book.flush_batches(run)
    assert sorted(decoded) == ["TrajectoryFinished"] * 8 + ["TrajectorySegment"] * 16
    monkeypatch.undo()
    assert len(read_batch(book.storage, batch.uri)) == 16


def test_a_crash_between_storing_an_event_and_accounting_for_it_loses_nothing(bus, tmp_path, monkeypatch):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    first, second = deliveries_for(run, "g", "r1", 0, "7"), deliveries_for(run, "g", "r2", 1, "3")
    assert feed(book, first + second[:1]) == []

    def crash(*args):
        raise ConnectionError("the reward service died here")

    monkeypatch.setattr(book, "account", crash)
    with pytest.raises(ConnectionError):
        feed(book, second[1:])  # r2's TrajectoryFinished is stored, not accounted for
    monkeypatch.undo()
    assert feed(book, second[1:]) == ["g"]  # its redelivery
    (batch,) = book.flush_batches(run)
    assert [r.rollout_id for r in read_batch(book.storage, batch.uri)] == ["r1", "r2"]


def test_segments_and_grades_that_come_after_their_rollouts_finish_complete_the_group(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    r1 = deliveries_for(run, "g", "r1", 0, "7", check="test", segments=2)
    r2 = deliveries_for(run, "g", "r2", 1, "3", check="test")
    early_grade = grade(run, "g", "r2", 0.0)
    assert feed(book, [early_grade, r1[-1], r2[-1], r1[1], grade(run, "g", "r1", 1.0), r2[0]]) == []
    assert feed(book, [r1[0]]) == ["g"]
    (batch,) = book.flush_batches(run)
    rows = read_batch(book.storage, batch.uri)
    assert [(r.rollout_id, r.segment_index, r.reward) for r in rows] == [("r1", 0, 1.0), ("r1", 1, 1.0),
                                                                          ("r2", 0, 0.0)]


def test_a_rollout_still_missing_segments_at_the_timeout_is_dropped_saying_how_many(bus, tmp_path):
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=1, grade_timeout_s=600)
    short = deliveries_for(run, "g", "r1", 0, "7", segments=3)
    assert serve(book, short[1:2] + short[3:] + deliveries_for(run, "g", "r2", 1, "3")) == []
    assert book.expire_overdue(now=time.time() + 601) == ["g"]
    (drop,) = dropped_events(bus).values()
    assert drop.cause == "grade_timeout" and drop.reason == "2 of its 3 segments did not come within 600 s"
    assert [b.group_ids for b in book.flush_batches(run)] == [["g"]]
