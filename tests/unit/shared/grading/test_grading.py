"""rollstream.shared.grading on the fixture tasks (tests/fixtures/tasks) with the real bubblewrap backend.

    python -m pytest tests/unit/shared/grading/test_grading.py -q   (skipped where `bwrap` is not installed)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from rollstream.shared.grading.diffs import apply_diff
from rollstream.shared.grading.harbor import grade_harbor
from rollstream.shared.grading.runs import store_log
from rollstream.shared.grading.swebench import grade_swebench
from rollstream.shared.grading.untrusted import _reward_from_json
from rollstream.shared.grading.validation import reference_diff, validate_tasks
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.bubblewrap import BubblewrapBackend
from rollstream.shared.sandbox.unsafe_local import UnsafeLocalBackend
from rollstream.shared.sandbox.workspace import prepare_workspace
from rollstream.shared.tasks.harbor import load_harbor_task, load_harbor_tasks
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES, edit_diff

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")


@pytest.fixture(scope="module")
def backend():
    return get_backend("bubblewrap")


@pytest.fixture(scope="module", params=["bubblewrap", "docker"])
def harbor_backend(request):
    """Harbor tasks graded in both real sandboxes: under docker each task's environment/Dockerfile is
    built (offline: FROM the local python:3.11-slim) and the workspace mounted at its WORKDIR."""
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return get_backend(request.param)


@pytest.fixture(scope="module")
def fix_add():
    return load_harbor_task(FIXTURES / "harbor" / "fix-add")


@pytest.fixture(scope="module")
def three_functions():
    return load_harbor_task(FIXTURES / "harbor" / "three-functions")


@pytest.fixture(scope="module")
def app_stats():
    """A task written as terminal-bench's are: its tests and solution use /app by absolute path."""
    return load_harbor_task(FIXTURES / "harbor" / "app-stats")


@pytest.fixture(scope="module")
def swe():
    return load_swebench_rows(FIXTURES / "swebench" / "rows.jsonl")[0]


def test_reference_solutions_score_1(backend, fix_add, three_functions, app_stats, swe):
    for task in (fix_add, three_functions, app_stats):
        diff = reference_diff(task, backend)
        assert diff.startswith("diff --git"), diff
        outcome = grade_harbor(task, diff, backend)
        assert (outcome.score, outcome.passed, outcome.infrastructure_error) == (1.0, True, False), outcome
    outcome = grade_swebench(swe, reference_diff(swe, backend), backend)
    assert outcome.score == 1.0 and outcome.passed, outcome
    assert set(outcome.tests.values()) == {"passed"}
    assert outcome.tests["tests/test_core.py::test_median_even"] == "passed"


def test_empty_diff_scores_0(backend, fix_add, three_functions, app_stats, swe):
    for task in (fix_add, three_functions, app_stats):
        outcome = grade_harbor(task, "", backend)
        assert (outcome.score, outcome.passed, outcome.infrastructure_error) == (0.0, False, False)
        assert "reward 0" in outcome.reason
    outcome = grade_swebench(swe, "", backend)
    assert outcome.score == 0.0 and not outcome.infrastructure_error
    assert outcome.tests["tests/test_core.py::test_median_even"] == "failed"
    assert outcome.tests["tests/test_core.py::test_mean"] == "passed"
    assert "FAIL_TO_PASS 0/1" in outcome.reason


def test_an_app_task_grades_the_patched_files_at_its_workdir(harbor_backend, app_stats):
    assert app_stats.workdir == "/app"
    source = (app_stats.workspace / "stats.py").read_text()
    fixed = source.replace("/ (len(values) - 1)", "/ len(values)")
    assert fixed != source
    outcome = grade_harbor(app_stats, edit_diff(app_stats.workspace, {"stats.py": fixed}), harbor_backend)
    assert (outcome.score, outcome.infrastructure_error) == (1.0, False), outcome
    assert "variance([1, 2, 3, 4]) = 1.25, expected 1.25: ok" in outcome.log
    outcome = grade_harbor(app_stats, "", harbor_backend)
    assert "variance([1, 2, 3, 4]) = 1.6666666666666667, expected 1.25: FAILED" in outcome.log


