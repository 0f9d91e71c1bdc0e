"""Grading a SWE-bench row: apply the model's diff, restore the test files, run the listed tests, and
score them from pytest's own signed record of the session, never from the output.

After the model diff, every file the test_patch touches, and every hook or configuration file the
diff touched (conftest.py, sitecustomize.py, usercustomize.py, *.pth, compiled bytecode, and pytest's
configuration: pytest.ini, .pytest.ini, pytest.toml, tox.ini, setup.cfg, pyproject.toml, wherever they
are), is reset to the snapshot's version (removed if it had none); the test_patch is applied on top.
Then `test_command` + FAIL_TO_PASS + PASS_TO_PASS ids runs in the sandbox with the grader's pytest
plugin loaded (shared/grading/pytest_report.py). Score: 1 when every F2P and P2P id passed (XFAIL and
XPASS count as passed, as in the SWE-bench harness; an id pytest never reported is an error), else 0;
with the task flag `partial_credit` (attribute, or metadata["partial_credit"]) the fraction of F2P
passing provided all P2P pass (0 otherwise).

Threat model: the code under test runs inside the pytest process whose results we read.
Stopped (each a grade of 0 with the reason; tests/unit/shared/grading/test_hostile_swebench.py runs them
under bubblewrap and docker):
- pass lines or a whole pytest summary written to stdout, stderr or any inherited descriptor, an output
  flood that pushes the real summary out of the kept tail: the output is a log, never read for results;
- a process that ends early (os._exit, sys.exit, a signal, killing its parent) or whose exit status is
  changed after pytest finished (an atexit hook): the record is written only when the session ends, and
  its exit status must be the process's and agree with the outcomes;
- a report written by the code under test: it cannot sign it, because the key is read and deleted by
  the plugin before any conftest or test module is imported, and no module of the tree runs before:
  the plugin is staged under a module name drawn at random for each grading, which the diff (written
  before) cannot name, so no module of the tree stands in for it, however the tree comes onto sys.path
  (the snapshot's own pytest `pythonpath`, which pytest 8 and later applies before loading `-p` plugins,
  an editable install's .pth, PYTHONPATH in the test_command); the standard library modules the plugin
  imports before taking the key are looked up in the standard library's directories only; and
  PYTHONSAFEPATH keeps the working directory off sys.path, so no module at the tree's root can shadow
  pytest or the standard library before the plugin runs;
- edited tests, conftest.py files, pytest configuration that loads another plugin or turns ours off:
  restored to the snapshot before the run (turning ours off anyway leaves no report: 0); test files
  rewritten during the run (by code a test module imports, before pytest collects the next module): their
  digests when collection ended and after the run must be the restored ones;
- a plugin or hook implementation whose code comes from a file the diff changed (registered from the
  code under test at import), and replacing pytest's reporting functions (pytest_report_plugin.GUARDED):
  seen at the end of the session;
- a process left running after the tests (it could rewrite the report later): refused;
- code the diff changed that pytest imports before the plugin on purpose: a `-p` plugin of the tree in the
  snapshot's own `addopts` (pytest puts the configuration's `addopts` before PYTEST_ADDOPTS). Before the
  run every pytest configuration of the restored tree is read (shared/grading/pytest_config.py), and a
  diff that changed a file that could be such a plugin's module, a package above it, or a module it
  imports (read from its source, transitively) is refused, whether the change is rightful or not.
Not stopped: the code under test making the tests pass wrongly (special-casing the tests' inputs,
patching what the tests import, or builtins); in-process attacks written against this plugin (reading its
key-derived state from memory, patching pytest internals not in GUARDED, forging a hook's source file
name); a Python older than 3.11 ignores PYTHONSAFEPATH, so there a module at the tree's root could shadow one
that pytest imports before the plugin; a `-p` plugin of the tree that runs a changed file other than by an
import its source names (a module name built at run time, exec of a file); a row whose code under test is
pytest itself or a module pytest imports to start (pluggy, iniconfig). A task author closes the first with
hidden or stronger tests; the rest need the tests to run in a process that does not import the code under
test, which pytest does not offer.
A test_command that starts no pytest session (or a sandbox without pytest) is an infrastructure error, never a
score: nothing of the model's runs before the plugin takes its key. A command must run exactly one pytest
session (the record is the first session's, the exit status the command's); `rollstream validate` shows a row
that breaks either rule (its reference patch must score 1). A diff that rightly changes a module the project's
own conftest loads as a pytest plugin (`pytest_plugins`) is refused like a forged plugin; a row whose own
`-p` plugin imports the code under test cannot be graded at all (`rollstream validate` shows its reference
patch refused).
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
from rollstream.shared.grading.pytest_config import addopts_plugin_refusal
from rollstream.shared.grading.pytest_report import (
    HARNESS_OUTCOME,
    ReportSetup,
    SessionReport,
    exit_words,
    file_digest,
    judge,
    plugin_loaded,
    prepare_report,
    read_report,
)
from rollstream.shared.grading.runs import (
    MAX_TEST_OUTPUT_BYTES,
    SandboxRun,
    run_log,
    run_wrapped,
    task_environment,
    task_limits,
)
from rollstream.shared.sandbox.base import SandboxBackend, SandboxEnvironment, SandboxLimits
from rollstream.shared.sandbox.workspace import GitWorkspace, prepare_workspace

PROTECTED_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", ".pytest.ini",
                   "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg", "pyproject.toml")
"""Files with these names that the model's diff touched are reset to the snapshot (removed if it had
none), wherever they are: pytest's and Python's hooks and pytest's configuration."""


