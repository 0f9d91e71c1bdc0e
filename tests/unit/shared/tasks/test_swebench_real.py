"""SWE-bench rows as the datasets publish them: the real-repository rows of
tests/fixtures/tasks/swebench-real (no repo_dir; the snapshot is checked out of a git clone of `repo`),
SWE-smith rows (the bug patch applied, its reverse the reference fix), and the errors that say what to do.

    python -m pytest tests/unit/shared/tasks/test_swebench_real.py -q
"""

import difflib
import json
import os
import shutil
import subprocess
import sys

import pytest

from rollstream.shared.errors import TaskError
from rollstream.shared.grading.validation import validate_tasks
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES
from tests.unit.shared.sandbox.test_venv_environments import environments_root

REAL = FIXTURES / "swebench-real"
REAL_ROWS = REAL / "rows.jsonl"
SEMVER = "python-semver__python-semver-426"
MORE_ITERTOOLS = "more-itertools__more-itertools-split-after"
MORE_PY = "more_itertools/more.py"
SPLIT_AFTER_MAXSPLIT = ("        if pred(item) and buf:\n"
                        "            yield buf\n"
                        "            if maxsplit == 1:\n")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def published_rows() -> list[dict]:
    return [json.loads(line) for line in REAL_ROWS.read_text().splitlines()]


def clone_bundles(repos_dir):
    """Git clones of the fixture's bundles, named owner__name, as a user's repos directory holds them."""
    repos_dir.mkdir(parents=True, exist_ok=True)
    for bundle in (REAL / "bundles").glob("*.bundle"):
        subprocess.run(["git", "clone", "-q", str(bundle), str(repos_dir / bundle.stem)], check=True,
                       capture_output=True)
    return repos_dir


@pytest.fixture(scope="module")
def clones(tmp_path_factory):
    return clone_bundles(tmp_path_factory.mktemp("clones") / "repos")


def write_rows(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def git_apply(workdir, patch, *flags):
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(workdir.parent)}
    return subprocess.run(["git", "apply", *flags, "-"], cwd=workdir, input=patch, text=True,
                          capture_output=True, env=env)


def test_the_fixture_rows_are_in_the_published_format():
    for row in published_rows():
        assert "repo_dir" not in row and "repos_dir" not in row
        assert isinstance(row["FAIL_TO_PASS"], str) and isinstance(json.loads(row["FAIL_TO_PASS"]), list)
        assert {"instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "version",
                "environment_setup_commit", "created_at", "hints_text", "PASS_TO_PASS"} <= set(row)


def test_published_rows_load_from_clones_in_a_repos_dir(clones):
    semver, more = load_swebench_rows(REAL_ROWS, repos_dir=clones)
    assert semver.instance_id == SEMVER and semver.repo == "python-semver/python-semver"
    assert semver.version == "3.0.1" and semver.environment_setup_commit == semver.base_commit
    assert semver.fail_to_pass == ["tests/test_subclass.py::test_replace_from_subclass"]
    assert semver.gold_patch.startswith("diff --git a/src/semver/version.py")
    snapshot = semver.repo_dir
    assert snapshot == clones / ".snapshots" / "python-semver__python-semver" / semver.base_commit
    assert not (snapshot / ".git").exists()
    assert "pythonpath = src tests" in (snapshot / "setup.cfg").read_text()
    assert "return Version(**version)" in (snapshot / "src" / "semver" / "version.py").read_text()
    assert more.repo_dir.parent.name == "more-itertools__more-itertools"
    assert (more.repo_dir / "more_itertools" / "more.py").is_file()
    # loading again reuses the snapshots
    marker = snapshot / "left-by-the-first-load"
    marker.touch()
    assert load_swebench_rows(REAL_ROWS, repos_dir=clones)[0].repo_dir == snapshot and marker.exists()
    marker.unlink()


