"""The grading stage: what a sandbox made of a rollout that needs a grade (stream `grades`): a grade, or the
failure of the machinery that was to give it, which is never a grade.

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from pydantic import Field

from rollstream.shared.contract.event_models import Event, Finite


class GradeReported(Event):
    """A sandbox ran the task's check on the rollout (stream `grades`). Published by the sandbox-grader's job;
    the `reward` group makes its score the rollout's reward; `rollstream inspect` shows it."""

    TYPE = "GradeReported"
    score: Finite
    """0 to 1: 1 when the check exited 0 or the task's tests passed (a task's verifier may give a
    fraction)."""
    passed: bool
    """Whether score is 1."""
    reason: str
    """The outcome in words: the check's exit (e.g. `exit 1`), the tests' verdict, or why it scored 0."""
    duration_s: Finite
    """Wall-clock seconds the grading took, set-up included."""
    log_uri: str | None = None
    """Path in run storage of what the check or the tests printed (`<run>/sandbox-logs/<rollout>.log`)."""
    tests: dict[str, str] = Field(default_factory=dict)
    """Per-test outcome (passed, failed, error, skipped) where the task's tests report them."""


class GradingFailed(Event):
    """The sandbox could not grade the rollout (stream `grades`): its backend cannot run here, the
    task's files or image could not be prepared, the worker died under the job, or every retry met
    an infrastructure error. Published by the sandbox-grader (its job, or its sweep of jobs that died).
    This is not a grade and never becomes a reward: the `reward` group leaves the rollout out of its
    group's batch and counts it (its sample slot is given back to the dispatcher). Whatever the
    rollout's own code did, time-outs and crashes included, is a GradeReported instead, so a policy
    cannot turn bad attempts into unpunished failures."""

    TYPE = "GradingFailed"
    reason: str
    """Why, with the error: `cannot be graded: ...` (no retry could help) or `grading failed and no retry
    is left: ...`."""
    attempts: int
    """How many times the job ran before it was given up."""
