"""Why a task failed `rollstream validate`: a `Verdict` read from its gradings, with what to do.

A reference solution that does not score 1 means one of two different things, and the fix is in a different
place for each:
- ENVIRONMENT_BROKEN: its tests never ran. pytest could not collect them (exit 2, interrupted or a collection
  error; 4, usage error, which is what a test id in a module that failed to import gives; 5, no tests
  collected), the log shows an ImportError / ModuleNotFoundError (the package under test or a dependency is
  not importable in the sandbox), or the sandbox itself failed. The task's environment needs fixing.
- TESTS_WRONG: the tests ran on the reference and some failed (their ids are kept): the tests or the
  reference solution are wrong.
Besides these, SOLUTION_FAILED: no reference diff to grade (a Harbor solve.sh that failed or is missing, a
SWE-bench gold patch that does not apply); EMPTY_DIFF_PASSES: the tests pass without any change, so they do
not test the task's problem.

    python -m pytest tests/unit/shared/grading/test_validation.py -q   (needs `bwrap`)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from rollstream.shared.grading.outcome import GradeOutcome

LOG_TAIL_LINES = 30
"""How much of a failed reference's grading log a verdict keeps: the end, where pytest's summary is."""

ENVIRONMENTS_DOC = "docs/tasks/datasets.md#the-tasks-environment"

_COLLECTION_EXITS = {2: "interrupted or a collection error", 4: "usage error", 5: "no tests collected"}
_PYTEST_EXIT = re.compile(r"\(pytest exit (-?\d+):")
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
_IMPORT_ERROR = re.compile(r"ImportError: (?:cannot import name '[^']+' from '([^']+)'"
                           r"|No module named '?([\w.]+))|ImportError while importing test module")
# grade_harbor and grade_swebench give this reason when the diff did not apply and nothing ran
_NOT_APPLIED = "patch did not apply"


class Verdict(StrEnum):
    OK = "ok"
    ENVIRONMENT_BROKEN = "environment_broken"
    TESTS_WRONG = "tests_wrong"
    SOLUTION_FAILED = "solution_failed"
    EMPTY_DIFF_PASSES = "empty_diff_passes"

    @property
    def words(self) -> str:
        return self.value.replace("_", " ")


_MEANING = {
    Verdict.OK: "",
    Verdict.ENVIRONMENT_BROKEN: (
        "the task's environment is broken: its tests could not run on the reference solution, because the "
        "package under test or its dependencies are not importable in the sandbox{module}. Give the row an "
        "environment that installs them (its install_config, its `install` commands, or an environments.json "
        "beside the dataset; `rollstream environments prepare ROWS` builds and checks them), or a Harbor "
        "task an environment/Dockerfile graded with `--backend docker`. See " + ENVIRONMENTS_DOC),
    Verdict.TESTS_WRONG: (
        "the tests ran on the reference solution and {failing} failed: the tests (FAIL_TO_PASS / "
        "PASS_TO_PASS, tests/test.sh) or the reference solution (the gold patch, solution/solve.sh) "
        "are wrong"),
    Verdict.SOLUTION_FAILED: (
        "there is no reference diff to grade: solution/solve.sh failed or is missing, or the gold patch does "
        "not apply to the repository snapshot"),
    Verdict.EMPTY_DIFF_PASSES: "the tests pass without any change: they do not test the task's problem",
}


@dataclass
class Diagnosis:
    """What a failed grading of the reference solution says about the task."""
    verdict: Verdict
    missing_module: str | None = None
    """The module the log says could not be imported, when it names one."""
    failing_tests: list[str] = field(default_factory=list)
    """Test ids that ran and did not pass."""


def diagnose_reference(outcome: GradeOutcome) -> Diagnosis:
    """ENVIRONMENT_BROKEN, TESTS_WRONG or SOLUTION_FAILED for a reference solution that did not score 1."""
    missing_module, import_failed = _import_failure(outcome.log)
    if outcome.infrastructure_error or import_failed or _collection_failed(outcome):
        return Diagnosis(Verdict.ENVIRONMENT_BROKEN, missing_module)
    if outcome.reason.startswith(_NOT_APPLIED):
        return Diagnosis(Verdict.SOLUTION_FAILED)
    failing = [test_id for test_id, result in outcome.tests.items() if result in ("failed", "error")]
    return Diagnosis(Verdict.TESTS_WRONG, failing_tests=failing)


def explain(diagnosis: Diagnosis) -> str:
    """What the verdict means for this task and what to do, naming the module or the failing tests."""
    module = f" (no module named {diagnosis.missing_module!r})" if diagnosis.missing_module else ""
    failing = ", ".join(diagnosis.failing_tests) if diagnosis.failing_tests else "some"
    return _MEANING[diagnosis.verdict].format(module=module, failing=failing)


def pytest_exit(outcome: GradeOutcome) -> int | None:
    """The pytest exit status a SWE-bench grading's reason gives, if any."""
    match = _PYTEST_EXIT.search(outcome.reason)
    return int(match.group(1)) if match else None


def _collection_failed(outcome: GradeOutcome) -> bool:
    """pytest stopped before running the tests."""
    return pytest_exit(outcome) in _COLLECTION_EXITS


def _import_failure(log: str) -> tuple[str | None, bool]:
    """(the module named, whether an import failed) from a grading log."""
    missing = _MISSING_MODULE.search(log)
    if missing:
        return missing.group(1), True
    failed = _IMPORT_ERROR.search(log)
    if failed:
        return failed.group(1) or failed.group(2), True
    return None, False


def log_tail(log: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a grading log, without its trailing blank lines and the heading of an empty
    stderr (shared/grading/runs.py run_log)."""
    kept = log.rstrip().splitlines()
    if kept and kept[-1] == "--- stderr ---":
        kept = "\n".join(kept[:-1]).rstrip().splitlines()
    return "\n".join(kept[-lines:])
