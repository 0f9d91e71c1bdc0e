import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstream.shared.errors import DatasetError, TaskError
from rollstream.shared.tasks.datasets import load_dataset
from rollstream.shared.tasks.harbor import (
    HarborTask,
    dockerfile_workdir,
    load_harbor_task,
    load_harbor_tasks,
)
from rollstream.shared.tasks.prompts import task_prompt_row
from rollstream.shared.tasks.rows import CODING_TOOLS
from rollstream.shared.tasks.swebench import DEFAULT_SWE_TEST_COMMAND, SweTask, load_swebench_rows
from tests.support import FIXTURES

HARBOR = FIXTURES / "harbor"
SWE_ROWS = FIXTURES / "swebench" / "rows.jsonl"
TINY_REPO = FIXTURES / "swebench" / "repos" / "tiny-repo"


@pytest.fixture
def task_dir(tmp_path):
    """A copy of fix-add to break."""
    return Path(shutil.copytree(HARBOR / "fix-add", tmp_path / "tasks" / "fix-add"))


def swe_record(**overrides):
    record = json.loads(SWE_ROWS.read_text().splitlines()[0])
    record["repo_dir"] = str(TINY_REPO)
    record["dockerfile"] = str(SWE_ROWS.parent / record["dockerfile"])
    record.update(overrides)
    return {k: v for k, v in record.items() if v is not None}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Harbor: the fixtures


def test_harbor_fixtures_load_in_name_order():
    tasks = load_harbor_tasks(HARBOR)
    assert [t.name for t in tasks] == ["app-stats", "fix-add", "three-functions"]
    assert [t.workdir for t in tasks] == ["/app", "/app", "/app"]
    add = tasks[1]
    assert isinstance(add, HarborTask) and add.path == HARBOR / "fix-add"
    assert add.instruction.startswith("# Fix `add`")
    assert add.workspace == HARBOR / "fix-add" / "environment" / "workspace"
    assert (add.workspace / "calc.py").is_file()
    assert add.dockerfile.read_text().startswith("FROM python:3.11-slim")
    assert (add.tests_dir / "test.sh").is_file()
    assert add.solution == HARBOR / "fix-add" / "solution" / "solve.sh"
    assert add.verifier_timeout_s == 60.0 and add.agent_timeout_s == 300.0
    assert add.config["metadata"]["difficulty"] == "easy"
    assert tasks[2].agent_timeout_s == 600.0 and tasks[2].solution is not None


def test_one_task_directory_is_a_dataset_of_one():
    assert [t.name for t in load_harbor_tasks(HARBOR / "three-functions")] == ["three-functions"]


def test_defaults_and_lenient_extras(task_dir):
    (task_dir / "task.toml").write_text(
        'schema_version = "1.1"\nsomething_new = 3\n[task]\nname = "org/fix-add"\n'
        '[verifier]\nfuture_field = "x"\n[brand_new_section]\nk = 1\n')
    shutil.rmtree(task_dir / "solution")
    shutil.rmtree(task_dir / "environment" / "workspace")
    task = load_harbor_task(task_dir)
    assert task.verifier_timeout_s == 120.0 and task.agent_timeout_s == 600.0
    assert task.solution is None and task.workspace is None
    assert task.config["brand_new_section"] == {"k": 1}


def run_verifier(task: Path, workspace: Path, logs: Path) -> str:
    """The reward test.sh wrote: reward.txt's text, or reward.json's "reward"."""
    env = {**os.environ, "VERIFIER_LOG_DIR": str(logs)}
    subprocess.run(["bash", str(task / "tests" / "test.sh")], cwd=workspace, env=env, check=True,
                   capture_output=True, timeout=60)
    if (logs / "reward.json").exists():
        return str(json.loads((logs / "reward.json").read_text())["reward"])
    return (logs / "reward.txt").read_text().strip()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None,
                    reason="needs bash, python3")
@pytest.mark.parametrize("name", ["fix-add", "three-functions"])
def test_fixture_verifiers_score_the_start_0_and_the_solution_1(tmp_path, name):
    task = HARBOR / name
    workspace = Path(shutil.copytree(task / "environment" / "workspace", tmp_path / "ws"))
    assert run_verifier(task, workspace, tmp_path / "logs") == "0"
    subprocess.run(["bash", str(task / "solution" / "solve.sh")], cwd=workspace, check=True, timeout=60)
    assert run_verifier(task, workspace, tmp_path / "logs") == "1"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None,
                    reason="needs bash, python3")
