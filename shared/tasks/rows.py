"""A prompt row: one line of a dataset, as the dispatcher issues it.

A row: `prompt` (a string, or a list of chat messages), optional `label` (reference answer),
`reward_fn` (built-in reward name), `sandbox_check` (shell command that grades in a sandbox),
`agent` and `tools` (the agent loop and tools it asks for), `role` (the role its episode's turns take
unless its agent loop chooses others; none: roles.default), `metadata` (a map). A row without a
usable prompt is rejected with an error naming the row, and so is one whose role the run does not have
(`check_roles`, which the dispatcher runs with the run's roles). `CODING_TOOLS` are the tool names coding
tasks ask for (registered by shared/agent/environments/coding.py).

A row grades as the PromptIssued the dispatcher makes of it: the same grading fields (Grading, in
shared/contract/events.py), and a task's grader in `metadata["grader"]`.

    python -m pytest tests/unit/shared/tasks -q
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from rollstream.shared.contract.events import Grading
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.errors import DatasetError, UnknownRole

CODING_TOOLS = ("read_file", "write_file", "edit_file", "list_files", "run_shell", "run_tests")
"""The tools a coding task asks for; shared/agent/environments/coding.py registers them."""


class PromptRow(Grading):
    model_config = ConfigDict(extra="forbid", frozen=True)
    messages: list[dict[str, Any]]
    agent: str | None = None
    tools: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    role: str | None = None
    """The role the episode's turns take unless its agent loop chooses others; None: roles.default."""

    @property
    def grader(self) -> dict[str, Any]:
        """The task's grader (SampleGrading.grader), kept in the row's metadata as the prompt keeps it."""
        return dict(self.metadata.get("grader") or {})

    @property
    def needs_sandbox(self) -> bool:
        """Graded in a sandbox: by its shell check, or by a task's tests (its grader)."""
        return bool(self.sandbox_check or self.grader)


def parse_row(record: Any, where: str) -> PromptRow:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise DatasetError(f"{where}: missing 'prompt' "
                           f"(columns present: {', '.join(sorted(record)) or 'none'})")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                          for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise DatasetError(f"{where}: 'prompt' must be a string or a list of {{role, content}} messages")
    label = record.get("label", record.get("answer"))
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    tools = record.get("tools") or []
    if isinstance(tools, str) or not all(isinstance(t, str) for t in tools):
        raise DatasetError(f"{where}: 'tools' must be a list of tool names")
    role = record.get("role") or None
    if role is not None and not isinstance(role, str):
        raise DatasetError(f"{where}: 'role' must be the name of one of the run's roles, got {role!r}")
    try:
        return PromptRow(
            messages=messages,
            label=None if label is None else str(label),
            reward_fn=record.get("reward_fn") or "exact_match",
            sandbox_check=record.get("sandbox_check") or None,
            agent=record.get("agent") or None,
            tools=list(tools),
            metadata=metadata,
            role=role,
        )
    except ValidationError as exc:  # a row that no PromptIssued could carry
        raise DatasetError(f"{where}: {exc}") from exc



def check_roles(rows: list[PromptRow], roles: RunRoles, source: str) -> None:
    """DatasetError naming the first row (`<source> row <index>`, as parse_row names it) whose role the run
    does not have."""
    for index, row in enumerate(rows):
        try:
            roles.resolve(row.role)
        except UnknownRole as exc:
            raise DatasetError(f"{source} row {index}: {exc}") from exc
