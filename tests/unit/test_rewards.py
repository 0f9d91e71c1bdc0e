import numpy as np
import pytest

from services.reward.rewards import exact_match, grpo_advantages, reward_for


@pytest.mark.parametrize("response, label, reward", [
    ("19", "19", 1.0),
    ("the answer is 19", "19", 1.0),
    ("12 + 7 = 19", "19", 1.0),
    ("19 no wait 20", "19", 0.1),
    ("no idea", "19", 0.0),
    ("hello", "hello", 1.0),
    ("hello!", "hello", 0.0),
])
def test_exact_match(response, label, reward):
    assert exact_match(response, label) == reward


def test_unknown_reward_function_is_named():
    with pytest.raises(ValueError, match="unknown reward function 'bleu'"):
        reward_for("bleu", "x", "y")


def test_exact_match_needs_a_label():
    with pytest.raises(ValueError, match="needs a label"):
        exact_match("x", None)


def test_grpo_advantages_are_normalised_within_the_group():
    adv = np.array(grpo_advantages([1.0, 0.0, 0.0, 1.0]))
    assert adv.mean() == pytest.approx(0.0)
    assert adv.std() == pytest.approx(1.0, abs=1e-4)
    assert adv[0] > 0 > adv[1]


def test_equal_rewards_give_zero_advantage():
    assert grpo_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
