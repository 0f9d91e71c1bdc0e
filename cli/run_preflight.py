"""What a local run checks before it starts anything (cli/local_run.py): that its dataset loads and, when a
sandbox-grader will grade some of its rows, that the grader's sandbox runs on this machine. A run without
a working sandbox would only collect rollouts nobody can grade.

Tests: tests/unit/cli/test_run_preflight.py.
"""

from __future__ import annotations

from rollstream.shared.errors import BackendUnavailable
from rollstream.shared.runtime.config import Settings
from rollstream.shared.sandbox.backends import probe_sandbox
from rollstream.shared.tasks.datasets import arithmetic_dataset, load_dataset


def check_sandbox(settings: Settings, services: tuple[str, ...]) -> None:
    """Load the dataset (DatasetError when it is bad) and, when a sandbox-grader will grade some of its
    rows, make a real sandbox of the grader's backend here (probe_sandbox): BackendUnavailable with the
    backend's reason and what to do otherwise. A run without a working sandbox would only collect
    ungradable rollouts."""
    if settings.data.path is not None:
        rows = load_dataset(settings.data.path)
    else:
        rows = arithmetic_dataset(settings.data.synthetic_prompts, settings.data.seed,
                                  settings.data.synthetic_sandbox_every)
    sandboxed = sum(row.needs_sandbox for row in rows)
    if not sandboxed or "sandbox-grader" not in services:
        return
    try:
        probe_sandbox(settings.grader.backend)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{sandboxed} of the dataset's {len(rows)} prompts are graded in a sandbox, "
                                 f"and the grader's backend ({settings.grader.backend}) cannot run here: "
                                 f"{exc}") from None
