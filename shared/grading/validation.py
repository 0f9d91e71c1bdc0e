"""Checking tasks before training on them: `rollstream validate TASKS`.

`grade(task, diff, backend)` picks Harbor or SWE-bench grading by the task's kind.
`reference_diff(task, backend)` is the task's reference solution as a diff (Harbor: solution/solve.sh
run in the sandbox on a fresh workspace, mounted at the task's workdir as for grading, without the
tests, then the workspace's diff; SWE: the gold patch). `validate_tasks(tasks, backend)`: the
reference must grade 1 and an empty diff 0; a task that cannot be graded (its reference solution
fails, say) is invalid, with the reason and no scores. Each result carries a `Verdict`
(shared/grading/verdicts.py): a broken environment apart from wrong tests, with what to do and the tail of
the grading log at fault.

    python -m pytest tests/unit/shared/grading/test_validation.py tests/unit/shared/grading/test_grading.py -q
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.shared.errors import GradingError, SandboxError
from rollstream.shared.grading.harbor import grade_harbor
from rollstream.shared.grading.outcome import GradeOutcome, cap_text
from rollstream.shared.grading.runs import (
    run_log,
    run_wrapped,
    stage_copy,
    task_image,
    task_limits,
    task_name,
)
from rollstream.shared.grading.swebench import grade_swebench
from rollstream.shared.grading.verdicts import Diagnosis, Verdict, diagnose_reference, explain, log_tail
from rollstream.shared.sandbox.base import SandboxBackend, SandboxLimits
from rollstream.shared.sandbox.workspace import prepare_workspace


class ReferenceSolutionFailed(GradingError):
    """A Harbor task's solution/solve.sh is missing or failed in the sandbox: no reference diff. The message
    ends with the start of the log; validate shows the summary and the log's tail apart."""

    def __init__(self, summary: str, log: str = "") -> None:
        super().__init__(f"{summary}: {cap_text(log, 2000)}" if log else summary)
        self.summary = summary
        self.log = log


def _is_swe(task: Any) -> bool:
    return hasattr(task, "instance_id") and hasattr(task, "test_patch")


def grade(task: Any, diff: str, backend: SandboxBackend,
          limits: SandboxLimits | None = None) -> GradeOutcome:
    """grade_swebench or grade_harbor, by the task's kind."""
    if _is_swe(task):
        return grade_swebench(task, diff, backend, limits)
    return grade_harbor(task, diff, backend, limits)


def reference_diff(task: Any, backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> str:
    """The task's reference solution as a diff (Harbor: solve.sh run in the sandbox)."""
    if _is_swe(task):
        return task.gold_patch or ""
    solution = getattr(task, "solution", None)
    if solution is None or not Path(solution).is_file():
        raise ReferenceSolutionFailed(f"task {task_name(task)} has no solution/solve.sh")
    image = task_image(backend, task)
    with prepare_workspace(getattr(task, "workspace", None)) as workspace:
        staged = stage_copy(Path(solution).parent, workspace.base / "solution")
        logs = workspace.scratch("logs")
        (logs / "agent").mkdir(mode=0o755)
        timeout = getattr(task, "agent_timeout_s", None) or getattr(task, "verifier_timeout_s", None)
        run = run_wrapped(backend, f"bash /solution/{shlex.quote(Path(solution).name)}", workspace,
                          task_limits(limits, timeout), {"/solution": staged}, {"/logs": logs},
                          {"WORKSPACE": task.workdir, "LOGS_DIR": "/logs"}, image, task.workdir)
        if run.error:
            raise GradingError(f"reference solution of {task_name(task)}: {run.error}")
        if run.result.exit_code != 0:
            raise ReferenceSolutionFailed(
                f"reference solution of {task_name(task)} failed ({run.result.reason})", run_log(run))
        return workspace.diff()


@dataclass
class ValidationResult:
    """One task's verdict; the scores are None when the task could not be graded at all."""
    name: str
    reference_score: float | None
    empty_score: float | None
    ok: bool
    problem: str
    """What the gradings said, whole ("reference solution scores 0: FAIL_TO_PASS 0/1 passed ...")."""
    verdict: Verdict = Verdict.OK
    advice: str = ""
    """What the verdict means for this task and what to do (verdicts.explain)."""
    missing_module: str | None = None
    failing_tests: list[str] = field(default_factory=list)
    log_tail: str = ""
    """The last lines of the grading log at fault (log_of): the reference's when it did not score 1."""
    log_of: str = ""


def validate_tasks(tasks: list[Any], backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> list[ValidationResult]:
    """Each task's reference solution must grade 1 and an empty diff 0."""
    results = []
    for task in tasks:
        name = task_name(task)
        try:
            reference = grade(task, reference_diff(task, backend, limits), backend, limits)
            empty = grade(task, "", backend, limits)
        except ReferenceSolutionFailed as exc:
            results.append(_ungraded(name, exc.summary, Verdict.SOLUTION_FAILED, exc.log))
            continue
        except (GradingError, SandboxError, OSError) as exc:
            # the sandbox or the task's image could not be made: nothing of the task ran
            results.append(_ungraded(name, str(exc), Verdict.ENVIRONMENT_BROKEN, ""))
            continue
        results.append(_judge(name, reference, empty))
    return results


def _ungraded(name: str, why: str, verdict: Verdict, log: str) -> ValidationResult:
    return ValidationResult(name, None, None, False, f"could not grade: {why}", verdict,
                            explain(Diagnosis(verdict)), log_tail=log_tail(log),
                            log_of="reference solution" if log else "")


def _judge(name: str, reference: GradeOutcome, empty: GradeOutcome) -> ValidationResult:
    """The verdict on a task whose reference and empty diff were both graded."""
    problems = []
    if reference.infrastructure_error or empty.infrastructure_error:
        failed = reference if reference.infrastructure_error else empty
        problems.append(f"infrastructure error: {failed.reason}")
    if reference.score != 1:
        problems.append(f"reference solution scores {reference.score:g}: {reference.reason}")
    if empty.score != 0:
        problems.append(f"empty diff scores {empty.score:g}: {empty.reason}")
    if reference.score != 1 or reference.infrastructure_error:
        diagnosis, at_fault, log_of = diagnose_reference(reference), reference, "reference solution"
    elif empty.infrastructure_error:
        diagnosis, at_fault, log_of = Diagnosis(Verdict.ENVIRONMENT_BROKEN), empty, "empty diff"
    elif empty.score != 0:
        diagnosis, at_fault, log_of = Diagnosis(Verdict.EMPTY_DIFF_PASSES), empty, "empty diff"
    else:
        return ValidationResult(name, reference.score, empty.score, True, "")
    return ValidationResult(name, reference.score, empty.score, False, "; ".join(problems),
                            diagnosis.verdict, explain(diagnosis), diagnosis.missing_module,
                            diagnosis.failing_tests, log_tail(at_fault.log), log_of)
