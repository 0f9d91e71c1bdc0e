"""The reward service scores each role of a group (services/reward/roles.py): a role's own reward function
or the rollout's reward, advantages within each role's samples, the role on every batch row, and filtering
only where no role has a signal. Real Redis, real Parquet batches."""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY

from rollstream.services.reward.book import RewardBook
from rollstream.services.reward.roles import role_reward_functions
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.bus import Delivery
from rollstream.shared.contract.events import (
    RewardAssigned,
    TrajectoryFinished,
    TrajectorySegment,
    make_envelope,
)
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from tests.unit.services.reward.test_reward_book import feed

EPS = 1e-6
"""The grpo estimator's epsilon (rewards.advantages)."""


def planned_a_check(response: str, label: str | None) -> float:
    """The planner's own reward: whether its plan ends by checking the answer."""
    return 1.0 if "check" in response else 0.0


JUDGE = {"reachable": False}


def judged(response: str, label: str | None) -> float:
    """A reward function that fails while its judge cannot be reached."""
    if not JUDGE["reachable"]:
        raise RuntimeError("the judge is unreachable")
    return planned_a_check(response, label)


def run_settings(default: str | None = None, planner_reward: str | None = "planned_a_check") -> Settings:
    planner = {"reward_function": f"{__name__}:{planner_reward}"} if planner_reward else {}
    return Settings(roles={"names": {"planner": planner, "solver": {}}, "default": default},
                    train={"lora_rank": 8})


def role_book(bus, tmp_path, settings: Settings, **options) -> RewardBook:
    """The book as the service builds it from the run's settings."""
    return RewardBook(bus, Storage(str(tmp_path)), roles=RunRoles.of(settings),
                      role_reward_functions=role_reward_functions(settings.roles), **options)


def rollout(run, group, rollout_id, sample_index, segments, answer, group_size=3, label="7"):
    """A rollout whose segments are (role, text), its segments delivered last first (the book must order
    them by segment index), then its TrajectoryFinished with the final `answer`."""
    ids = dict(run_id=run, group_id=group, rollout_id=rollout_id, trajectory_id=rollout_id,
               session_id=rollout_id)
    out = [Delivery("trajectories", "0-1", make_envelope(TrajectorySegment(
        segment_index=index, attempt="a1", tokens=[1, 2, 3 + index], response_length=1, loss_mask=[0, 0, 1],
        rollout_logprobs=[0.0, 0.0, -0.5], turn_policy_versions=[0], status="completed", response_text=text,
        sample_index=sample_index, group_size=group_size, role=role), **ids))
        for index, (role, text) in reversed(list(enumerate(segments)))]
    finished = TrajectoryFinished(status="completed", attempt="a1", segment_count=len(segments),
                                  group_size=group_size, sample_index=sample_index, response_text=answer,
                                  label=label)
    return out + [Delivery("trajectories", "0-2", make_envelope(finished, **ids))]


def rewards_of(bus) -> dict[str, RewardAssigned]:
    return {d.envelope.rollout_id: d.event for d in bus.read_all("rewards")
            if isinstance(d.event, RewardAssigned)}


def rewards_observed(source: str, role: str) -> float:
    """How many rewards rollstream_reward_value observed of a source and role, so far in this process."""
    return REGISTRY.get_sample_value("rollstream_reward_value_count", {"source": source, "role": role}) or 0.0


def rows_of(book, run):
    (batch,) = book.flush_batches(run)
    return batch, [(r.rollout_id, r.segment_index, r.role, r.reward, pytest.approx(r.advantage, abs=1e-6))
                   for r in read_batch(book.storage, batch.uri)]


