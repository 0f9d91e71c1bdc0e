"""validate_tasks' verdicts on tasks that fail, with the real bubblewrap backend: an environment where the
package under test is not importable, tests that fail on the reference, a reference solution that fails,
tests that pass without a fix. The rows are tests/fixtures/tasks/swebench-broken/rows.jsonl.

    python -m pytest tests/unit/shared/grading/test_validation.py -q   (skipped without `bwrap`)
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from rollstream.shared.grading.validation import validate_tasks
from rollstream.shared.grading.verdicts import ENVIRONMENTS_DOC, LOG_TAIL_LINES, Verdict, log_tail
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")

BROKEN_ROWS = FIXTURES / "swebench-broken" / "rows.jsonl"


@pytest.fixture(scope="module")
def backend():
    return get_backend("bubblewrap")


@pytest.fixture(scope="module")
def rows():
    unimportable, wrong_patch = load_swebench_rows(BROKEN_ROWS)
    assert (unimportable.instance_id, wrong_patch.instance_id) == ("rollstream__srcstats-1",
                                                                   "rollstream__tinystats-wrong-patch")
    return unimportable, wrong_patch


def test_a_package_that_is_not_importable_is_a_broken_environment(backend, rows):
    [result] = validate_tasks([rows[0]], backend)
    assert (result.ok, result.verdict) == (False, Verdict.ENVIRONMENT_BROKEN), result
    assert result.reference_score == 0
    assert result.missing_module == "srcstats"
    assert "(pytest exit 4: pytest usage error)" in result.problem
    assert "no module named 'srcstats'" in result.advice and ENVIRONMENTS_DOC in result.advice
    assert "E   ModuleNotFoundError: No module named 'srcstats'" in result.log_tail
    assert result.log_of == "reference solution" and len(result.log_tail.splitlines()) <= LOG_TAIL_LINES


def test_the_advised_pythonpath_makes_the_same_row_valid(backend, rows):
    """The fix the verdict gives for a src layout works: the package under test is on pytest's path."""
    fixed = dataclasses.replace(rows[0], test_command=rows[0].test_command + " -o pythonpath=src")
    [result] = validate_tasks([fixed], backend)
    assert (result.ok, result.verdict, result.reference_score, result.empty_score) == (True, Verdict.OK, 1, 0)
    assert result.log_tail == "" and result.advice == ""


def test_a_reference_patch_that_fails_a_test_means_the_tests_or_the_patch_are_wrong(backend, rows):
    [result] = validate_tasks([rows[1]], backend)
    assert (result.ok, result.verdict, result.missing_module) == (False, Verdict.TESTS_WRONG, None), result
    assert result.failing_tests == ["tests/test_core.py::test_median_even"]
    assert "tests/test_core.py::test_median_even failed" in result.advice
    assert "FAILED tests/test_core.py::test_median_even - assert 2 == 2.5" in result.log_tail


def test_a_gold_patch_that_does_not_apply_is_a_failed_solution(backend, rows):
    stale_patch = rows[1].gold_patch.replace("middle = len", "mid = len")
    unappliable = dataclasses.replace(rows[1], gold_patch=stale_patch)
    [result] = validate_tasks([unappliable], backend)
    assert (result.ok, result.verdict, result.reference_score) == (False, Verdict.SOLUTION_FAILED, 0), result
    assert "patch did not apply" in result.problem


def _harbor_copy(tmp_path, name: str, files: dict[str, str]):
    """A copy of a Harbor fixture task with `files` (path in the task -> text) replaced."""
    task = shutil.copytree(FIXTURES / "harbor" / name, tmp_path / name)
    for relative, text in files.items():
        (task / relative).write_text(text)
    return load_harbor_task(task)


def test_a_harbor_solution_that_fails_is_a_failed_solution_with_its_log(backend, tmp_path):
    task = _harbor_copy(tmp_path, "app-stats",
                        {"solution/solve.sh": "#!/bin/bash\necho 'no solution here' >&2\nexit 3\n"})
    [result] = validate_tasks([task], backend)
    assert (result.ok, result.verdict, result.reference_score) == (False, Verdict.SOLUTION_FAILED, None)
    assert "no solution here" in result.log_tail and result.log_of == "reference solution"


def test_harbor_tests_that_cannot_import_their_module_are_a_broken_environment(backend, tmp_path):
    task = _harbor_copy(tmp_path, "fix-add", {"tests/test.sh": (
        "python3 -c 'import numpy_that_is_not_installed' || { echo 0 > /logs/verifier/reward.txt; exit 0; }\n"
        "echo 1 > /logs/verifier/reward.txt\n")})
    [result] = validate_tasks([task], backend)
    assert result.verdict == Verdict.ENVIRONMENT_BROKEN, result
    assert result.missing_module == "numpy_that_is_not_installed"
    assert "ModuleNotFoundError: No module named 'numpy_that_is_not_installed'" in result.log_tail


def test_a_harbor_solution_the_tests_reject_means_the_tests_or_solution_are_wrong(backend, tmp_path):
    task = _harbor_copy(tmp_path, "fix-add", {"solution/solve.sh": "#!/bin/bash\ntrue\n"})
    [result] = validate_tasks([task], backend)
    assert (result.ok, result.verdict, result.reference_score) == (False, Verdict.TESTS_WRONG, 0), result
    assert "reference solution scores 0" in result.problem


def test_tests_that_pass_without_a_fix_are_reported(backend, tmp_path):
    task = _harbor_copy(tmp_path, "fix-add", {"tests/test.sh": "echo 1 > /logs/verifier/reward.txt\n"})
    [result] = validate_tasks([task], backend)
    assert (result.ok, result.verdict, result.reference_score, result.empty_score) == (
        False, Verdict.EMPTY_DIFF_PASSES, 1, 1), result
    assert result.log_of == "empty diff"


def test_the_log_tail_keeps_the_last_lines():
    log = "\n".join(f"line {i}" for i in range(100)) + "\n--- stderr ---\n\n"
    assert log_tail(log).splitlines() == [f"line {i}" for i in range(70, 100)]
