"""The dispatcher's stage: a sample admitted (PromptIssued), and the per-sample fields that travel with it
from the prompt to the rollout's last event (SampleSlot, Grading, SampleGrading).

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from rollstream.shared.contract.event_models import Count, Event, Index


class SampleSlot(BaseModel):
    """Which sample of its prompt group a rollout is."""

    sample_index: Index
    """Position of this sample in the run's admission order (0-based)."""
    group_size: Count
    """Samples in this prompt group (n)."""


class Grading(BaseModel):
    """How a sample's answer is graded: by a built-in rule against its label, or by a check in a sandbox."""

    label: str | None = None
    """Reference answer for rule-based rewards."""
    reward_fn: str = "exact_match"
    """Name of the built-in reward function."""
    sandbox_check: str | None = None
    """Shell command whose exit status grades the sample in a sandbox; None: no sandbox grade."""


class SampleGrading(SampleSlot, Grading):
    """Every per-sample grading field: the sample's place in its group and how it is graded, a task's grader
    included. TrajectoryFinished carries them, and a gateway session is created with them. A prompt
    (PromptIssued, and the dataset row it comes from) has the same, but keeps its grader in
    `metadata["grader"]`, where the agent's sandbox reads it too."""

    grader: dict[str, Any] = Field(default_factory=dict)
    """A task whose tests grade the rollout's diff: {"kind": "harbor" | "swebench", ...}."""

    @staticmethod
    def of(source: Any) -> SampleGrading:
        """These fields of anything that has them as attributes: a prompt, a session's spec, a request."""
        return SampleGrading(**{name: getattr(source, name) for name in SampleGrading.model_fields})


class PromptIssued(Event, SampleSlot, Grading):
    """The dispatcher admitted one sample of a prompt group (stream `prompts`). The `agent-runner` group reads
    it and runs the sample's episode (a black-box one through a gateway session); `rollstream inspect` shows
    it."""

    TYPE = "PromptIssued"
    VERSION = 2  # v2: role
    messages: list[dict[str, Any]]
    """Chat messages of the prompt (role, content)."""
    agent: str | None = None
    """Agent loop: a registered name or package.module:function; None: the configured default."""
    tools: list[str] = Field(default_factory=list)
    """Tools the episode may call: registered names or package.module:attr."""
    policy_version: Index
    """The policy version the dispatcher saw when it admitted the sample."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The dataset row's map (e.g. `grader`, `repo`, `time_budget_s`), for the agent loop and its tools; every
    segment's metadata starts from it."""
    role: str | None = None
    """The role the episode's turns take unless its agent loop chooses others (the dataset row's `role`);
    None: the run's default role (roles.default)."""

    @property
    def grader(self) -> dict[str, Any]:
        """The task's grader (SampleGrading.grader), which a prompt carries in its metadata."""
        return dict(self.metadata.get("grader") or {})
