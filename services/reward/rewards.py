"""Built-in reward functions and group-relative advantages."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np

from rollstream.shared.tasks.scoring import exact_match

RewardFunction = Callable[[str, str | None], float]
"""(response text, label) -> reward."""

REWARD_FUNCTIONS: dict[str, RewardFunction] = {"exact_match": exact_match}


def reward_for(name: str, response: str, label: str | None) -> float:
    try:
        fn = REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; built in: "
                         f"{', '.join(REWARD_FUNCTIONS)}") from None
    return fn(response, label)


def resolve_reward_function(spec: str) -> RewardFunction:
    """reward.function: a built-in name or `module:function`, resolved once when the service starts, so
    that a typo stops it there rather than failing every group it would score."""
    if ":" not in spec:
        try:
            return REWARD_FUNCTIONS[spec]
        except KeyError:
            raise ValueError(f"unknown reward function {spec!r}; built in: {', '.join(REWARD_FUNCTIONS)}; "
                             "or give an import path module:function") from None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: an import path needs both parts, module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute "
                         f"{attr!r}") from None
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn


ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")


def advantages(rewards: list[float], estimator: str, eps: float = 1e-6) -> list[float]:
    """Group-relative advantages over the rewards of one group's rollouts.

    grpo: (r - mean) / (std + eps).
    dr_grpo: r - mean (Dr. GRPO): dividing by the std up-weights groups that are nearly all right or
    all wrong, a bias towards too easy and too hard prompts.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
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
