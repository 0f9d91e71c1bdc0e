"""`rollstream environments prepare ROWS`: build the test environment of every distinct EnvironmentSpec of a
SWE-bench dataset ahead of a run, so that no grading waits for one (shared/tasks/environment_spec.py).

Under bubblewrap an environment is a virtual environment under grader.environments_dir
(shared/sandbox/venv_environments.py); under docker an image (shared/sandbox/docker_environments.py). Each is
then checked in a real sandbox on the snapshot of the first row that uses it, with the row's test_patch
applied: pytest imports, and `pytest --collect-only` finds the row's FAIL_TO_PASS tests (the package under
test and its dependencies import). A table says, per environment: its key, repository, commit, built or
reused, seconds, size on disk and the check; a second run reuses them all. Exit 1 when any failed, with why.

    rollstream environments prepare tests/fixtures/tasks/swebench-real/rows.jsonl
    python -m pytest tests/unit/cli/test_environments.py -q   (needs bwrap and PyPI)
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

environments_app = typer.Typer(no_args_is_help=True, help="SWE rows' test environments, prepared ahead.")
console = Console()

CHECK_WALL_TIME_S = 300.0
"""Wall clock of one environment's check (collecting the tests imports the package and its dependencies)."""


@dataclasses.dataclass
class EnvironmentReport:
    key: str
    repo: str
    commit: str
    rows: int
    action: str = "failed"
    seconds: float = 0.0
    size_mb: float | None = None
    check: str = "-"
    problem: str = ""
    """Why it failed (the build's log tail, or the check's output); empty when it is ready."""
    notes: tuple[str, ...] = ()