def test_the_workdir_is_read_from_the_dockerfile(harbor_backend, tmp_path):
    """The same task with /srv/stats instead of /app everywhere: graded where its Dockerfile says."""
    task_dir = Path(shutil.copytree(FIXTURES / "harbor" / "app-stats", tmp_path / "srv-stats"))
    for path in [task_dir / "environment" / "Dockerfile", task_dir / "tests" / "test_stats.py",
                 task_dir / "solution" / "solve.sh"]:
        path.write_text(path.read_text().replace("/app", "/srv/stats"))
    task = load_harbor_task(task_dir)
    assert task.workdir == "/srv/stats"
    [result] = validate_tasks([task], harbor_backend)
    assert (result.ok, result.reference_score, result.empty_score) == (True, 1.0, 0.0), result
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test.sh").write_text('echo "test.sh in $(pwd), WORKSPACE=$WORKSPACE"; ls\n'
                                   "echo 1 > /logs/verifier/reward.txt\n")
    outcome = grade_harbor(dataclasses.replace(task, tests_dir=probe), "", harbor_backend)
    assert outcome.score == 1, outcome
    assert "test.sh in /srv/stats, WORKSPACE=/srv/stats\nstats.py\n" in outcome.log


def test_partial_fix_gets_the_fraction(harbor_backend, three_functions):
    source = (three_functions.workspace / "textutils.py").read_text()
    old = 'return " ".join(sentence.split())'
    assert old in source
    diff = edit_diff(three_functions.workspace, {
        "textutils.py": source.replace(old, 'return " ".join(reversed(sentence.split()))')})
    outcome = grade_harbor(three_functions, diff, harbor_backend)
    assert outcome.score == pytest.approx(1 / 3, abs=1e-3), outcome
    assert not outcome.passed
    assert "reverse_words: ok" in outcome.log and "count_vowels: FAILED" in outcome.log


def test_swe_partial_credit_flag(backend, swe):
    class Flagged:
        pass
    task = Flagged()
    task.__dict__.update(vars(swe))
    task.partial_credit = True
    task.fail_to_pass = [*swe.fail_to_pass, "tests/test_core.py::test_median_odd"]
    task.pass_to_pass = [t for t in swe.pass_to_pass if not t.endswith("test_median_odd")]
    source = (swe.repo_dir / "tinystats" / "core.py").read_text()
    half = source.replace("    return ordered[middle]\n", "    if len(ordered) % 2 == 0:\n"
                          "        return (ordered[middle - 1] + ordered[middle]) / 2\n    return -1\n")
    diff = edit_diff(swe.repo_dir, {"tinystats/core.py": half})
    outcome = grade_swebench(task, diff, backend)
    assert outcome.score == 0.5, outcome
    assert outcome.tests["tests/test_core.py::test_median_odd"] == "failed"
    task.partial_credit = False
    assert grade_swebench(task, diff, backend).score == 0
    # an id that does not exist is an error, not a pass (pytest refuses the whole selection: exit 4)
    task.fail_to_pass = [*swe.fail_to_pass, "tests/test_core.py::test_gone"]
    task.pass_to_pass = [*swe.pass_to_pass]
    outcome = grade_swebench(task, reference_diff(swe, backend), backend)
    assert outcome.tests["tests/test_core.py::test_gone"] == "error"
    assert outcome.score == 0 and "pytest exit 4" in outcome.reason, outcome


def test_a_test_command_that_starts_no_pytest_is_an_infrastructure_error(backend, swe):
    """No pytest in the environment (or a command that runs none) is the machinery's failure: retried,
    then GradingFailed, never a 0 to train on."""
    for command in ("python3 -c 'import sys; sys.exit(0)'", "python3 -m no_such_test_runner"):
        outcome = grade_swebench(dataclasses.replace(swe, test_command=command), reference_diff(swe, backend),
                                 backend)
        assert outcome.infrastructure_error, outcome
        assert "never loaded the grader's report plugin" in outcome.reason


def test_a_test_patch_that_cannot_be_used_is_the_tasks_infrastructure_error_not_a_0(backend, swe):
    """The task's own test_patch is put back over the diff's changes; when git cannot parse it, or it no
    longer applies, the task is broken: retried, then GradingFailed, never a 0 to train on."""
    stale = ("diff --git a/tests/test_core.py b/tests/test_core.py\n--- a/tests/test_core.py\n"
             "+++ b/tests/test_core.py\n@@ -1 +1 @@\n-a line the file does not have\n+anything\n")
    for test_patch, reason in (("not a patch at all\n", "the task's test_patch cannot be parsed"),
                               (stale, "the task's test_patch did not apply after restoring the test files")):
        outcome = grade_swebench(dataclasses.replace(swe, test_patch=test_patch),
                                 reference_diff(swe, backend), backend)
        assert outcome.infrastructure_error and outcome.score == 0, outcome
        assert outcome.reason.startswith(reason), outcome