def _protected(path: str) -> bool:
    """A path the diff may not change: a hook or configuration file (PROTECTED_NAMES), a *.pth file,
    or compiled bytecode (it would be imported instead of the restored source)."""
    pure = PurePosixPath(path)
    return (pure.name in PROTECTED_NAMES or pure.suffix in (".pth", ".pyc", ".pyo")
            or "__pycache__" in pure.parts)


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


def _changed_paths(workspace: GitWorkspace) -> list[str]:
    """Every path the model's diff changed, added or removed."""
    workspace.snapshot_index()
    proc = workspace.git("diff-index", "--cached", "-z", "--no-renames", "--name-only",
                         workspace.baseline)
    workspace.reset_index()
    return [os.fsdecode(name) for name in proc.stdout.split(b"\0") if name]


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


class _TaskTestsUnusable(GradingError):
    """The task's own test files could not be put in place: the task's fault, never the diff's."""


def grade_swebench(task: Any, diff: str, backend: SandboxBackend,
                   limits: SandboxLimits | None = None) -> GradeOutcome:
    """Apply `diff`, restore and re-apply the test files, run FAIL_TO_PASS + PASS_TO_PASS under the
    report plugin and score them from its signed report."""
    started = time.monotonic()
    fail_to_pass = _id_list(task.fail_to_pass)
    pass_to_pass = _id_list(task.pass_to_pass)
    try:
        environment = task_environment(backend, task)
        workspace = prepare_workspace(Path(task.repo_dir))
    except (GradingError, SandboxError, OSError) as exc:
        return make_outcome(0, f"grading setup failed: {exc}", started=started,
                            infrastructure_error=True)
    with workspace:
        ok, why = apply_diff(workspace, diff)
        if not ok:
            return make_outcome(0, f"patch did not apply: {why}", started=started)
        try:
            test_paths, changed, restored = _put_back_test_files(workspace, task)
        except _TaskTestsUnusable as exc:
            return make_outcome(0, str(exc), started=started, infrastructure_error=True)
        refused = addopts_plugin_refusal(workspace.root, set(changed) - set(restored), task.test_command)
        if refused is not None:
            return make_outcome(0, refused, started=started)
        test_files = sorted(set(test_paths) | {test_id.split("::", 1)[0]
                                               for test_id in fail_to_pass + pass_to_pass})
        test_digests = {path: file_digest(workspace.root, path) for path in test_files}
        report_setup = prepare_report(workspace.scratch("report-plugin"), workspace.scratch("report"))
        run = _run_tests(task, fail_to_pass + pass_to_pass, workspace, backend, environment, limits,
                         report_setup)
        log_text = run_log(run)
        if run.error:
            return make_outcome(0, run.error, log_text=log_text, started=started,
                                infrastructure_error=True)
        notes = f"; restored {restored[:5]}" + ("..." if len(restored) > 5 else "") if restored else ""
        if run.processes_left:
            return make_outcome(0, "the tests left processes running (one could rewrite the report "
                                "after pytest wrote it): not trusted" + notes,
                                log_text=log_text, started=started)
        if not plugin_loaded(report_setup):
            return make_outcome(0, "pytest never loaded the grader's report plugin (no pytest in the "
                                f"sandbox's Python, or a test_command that runs none; {run.result.reason}): "
                                f"{run.stdout.strip()[-300:]}", log_text=log_text, started=started,
                                infrastructure_error=True)
        report, why = read_report(report_setup)
        refused = why if report is None else judge(
            report, run.result.exit_code, set(changed) - set(restored), test_digests,
            {path: file_digest(workspace.root, path) for path in test_files})
        if refused is not None:
            return make_outcome(0, f"test results not trusted: {refused} ({run.result.reason})" + notes,
                                log_text=log_text, started=started)
        return _score(task, report, fail_to_pass, pass_to_pass, notes, log_text, started)