def test_three_functions_gives_partial_credit(tmp_path):
    task = HARBOR / "three-functions"
    workspace = Path(shutil.copytree(task / "environment" / "workspace", tmp_path / "ws"))
    source = workspace / "textutils.py"
    source.write_text(source.read_text().replace('if ch in "aeiou")', 'if ch.lower() in "aeiou")'))
    assert run_verifier(task, workspace, tmp_path / "logs") == "0.3333"
    source.write_text(source.read_text().replace('" ".join(sentence.split())',
                                                 '" ".join(sentence.split()[::-1])'))
    assert run_verifier(task, workspace, tmp_path / "logs") == "0.6667"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python3") is None,
                    reason="needs bash, python3")
def test_fix_add_reports_each_case_as_a_test(tmp_path):
    task = HARBOR / "fix-add"
    workspace = Path(shutil.copytree(task / "environment" / "workspace", tmp_path / "ws"))
    assert run_verifier(task, workspace, tmp_path / "logs") == "0"
    assert json.loads((tmp_path / "logs" / "reward.json").read_text())["tests"] == {
        "add(2, 3) == 5": False, "add(0, 0) == 0": True, "add(-4, 10) == 6": False,
        "add(1.5, 2.5) == 4.0": False}


# Harbor: the workdir, from the Dockerfile


@pytest.mark.parametrize("dockerfile, workdir", [
    ("FROM python:3.12-slim\nCOPY workspace/ /app/\n", "/app"),
    ("FROM python:3.12-slim\nWORKDIR /srv\nWORKDIR /code\nCOPY workspace/ .\n", "/code"),
    ("FROM python:3.12-slim\nWORKDIR /srv\nWORKDIR project\nWORKDIR ../other//x/\n", "/srv/other/x"),
    ("FROM python:3.12-slim\nWORKDIR app\n", "/app"),
    ("FROM golang:1.22 AS build\nWORKDIR /src\nRUN go build\n"
     "FROM debian:bookworm-slim\nCOPY --from=build /src/tool /usr/local/bin/\n", "/app"),
    ("FROM golang:1.22 AS build\nWORKDIR /src\nFROM debian:bookworm-slim\nWORKDIR /opt/task\n",
     "/opt/task"),
    ("FROM python:3.12 AS Base\nWORKDIR /work\nFROM base AS test\nWORKDIR tests\n", "/work/tests"),
    ("FROM --platform=linux/amd64 python:3.12 AS base\nWORKDIR /work\nFROM base\n", "/work"),
    ("FROM python:3.12 AS build\nWORKDIR $GOPATH/src\nFROM python:3.12\nWORKDIR /ok\n", "/ok"),
    ('# a comment\nfrom python:3.12\nworkdir\t"/quoted"\n', "/quoted"),
    ("FROM python:3.12\nRUN apt-get update \\\n    # a comment inside\n    && true\nWORKDIR /after\n",
     "/after"),
    ("FROM python:3.12\nWORKDIR /code\nRUN cat > /code/x.py <<'EOF'\nfrom os import path\n"
     "WORKDIR /not-an-instruction\nEOF\nRUN cat <<<'no heredoc'\n", "/code"),
])
def test_workdir_is_the_final_stages_last_workdir(tmp_path, dockerfile, workdir):
    (tmp_path / "Dockerfile").write_text(dockerfile)
    assert dockerfile_workdir(tmp_path / "Dockerfile") == workdir


def test_workdir_without_a_dockerfile_is_app(tmp_path):
    assert dockerfile_workdir(None) == dockerfile_workdir(tmp_path / "Dockerfile") == "/app"


