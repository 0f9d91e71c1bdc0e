"""Grading a SWE-bench row: apply the model's diff, restore the test files, run the listed tests.

After the model diff, every file the test_patch touches (and pytest/site hooks a diff could use to
fake outcomes: conftest.py, pytest.ini, sitecustomize.py, usercustomize.py, *.pth, wherever the
diff touched them) is reset to the snapshot's version (removed if it had none), and the test_patch
is applied on top. Then `test_command` + FAIL_TO_PASS + PASS_TO_PASS ids; pytest -rA summary lines
(PASSED/FAILED/ERROR/SKIPPED/XFAIL/XPASS) fill `tests` (XFAIL/XPASS count as passed, as in the
SWE-bench harness; an id not in the output is "error"). Score: 1 when every F2P and P2P id passed,
else 0; with the task flag `partial_credit` (attribute, or metadata["partial_credit"]) the score is
the fraction of F2P passing provided all P2P pass (0 otherwise). Known limit: a diff can still
change non-test code the tests import to special-case them; that is what the tests are for.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import Any

from rollstream.shared.errors import GradingError, SandboxError
from rollstream.shared.grading.diffs import (
    apply_diff,
    bad_path,
    git_message,
    numstat_paths,
)
from rollstream.shared.grading.outcome import GradeOutcome, make_outcome
from rollstream.shared.grading.runs import (
    MAX_TEST_OUTPUT_BYTES,
    run_log,
    run_wrapped,
    task_image,
    task_limits,
)
from rollstream.shared.sandbox.base import SandboxBackend, SandboxLimits
from rollstream.shared.sandbox.workspace import GitWorkspace, prepare_workspace

PROTECTED_NAMES = ("conftest.py", "pytest.ini", "sitecustomize.py", "usercustomize.py")
"""SWE: files with these names (and *.pth) that a diff touches are reset to the snapshot."""

_PYTEST_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                  "XFAIL": "passed", "XPASS": "passed"}


def parse_pytest_report(output: str) -> list[tuple[str, str]]:
    """(status word, rest of line) of each pytest -rA summary line."""
    found = []
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word in _PYTEST_STATUS and rest:
            found.append((word, rest.strip()))
    return found


def _test_outcomes(output: str, expected: list[str]) -> dict[str, str]:
    lines = parse_pytest_report(output)
    tests: dict[str, str] = {}
    for word, rest in lines:
        tests[rest.split(" - ", 1)[0]] = _PYTEST_STATUS[word]
    for test_id in expected:
        outcome = None
        for word, rest in lines:
            if rest == test_id or rest.startswith(test_id + " - "):
                outcome = _PYTEST_STATUS[word]
                if outcome != "passed":
                    break  # a failure (e.g. an ERROR at teardown) wins over a PASSED line
        tests[test_id] = outcome or "error"
    return tests


def _tree_entry(workspace: GitWorkspace, path: str) -> tuple[str, str] | None:
    """(mode, blob) of `path` in the baseline, or None."""
    proc = workspace.git("ls-tree", "-z", workspace.baseline, "--", path)
    record = proc.stdout.split(b"\0")[0]
    if not record:
        return None
    meta, _, name = record.partition(b"\t")
    mode, kind, blob = meta.decode().split()
    if os.fsdecode(name) != path or kind != "blob":
        return None
    return mode, blob


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _restore(workspace: GitWorkspace, path: str) -> None:
    """Make `path` in the tree exactly what the baseline had (or absent)."""
    if bad_path(path):
        raise GradingError(f"cannot restore {path!r}")
    current = workspace.root
    for component in PurePosixPath(path).parts[:-1]:
        current = current / component
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
    target = workspace.root / path
    if target.is_symlink() or target.exists():
        _remove(target)
    entry = _tree_entry(workspace, path)
    if entry is None:
        return
    mode, blob = entry
    data = workspace.git("cat-file", "blob", blob).stdout
    target.parent.mkdir(parents=True, exist_ok=True)
    if mode == "120000":
        os.symlink(os.fsdecode(data), target)
    else:
        target.write_bytes(data)
        target.chmod(0o755 if mode == "100755" else 0o644)


def _protected_paths(workspace: GitWorkspace) -> list[str]:
    """Files the model's diff changed whose names make them pytest/site hooks."""
    workspace.snapshot_index()
    proc = workspace.git("diff-index", "--cached", "-z", "--no-renames", "--name-only",
                         workspace.baseline)
    workspace.reset_index()
    names = [os.fsdecode(name) for name in proc.stdout.split(b"\0") if name]
    return [name for name in names
            if PurePosixPath(name).name in PROTECTED_NAMES or name.endswith(".pth")]


