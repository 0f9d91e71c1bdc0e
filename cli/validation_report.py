"""What `rollstream validate` prints: a table of the tasks' scores and verdicts, then, for each task that
failed, its verdict in words, what the gradings said, what to do and the tail of the grading log at fault;
or, with `--json`, the same as one JSON object per task.

Nothing is cut at the terminal's width: the table folds long names, and everything under it is printed as
whole lines (soft wrap), so a log file or a CI page, whose width nobody knows, keeps every word and the log
keeps its own lines.

    python -m pytest tests/unit/cli/test_validate.py -q   (needs `bwrap`)
"""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rollstream.shared.grading.validation import ValidationResult


def print_report(console: Console, results: list[ValidationResult], title: str) -> None:
    table = Table(title=title)
    table.add_column("task", overflow="fold")
    table.add_column("reference")
    table.add_column("empty diff")
    table.add_column("verdict", overflow="fold")
    for r in results:
        # Text, not markup: names are the dataset's, and may hold brackets
        table.add_row(Text(r.name), _score(r.reference_score), _score(r.empty_score),
                      Text(r.verdict.words, style="green" if r.ok else "red"))
    console.print(table)
    for r in results:
        if not r.ok:
            _print_failure(console, r)


def _print_failure(console: Console, r: ValidationResult) -> None:
    def line(text: str, style: str = "") -> None:
        console.print(Text(text, style=style), soft_wrap=True)

    line("")
    line(f"== {r.name}: {r.verdict.words} ==", "bold red")
    line(f"problem: {r.problem}")
    # the verdict's explanation names the module that is not importable or the failing tests
    line(f"verdict: {r.advice}")
    if r.log_tail:
        line(f"-- last lines of the {r.log_of}'s grading log ({r.name}) --", "bold")
        line(r.log_tail)


def report_json(results: list[ValidationResult]) -> str:
    """One object per task: name, scores, ok, verdict, problem, advice, missing_module, failing_tests, log."""
    return json.dumps([{**dataclasses.asdict(r), "verdict": str(r.verdict)} for r in results], indent=2)


def _score(score: float | None) -> str:
    return "-" if score is None else f"{score:.3g}"