def test_a_task_runs_in_its_dockerfiles_workdir(task_dir):
    (task_dir / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /srv/task\n")
    assert load_harbor_task(task_dir).workdir == "/srv/task"
    assert task_prompt_row(load_harbor_task(task_dir)).metadata["workdir"] == "/srv/task"


@pytest.mark.parametrize("workdir, message", [
    ("/usr/src/app", r"the workspace cannot be mounted at its WORKDIR: WORKDIR '/usr/src/app' is \(under\) "
                     r"the sandbox's /usr"),
    ("/", r"WORKDIR '/' is \(under\) the sandbox's /$"),
    ("/tmp", r"the sandbox's /tmp"),
    ("$HOME/app", r"WORKDIR /\$HOME/app depends on a variable"),
])
def test_a_workdir_no_sandbox_can_use_is_a_task_error(task_dir, workdir, message):
    (task_dir / "environment" / "Dockerfile").write_text(f"FROM python:3.12-slim\nWORKDIR {workdir}\n")
    with pytest.raises(TaskError, match=r"fix-add/environment/Dockerfile: .*" + message):
        load_harbor_task(task_dir)


# Harbor: broken tasks name the file and the field


def test_missing_task_toml(task_dir):
    (task_dir / "task.toml").unlink()
    with pytest.raises(TaskError, match=r"fix-add/task\.toml: missing"):
        load_harbor_task(task_dir)


def test_bad_toml_syntax_names_the_line(task_dir):
    (task_dir / "task.toml").write_text('version = "1.0"\n\n[verifier\ntimeout_sec = 60\n')
    with pytest.raises(TaskError, match=r"fix-add/task\.toml: invalid TOML: .*line 3"):
        load_harbor_task(task_dir)


@pytest.mark.parametrize("section, value, shown", [
    ("verifier", '"abc"', "'abc'"),
    ("verifier", "-5", "-5"),
    ("verifier", "0", "0"),
    ("agent", "true", "True"),
    ("agent", "[1]", r"\[1\]"),
])
def test_wrong_timeout_type(task_dir, section, value, shown):
    (task_dir / "task.toml").write_text(f"[{section}]\ntimeout_sec = {value}\n")
    with pytest.raises(TaskError, match=rf"fix-add/task\.toml: \[{section}\] timeout_sec must be a positive "
                                        rf"number, got {shown}$"):
        load_harbor_task(task_dir)


def test_exact_message_for_a_string_timeout(task_dir):
    (task_dir / "task.toml").write_text('[verifier]\ntimeout_sec = "abc"\n')
    with pytest.raises(TaskError) as info:
        load_harbor_task(task_dir)
    assert str(info.value) == (f"{task_dir}/task.toml: [verifier] timeout_sec must be a positive number, "
                               "got 'abc'")


@pytest.mark.parametrize("toml, message", [
    ("verifier = 3\n", r"\[verifier\] must be a table, got 3"),
    ('[environment]\ncpus = "two"\n', r"\[environment\] cpus must be a positive number, got 'two'"),
    ('[environment]\nallow_internet = "yes"\n', r"\[environment\] allow_internet must be true or false"),
    ("[verifier]\nenv = { A = 1 }\n", r"\[verifier\] env\.A must be a string, got 1"),
    ("version = 1\n", r"task\.toml: version must be a string, got 1"),
])
def test_wrong_types_of_other_known_fields(task_dir, toml, message):
    (task_dir / "task.toml").write_text(toml)
    with pytest.raises(TaskError, match=message):
        load_harbor_task(task_dir)


def test_empty_instruction(task_dir):
    (task_dir / "instruction.md").write_text("  \n\n")
    with pytest.raises(TaskError, match=r"fix-add/instruction\.md: empty"):
        load_harbor_task(task_dir)


def test_missing_instruction(task_dir):
    (task_dir / "instruction.md").unlink()
    with pytest.raises(TaskError, match=r"fix-add/instruction\.md: missing"):
        load_harbor_task(task_dir)


def test_missing_test_sh(task_dir):
    (task_dir / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"fix-add/tests/test\.sh: missing"):
        load_harbor_task(task_dir)


def test_missing_dockerfile(task_dir):
    (task_dir / "environment" / "Dockerfile").unlink()
    with pytest.raises(TaskError, match=r"fix-add/environment/Dockerfile: missing"):
        load_harbor_task(task_dir)


def test_a_broken_task_among_several_is_named(tmp_path):
    root = tmp_path / "tasks"
    shutil.copytree(HARBOR, root)
    (root / "three-functions" / "instruction.md").write_text("")
    with pytest.raises(TaskError, match=r"three-functions/instruction\.md: empty"):
        load_harbor_tasks(root)


def test_an_empty_root_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match=r"empty: no tasks"):
        load_harbor_tasks(tmp_path / "empty")
    with pytest.raises(TaskError, match=r"nowhere: no such task directory"):
        load_harbor_tasks(tmp_path / "nowhere")


# SWE-bench


def test_swebench_fixture_loads():
    [task] = load_swebench_rows(SWE_ROWS)
    assert isinstance(task, SweTask)
    assert task.instance_id == "rollstream__tinystats-1"
    assert task.repo_dir == TINY_REPO and task.dataset == SWE_ROWS
    assert task.fail_to_pass == ["tests/test_core.py::test_median_even"]
    assert task.pass_to_pass == ["tests/test_core.py::test_mean", "tests/test_core.py::test_mean_empty",
                                 "tests/test_core.py::test_median_odd"]
    assert task.test_patch.startswith("diff --git a/tests/test_core.py")
    assert task.gold_patch.startswith("diff --git a/tinystats/core.py")
    assert task.test_command == DEFAULT_SWE_TEST_COMMAND
    assert "median()" in task.problem_statement


