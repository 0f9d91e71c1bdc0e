"""The reward service's group bookkeeping and batching, on real Redis."""

from shared.batches import read_batch
from shared.bus import Delivery
from shared.events import GradeReported, TrajectoryFinished, TrajectorySegment, make_envelope
from shared.storage import Storage

from services.reward.main import RewardBook


def deliveries_for(run_id, group, rollout, sample_index, answer, label="7", check=None, group_size=2):
    ids = dict(run_id=run_id, group_id=group, rollout_id=rollout, trajectory_id=rollout, session_id=rollout)
    segment = TrajectorySegment(segment_index=0, tokens=[1, 2, 3], response_length=1, loss_mask=[0, 0, 1],
                                rollout_logprobs=[0.0, 0.0, -0.3], turn_policy_versions=[0], status="completed",
                                response_text=answer, sample_index=sample_index, group_size=group_size)
    finished = TrajectoryFinished(status="completed", segment_count=1, group_size=group_size,
                                  sample_index=sample_index, response_text=answer, label=label, sandbox_check=check)
    return [Delivery("trajectories", "0-1", make_envelope(segment, **ids)),
            Delivery("trajectories", "0-2", make_envelope(finished, **ids))]


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