def test_the_default_repos_dir_is_beside_the_file_and_a_row_may_name_its_own(tmp_path, clones):
    clone_bundles(tmp_path / "repos")
    [row] = [r for r in published_rows() if r["instance_id"] == MORE_ITERTOOLS]
    [task] = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [row]))
    assert task.repo_dir.is_relative_to(tmp_path / "repos" / ".snapshots")
    shutil.move(tmp_path / "repos", tmp_path / "elsewhere")
    [task] = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [{**row, "repos_dir": "elsewhere"}]))
    assert task.repo_dir.is_relative_to(tmp_path / "elsewhere")


def test_the_real_patches_apply_and_fix_the_failing_tests(tmp_path, clones):
    for task in load_swebench_rows(REAL_ROWS, repos_dir=clones):
        repo = shutil.copytree(task.repo_dir, tmp_path / task.instance_id)
        assert git_apply(repo, task.test_patch).returncode == 0
        pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        assert subprocess.run(pytest_cmd + task.fail_to_pass, cwd=repo, capture_output=True).returncode == 1
        assert subprocess.run(pytest_cmd + task.pass_to_pass, cwd=repo, capture_output=True).returncode == 0
        assert git_apply(repo, task.gold_patch).returncode == 0
        fixed = subprocess.run(pytest_cmd + task.fail_to_pass + task.pass_to_pass, cwd=repo,
                               capture_output=True, text=True)
        assert fixed.returncode == 0, fixed.stdout[-2000:]


@pytest.mark.parametrize("backend_name", ["bubblewrap", "docker"])
def test_the_real_rows_grade_reference_1_and_empty_0_in_their_environments(clones, backend_name, request):
    """Each in its environment (shared/tasks/environment_spec.py): semver, a src layout, installed with the
    default `pip install -e .` at its environment commit; more-itertools with no install commands (the
    fixture's environments.json). Under bubblewrap a virtual environment of the sandbox's Python, under docker
    an image built from the default one: built here, or reused from an earlier run."""
    if backend_name == "bubblewrap":
        if shutil.which("bwrap") is None:
            pytest.skip("bubblewrap (`bwrap`) is not installed")
        with environments_root() as root:
            results = validate_tasks(load_swebench_rows(REAL_ROWS, repos_dir=clones),
                                     get_backend("bubblewrap", environments_dir=root))
    else:
        request.getfixturevalue("docker_engine")  # skipped, with the reason, without an engine
        results = validate_tasks(load_swebench_rows(REAL_ROWS, repos_dir=clones), get_backend("docker"))
    assert [(r.name, r.reference_score, r.empty_score) for r in results] == [(SEMVER, 1, 0),
                                                                            (MORE_ITERTOOLS, 1, 0)], results


def swesmith_row(clones) -> dict:
    """A row as SWE-smith publishes them, over the more-itertools clone: no base_commit, the mirror's name
    in `repo`, and a `patch` that puts a bug into the clean tree."""
    [row] = [r for r in published_rows() if r["instance_id"] == MORE_ITERTOOLS]
    commit = row["base_commit"]
    clean = subprocess.run(["git", "-C", str(clones / "more-itertools__more-itertools"), "show",
                            f"{commit}:{MORE_PY}"], capture_output=True, text=True, check=True).stdout
    bugged = clean.replace(SPLIT_AFTER_MAXSPLIT, SPLIT_AFTER_MAXSPLIT.replace("== 1", "== 2"))
    assert bugged != clean
    bug = "".join(difflib.unified_diff(clean.splitlines(keepends=True), bugged.splitlines(keepends=True),
                                       f"a/{MORE_PY}", f"b/{MORE_PY}"))
    return {"instance_id": f"more-itertools__more-itertools.{commit[:8]}.func_pm_op_change__split_after",
            "repo": f"swesmith/more-itertools__more-itertools.{commit[:8]}", "patch": bug,
            "FAIL_TO_PASS": ["tests/test_more.py::SplitAfterTest::test_max_split"], "PASS_TO_PASS": [],
            "image_name": f"swesmith.x86_64.more-itertools__more-itertools.{commit[:8]}",
            "problem_statement": "split_after() splits once more than maxsplit asks"}