def test_lists_relative_repo_dir_and_parquet(tmp_path):
    shutil.copytree(TINY_REPO, tmp_path / "snap")
    record = swe_record(FAIL_TO_PASS=["t.py::a"], PASS_TO_PASS=[], repo_dir="snap", test_command="pytest -x",
                        patch=None, test_patch=None)
    [task] = load_swebench_rows(write_jsonl(tmp_path / "rows.jsonl", [record]))
    assert task.fail_to_pass == ["t.py::a"] and task.pass_to_pass == []
    assert task.repo_dir == tmp_path / "snap" and task.test_command == "pytest -x"
    assert task.gold_patch is None and task.test_patch == ""
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "rows.parquet")
    [task] = load_swebench_rows(tmp_path / "rows.parquet")
    assert task.fail_to_pass == ["t.py::a"] and task.repo_dir == tmp_path / "snap"


def test_snapshot_found_under_repos_by_instance_id(tmp_path):
    shutil.copytree(TINY_REPO, tmp_path / "repos" / "x__y-1")
    [task] = load_swebench_rows(write_jsonl(tmp_path / "rows.jsonl", [swe_record(instance_id="x__y-1",
                                                                                 repo_dir=None)]))
    assert task.repo_dir == tmp_path / "repos" / "x__y-1"


@pytest.mark.parametrize("overrides, message", [
    ({"instance_id": None}, r"rows\.jsonl row 1: 'instance_id' missing"),
    ({"FAIL_TO_PASS": "not json"}, r"rows\.jsonl row 1 \(a-2\): 'FAIL_TO_PASS' is a string but not a JSON"),
    ({"FAIL_TO_PASS": "[1, 2]"}, r"rows\.jsonl row 1 \(a-2\): 'FAIL_TO_PASS' must be a list of test ids"),
    ({"FAIL_TO_PASS": "[]"}, r"rows\.jsonl row 1 \(a-2\): 'FAIL_TO_PASS' is empty"),
    ({"FAIL_TO_PASS": None}, r"rows\.jsonl row 1 \(a-2\): 'FAIL_TO_PASS' missing"),
    ({"PASS_TO_PASS": '{"a": 1}'}, r"rows\.jsonl row 1 \(a-2\): 'PASS_TO_PASS' must be a list"),
    ({"repo_dir": None}, r"rows\.jsonl row 1 \(a-2\): no clone of rollstream/tinystats in .*repos: "
                         r"clone https://github\.com/rollstream/tinystats into .*rollstream__tinystats"),
    ({"repo_dir": "no/such/dir"}, r"rows\.jsonl row 1 \(a-2\): 'repo_dir' 'no/such/dir' is not a directory"),
    ({"problem_statement": ""}, r"rows\.jsonl row 1 \(a-2\): 'problem_statement' missing or empty"),
    ({"instance_id": "a-1"}, r"rows\.jsonl row 1: 'instance_id' 'a-1' repeats row 0"),
])
def test_bad_swebench_rows_name_file_row_and_field(tmp_path, overrides, message):
    path = write_jsonl(tmp_path / "rows.jsonl", [swe_record(instance_id="a-1"),
                                                swe_record(**{"instance_id": "a-2", **overrides})])
    with pytest.raises(TaskError, match=message):
        load_swebench_rows(path)


def git_apply_check(workdir: Path, patch: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(workdir.parent)}
    return subprocess.run(["git", "apply", "--check", "-"], cwd=workdir, input=patch, text=True,
                          capture_output=True, env=env)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_fixture_patches_apply_and_fix_the_failing_test(tmp_path):
    [task] = load_swebench_rows(SWE_ROWS)
    for name, patch in [("test", task.test_patch), ("gold", task.gold_patch)]:
        copy = Path(shutil.copytree(task.repo_dir, tmp_path / name))
        result = git_apply_check(copy, patch)
        assert result.returncode == 0, result.stderr
    # both together: the failing test fails before the gold patch and passes after it
    repo = Path(shutil.copytree(task.repo_dir, tmp_path / "both"))
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    subprocess.run(["git", "apply", "-"], cwd=repo, input=task.test_patch, text=True, check=True, env=env)
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    assert subprocess.run(pytest_cmd + task.fail_to_pass, cwd=repo, capture_output=True).returncode == 1
    assert subprocess.run(pytest_cmd + task.pass_to_pass, cwd=repo, capture_output=True).returncode == 0
    subprocess.run(["git", "apply", "-"], cwd=repo, input=task.gold_patch, text=True, check=True, env=env)
    assert subprocess.run(pytest_cmd + task.fail_to_pass + task.pass_to_pass, cwd=repo,
                          capture_output=True).returncode == 0