def test_unappliable_patch_is_a_graded_failure_with_gits_reason(backend, fix_add):
    diff = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
            "@@ -1,2 +1,2 @@\n-this line is not in calc.py\n+nor is this one\n context\n")
    outcome = grade_harbor(fix_add, diff, backend)
    assert outcome.score == 0 and not outcome.infrastructure_error
    assert outcome.reason.startswith("patch did not apply: ")
    assert "calc.py" in outcome.reason and "patch" in outcome.reason
    outcome = grade_harbor(fix_add, "this is not a diff at all\n", backend)
    assert outcome.reason.startswith("patch did not apply: ") and outcome.score == 0


def test_swe_diff_editing_the_tests_still_scores_0(backend, swe):
    test_file = swe.repo_dir / "tests" / "test_core.py"
    trivial = test_file.read_text() + "\n\ndef test_median_even():\n    assert True\n"
    diff = edit_diff(swe.repo_dir, {"tests/test_core.py": trivial})
    outcome = grade_swebench(swe, diff, backend)
    assert outcome.score == 0, outcome
    assert outcome.tests["tests/test_core.py::test_median_even"] == "failed"
    assert "restored ['tests/test_core.py']" in outcome.reason
    # a conftest.py that rewrites every outcome to "passed" is reset too
    conftest = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n"
                "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    diff = edit_diff(swe.repo_dir, {"tests/conftest.py": conftest})
    outcome = grade_swebench(swe, diff, backend)
    assert outcome.score == 0, outcome
    assert outcome.tests["tests/test_core.py::test_median_even"] == "failed"


def test_symlink_out_of_the_workspace_is_refused(backend, fix_add):
    for target in ("/etc/passwd", "../../../../etc", "sub/../../x"):
        diff = edit_diff(fix_add.workspace, {}, symlinks={"escape": target})
        assert "120000" in diff
        outcome = grade_harbor(fix_add, diff, backend)
        assert outcome.score == 0 and not outcome.infrastructure_error
        assert "symlink" in outcome.reason and "outside the workspace" in outcome.reason, outcome.reason
    inside = edit_diff(fix_add.workspace, {}, symlinks={"alias.py": "calc.py"})
    with prepare_workspace(fix_add.workspace) as workspace:
        assert apply_diff(workspace, inside) == (True, "applied")
        assert os.readlink(workspace.root / "alias.py") == "calc.py"


def test_paths_outside_the_workspace_are_refused(fix_add):
    diff = ("diff --git a/../evil.txt b/../evil.txt\nnew file mode 100644\n--- /dev/null\n"
            "+++ b/../evil.txt\n@@ -0,0 +1 @@\n+pwned\n")
    with prepare_workspace(fix_add.workspace) as workspace:
        ok, reason = apply_diff(workspace, diff)
        assert not ok and "outside the workspace" in reason
        assert not (workspace.base / "evil.txt").exists()
    # writing through a symlink that the same patch creates
    link_then_write = edit_diff(fix_add.workspace, {}, symlinks={"d": "."}) + (
        "diff --git a/d/x.txt b/d/x.txt\nnew file mode 100644\n--- /dev/null\n+++ b/d/x.txt\n"
        "@@ -0,0 +1 @@\n+x\n")
    with prepare_workspace(fix_add.workspace) as workspace:
        ok, reason = apply_diff(workspace, link_then_write)
        assert not ok, reason
        assert not (workspace.root / "d").exists() and not (workspace.root / "x.txt").exists()


def test_validate_tasks_on_the_fixtures(backend, fix_add, three_functions, app_stats, swe):
    results = validate_tasks([fix_add, three_functions, app_stats, swe], backend)
    assert [r.name for r in results] == ["fix-add", "three-functions", "app-stats", swe.instance_id]
    assert all(r.ok and r.reference_score == 1 and r.empty_score == 0 for r in results), results


