"""What a grading says (`GradeOutcome`): the score, the reason in words, per-test outcomes, the
capped log, and whether it was the machinery that failed (`infrastructure_error`) rather than the
diff. An infrastructure error says nothing about the model's work: callers retry it and never
turn it into a reward.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

MAX_LOG_CHARS = 64 * 1024
"""GradeOutcome.log keeps at most this much (head and tail)."""


@dataclass
class GradeOutcome:
    score: float
    """0..1."""
    passed: bool
    """score == 1."""
    reason: str
    tests: dict[str, str] = field(default_factory=dict)
    """test id -> "passed" / "failed" / "error" / "skipped"."""
    log: str = ""
    """What the test run printed, capped to MAX_LOG_CHARS."""
    duration_s: float = 0.0
    infrastructure_error: bool = False
    """The sandbox could not run: retry the grading; it says nothing about the diff."""


def make_outcome(score: float, reason: str, *, tests: dict[str, str] | None = None, log_text: str = "",
                 started: float, infrastructure_error: bool = False) -> GradeOutcome:
    if not isinstance(score, (int, float)) or math.isnan(score):
        score = 0.0
    score = min(1.0, max(0.0, float(score)))
    return GradeOutcome(score=score, passed=score == 1.0 and not infrastructure_error,
                        reason=reason, tests=tests or {}, log=cap_text(log_text),
                        duration_s=time.monotonic() - started,
                        infrastructure_error=infrastructure_error)


def cap_text(text: str, limit: int = MAX_LOG_CHARS) -> str:
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - head - tail} characters omitted ...]\n{text[-tail:]}"

