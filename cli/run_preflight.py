"""What a local run checks before it starts anything (cli/local_run.py): that its dataset loads and, when a
sandbox-grader will grade some of its rows, that the grader's sandbox runs on this machine. A run without
a working sandbox would only collect rollouts nobody can grade. Then the test environments of its SWE rows
are built or reused (cli/environments.py), so that no grading job spends its time limit building one.

Tests: tests/unit/cli/test_run_preflight.py.
"""

from __future__ import annotations

from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.errors import BackendUnavailable, SandboxError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.sandbox.backends import probe_sandbox
from rollstream.shared.tasks.datasets import arithmetic_dataset, load_dataset_and_swebench_rows
from rollstream.shared.tasks.rows import check_roles
from rollstream.shared.tasks.swebench import SweTask


def check_sandbox(settings: Settings, services: tuple[str, ...]) -> list[SweTask]:
    """Load the dataset (DatasetError when it is bad, or a row names a role the run does not have) and, when a
    sandbox-grader will grade some of its rows, make a real sandbox of the grader's backend here
    (probe_sandbox): BackendUnavailable with the backend's reason and what to do otherwise. A run without a
    working sandbox would only collect ungradable rollouts. Returns the dataset's SWE-bench rows ([] for any
    other dataset), for prepare_task_environments."""
    tasks: list[SweTask] = []
    if settings.data.path is not None:
        rows, tasks = load_dataset_and_swebench_rows(settings.data.path)
        check_roles(rows, RunRoles.of(settings), str(settings.data.path))
    else:
        rows = arithmetic_dataset(settings.data.synthetic_prompts, settings.data.seed,
                                  settings.data.synthetic_sandbox_every)
    sandboxed = sum(row.needs_sandbox for row in rows)
    if not sandboxed or "sandbox-grader" not in services:
        return tasks
    try:
        probe_sandbox(settings.grader.backend)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{sandboxed} of the dataset's {len(rows)} prompts are graded in a sandbox, "
                                 f"and the grader's backend ({settings.grader.backend}) cannot run here: "
                                 f"{exc}") from None
    return tasks


def prepare_task_environments(settings: Settings, services: tuple[str, ...], tasks: list[SweTask],
                              on_step) -> None:
    """When a sandbox-grader grades SWE rows (`tasks`, as check_sandbox loaded them) that have test
    environments, build or reuse each (and check it) before the run starts; SandboxError with the reasons
    when one cannot be had."""
    from rollstream.cli.environments import environments_of, prepare_environments

    if "sandbox-grader" not in services:
        return
    by_key = environments_of(tasks)
    if not by_key:
        return
    on_step(f"preparing the test environments of {len(by_key)} repositories ({settings.grader.backend})")
    reports = prepare_environments(by_key, settings.grader.backend, settings.grader.environments_dir)
    for report in reports:
        on_step(f"  {report.key}: {report.action} in {report.seconds:.1f} s, check {report.check}")
    failed = [f"{report.key} ({report.repo}@{report.commit}): {report.problem}"
              for report in reports if report.problem]
    if failed:
        raise SandboxError("the test environments of these rows could not be prepared (`rollstream "
                           "environments prepare` on the dataset shows the same):\n" + "\n".join(failed))