def test_a_swesmith_row_starts_from_the_bug_and_its_reference_is_the_bug_reversed(tmp_path, clones):
    record = swesmith_row(clones)
    [task] = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [record]), repos_dir=clones)
    assert SPLIT_AFTER_MAXSPLIT.replace("== 1", "== 2") in (task.repo_dir / MORE_PY).read_text()
    assert task.image_name == record["image_name"] and task.base_commit is None
    assert task.gold_patch != record["patch"] and task.test_patch == ""
    fixed = shutil.copytree(task.repo_dir, tmp_path / "fixed")
    assert git_apply(fixed, task.gold_patch).returncode == 0
    clean_commit = subprocess.run(["git", "-C", str(clones / "more-itertools__more-itertools"), "rev-parse",
                                   record["repo"].rsplit(".", 1)[1]], capture_output=True, text=True).stdout
    clean = subprocess.run(["git", "-C", str(clones / "more-itertools__more-itertools"), "show",
                            f"{clean_commit.strip()}:{MORE_PY}"], capture_output=True, text=True,
                           check=True).stdout
    assert (fixed / MORE_PY).read_text() == clean
    # a repo_dir cannot stand in for the clone: the row's patch is the bug, and the fix comes from the clone
    [again] = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [{**record, "repo_dir": "fixed"}]),
                                 repos_dir=clones)
    assert again.repo_dir == task.repo_dir and again.gold_patch == task.gold_patch


def test_a_swesmith_clone_may_carry_the_mirror_name(tmp_path, clones):
    record = swesmith_row(clones)
    repos = tmp_path / "repos"
    repos.mkdir()
    shutil.copytree(clones / "more-itertools__more-itertools", repos / record["repo"].split("/")[1])
    [task] = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [record]))
    assert task.repo_dir.parent.name == record["repo"].split("/")[1]


def test_install_config_is_kept_as_data(tmp_path, clones):
    [row] = [r for r in published_rows() if r["instance_id"] == SEMVER]
    config = {"python": "3.11", "install": "pip install -e .", "test_cmd": "pytest -rA"}
    rows = [{**row, "install_config": config},
            {**row, "instance_id": "as-a-string", "install_config": json.dumps(config)}]
    tasks = load_swebench_rows(write_rows(tmp_path / "rows.jsonl", rows), repos_dir=clones)
    assert [t.install_config for t in tasks] == [config, config]
    with pytest.raises(TaskError, match=r"row 0 \(.*\): 'install_config' must be an object, got list"):
        load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [{**row, "install_config": [1]}]),
                           repos_dir=clones)


@pytest.mark.parametrize("change, message", [
    ({}, r"row 0 \(python-semver__python-semver-426\): no clone of python-semver/python-semver in .*: "
         r"clone https://github\.com/python-semver/python-semver into .*/python-semver__python-semver$"),
    ({"base_commit": "0123456789abcdef0123456789abcdef01234567"},
     r"row 0 \(.*\): commit 0123456789abcdef0123456789abcdef01234567 is not in "
     r".*python-semver__python-semver: fetch it"),
    ({"base_commit": None}, r"row 0 \(.*\): 'base_commit' missing and no 'repo_dir'"),
    ({"repo": None}, r"row 0 \(.*\): 'repo_dir' missing, and no 'repo' to find a clone of"),
])
def test_a_row_that_lacks_what_grading_needs_says_what_to_do(tmp_path, clones, change, message):
    [row] = [r for r in published_rows() if r["instance_id"] == SEMVER]
    record = {k: v for k, v in {**row, **change}.items() if v is not None}
    path = write_rows(tmp_path / "rows.jsonl", [record])
    repos_dir = tmp_path / "empty" if not change else clones
    with pytest.raises(TaskError, match=message):
        load_swebench_rows(path, repos_dir=repos_dir)


def test_a_swesmith_bug_that_does_not_apply_is_an_error_naming_the_row(tmp_path, clones):
    record = swesmith_row(clones)
    record["patch"] = record["patch"].replace("             yield buf\n", "             yield buffer\n")
    with pytest.raises(TaskError, match=r"row 0 \(.*__split_after\): the bug 'patch' does not apply"):
        load_swebench_rows(write_rows(tmp_path / "rows.jsonl", [record]), repos_dir=clones)
