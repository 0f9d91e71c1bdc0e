"""Prompt datasets: Parquet or JSONL files with a `prompt` column, a directory of Harbor tasks, a
file of SWE-bench rows, or the synthetic arithmetic task. The dispatcher reads them; the local run
checks them before it starts anything.

    python -m pytest tests/unit/shared/tasks -q
"""

from __future__ import annotations

import random
from pathlib import Path

from rollstream.shared.errors import DatasetError, TaskError
from rollstream.shared.tasks.harbor import load_harbor_tasks
from rollstream.shared.tasks.prompts import task_prompt_row
from rollstream.shared.tasks.rows import PromptRow, parse_row
from rollstream.shared.tasks.swebench import SweTask, is_swebench_record, load_swebench_rows, read_records


def _swebench_rows(path: Path) -> list[SweTask]:
    try:
        return load_swebench_rows(path)
    except TaskError as exc:
        raise DatasetError(str(exc)) from exc


def _records(path: Path) -> list:
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r} (use .parquet or .jsonl)")
    try:
        return read_records(path)
    except TaskError as exc:
        raise DatasetError(str(exc)) from exc


def load_dataset(path: Path) -> list[PromptRow]:
    return load_dataset_and_swebench_rows(path)[0]


def load_dataset_and_swebench_rows(path: Path) -> tuple[list[PromptRow], list[SweTask]]:
    """The dataset's prompt rows and, for a file of SWE-bench rows, those rows as tasks ([] otherwise): what
    a local run checks and prepares before it starts, loaded once."""
    if not path.exists():
        raise DatasetError(f"{path}: no such dataset file")
    # coding tasks (shared/tasks/): a directory of Harbor tasks, or a file of SWE-bench rows
    if path.is_dir():
        try:
            return [task_prompt_row(task) for task in load_harbor_tasks(path)], []
        except TaskError as exc:
            raise DatasetError(str(exc)) from exc
    records = _records(path)
    if records and is_swebench_record(records[0]):
        tasks = _swebench_rows(path)
        return [task_prompt_row(task) for task in tasks], tasks
    rows = [parse_row(record, f"{path} row {index}") for index, record in enumerate(records)]
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    return rows, []


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

