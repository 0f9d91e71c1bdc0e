"""`rollstream environments prepare` as a user runs it, with real bubblewrap and pip from PyPI: every distinct
environment of the rows built and checked, a second run reusing them all, a failing install with its log's
tail and exit 1; and `rollstream validate` grading the rows in their environments.

The rows: the two real-repository rows of tests/fixtures/tasks/swebench-real (semver with the default install,
`pip install -e .` at its environment commit; more-itertools with none, as the fixture's environments.json
says: its snapshot lacks the README.rst its pyproject.toml names, and its tests import it from the root) and
the src-layout row of tests/fixtures/tasks/swebench-env (its own `install`), three environments built once
for the module.

    python -m pytest tests/unit/cli/test_environments.py -q   (needs bwrap and PyPI)
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rollstream.cli import environments as cli_environments
from rollstream.cli.main import app
from rollstream.shared.sandbox.venv_environments import ENVIRONMENTS_DIR_VARIABLE
from tests.support import FIXTURES
from tests.unit.shared.sandbox.test_venv_environments import environments_root, pytestmark  # noqa: F401
from tests.unit.shared.tasks.test_swebench_real import (
    MORE_ITERTOOLS,
    REAL_ROWS,
    SEMVER,
    clone_bundles,
    published_rows,
)

runner = CliRunner()
ENV_ROWS = FIXTURES / "swebench-env" / "rows.jsonl"
SRCSTATS = "rollstream__srcstats-env-1"


def table_rows(output: str) -> dict[str, list[str]]:
    """first cell -> the other cells, from the table's one-line rows."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines()
            if line.startswith("│")]
    return {row[0]: row[1:] for row in rows}


@pytest.fixture(scope="module", autouse=True)
def wide_console():
    saved = cli_environments.console
    cli_environments.console = Console(width=250)
    yield
    cli_environments.console = saved


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The real rows (from clones in repos/ beside the file) and the srcstats row, in one dataset."""
    base = tmp_path_factory.mktemp("dataset")
    clone_bundles(base / "repos")
    [srcstats] = [json.loads(line) for line in ENV_ROWS.read_text().splitlines()]
    srcstats["repo_dir"] = str((ENV_ROWS.parent / srcstats["repo_dir"]).resolve())
    path = base / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [*published_rows(), srcstats]))
    shutil.copy(REAL_ROWS.parent / "environments.json", base)
    return path


@pytest.fixture(scope="module")
def root():
    with environments_root() as path:
        yield path


@pytest.fixture(scope="module")
def first_run(rows, root):
    started = time.monotonic()
    result = runner.invoke(app, ["environments", "prepare", str(rows), "--environments-dir", str(root)])
    return result, time.monotonic() - started


def test_prepare_builds_every_environment_and_checks_it(first_run, root):
    result, _ = first_run
    assert result.exit_code == 0, result.output
    table = {key: cells for key, cells in table_rows(result.output).items() if key != "key"}
    assert len(table) == 3 and {cells[0] for cells in table.values()} == {
        "python-semver/python-semver", "more-itertools/more-itertools", "rollstream/srcstats"}
    for cells in table.values():
        repo, commit, count, action, seconds, disk, check = cells
        assert (count, action, check) == ("1", "built", "ok"), result.output
        assert float(seconds) > 0 and float(disk) > 1
    assert sorted(path.name for path in root.iterdir() if not path.name.startswith(".")) == sorted(table)


def test_a_second_run_reuses_them_all_in_seconds(first_run, rows, root):
    started = time.monotonic()
    result = runner.invoke(app, ["environments", "prepare", str(rows), "--environments-dir", str(root)])
    assert result.exit_code == 0, result.output
    cells = [cells for key, cells in table_rows(result.output).items() if key != "key"]
    assert [(c[3], c[6]) for c in cells] == [("reused", "ok")] * 3, result.output
    assert time.monotonic() - started < max(60.0, first_run[1] / 2)


def test_validate_grades_the_rows_in_their_environments(first_run, rows, root, monkeypatch):
    monkeypatch.setenv(ENVIRONMENTS_DIR_VARIABLE, str(root))
    result = runner.invoke(app, ["validate", str(rows), "--json"])
    assert result.exit_code == 0, result.output
    verdicts = {r["name"]: (r["reference_score"], r["empty_score"], r["verdict"])
                for r in json.loads(result.output)}
    assert verdicts == {name: (1, 0, "ok") for name in (SEMVER, MORE_ITERTOOLS, SRCSTATS)}


def test_a_failing_install_fails_the_command_with_the_log_tail(tmp_path, root):
    [row] = [json.loads(line) for line in ENV_ROWS.read_text().splitlines()]
    row.update(repo_dir=str((ENV_ROWS.parent / row["repo_dir"]).resolve()),
               install=["echo the-install-printed-this >&2", "exit 7"])
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    result = runner.invoke(app, ["environments", "prepare", str(path), "--environments-dir", str(root)])
    assert result.exit_code == 1
    [cells] = [cells for key, cells in table_rows(result.output).items() if key != "key"]
    assert cells[3] == "failed"
    assert "build failed" in result.output and "the-install-printed-this" in result.output
    assert "install command 'exit 7'" in result.output and "(exit 7)" in result.output


def test_a_local_run_prepares_its_rows_environments_first_and_refuses_one_that_fails(tmp_path, root):
    """A local run builds its SWE rows' environments before anything starts (so that no grading job spends
    its time limit on one): an install that fails stops it there, with the repository and the install's
    output, and no service was started."""
    from rollstream.cli.run_preflight import check_sandbox, prepare_task_environments
    from rollstream.shared.errors import SandboxError
    from rollstream.shared.runtime.config import Settings

    [row] = [json.loads(line) for line in ENV_ROWS.read_text().splitlines()]
    row.update(repo_dir=str((ENV_ROWS.parent / row["repo_dir"]).resolve()),
               install=["echo the-install-printed-this >&2", "exit 7"])
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    settings = Settings(data={"path": path}, grader={"environments_dir": root})
    steps: list[str] = []
    tasks = check_sandbox(settings, ("dispatcher", "sandbox-grader"))
    assert [task.instance_id for task in tasks] == [row["instance_id"]]
    with pytest.raises(SandboxError) as failed:
        prepare_task_environments(settings, ("dispatcher", "sandbox-grader"), tasks, steps.append)
    assert "rollstream/srcstats@" in str(failed.value) and "the-install-printed-this" in str(failed.value)
    assert steps[0] == "preparing the test environments of 1 repositories (bubblewrap)"
    # a run whose grader is elsewhere (no sandbox-grader among its services) builds nothing
    prepare_task_environments(settings, ("dispatcher",), tasks, steps.append)
    assert len(steps) == 2