def _put_back_test_files(workspace: GitWorkspace, task: Any) -> tuple[list[str], list[str], list[str]]:
    """Reset the task's test files and every protected path the diff changed to the snapshot, then apply
    the task's test_patch. Returns the test_patch's paths, the paths the diff changed and those reset."""
    test_patch = task.test_patch or ""
    patch_file = workspace.base / "test.patch"
    patch_file.write_bytes(test_patch.encode("utf-8", errors="surrogateescape"))
    test_paths = numstat_paths(workspace, patch_file) if test_patch.strip() else []
    if test_paths is None:
        raise _TaskTestsUnusable("the task's test_patch cannot be parsed")
    changed = _changed_paths(workspace)
    restored = sorted(set(test_paths) | {path for path in changed if _protected(path)})
    for path in restored:
        _restore(workspace, path)
    if test_patch.strip():
        proc = workspace.git("apply", str(patch_file), check=False)
        if proc.returncode != 0:
            raise _TaskTestsUnusable(f"the task's test_patch did not apply after restoring the "
                                   f"test files: {git_message(proc)}")
    return test_paths, changed, restored


def _run_tests(task: Any, test_ids: list[str], workspace: GitWorkspace, backend: SandboxBackend,
               environment: SandboxEnvironment, limits: SandboxLimits | None,
               report_setup: ReportSetup) -> SandboxRun:
    """The task's test command on `test_ids` in the row's environment, its output cut to its last
    MAX_TEST_OUTPUT_BYTES."""
    ids = " ".join(shlex.quote(test_id) for test_id in test_ids)
    command = (f"set -o pipefail 2>/dev/null; ( {task.test_command} {ids} ) 2>&1 "
               f"| tail -c {MAX_TEST_OUTPUT_BYTES}")
    return run_wrapped(backend, f"bash -c {shlex.quote(command)}", workspace,
                       task_limits(limits, getattr(task, "verifier_timeout_s", None)),
                       {**environment.ro_mounts, **report_setup.ro_mounts()}, report_setup.rw_mounts(),
                       {**environment.env, "WORKSPACE": "/workspace", "PYTHONDONTWRITEBYTECODE": "1",
                        **report_setup.env()},
                       environment.image, flag_leftovers=True)


def _score(task: Any, report: SessionReport, fail_to_pass: list[str], pass_to_pass: list[str],
           notes: str, log_text: str, started: float) -> GradeOutcome:
    """1 when every F2P and P2P id passed, else 0 (or the F2P fraction with partial_credit)."""
    tests = {test_id: HARNESS_OUTCOME.get(outcome, "error") for test_id, outcome in report.outcomes.items()}
    for test_id in fail_to_pass + pass_to_pass:
        tests.setdefault(test_id, "error")  # an id pytest never reported: not found or never run
    passed = {test_id for test_id in fail_to_pass + pass_to_pass if tests[test_id] == "passed"}
    f2p_ok = [test_id for test_id in fail_to_pass if test_id in passed]
    f2p_bad = [test_id for test_id in fail_to_pass if test_id not in passed]
    p2p_bad = [test_id for test_id in pass_to_pass if test_id not in passed]
    summary = (f"FAIL_TO_PASS {len(f2p_ok)}/{len(fail_to_pass)} passed, PASS_TO_PASS "
               f"{len(pass_to_pass) - len(p2p_bad)}/{len(pass_to_pass)} passed "
               f"({exit_words(report.exitstatus)}){notes}")
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
