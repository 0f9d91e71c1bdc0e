import re

import numpy as np
import pytest

from rollstream.services.reward.rewards import advantages, exact_match, resolve_reward_function, reward_for


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


def test_a_reward_function_is_a_built_in_name_or_an_import_path():
    assert resolve_reward_function("exact_match") is exact_match
    assert resolve_reward_function("rollstream.shared.tasks.scoring:exact_match") is exact_match


@pytest.mark.parametrize("spec, error", [
    ("bleu", "unknown reward function 'bleu'; built in: exact_match; or give an import path module:function"),
    ("no_such_module:score", "reward function 'no_such_module:score': cannot import module 'no_such_module'"),
    ("rollstream.shared.tasks.scoring:bleu",
     "reward function 'rollstream.shared.tasks.scoring:bleu': module 'rollstream.shared.tasks.scoring' has "
     "no attribute 'bleu'"),
    ("rollstream.services.reward.rewards:REWARD_FUNCTIONS",
     "reward function 'rollstream.services.reward.rewards:REWARD_FUNCTIONS': 'REWARD_FUNCTIONS' is a dict, "
     "not callable"),
    ("rollstream.shared.tasks.scoring:",
     "reward function 'rollstream.shared.tasks.scoring:': an import path needs both parts, module:function"),
])
def test_a_bad_reward_function_says_what_is_wrong(spec, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        resolve_reward_function(spec)


def test_exact_match_needs_a_label():
    with pytest.raises(ValueError, match="needs a label"):
        exact_match("x", None)


def test_grpo_advantages_are_normalised_within_the_group():
    adv = np.array(advantages([1.0, 0.0, 0.0, 1.0], "grpo"))
    assert adv.mean() == pytest.approx(0.0)
    assert adv.std() == pytest.approx(1.0, abs=1e-4)
    assert adv[0] > 0 > adv[1]


def test_dr_grpo_advantages_are_centred_but_not_scaled():
    rewards = [1.0, 0.1, 0.1, 0.0]
    mean = sum(rewards) / 4
    assert advantages(rewards, "dr_grpo") == pytest.approx([r - mean for r in rewards])
    # a group that is nearly all wrong: GRPO's std division blows the lone success up, Dr. GRPO does not
    skewed = [1.0] + [0.0] * 7
    assert advantages(skewed, "dr_grpo")[0] == pytest.approx(0.875)
    assert advantages(skewed, "grpo")[0] == pytest.approx(0.875 / np.std(skewed), rel=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_equal_rewards_give_exactly_zero_advantage(estimator):
    assert advantages([0.1, 0.1, 0.1], estimator) == [0.0, 0.0, 0.0]


def test_unknown_advantage_estimator_is_named():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo, dr_grpo"):
        advantages([1.0, 0.0], "ppo")
    with pytest.raises(ValueError, match="at least one reward"):
        advantages([], "grpo")
