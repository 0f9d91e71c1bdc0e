"""SWE-bench rows: loading and checking them.

SWE-bench rows (JSONL, one object a line, or Parquet), with the fields of the SWE-bench datasets:
`instance_id`, `repo`, `base_commit`, `problem_statement`, `patch` (the reference fix),
`test_patch` (adds the tests), `FAIL_TO_PASS` and `PASS_TO_PASS` (lists of test ids, or those lists
JSON-encoded as strings, as the published datasets store them), plus our own:

    repo_dir       optional; a local snapshot of `repo` at `base_commit` (relative paths are resolved
                   against the dataset file's directory); without it, `repos/<instance_id>/` beside
                   the dataset file if it exists, else the row's `base_commit` checked out of a git
                   clone of `repo` in the repos directory (shared/tasks/swebench_repos.py)
    repos_dir      optional; the directory of git clones named `owner__name` (relative to the
                   dataset file); else load_swebench_rows' `repos_dir`, else `repos/` beside the file
    test_command   optional; default "python -m pytest -rA -p no:cacheprovider". One pytest session:
                   the grader scores the tests from pytest's own record of that session (see
                   shared/grading/swebench.py), so a command that runs no pytest scores 0
    dockerfile     optional; a Dockerfile (relative to the dataset file) of the test environment, which
                   the docker backend builds and runs the tests in (it must provide the repository's
                   Python with pytest); without it, the backend's default image
    install        optional; a command or a list of commands that install the repository's test
                   environment, run in its tree at the environment commit (shared/tasks/environment_spec.py)
    python         optional; the Python version of that environment ("3.11"); default: the sandbox's

Example:

    {"instance_id": "rollstream__tinystats-1", "repo": "rollstream/tinystats",
     "base_commit": "4f1c...", "problem_statement": "median() is wrong for ...",
     "patch": "diff --git a/tinystats/core.py ...", "test_patch": "diff --git a/tests/test_core.py ...",
     "FAIL_TO_PASS": "[\\"tests/test_core.py::test_median_even\\"]",
     "PASS_TO_PASS": "[\\"tests/test_core.py::test_mean\\"]", "repo_dir": "repos/tiny-repo"}

Rows load as SWE-bench, SWE-bench Verified, SWE-Gym, SWE-bench-extra and SWE-rebench publish them
(their `environment_setup_commit`, `version` and `install_config` are kept on the task for per-row
environments), and as SWE-smith publishes them: no base_commit, `repo` "swesmith/owner__name.<commit>",
`patch` the bug (the reference fix is its reverse), `image_name` the test environment's image; a
SWE-smith row's snapshot always comes from the clone, never from `repo_dir`.

Every problem raises `TaskError` naming the file and the field (and the row, for SWE-bench), e.g.
"tasks/fix-bug/task.toml: [verifier] timeout_sec must be a positive number, got 'abc'".
The example tasks in tests/fixtures/tasks/ show both formats:

    python -m pytest tests/unit/shared/tasks -q
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.shared.errors import TaskError
from rollstream.shared.tasks.environment_spec import install_commands, python_version
from rollstream.shared.tasks.swebench_repos import (
    Snapshot,
    checkout_snapshot,
    swesmith_parts,
    swesmith_snapshot,
)

DEFAULT_SWE_TEST_COMMAND = "python -m pytest -rA -p no:cacheprovider"


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
    dockerfile: Path | None = None  # the test environment's Dockerfile, for the docker backend
    repo: str | None = None         # "owner/name" (SWE-smith: "swesmith/owner__name.<commit>")
    base_commit: str | None = None  # the commit the snapshot is of, as the row gives it
    environment_setup_commit: str | None = None  # the commit whose dependencies the environment installs
    version: str | None = None      # the repository's release the environment is built for
    image_name: str | None = None   # SWE-smith: the docker image of the test environment
    install_config: dict[str, Any] | None = None  # SWE-bench-extra / SWE-rebench: how to install the repo
    install: tuple[str, ...] | None = None  # our own: the commands that install the environment
    python: str | None = None       # our own: the environment's Python version
    repos_dir: Path | None = None   # the directory of the rows' git clones (the environment commit's source)


def read_records(path: Path) -> list[Any]:
    """The records of a .jsonl (one object a line) or .parquet file; TaskError naming the file (and line)."""
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


def _given_repo_dir(record: dict[str, Any], base: Path, instance_id: str, where: str) -> Path | None:
    """The snapshot the row points at itself (`repo_dir`, or `repos/<instance_id>/` beside the file)."""
    repo_value = record.get("repo_dir")
    if repo_value is None or repo_value == "":
        fallback = base / "repos" / instance_id
        safe_name = not ("/" in instance_id or "\\" in instance_id or instance_id.startswith("."))
        return fallback if safe_name and fallback.is_dir() else None
    if not isinstance(repo_value, str):
        raise TaskError(f"{where}: 'repo_dir' must be a path string, got {type(repo_value).__name__}")
    repo_dir = (base / repo_value).resolve()
    if not repo_dir.is_dir():
        raise TaskError(f"{where}: 'repo_dir' {repo_value!r} is not a directory ({repo_dir})")
    return repo_dir


def _snapshot(record: dict[str, Any], base: Path, repos_dir: Path | None, where: str) -> Snapshot:
    """The row's snapshot: the one it points at, else a checkout of a clone of its `repo` in the repos
    directory. A SWE-smith row's always comes from the clone: its `patch` is the bug, not the fix, and
    the fix is derived from the clone with it."""
    instance_id = record["instance_id"]
    repo = _optional_str(record, "repo", where)
    swesmith = repo is not None and swesmith_parts(repo) is not None
    given = None if swesmith else _given_repo_dir(record, base, instance_id, where)
    if given is not None:
        return Snapshot(repo_dir=given, gold_patch=None)
    clones = _clones_dir(record, base, repos_dir, where)
    if not repo:
        raise TaskError(f"{where}: 'repo_dir' missing, and no 'repo' to find a clone of (or put a snapshot "
                        f"at {base / 'repos' / instance_id})")
    if swesmith:
        bug_patch = _optional_str(record, "patch", where)
        if not bug_patch:
            raise TaskError(f"{where}: 'patch' missing (a SWE-smith row's bug, applied to {repo})")
        return swesmith_snapshot(clones, repo, bug_patch, where)
    base_commit = _optional_str(record, "base_commit", where)
    if not base_commit:
        raise TaskError(f"{where}: 'base_commit' missing and no 'repo_dir' (the commit of {repo} the task "
                        f"starts from)")
    return checkout_snapshot(clones, repo, base_commit, where)


def _clones_dir(record: dict[str, Any], base: Path, repos_dir: Path | None, where: str) -> Path:
    row_repos = _optional_str(record, "repos_dir", where)
    clones = (base / row_repos) if row_repos else (repos_dir if repos_dir is not None else base / "repos")
    return clones.resolve()


def _install_config(record: dict[str, Any], where: str) -> dict[str, Any] | None:
    value = record.get("install_config")
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: 'install_config' is a string but not JSON ({exc.msg})") from exc
    if value is not None and not isinstance(value, dict):
        raise TaskError(f"{where}: 'install_config' must be an object, got {type(value).__name__}")
    return value or None


def _swe_row(record: Any, path: Path, where: str, repos_dir: Path | None) -> SweTask:
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
    base = path.resolve().parent
    snapshot = _snapshot(record, base, repos_dir, where)
    dockerfile = _optional_str(record, "dockerfile", where)
    if dockerfile is not None and not (base / dockerfile).is_file():
        raise TaskError(f"{where}: 'dockerfile' {dockerfile!r} is not a file ({base / dockerfile})")
    return SweTask(
        instance_id=instance_id,
        repo_dir=snapshot.repo_dir,
        problem_statement=problem,
        test_patch=_optional_str(record, "test_patch", where) or "",
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        test_command=_optional_str(record, "test_command", where) or DEFAULT_SWE_TEST_COMMAND,
        gold_patch=snapshot.gold_patch or _optional_str(record, "patch", where) or None,
        dataset=path.resolve(),
        dockerfile=(base / dockerfile).resolve() if dockerfile is not None else None,
        repo=_optional_str(record, "repo", where),
        base_commit=_optional_str(record, "base_commit", where) or None,
        environment_setup_commit=_optional_str(record, "environment_setup_commit", where) or None,
        version=_optional_str(record, "version", where) or None,
        image_name=_optional_str(record, "image_name", where) or None,
        install_config=_install_config(record, where),
        install=None if record.get("install") is None else install_commands(record["install"], where,
                                                                             "install"),
        python=python_version(record.get("python"), where, "python"),
        repos_dir=_clones_dir(record, base, repos_dir, where),
    )


def load_swebench_rows(path: Path, repos_dir: Path | None = None) -> list[SweTask]:
    """SWE-bench rows from a JSONL or Parquet file; rows are numbered from 0 in errors, as in
    shared/tasks/datasets.py. `repos_dir`: the git clones of the rows' repositories, for rows without a
    snapshot of their own (default: `repos/` beside the file)."""
    if not path.is_file():
        raise TaskError(f"{path}: no such SWE-bench file")
    tasks: list[SweTask] = []
    seen: dict[str, int] = {}
    for index, record in enumerate(read_records(path)):
        task = _swe_row(record, path, f"{path} row {index}", repos_dir)
        if task.instance_id in seen:
            raise TaskError(f"{path} row {index}: 'instance_id' {task.instance_id!r} "
                            f"repeats row {seen[task.instance_id]}")
        seen[task.instance_id] = index
        tasks.append(task)
    if not tasks:
        raise TaskError(f"{path}: the file has no rows")
    return tasks


def is_swebench_record(record: Any) -> bool:
    """Whether a dataset record looks like a SWE-bench row (load_dataset's test on the first one)."""
    return isinstance(record, dict) and "instance_id" in record and "FAIL_TO_PASS" in record