def test_a_role_with_its_own_reward_function_is_scored_by_it_and_the_other_takes_the_rollouts(bus, tmp_path):
    run = bus.keys.run_id
    book = role_book(bus, tmp_path, run_settings(), batch_size=3)
    observed = rewards_observed(f"{__name__}:planned_a_check", "planner")
    # the planner's last segment in r1 checks, its first does not: the last one is scored
    r1 = [("planner", "plan: add"), ("solver", "7"), ("planner", "plan: check")]
    deliveries = (
        rollout(run, "g", "r1", 0, r1, "7")
        + rollout(run, "g", "r2", 1, [("planner", "plan: check"), ("solver", "no idea")], "no idea")
        + rollout(run, "g", "r3", 2, [("planner", "plan: guess"), ("solver", "7")], "the answer is 7"))
    assert feed(book, deliveries) == ["g"]
    assert feed(book, deliveries) == []  # a redelivery changes nothing

    # planner (its own): 1, 1, 0, mean 2/3; solver (the rollouts' exact_match): 1, 0, 1, mean 2/3
    std = math.sqrt(2 / 9)
    high, low = (1 / 3) / (std + EPS), (-2 / 3) / (std + EPS)
    rewards = rewards_of(bus)
    assert {r: (e.reward, e.source, e.role_rewards) for r, e in rewards.items()} == {
        "r1": (1.0, "exact_match", {"planner": 1.0}), "r2": (0.0, "exact_match", {"planner": 1.0}),
        "r3": (1.0, "exact_match", {"planner": 0.0})}
    assert {r: e.role_advantages for r, e in rewards.items()} == {
        "r1": {"planner": pytest.approx(high), "solver": pytest.approx(high)},
        "r2": {"planner": pytest.approx(high), "solver": pytest.approx(low)},
        "r3": {"planner": pytest.approx(low), "solver": pytest.approx(high)}}
    # the rollout's own advantage stays over the rollouts' rewards
    assert {r: e.advantage for r, e in rewards.items()} == pytest.approx({"r1": high, "r2": low, "r3": high})

    batch, rows = rows_of(book, run)
    assert rows == [("r1", 0, "planner", 1.0, high), ("r1", 1, "solver", 1.0, high),
                    ("r1", 2, "planner", 1.0, high), ("r2", 0, "planner", 1.0, high),
                    ("r2", 1, "solver", 0.0, low), ("r3", 0, "planner", 0.0, low),
                    ("r3", 1, "solver", 1.0, high)]
    assert batch.mean_reward == pytest.approx(2 / 3)  # the rollouts' rewards, not their rows'
    assert rewards_observed(f"{__name__}:planned_a_check", "planner") - observed == 3


def test_each_roles_advantage_is_over_the_rollouts_that_have_that_role(bus, tmp_path):
    run = bus.keys.run_id
    book = role_book(bus, tmp_path, run_settings(default="solver", planner_reward=None), batch_size=3,
                     advantage_estimator="dr_grpo")
    deliveries = (rollout(run, "g", "r1", 0, [("planner", "plan"), ("solver", "7")], "7")
                  + rollout(run, "g", "r2", 1, [(None, "no idea")], "no idea")  # the default role's only
                  + rollout(run, "g", "r3", 2, [("planner", "plan"), ("solver", "unsure")], "unsure"))
    assert feed(book, deliveries) == ["g"]
    rewards = rewards_of(bus)
    # rollout rewards 1, 0, 0. planner: r1 and r3 only (mean 1/2); solver: all three (mean 1/3)
    assert {r: e.role_advantages for r, e in rewards.items()} == {
        "r1": pytest.approx({"planner": 0.5, "solver": 2 / 3}), "r2": pytest.approx({"solver": -1 / 3}),
        "r3": pytest.approx({"planner": -0.5, "solver": -1 / 3})}
    assert all(e.role_rewards == {} for e in rewards.values())  # no role has a reward function of its own
    _, rows = rows_of(book, run)
    assert rows == [("r1", 0, "planner", 1.0, 0.5), ("r1", 1, "solver", 1.0, 2 / 3),
                    ("r2", 0, "solver", 0.0, -1 / 3),  # written None, batched as the default it stands for
                    ("r3", 0, "planner", 0.0, -0.5), ("r3", 1, "solver", 0.0, -1 / 3)]


def test_a_group_is_filtered_only_when_no_role_has_a_learning_signal(bus, tmp_path):
    run = bus.keys.run_id
    book = role_book(bus, tmp_path, run_settings(), batch_size=2, filter_zero_variance=True,
                     advantage_estimator="dr_grpo")
    # every rollout right, so the solver has no signal; the planner's plans differ, so it has one
    planner_only = (rollout(run, "g1", "r1", 0, [("planner", "check"), ("solver", "7")], "7", group_size=2)
                    + rollout(run, "g1", "r2", 1, [("planner", "guess"), ("solver", "7")], "7", group_size=2))
    assert feed(book, planner_only) == ["g1"]
    _, rows = rows_of(book, run)
    assert rows == [("r1", 0, "planner", 1.0, 0.5), ("r1", 1, "solver", 1.0, 0.0),
                    ("r2", 0, "planner", 0.0, -0.5), ("r2", 1, "solver", 1.0, 0.0)]
    assert book.filtered_groups() == 0

    neither = (rollout(run, "g2", "r3", 2, [("planner", "check"), ("solver", "7")], "7", group_size=2)
               + rollout(run, "g2", "r4", 3, [("planner", "check"), ("solver", "7")], "7", group_size=2))
    assert feed(book, neither) == ["g2"]
    assert book.flush_batches(run) == [] and book.filtered_groups() == 1
    drops = {d.envelope.rollout_id: d.event.reason for d in bus.read_all("rewards")
             if d.envelope.type == "RolloutDropped"}
    assert drops == dict.fromkeys(("r3", "r4"), "each role of its group got the same reward in every rollout "
                                                "that has it: no learning signal")