@environments_app.command("prepare")
def prepare(
    rows: Annotated[Path, typer.Argument(help="A SWE-bench .jsonl/.parquet file.")],
    backend: Annotated[str, typer.Option(help="Sandbox backend: bubblewrap or docker.")] = "bubblewrap",
    repos_dir: Annotated[Path | None, typer.Option(
        help="The rows' git clones (default: repos/ beside the file).")] = None,
    environments_dir: Annotated[Path | None, typer.Option(
        help="bubblewrap: where environments are built (default: grader.environments_dir).")] = None,
) -> None:
    """Build (or reuse) the environment of every distinct environment of the rows, then check each."""
    from rollstream.shared.errors import SandboxError, TaskError
    from rollstream.shared.tasks.swebench import load_swebench_rows

    try:
        tasks = load_swebench_rows(rows, repos_dir=repos_dir)
        by_key = environments_of(tasks)
    except TaskError as exc:
        console.print(f"[bold red]invalid rows:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    without = len(tasks) - sum(len(users) for _, users in by_key.values())
    try:
        reports = prepare_environments(by_key, backend, environments_dir)
    except (SandboxError, ValueError) as exc:
        console.print(f"[bold red]no sandbox:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    _print(reports, f"{len(reports)} environments of {len(tasks)} rows, {backend}"
           + (f" ({without} rows without one: graded on the sandbox's own Python)" if without else ""))
    if any(report.problem for report in reports):
        raise typer.Exit(1)


def environments_of(tasks: list[Any]) -> dict[str, tuple[Any, list[Any]]]:
    """Every distinct EnvironmentSpec of the rows, by key, with the rows that use it (TaskError for a bad
    row's environment); rows without one are left out."""
    from rollstream.shared.tasks.environment_spec import environment_spec

    by_key: dict[str, tuple[Any, list[Any]]] = {}
    for task in tasks:
        spec = environment_spec(task)
        if spec is not None:
            by_key.setdefault(spec.key, (spec, []))[1].append(task)
    return by_key


def prepare_environments(by_key: dict[str, tuple[Any, list[Any]]], backend: str,
                         environments_dir: Path | None) -> list[EnvironmentReport]:
    """Build or reuse, then check, each environment (environments_of); SandboxError or ValueError when the
    backend cannot prepare any."""
    sandbox, build = _backend(backend, environments_dir)
    return [_prepare_one(spec, users, sandbox, build) for spec, users in by_key.values()]


def _backend(name: str, environments_dir: Path | None) -> tuple[Any, Any]:
    """The sandbox backend and its builder: build(spec, task, on_progress) -> (prepared, SandboxEnvironment),
    `task` a row that uses the environment."""
    from rollstream.shared.sandbox.backends import get_backend
    from rollstream.shared.sandbox.base import SandboxEnvironment

    if name in ("bubblewrap", "bwrap"):
        from rollstream.shared.runtime.config import Settings

        sandbox = get_backend(name, environments_dir=environments_dir or Settings().grader.environments_dir)

        def build_venv(spec: Any, task: Any, on_progress: Any) -> tuple[Any, SandboxEnvironment | None]:
            if not spec.install and not spec.python and spec.image_name:
                raise ValueError(f"only a published image ({spec.image_name}): prepare it with "
                                 f"--backend docker")
            prepared = sandbox.environments.prepare(spec, on_progress)
            return prepared, sandbox.environments.sandbox_environment(prepared.path)

        return sandbox, build_venv
    if name != "docker":
        raise ValueError(f"unknown backend {name!r}; environments are prepared for bubblewrap or docker")
    try:
        from rollstream.shared.sandbox.docker_environments import prepare_image
    except ImportError:
        raise ValueError("docker: not supported yet (no docker environment builder)") from None
    sandbox = get_backend(name)

    def build_image(spec: Any, task: Any, on_progress: Any) -> tuple[Any, SandboxEnvironment | None]:
        # the row's instance names SWE-bench's published image of it, used when the engine has it
        prepared = prepare_image(spec, sandbox, on_progress, instance_id=task.instance_id)
        return prepared, SandboxEnvironment(image=prepared.image)

    return sandbox, build_image


def _prepare_one(spec: Any, users: list[Any], sandbox: Any, build: Any) -> EnvironmentReport:
    from rollstream.shared.errors import GradingError, SandboxError

    report = EnvironmentReport(spec.key, spec.repo, spec.commit[:12], len(users))
    with console.status(f"{spec.key}: preparing") as status:
        def on_progress(message: str) -> None:
            status.update(escape(message[:200]))
        try:
            prepared, environment = build(spec, users[0], on_progress)
        except (SandboxError, GradingError, OSError, ValueError) as exc:
            report.problem = str(exc)
            return report
        report.action, report.seconds = prepared.action, prepared.seconds
        report.size_mb = getattr(prepared, "size_mb", None)
        report.notes = tuple(getattr(prepared, "notes", ()))
        status.update(f"{spec.key}: checking on {users[0].instance_id}")
        problem = check_environment(users[0], sandbox, environment)
    report.check = "ok" if problem is None else "failed"
    report.problem = problem or ""
    return report


def check_environment(task: Any, sandbox: Any, environment: Any) -> str | None:
    """None when, in the environment, pytest imports and collects the row's FAIL_TO_PASS tests on its
    snapshot with its test_patch applied; else what went wrong, with the output's tail."""
    from rollstream.shared.grading.runs import DEFAULT_GRADE_LIMITS, run_log, run_wrapped
    from rollstream.shared.sandbox.workspace import prepare_workspace

    ids = " ".join(shlex.quote(test_id) for test_id in task.fail_to_pass)
    command = ("python -c 'import pytest' && python -m pytest --collect-only -q -p no:cacheprovider "
               f"{ids}")
    limits = dataclasses.replace(DEFAULT_GRADE_LIMITS, wall_time_s=CHECK_WALL_TIME_S,
                                 cpu_time_s=CHECK_WALL_TIME_S)
    with prepare_workspace(Path(task.repo_dir)) as workspace:
        if (task.test_patch or "").strip():
            patch = workspace.base / "test.patch"
            patch.write_text(task.test_patch)
            applied = workspace.git("apply", str(patch), check=False)
            if applied.returncode != 0:
                return (f"the test_patch of {task.instance_id} does not apply: "
                        f"{applied.stderr.decode()[-500:]}")
        run = run_wrapped(sandbox, command, workspace, limits, environment.ro_mounts, {},
                          {**environment.env, "PYTHONDONTWRITEBYTECODE": "1"}, environment.image)
    if run.error:
        return run.error
    if run.result.exit_code != 0:
        return (f"pytest could not collect the FAIL_TO_PASS tests of {task.instance_id} "
                f"({run.result.reason}):\n{run_log(run)[-2000:]}")
    return None


def _print(reports: list[EnvironmentReport], title: str) -> None:
    table = Table(title=title)
    for column in ("key", "repo", "commit", "rows", "built or reused", "seconds", "disk (MB)", "check"):
        table.add_column(column, overflow="fold")
    for r in reports:
        table.add_row(Text(r.key), Text(r.repo), r.commit, str(r.rows),
                      Text(r.action, style="red" if r.action == "failed" else ""), f"{r.seconds:.1f}",
                      "-" if r.size_mb is None else f"{r.size_mb:g}",
                      Text(r.check, style="green" if r.check == "ok" else "red"))
    # into a pipe or a log file, each environment keeps one line; a terminal folds the cells to its width
    natural = Measurement.get(console, console.options.update_width(1000), table).maximum
    wide = console.width >= natural or console.is_terminal
    (console if wide else Console(file=console.file, width=natural, no_color=console.no_color)).print(table)
    for r in reports:
        for note in r.notes:
            console.print(Text(f"{r.key}: {note}", style="yellow"), soft_wrap=True)
        if r.problem:
            what = "build failed" if r.action == "failed" else "check failed"
            console.print(Text(f"\n== {r.key} ({r.repo} at {r.commit}): {what} ==", style="bold red"),
                          soft_wrap=True)
            console.print(Text(r.problem), soft_wrap=True)
