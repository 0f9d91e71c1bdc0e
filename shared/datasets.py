"""Prompt datasets: Parquet or JSONL files with a `prompt` column, or the synthetic arithmetic task.
The dispatcher reads them; the local run checks them before it starts anything.

A row: `prompt` (a string, or a list of chat messages), optional `label` (reference answer),
`reward_fn` (built-in reward name), `sandbox_check` (shell command that grades in a sandbox),
`metadata` (a map). A row without a usable prompt is rejected with an error naming the row.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


class DatasetError(ValueError):
    """The dataset cannot be used; the message names the file and the row."""


@dataclass(frozen=True)
class PromptRow:
    messages: list[dict[str, Any]]
    label: str | None = None
    reward_fn: str = "exact_match"
    sandbox_check: str | None = None
    agent: str | None = None
    tools: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


def load_dataset(path: Path) -> list[PromptRow]:
    if not path.exists():
        raise DatasetError(f"{path}: no such dataset file")
    # coding tasks (shared/tasks.py): a directory of Harbor tasks, or a file of SWE-bench rows
    from shared.tasks import TaskError, is_swebench_record, load_harbor_tasks, load_swebench_rows, task_prompt_row

    if path.is_dir():
        try:
            return [task_prompt_row(task) for task in load_harbor_tasks(path)]
        except TaskError as exc:
            raise DatasetError(str(exc)) from exc
    if path.suffix == ".parquet":
        records = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        records = []
        for line_number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path} line {line_number}: not JSON ({exc.msg})") from exc
    else:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r} (use .parquet or .jsonl)")
    if records and is_swebench_record(records[0]):
        try:
            return [task_prompt_row(task) for task in load_swebench_rows(path)]
        except TaskError as exc:
            raise DatasetError(str(exc)) from exc
    rows = [parse_row(record, f"{path} row {index}") for index, record in enumerate(records)]
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    return rows


def parse_row(record: Any, where: str) -> PromptRow:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise DatasetError(f"{where}: missing 'prompt' (columns present: {', '.join(sorted(record)) or 'none'})")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
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
    return PromptRow(
        messages=messages,
        label=None if label is None else str(label),
        reward_fn=record.get("reward_fn") or "exact_match",
        sandbox_check=record.get("sandbox_check") or None,
        agent=record.get("agent") or None,
        tools=list(tools),
        metadata=metadata,
    )


def arithmetic_dataset(size: int, seed: int, sandbox_every: int) -> list[PromptRow]:
    """The calculator task: 'What is a + b?' with the calculator tool and the answer as label; every
    `sandbox_every`-th row is graded by a shell check in a sandbox instead of a rule."""
    rng = random.Random(seed)
    rows = []
    for index in range(size):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        answer = str(a + b)
        check = None
        if sandbox_every and index % sandbox_every == sandbox_every - 1:
            check = f'test "$(grep -Eo "[0-9]+" answer.txt | tail -n 1)" = "{answer}"'
        rows.append(PromptRow(
            messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
            label=answer,
            reward_fn="exact_match",
            sandbox_check=check,
            tools=["calculator"],
            metadata={"task": "arithmetic", "a": a, "b": b},
        ))
    return rows