def test_every_harbor_fixture_validates_in_both_sandboxes(harbor_backend):
    tasks = load_harbor_tasks(FIXTURES / "harbor")
    results = validate_tasks(tasks, harbor_backend)
    assert {r.name for r in results} == {"app-stats", "fix-add", "three-functions"}
    assert all(r.ok and r.reference_score == 1 and r.empty_score == 0 for r in results), results


def test_validate_tasks_reports_a_broken_task(backend, fix_add, tmp_path):
    broken = shutil.copytree(FIXTURES / "harbor" / "fix-add", tmp_path / "broken")
    (broken / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    [result] = validate_tasks([load_harbor_task(broken)], backend)
    assert not result.ok and result.reference_score == 0
    assert "reference solution scores 0" in result.problem


def test_validate_tasks_reports_a_reference_solution_that_fails(backend, app_stats, tmp_path):
    broken = shutil.copytree(FIXTURES / "harbor" / "app-stats", tmp_path / "broken")
    (broken / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'no solution here' >&2\nexit 3\n")
    [result] = validate_tasks([load_harbor_task(broken)], backend)
    assert (result.ok, result.reference_score, result.empty_score) == (False, None, None)
    assert "reference solution of broken failed (exit 3)" in result.problem
    assert "no solution here" in result.log_tail


def test_unsafe_local_is_refused_unless_explicitly_allowed(tmp_path):
    for name in ("unsafe-local", "unsafe_local", "local", "UNSAFE-LOCAL"):
        with pytest.raises(ValueError, match="unsafe|allow_unsafe"):
            get_backend(name)
    for name in ("unsafe_local", "local"):
        with pytest.raises(ValueError, match="exactly 'unsafe-local'"):
            get_backend(name, allow_unsafe=True)
    with pytest.raises(ValueError, match="allow_unsafe=True"):
        get_backend("unsafe-local", allow_unsafe="yes")
    backend = get_backend("unsafe-local", allow_unsafe=True)
    assert isinstance(backend, UnsafeLocalBackend)
    result = backend.run("echo hi > f; cat f", tmp_path, limits=SandboxLimits())
    assert (result.exit_code, result.stdout) == (0, "hi\n")
    assert isinstance(get_backend("bubblewrap"), BubblewrapBackend)


def test_reward_json_forms():
    parse = _reward_from_json
    assert parse({"reward": 0.25})[0] == 0.25
    score, _, tests = parse({"tests": {"a": "passed", "b": "failed", "c": True, "d": "skipped"}})
    assert score == pytest.approx(2 / 3) and tests == {"a": "passed", "b": "failed", "c": "passed",
                                                       "d": "skipped"}
    assert parse({"reward": "1"})[0] is None
    assert parse([1])[0] is None


def test_store_log_is_atomic(tmp_path):
    storage = Storage(str(tmp_path))
    path = store_log(storage, "run-1", "grade-fix-add", "hello\n")
    assert Path(path).read_text() == "hello\n"
    assert [p.name for p in Path(path).parent.iterdir()] == ["grade-fix-add.log"]
    with pytest.raises(ValueError):
        store_log(storage, "run-1", "../escape", "x")


def test_fixture_sanity():
    """The shared fixtures are the tasks graded above."""
    rows = [json.loads(line) for line in (FIXTURES / "swebench" / "rows.jsonl").read_text().splitlines()
            if line.strip()]
    assert rows and (FIXTURES / "harbor" / "fix-add" / "tests" / "test.sh").is_file()


def test_the_grader_needs_no_pytest_and_agrees_with_its_plugin_on_names():
    """The services' images have no pytest: the SWE grader stages its plugin without importing it."""
    import ast
    import subprocess
    import sys

    from rollstream.shared.grading import pytest_report

    code = ("import sys; sys.modules['pytest'] = sys.modules['_pytest'] = None\n"
            "import rollstream.services.sandbox_grader.jobs, rollstream.shared.grading.swebench")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr == ""
    plugin_names = {node.targets[0].id: node.value.value
                    for node in ast.parse(pytest_report.PLUGIN_SOURCE.read_text()).body
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.targets[0], ast.Name)}
    for name in ("REPORT_DIR_ENV", "KEY_FILE", "REPORT_FILE"):
        assert plugin_names[name] == getattr(pytest_report, name)
