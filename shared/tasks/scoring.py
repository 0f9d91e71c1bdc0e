"""Rule-based answer scoring shared by the reward service and the warm-up's evaluation, so that the
score a warm start is measured by is the reward RL later optimises."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(response: str, label: str | None) -> float:
    """1 if the response's last number (or, with no number in the label, its stripped text) equals
    the label; 0.1 if it answered with a number that is wrong; else 0. The small format credit
    gives an untrained policy a signal to climb."""
    if label is None:
        raise ValueError("exact_match needs a label on the prompt row")
    if NUMBER.fullmatch(label.strip()):
        numbers = NUMBER.findall(response)
        if not numbers:
            return 0.0
        return 1.0 if float(numbers[-1]) == float(label) else 0.1
    return 1.0 if response.strip() == label.strip() else 0.0
