"""A prompt row: one line of a dataset, as the dispatcher issues it.

A row: `prompt` (a string, or a list of chat messages), optional `label` (reference answer),
`reward_fn` (built-in reward name), `sandbox_check` (shell command that grades in a sandbox),
`agent` and `tools` (the agent loop and tools it asks for), `metadata` (a map). A row without a
usable prompt is rejected with an error naming the row. `CODING_TOOLS` are the tool names coding
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
from rollstream.shared.errors import DatasetError

CODING_TOOLS = ("read_file", "write_file", "edit_file", "list_files", "run_shell", "run_tests")
"""The tools a coding task asks for; shared/agent/environments/coding.py registers them."""


class PromptRow(Grading):
    model_config = ConfigDict(extra="forbid", frozen=True)
    messages: list[dict[str, Any]]
    agent: str | None = None
    tools: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

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
    try:
        return PromptRow(
            messages=messages,
            label=None if label is None else str(label),
            reward_fn=record.get("reward_fn") or "exact_match",
            sandbox_check=record.get("sandbox_check") or None,
            agent=record.get("agent") or None,
            tools=list(tools),
            metadata=metadata,
        )
    except ValidationError as exc:  # a row that no PromptIssued could carry
        raise DatasetError(f"{where}: {exc}") from exc