def test_a_segment_of_a_role_the_run_does_not_have_is_batched_with_that_role_for_the_trainer_to_refuse(
        bus, tmp_path):
    run = bus.keys.run_id
    book = role_book(bus, tmp_path, run_settings(), batch_size=2, advantage_estimator="dr_grpo")
    observed = rewards_observed("exact_match", "unknown")
    deliveries = (rollout(run, "g", "r1", 0, [("critic", "looks right"), ("solver", "7")], "7", group_size=2)
                  + rollout(run, "g", "r2", 1, [("solver", "nope")], "nope", group_size=2))
    assert feed(book, deliveries) == ["g"]
    assert rewards_of(bus)["r1"].role_advantages == {"critic": 0.0, "solver": 0.5}
    _, rows = rows_of(book, run)
    assert rows == [("r1", 0, "critic", 1.0, 0.0), ("r1", 1, "solver", 1.0, 0.5),
                    ("r2", 0, "solver", 0.0, -0.5)]
    assert rewards_observed("exact_match", "unknown") - observed == 1  # not a label per name written


def test_a_role_reward_function_that_fails_gives_no_reward_and_the_group_completes_when_it_scores(
        bus, tmp_path, monkeypatch):
    run = bus.keys.run_id
    monkeypatch.setitem(JUDGE, "reachable", False)
    book = role_book(bus, tmp_path, run_settings(planner_reward="judged"), batch_size=2)
    deliveries = (rollout(run, "g", "r1", 0, [("planner", "plan"), ("solver", "7")], "7", group_size=2)
                  + rollout(run, "g", "r2", 1, [("planner", "plan"), ("solver", "2")], "2", group_size=2))
    with pytest.raises(RuntimeError, match="the judge is unreachable"):
        feed(book, deliveries)
    assert rewards_of(bus) == {} and book.flush_batches(run) == []  # never a reward of 0 for it
    monkeypatch.setitem(JUDGE, "reachable", True)
    assert feed(book, deliveries[-1:]) == ["g"]  # the redelivery of the entry that failed
    assert {r: e.role_rewards for r, e in rewards_of(bus).items()} == {"r1": {"planner": 0.0},
                                                                       "r2": {"planner": 0.0}}


def test_a_bad_role_reward_function_stops_the_book_at_start_naming_the_role(bus, tmp_path):
    with pytest.raises(ValueError, match=r"roles\.names\.planner\.reward_function: .*cannot import module "
                                         "'nowhere'"):
        RewardBook(bus, Storage(str(tmp_path)), batch_size=2, roles=RunRoles.of(run_settings()),
                   role_reward_functions={"planner": "nowhere:score"})
    with pytest.raises(ValueError, match="reward function 'exact_match' of role 'judge': the run has no such "
                                         "role"):
        RewardBook(bus, Storage(str(tmp_path)), batch_size=2, roles=RunRoles.of(run_settings()),
                   role_reward_functions={"judge": "exact_match"})


def test_a_group_scored_by_a_book_from_before_roles_is_batched_with_its_rollouts_rewards(bus, tmp_path):
    """A restart onto this book finds the scores an earlier one kept (`reward,advantage`): its rows take the
    rollout's reward and advantage, under the role their segment resolves to."""
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2)
    deliveries = (rollout(run, "g", "r1", 0, [(None, "7")], "7", group_size=2)
                  + rollout(run, "g", "r2", 1, [(None, "2")], "2", group_size=2))
    assert feed(book, deliveries) == ["g"]
    bus.redis.hset(bus.keys.reward.assigned("g"), mapping={"r1": "1.0,0.75", "r2": "0.0,-0.75"})
    _, rows = rows_of(book, run)
    assert rows == [("r1", 0, "policy", 1.0, 0.75), ("r2", 0, "policy", 0.0, -0.75)]
