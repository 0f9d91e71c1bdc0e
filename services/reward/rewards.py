"""Built-in reward functions and group-relative advantages."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shared.scoring import exact_match

REWARD_FUNCTIONS: dict[str, Callable[[str, str | None], float]] = {"exact_match": exact_match}


def reward_for(name: str, response: str, label: str | None) -> float:
    try:
        fn = REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; built in: {', '.join(REWARD_FUNCTIONS)}") from None
    return fn(response, label)


ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")


def advantages(rewards: list[float], estimator: str, eps: float = 1e-6) -> list[float]:
    """Group-relative advantages over the rewards of one group's rollouts.

    grpo: (r - mean) / (std + eps).
    dr_grpo: r - mean (Dr. GRPO): dividing by the std up-weights groups that are nearly all right or
    all wrong, a bias towards too easy and too hard prompts.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    if not rewards:
        raise ValueError("a group needs at least one reward to compute advantages")
    values = np.asarray(rewards, dtype=np.float64)
    if values.min() == values.max():
        # exactly 0, not the rounding residue of subtracting a computed mean
        return [0.0] * len(rewards)
    centred = values - values.mean()
    if estimator == "dr_grpo":
        return centred.tolist()
    return (centred / (values.std() + eps)).tolist()
