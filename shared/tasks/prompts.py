"""Coding tasks as prompt rows: the instruction (or problem statement), a note on the tools, the
coding tools, the workspace in metadata (for a Harbor task also its `workdir`, where the coding
tools mount it, as the grader does), and what the sandbox-grader needs to grade the diff.
"""

from __future__ import annotations

from typing import Any

from rollstream.shared.tasks.harbor import HarborTask
from rollstream.shared.tasks.rows import CODING_TOOLS, PromptRow
from rollstream.shared.tasks.swebench import SweTask

TOOLS_NOTE = (
    "Your tools (read_file, write_file, edit_file, list_files, run_shell, run_tests) work on the "
    "task's repository, which is the current directory for shell commands. Edit its files to solve "
    "the task: your changes to the repository are your answer, and the task's tests grade them "
    "when you finish."
)


def task_prompt_row(task: HarborTask | SweTask):
    """The prompt row for one task: the instruction (or problem statement) and a note on the
    tools, the coding tools, the workspace in metadata and what the grader needs to grade it."""

    if isinstance(task, HarborTask):
        text = task.instruction.strip()
        metadata: dict[str, Any] = {}
        if task.workspace is not None:
            metadata["repo"] = str(task.workspace)
        else:
            metadata["files"] = {}
        metadata["workdir"] = task.workdir
        metadata["grader"] = {"kind": "harbor", "task_dir": str(task.path)}
        if "timeout_sec" in task.config.get("agent", {}):
            metadata["time_budget_s"] = task.agent_timeout_s
        # else a black-box agent gets agent.command_time_budget_s
    elif isinstance(task, SweTask):
        text = task.problem_statement.strip()
        metadata = {
            "repo": str(task.repo_dir),
            "test_command": task.test_command,
            "grader": {"kind": "swebench", "instance_id": task.instance_id,
                       "dataset": str(task.dataset) if task.dataset is not None else None},
        }
    else:
        raise TypeError(f"task_prompt_row takes a HarborTask or a SweTask, got {type(task).__name__}")
    return PromptRow(
        messages=[{"role": "user", "content": f"{text}\n\n{TOOLS_NOTE}"}],
        label=None,
        sandbox_check=None,
        agent=None,
        tools=list(CODING_TOOLS),
        metadata=metadata,
    )