# prompt rows and load_dataset


def test_harbor_prompt_row():
    task = load_harbor_task(HARBOR / "fix-add")
    row = task_prompt_row(task)
    [message] = row.messages
    assert message["role"] == "user" and message["content"].startswith(task.instruction.strip())
    assert "repository" in message["content"]
    assert row.tools == list(CODING_TOOLS) and row.agent is None
    assert row.label is None and row.sandbox_check is None and row.reward_fn == "exact_match"
    assert row.metadata == {"repo": str(HARBOR / "fix-add" / "environment" / "workspace"),
                            "workdir": "/app",
                            "grader": {"kind": "harbor", "task_dir": str(HARBOR / "fix-add")},
                            "time_budget_s": 300.0}  # [agent] timeout_sec: a black-box agent's time budget
    assert json.loads(json.dumps(row.metadata)) == row.metadata


def test_a_harbor_task_without_an_agent_timeout_leaves_the_budget_to_the_config(task_dir):
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace("[agent]\ntimeout_sec = 300.0\n", "[agent]\n"))
    assert "time_budget_s" not in task_prompt_row(load_harbor_task(task_dir)).metadata


def test_harbor_prompt_row_without_a_workspace(task_dir):
    shutil.rmtree(task_dir / "environment" / "workspace")
    row = task_prompt_row(load_harbor_task(task_dir))
    assert row.metadata["files"] == {} and "repo" not in row.metadata


def test_swebench_prompt_row():
    [task] = load_swebench_rows(SWE_ROWS)
    row = task_prompt_row(task)
    assert row.messages[0]["content"].startswith("median() is wrong")
    assert row.tools == list(CODING_TOOLS) and row.agent is None and row.label is None
    assert row.metadata == {
        "repo": str(TINY_REPO),
        "test_command": DEFAULT_SWE_TEST_COMMAND,
        "grader": {"kind": "swebench", "instance_id": "rollstream__tinystats-1", "dataset": str(SWE_ROWS)},
    }
    assert json.loads(json.dumps(row.metadata)) == row.metadata


def test_load_dataset_reads_task_directories_and_swebench_files(tmp_path):
    rows = load_dataset(HARBOR)
    assert [r.metadata["grader"]["task_dir"] for r in rows] == [str(HARBOR / "app-stats"),
                                                                str(HARBOR / "fix-add"),
                                                                str(HARBOR / "three-functions")]
    assert [r.metadata["grader"]["kind"] for r in load_dataset(SWE_ROWS)] == ["swebench"]
    pq.write_table(pa.Table.from_pylist([swe_record()]), tmp_path / "rows.parquet")
    [row] = load_dataset(tmp_path / "rows.parquet")
    assert row.metadata["grader"]["dataset"] == str(tmp_path / "rows.parquet")


def test_load_dataset_turns_task_errors_into_dataset_errors(tmp_path, task_dir):
    (task_dir / "tests" / "test.sh").unlink()
    with pytest.raises(DatasetError, match=r"fix-add/tests/test\.sh: missing"):
        load_dataset(task_dir)
    path = write_jsonl(tmp_path / "rows.jsonl", [swe_record(FAIL_TO_PASS="nope")])
    with pytest.raises(DatasetError, match=r"rows\.jsonl row 0 \(.*\): 'FAIL_TO_PASS'"):
        load_dataset(path)


def test_a_swebench_row_naming_a_dockerfile_that_is_not_there(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [swe_record(dockerfile="environment/Dockerfile")])
    with pytest.raises(TaskError, match=r"rows\.jsonl row 0 \(rollstream__tinystats-1\): 'dockerfile' "
                                        r"'environment/Dockerfile' is not a file"):
        load_swebench_rows(path)
    [task] = load_swebench_rows(write_jsonl(tmp_path / "rows.jsonl", [swe_record()]))
    assert task.dockerfile == SWE_ROWS.parent / "environment" / "Dockerfile"