def _task_flag(task: Any, name: str) -> bool:
    value = getattr(task, name, None)
    if value is None:
        metadata = getattr(task, "metadata", None)
        if isinstance(metadata, dict):
            value = metadata.get(name)
    return bool(value)


def _id_list(value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]
    return [str(item) for item in (value or [])]


def grade_swebench(task: Any, diff: str, backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> GradeOutcome:
    """Apply `diff`, restore and re-apply the test files, run FAIL_TO_PASS + PASS_TO_PASS."""
    started = time.monotonic()
    fail_to_pass = _id_list(task.fail_to_pass)
    pass_to_pass = _id_list(task.pass_to_pass)
    try:
        image = task_image(backend, task)
        workspace = prepare_workspace(Path(task.repo_dir))
    except (GradingError, SandboxError, OSError) as exc:
        return make_outcome(0, f"grading setup failed: {exc}", started=started,
                            infrastructure_error=True)
    with workspace:
        ok, why = apply_diff(workspace, diff)
        if not ok:
            return make_outcome(0, f"patch did not apply: {why}", started=started)
        test_patch = task.test_patch or ""
        patch_file = workspace.base / "test.patch"
        patch_file.write_bytes(test_patch.encode("utf-8", errors="surrogateescape"))
        test_paths = numstat_paths(workspace, patch_file) if test_patch.strip() else []
        if test_paths is None:
            return make_outcome(0, "the task's test_patch cannot be parsed", started=started,
                                infrastructure_error=True)
        restored = sorted(set(test_paths) | set(_protected_paths(workspace)))
        for path in restored:
            _restore(workspace, path)
        if test_patch.strip():
            proc = workspace.git("apply", str(patch_file), check=False)
            if proc.returncode != 0:
                return make_outcome(0, f"the task's test_patch did not apply after restoring the "
                                    f"test files: {git_message(proc)}", started=started,
                                    infrastructure_error=True)
        ids = " ".join(shlex.quote(test_id) for test_id in fail_to_pass + pass_to_pass)
        command = (f"set -o pipefail 2>/dev/null; ( {task.test_command} {ids} ) 2>&1 "
                   f"| tail -c {MAX_TEST_OUTPUT_BYTES}")
        run = run_wrapped(backend, f"bash -c {shlex.quote(command)}", workspace,
                          task_limits(limits, getattr(task, "verifier_timeout_s", None)),
                          {}, {}, {"WORKSPACE": "/workspace", "PYTHONDONTWRITEBYTECODE": "1"}, image)
        log_text = run_log(run)
        if run.error:
            return make_outcome(0, run.error, log_text=log_text, started=started,
                                infrastructure_error=True)
        tests = _test_outcomes(run.stdout, fail_to_pass + pass_to_pass)
        f2p_ok = [test_id for test_id in fail_to_pass if tests[test_id] == "passed"]
        p2p_bad = [test_id for test_id in pass_to_pass if tests[test_id] != "passed"]
        f2p_bad = [test_id for test_id in fail_to_pass if tests[test_id] != "passed"]
        status = run.result.reason
        summary = (f"FAIL_TO_PASS {len(f2p_ok)}/{len(fail_to_pass)} passed, PASS_TO_PASS "
                   f"{len(pass_to_pass) - len(p2p_bad)}/{len(pass_to_pass)} passed ({status})")
        if restored:
            summary += f"; restored test files {restored[:5]}" + ("..." if len(restored) > 5 else "")
        if f2p_bad:
            summary += f"; not passing: {f2p_bad[:5]}"
        if p2p_bad:
            summary += f"; broken: {p2p_bad[:5]}"
        if p2p_bad:
            score = 0.0
        elif _task_flag(task, "partial_credit") and fail_to_pass:
            score = len(f2p_ok) / len(fail_to_pass)
        else:
            score = 1.0 if not f2p_bad else 0.0
        return make_outcome(score, summary, tests=tests, log_text=log_text, started=started)

