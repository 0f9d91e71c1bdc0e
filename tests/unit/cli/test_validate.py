"""`rollstream validate` as a user runs it, on the fixture tasks with the real bubblewrap backend: the table,
the explanation of each task that fails (whole, at 80 columns and into a pipe), the tail of its grading log,
and `--json`.

    python -m pytest tests/unit/cli/test_validate.py -q   (the sandbox tests skip without `bwrap`)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rollstream.cli import main as cli_main
from rollstream.cli.main import app
from tests.support import FIXTURES

runner = CliRunner()
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")
BROKEN_ROWS = FIXTURES / "swebench-broken" / "rows.jsonl"


@pytest.fixture
def narrow_console(monkeypatch):
    """An 80-column terminal, the width where the table used to cut the reason."""
    monkeypatch.setattr(cli_main, "console", Console(width=80))


def _table_rows(output: str) -> dict[str, list[str]]:
    """task -> its other cells, from the table's one-line rows."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines()
            if line.startswith("│")]
    return {row[0]: row[1:] for row in rows}


@needs_bwrap
def test_validate_passes_on_the_harbor_fixtures(narrow_console):
    result = runner.invoke(app, ["validate", str(FIXTURES / "harbor")])
    assert result.exit_code == 0, result.output
    assert _table_rows(result.output) == {name: ["1", "0", "ok"]
                                          for name in ("app-stats", "fix-add", "three-functions")}
    assert "==" not in result.output  # nothing to explain


@needs_bwrap
def test_validate_explains_a_broken_environment_and_wrong_tests_whole_at_80_columns():
    """The user's case: a package the sandbox cannot import made pytest exit 4, and the table cut the reason.
    Run as a user does, into a pipe (a log file, CI) with COLUMNS=80."""
    env = {**os.environ, "COLUMNS": "80"}
    run = subprocess.run([str(Path(sys.executable).parent / "rollstream"), "validate", str(BROKEN_ROWS)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    table = lines[:lines.index("")]
    assert max(len(line) for line in table) <= 80, table
    assert "environment broken" in run.stdout and "tests wrong" in run.stdout
    # every explanation is a whole line, however long, never cut or folded
    assert "== rollstream__srcstats-1: environment broken ==" in lines
    assert ("problem: reference solution scores 0: FAIL_TO_PASS 0/1 passed, PASS_TO_PASS 0/2 passed (pytest "
            "exit 4: pytest usage error); restored ['tests/test_core.py']; not passing: "
            "['tests/test_core.py::test_spread_unsorted']; broken: "
            "['tests/test_core.py::test_spread_sorted', 'tests/test_core.py::test_spread_empty']") in lines
    [verdict] = [line for line in lines if line.startswith("verdict: the task's environment is broken")]
    assert "(no module named 'srcstats')" in verdict
    assert "docs/tasks/datasets.md#the-tasks-environment" in verdict
    # the grading log's tail, under a heading that names the task, with pytest's own lines as they were
    log_start = lines.index("-- last lines of the reference solution's grading log "
                            "(rollstream__srcstats-1) --")
    tail = lines[log_start + 1:lines.index("== rollstream__tinystats-wrong-patch: tests wrong ==")]
    assert "E   ModuleNotFoundError: No module named 'srcstats'" in tail
    assert "=" * 30 + " 1 error in" in "\n".join(tail) and len([line for line in tail if line]) <= 30
    [verdict] = [line for line in lines if line.startswith("verdict: the tests ran on the reference")]
    assert "tests/test_core.py::test_median_even failed" in verdict
    assert "FAILED tests/test_core.py::test_median_even - assert 2 == 2.5" in lines


@needs_bwrap
def test_validate_json_carries_the_verdicts():
    result = runner.invoke(app, ["validate", str(BROKEN_ROWS), "--json"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    by_name = {task["name"]: task for task in json.loads(result.output)}
    unimportable = by_name["rollstream__srcstats-1"]
    wrong_patch = by_name["rollstream__tinystats-wrong-patch"]
    assert {key: unimportable[key] for key in ("reference_score", "empty_score", "ok", "verdict",
                                                "missing_module")} == {
        "reference_score": 0, "empty_score": 0, "ok": False, "verdict": "environment_broken",
        "missing_module": "srcstats"}
    assert "No module named 'srcstats'" in unimportable["log_tail"]
    assert "(pytest exit 4: pytest usage error)" in unimportable["problem"]
    assert (wrong_patch["verdict"], wrong_patch["failing_tests"]) == (
        "tests_wrong", ["tests/test_core.py::test_median_even"])


@needs_bwrap
def test_validate_reports_a_task_whose_reference_solution_fails(tmp_path, narrow_console):
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "harbor" / "fix-add", tasks / "fix-add")
    shutil.copytree(FIXTURES / "harbor" / "app-stats", tasks / "broken")
    (tasks / "broken" / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'cannot solve' >&2\nexit 3\n")
    result = runner.invoke(app, ["validate", str(tasks)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert _table_rows(result.output) == {"broken": ["-", "-", "solution failed"],
                                          "fix-add": ["1", "0", "ok"]}
    lines = result.output.splitlines()
    assert "== broken: solution failed ==" in lines
    assert "problem: could not grade: reference solution of broken failed (exit 3)" in lines
    log_start = lines.index("-- last lines of the reference solution's grading log (broken) --")
    assert "cannot solve" in lines[log_start + 1:]


def test_validate_names_the_field_of_an_invalid_task(tmp_path):
    task = shutil.copytree(FIXTURES / "harbor" / "fix-add", tmp_path / "fix-add")
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = "abc"\n')
    result = runner.invoke(app, ["validate", str(task)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "[verifier] timeout_sec must be a positive number, got 'abc'" in " ".join(result.output.split())


def test_validate_without_a_usable_sandbox_says_so():
    result = runner.invoke(app, ["validate", str(FIXTURES / "harbor"), "--backend", "nonsense"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "no sandbox: unknown backend 'nonsense'" in result.output
