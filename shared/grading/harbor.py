"""Grading a Harbor task: apply the diff to a fresh copy of the task's workspace and run
tests/test.sh in the sandbox.

The workspace is mounted at the task's workdir (its Dockerfile's WORKDIR, /app by default), as in
the task's own container, so tests that import from /app read the patched files; it is test.sh's
working directory and env WORKSPACE names it. A COPY of the task's tests/ is mounted read-only at
/tests (the diff cannot reach it: it is not in the workspace) and a fresh host directory at /logs
(wall clock = task.verifier_timeout_s).

test.sh runs the code under test beside the verifier, as the same user, so the reward is trusted
only when that code could not have written it. /logs/verifier and its empty reward.txt and
reward.json are the grader's, writable but not removable by the sandbox
(shared/grading/untrusted.py): an early write is overwritten by the verifier's, and a reward file
that was chmod-ed, replaced or symlinked, or both files written, is refused. A test.sh that did not
finish (wall clock, a signal, exit >= 128) scores 0 whatever reward file exists (the code could
write one and then kill test.sh), and so does one that left processes running (one of them could
rewrite the reward after the verifier wrote it). A refused reward is a grade of 0 with the reason,
never an infrastructure error. The reward is clamped to 0..1. What this cannot stop (the code under
test making the tests pass wrongly, acting on the verifier's processes, which run as its user, or
rewriting the reward from a process that exits before test.sh does) is in docs/tasks/reward-integrity.md,
"Harbor tasks".

    python -m pytest tests/unit/shared/grading -q
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rollstream.shared.errors import GradingError, SandboxError
from rollstream.shared.grading.diffs import apply_diff
from rollstream.shared.grading.outcome import GradeOutcome, make_outcome
from rollstream.shared.grading.runs import (
    run_log,
    run_wrapped,
    stage_copy,
    task_image,
    task_limits,
)
from rollstream.shared.grading.untrusted import parse_reward, prepare_reward_files
from rollstream.shared.sandbox.base import SandboxBackend, SandboxLimits
from rollstream.shared.sandbox.workspace import prepare_workspace


def grade_harbor(task: Any, diff: str, backend: SandboxBackend,
                 limits: SandboxLimits | None = None) -> GradeOutcome:
    """Apply `diff` to a fresh copy of the task's workspace and run its tests/test.sh."""
    started = time.monotonic()
    try:
        image = task_image(backend, task)
        workspace = prepare_workspace(getattr(task, "workspace", None))
    except (GradingError, SandboxError, OSError) as exc:
        return make_outcome(0, f"grading setup failed: {exc}", started=started,
                            infrastructure_error=True)
    with workspace:
        ok, why = apply_diff(workspace, diff)
        if not ok:
            return make_outcome(0, f"patch did not apply: {why}", started=started)
        tests_dir = stage_copy(Path(task.tests_dir), workspace.base / "tests")
        logs = workspace.scratch("logs")
        reward_files = prepare_reward_files(logs)
        (logs / "agent").mkdir()
        (logs / "agent").chmod(0o1777)
        run = run_wrapped(backend, "bash /tests/test.sh", workspace,
                          task_limits(limits, getattr(task, "verifier_timeout_s", None)),
                          {"/tests": tests_dir}, {},
                          {"WORKSPACE": task.workdir, "TESTS_DIR": "/tests", "LOGS_DIR": "/logs"}, image,
                          task.workdir, kept_mounts={"/logs": logs}, flag_leftovers=True)
        log_text = run_log(run)
        if run.error:
            return make_outcome(0, run.error, log_text=log_text, started=started,
                                infrastructure_error=True)
        if run.processes_left:
            return make_outcome(0, "test.sh left processes running (one could have rewritten the "
                                "reward after the verifier wrote it): reward not trusted",
                                log_text=log_text, started=started)
        status = run.result.reason
        exit_code = run.result.exit_code
        if run.result.timed_out or exit_code is None or exit_code >= 128 or exit_code < 0:
            # killed: whatever reward is there may have been written by the model's code before
            # it stopped test.sh from writing the real one
            return make_outcome(0, f"test.sh did not finish ({status}); its reward is not trusted",
                                log_text=log_text, started=started)
        score, reason, tests = parse_reward(reward_files)
        if score is None:
            return make_outcome(0, f"{reason} (test.sh: {status})", tests=tests, log_text=log_text,
                                started=started)
        if not 0 <= score <= 1:
            reason += f", clamped to {min(1.0, max(0.0, score)):g}"
        return make_outcome(score, f"{reason} (test.sh: {status})", tests=tests, log_text=log_text,
                            started=started)

