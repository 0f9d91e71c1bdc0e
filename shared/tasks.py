"""Coding tasks from files: Harbor task directories and SWE-bench rows, turned into prompt rows.

`load_dataset` (shared/datasets.py) hands a directory to `load_harbor_tasks` and a SWE-bench file
(JSONL or Parquet whose first record has `instance_id` and `FAIL_TO_PASS`) to `load_swebench_rows`;
`task_prompt_row` makes each task a `PromptRow` that asks for the coding tools
(shared/agent/coding.py) and tells the sandbox-grader how to grade the episode's diff.

Harbor tasks (the format of Harbor, terminal-bench's successor): one directory per task,

    fix-add/
        task.toml            configuration: [verifier] timeout_sec, [agent] timeout_sec, ...
        instruction.md       the agent's instruction (markdown, non-empty)
        environment/
            Dockerfile       the task's container (kept for the docker backend)
            workspace/       optional: the task's starting files (our convention, see below)
        tests/
            test.sh          the verifier: writes /logs/verifier/reward.txt (a number) or
                             reward.json ({"reward": ...}); it may give partial credit
            ...              anything test.sh needs (hidden from the agent)
        solution/
            solve.sh         optional reference solution

task.toml, for example (unknown sections and fields are kept in `config` and ignored; the fields
read here must have the right types):

    version = "1.0"                  # or schema_version = "1.1" with a [task] table
    [metadata]
    difficulty = "easy"
    [verifier]
    timeout_sec = 60.0               # positive number; default 120
    [agent]
    timeout_sec = 300.0              # positive number; default 600
    [environment]
    build_timeout_sec = 300.0
    cpus = 1
    memory_mb = 1024

Workspace convention: on machines without Docker the Dockerfile cannot be built, so a task's
starting files live in `environment/workspace/` (the Dockerfile COPYs them into its WORKDIR, e.g.
`COPY workspace/ /app/`, so both backends start from the same files). A copy of that directory is
the agent's repository and, with the agent's diff applied, the grader's workspace; a task without
it starts from an empty workspace. tests/test.sh runs with the workspace as its current directory
(/app in Docker), so it should read the workspace from the current directory (or from $WORKSPACE
when the grader sets it).

SWE-bench rows (JSONL, one object a line, or Parquet), with the fields of the SWE-bench datasets:
`instance_id`, `repo`, `base_commit`, `problem_statement`, `patch` (the reference fix),
`test_patch` (adds the tests), `FAIL_TO_PASS` and `PASS_TO_PASS` (lists of test ids, or those lists
JSON-encoded as strings, as the published datasets store them), plus our own:

    repo_dir       a local snapshot of `repo` at `base_commit` (relative paths are resolved against
                   the dataset file's directory); without it, `repos/<instance_id>/` beside the
                   dataset file is used if it exists
    test_command   optional; default "python -m pytest -rA -p no:cacheprovider"

Example:

    {"instance_id": "rollstream__tinystats-1", "repo": "rollstream/tinystats",
     "base_commit": "4f1c...", "problem_statement": "median() is wrong for ...",
     "patch": "diff --git a/tinystats/core.py ...", "test_patch": "diff --git a/tests/test_core.py ...",
     "FAIL_TO_PASS": "[\\"tests/test_core.py::test_median_even\\"]",
     "PASS_TO_PASS": "[\\"tests/test_core.py::test_mean\\"]", "repo_dir": "repos/tiny-repo"}

Every problem raises `TaskError` naming the file and the field (and the row, for SWE-bench), e.g.
"tasks/fix-bug/task.toml: [verifier] timeout_sec must be a positive number, got 'abc'".
The example tasks in tests/fixtures/tasks/ show both formats:

    python -m pytest tests/unit/test_tasks.py -q
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_VERIFIER_TIMEOUT_S = 120.0
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_SWE_TEST_COMMAND = "python -m pytest -rA -p no:cacheprovider"

TOOLS_NOTE = (
    "Your tools (read_file, write_file, edit_file, list_files, run_shell, run_tests) work on the "
    "task's repository, which is the current directory for shell commands. Edit its files to solve "
    "the task: your changes to the repository are your answer, and the task's tests grade them "
    "when you finish."
)


class TaskError(ValueError):
    """The task cannot be used; the message names the file and the field (and the row)."""


@dataclass(frozen=True)
class HarborTask:
    name: str                       # the task directory's name
    path: Path                      # the task directory (absolute)
    instruction: str                # the text of instruction.md
    config: dict[str, Any]          # task.toml, parsed
    workspace: Path | None          # environment/workspace/, or None: an empty workspace
    dockerfile: Path                # environment/Dockerfile
    tests_dir: Path                 # tests/ (holds test.sh)
    solution: Path | None           # solution/solve.sh, if the task has one
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S


@dataclass(frozen=True)
class SweTask:
    instance_id: str
    repo_dir: Path                  # a local snapshot of the repository at its base commit
    problem_statement: str
    test_patch: str                 # may be empty
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_command: str = DEFAULT_SWE_TEST_COMMAND
    gold_patch: str | None = None   # the reference `patch`
    dataset: Path | None = None     # the file the row came from (absolute)


# Harbor


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(table: dict[str, Any], section: str, key: str, where: Path,
                     default: float | None = None) -> float | None:
    if key not in table:
        return default
    value = table[key]
    if not _is_number(value) or value <= 0:
        raise TaskError(f"{where}: [{section}] {key} must be a positive number, got {value!r}")
    return float(value)


_KINDS = {str: (str,), "number": (int, float), bool: (bool,), dict: (dict,), list: (list,)}
_KIND_NAMES = {str: "a string", "number": "a number", bool: "true or false", dict: "a table", list: "a list"}


def _check_types(table: dict[str, Any], section: str, where: Path, kinds: dict[str, tuple[Any, ...]]) -> None:
    """Each named field, when present, must be one of its kinds (str, "number", bool, dict, list)."""
    label = f"[{section}] " if section else ""
    for key, allowed in kinds.items():
        if key not in table:
            continue
        value = table[key]
        ok = any(isinstance(value, _KINDS[kind]) and (kind is bool or not isinstance(value, bool))
                 for kind in allowed)
        if not ok:
            names = " or ".join(_KIND_NAMES[kind] for kind in allowed)
            raise TaskError(f"{where}: {label}{key} must be {names}, got {value!r}")


def _section(config: dict[str, Any], name: str, where: Path) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise TaskError(f"{where}: [{name}] must be a table, got {value!r}")
    return value


def _validate_config(config: dict[str, Any], where: Path) -> tuple[float, float]:
    _check_types(config, "", where, {"version": (str,), "schema_version": (str,)})
    task = _section(config, "task", where)
    _check_types(task, "task", where, {"name": (str,), "description": (str,), "keywords": (list,),
                                       "authors": (list,)})
    _section(config, "metadata", where)

    verifier = _section(config, "verifier", where)
    verifier_timeout = _positive_number(verifier, "verifier", "timeout_sec", where, DEFAULT_VERIFIER_TIMEOUT_S)
    _check_types(verifier, "verifier", where, {"env": (dict,), "user": (str,)})
    env = verifier.get("env", {})
    for key, value in env.items():
        if not isinstance(value, str):
            raise TaskError(f"{where}: [verifier] env.{key} must be a string, got {value!r}")

    agent = _section(config, "agent", where)
    agent_timeout = _positive_number(agent, "agent", "timeout_sec", where, DEFAULT_AGENT_TIMEOUT_S)

    environment = _section(config, "environment", where)
    for key in ("build_timeout_sec", "cpus", "memory_mb", "storage_mb"):
        _positive_number(environment, "environment", key, where)
    _check_types(environment, "environment", where, {
        "memory": (str, "number"), "storage": (str, "number"), "allow_internet": (bool,),
        "docker_image": (str,),
    })
    return verifier_timeout, agent_timeout


def load_harbor_task(path: Path) -> HarborTask:
    """One Harbor task directory, checked; see the module docstring for the layout."""
    if not path.is_dir():
        raise TaskError(f"{path}: not a task directory (no such directory)")
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        raise TaskError(f"{toml_path}: missing (every task needs its task.toml)")
    try:
        config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise TaskError(f"{toml_path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{toml_path}: invalid TOML: {exc}") from exc
    verifier_timeout, agent_timeout = _validate_config(config, toml_path)

    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{instruction_path}: missing (the agent's instruction)")
    try:
        instruction = instruction_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"{instruction_path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not instruction.strip():
        raise TaskError(f"{instruction_path}: empty (the agent's instruction)")

    dockerfile = path / "environment" / "Dockerfile"
    if not dockerfile.is_file():
        raise TaskError(f"{dockerfile}: missing (the task's environment)")
    test_sh = path / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskError(f"{test_sh}: missing (the task's verifier)")

    root = path.resolve()
    workspace = root / "environment" / "workspace"
    solve_sh = root / "solution" / "solve.sh"
    return HarborTask(
        name=root.name,
        path=root,
        instruction=instruction.strip() + "\n",
        config=config,
        workspace=workspace if workspace.is_dir() else None,
        dockerfile=root / "environment" / "Dockerfile",
        tests_dir=root / "tests",
        solution=solve_sh if solve_sh.is_file() else None,
        verifier_timeout_s=verifier_timeout,
        agent_timeout_s=agent_timeout,
    )


def load_harbor_tasks(root: Path) -> list[HarborTask]:
    """`root` is one task directory (it has a task.toml) or a directory of task directories, loaded
    in name order; hidden directories and plain files beside the tasks are skipped."""
    if not root.is_dir():
        raise TaskError(f"{root}: no such task directory")
    if (root / "task.toml").exists():
        return [load_harbor_task(root)]
    children = sorted((child for child in root.iterdir()
                       if child.is_dir() and not child.name.startswith((".", "__"))),
                      key=lambda child: child.name)
    if not children:
        raise TaskError(f"{root}: no tasks (expected a task.toml here, or task directories in it)")
    return [load_harbor_task(child) for child in children]


# SWE-bench


def _read_records(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several kinds for a bad file
            raise TaskError(f"{path}: cannot read Parquet ({exc})") from exc
    if path.suffix in (".jsonl", ".json"):
        records = []
        for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TaskError(f"{path} line {line_number}: not JSON ({exc.msg})") from exc
        return records
    raise TaskError(f"{path}: unknown SWE-bench file format {path.suffix!r} (use .jsonl or .parquet)")


def _test_ids(record: dict[str, Any], key: str, where: str, required: bool) -> list[str]:
    value = record.get(key)
    if value is None or value == "":
        if required:
            raise TaskError(f"{where}: '{key}' missing (a list of test ids)")
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: '{key}' is a string but not a JSON-encoded list ({exc.msg})") from exc
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) and item for item in value):
        raise TaskError(f"{where}: '{key}' must be a list of test ids (strings), got {value!r}")
    if required and not value:
        raise TaskError(f"{where}: '{key}' is empty (a task needs at least one failing test to fix)")
    return list(value)


def _optional_str(record: dict[str, Any], key: str, where: str) -> str | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TaskError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _swe_row(record: Any, path: Path, where: str) -> SweTask:
    if not isinstance(record, dict):
        raise TaskError(f"{where}: expected an object, got {type(record).__name__}")
    instance_id = record.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id.strip():
        raise TaskError(f"{where}: 'instance_id' missing or not a non-empty string")
    where = f"{where} ({instance_id})"
    problem = _optional_str(record, "problem_statement", where)
    if not problem or not problem.strip():
        raise TaskError(f"{where}: 'problem_statement' missing or empty")
    fail_to_pass = _test_ids(record, "FAIL_TO_PASS", where, required=True)
    pass_to_pass = _test_ids(record, "PASS_TO_PASS", where, required=False)
    test_patch = _optional_str(record, "test_patch", where) or ""
    gold_patch = _optional_str(record, "patch", where) or None
    test_command = _optional_str(record, "test_command", where) or DEFAULT_SWE_TEST_COMMAND

    base = path.resolve().parent
    repo_value = record.get("repo_dir")
    if repo_value is None or repo_value == "":
        fallback = base / "repos" / instance_id
        if "/" in instance_id or "\\" in instance_id or instance_id.startswith(".") or not fallback.is_dir():
            raise TaskError(f"{where}: 'repo_dir' missing (a local snapshot of {record.get('repo') or 'the repository'}"
                            f" at {record.get('base_commit') or 'its base commit'}; or put one at {fallback})")
        repo_dir = fallback
    elif not isinstance(repo_value, str):
        raise TaskError(f"{where}: 'repo_dir' must be a path string, got {type(repo_value).__name__}")
    else:
        repo_dir = (base / repo_value).resolve()
        if not repo_dir.is_dir():
            raise TaskError(f"{where}: 'repo_dir' {repo_value!r} is not a directory ({repo_dir})")
    return SweTask(
        instance_id=instance_id,
        repo_dir=repo_dir,
        problem_statement=problem,
        test_patch=test_patch,
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        test_command=test_command,
        gold_patch=gold_patch,
        dataset=path.resolve(),
    )


def load_swebench_rows(path: Path) -> list[SweTask]:
    """SWE-bench rows from a JSONL or Parquet file; rows are numbered from 0 in errors, as in
    shared/datasets.py."""
    if not path.is_file():
        raise TaskError(f"{path}: no such SWE-bench file")
    tasks: list[SweTask] = []
    seen: dict[str, int] = {}
    for index, record in enumerate(_read_records(path)):
        task = _swe_row(record, path, f"{path} row {index}")
        if task.instance_id in seen:
            raise TaskError(f"{path} row {index}: 'instance_id' {task.instance_id!r} repeats row {seen[task.instance_id]}")
        seen[task.instance_id] = index
        tasks.append(task)
    if not tasks:
        raise TaskError(f"{path}: the file has no rows")
    return tasks


def is_swebench_record(record: Any) -> bool:
    """Whether a dataset record looks like a SWE-bench row (load_dataset's test on the first one)."""
    return isinstance(record, dict) and "instance_id" in record and "FAIL_TO_PASS" in record


# prompt rows


def task_prompt_row(task: HarborTask | SweTask):
    """The prompt row for one task: the instruction (or problem statement) and a note on the
    tools, the coding tools, the workspace in metadata and what the grader needs to grade it."""
    from shared.agent.coding import CODING_TOOLS
    from shared.datasets import PromptRow

    if isinstance(task, HarborTask):
        text = task.instruction.strip()
        metadata: dict[str, Any] = {}
        if task.workspace is not None:
            metadata["repo"] = str(task.workspace)
        else:
            metadata["files"] = {}
        metadata["grader"] = {"kind": "harbor", "task_dir": str(task.path)}
    elif isinstance(task, SweTask):
        text = task.problem_statement.strip()
        metadata = {
            "repo": str(task.repo_dir),
            "test_command": task.test_command,
            "grader": {"kind": "swebench", "instance_id": task.instance_id,
                       "dataset": str(task.dataset) if task.dataset is not None else None},
        }
    else:
        raise TypeError(f"task_prompt_row takes a HarborTask or a SweTask, got {type(task).__name__}")
    return PromptRow(
        messages=[{"role": "user", "content": f"{text}\n\n{TOOLS_NOTE}"}],
        label=None,
        sandbox_check=None,
        agent=None,
        tools=list(CODING_TOOLS),
        metadata=metadata,
    )
