"""The grader's side of the pytest report: the SWE-bench tests' outcomes from a record the output of the
tests cannot forge.

`prepare_report` stages the plugin (pytest_report_plugin.py) under a module name drawn afresh for this
grading (`rollstream_report_<hex>`) and a fresh report directory holding a random key, and gives the
environment that loads the plugin into the test session. The name is what keeps a module of the tree
from standing in for the plugin: the diff was written before it was drawn, so however the repository's
configuration orders sys.path (its own `pythonpath`, an editable install, PYTHONPATH set by the test
command), no module of the tree has it. After the run, `read_report` takes the record the plugin wrote,
refuses it unless its HMAC is right under that key and it names the module drawn, and `judge` decides
whether the record can be trusted:

- the session ran to its end (pytest_sessionfinish) and exited 0 (every test passed) or 1 (some failed);
- the test files are the ones the grader restored, when collection ended and after the run (code under
  test imported by one test module cannot rewrite another before pytest collects it);
- the process's exit status is the session's: anything that ended or replaced the process after pytest
  finished (an `os._exit` in an atexit hook, a kill) is seen;
- the outcomes agree with the status (0 and a failed test, or 1 and none, is a forged session), and every
  test collected has an outcome;
- no plugin or hook implementation comes from a file the model's diff changed, and none of pytest's
  reporting functions was replaced (pytest_report_plugin.GUARDED).

A record that fails any of these scores 0 with the reason: the code under test caused it, so it is a
grade, not a failure of the sandbox. A key the plugin never took (`plugin_loaded`) is the opposite: no
pytest in the environment, or a test command that runs none, and no code of the model's ran before the
plugin would have; that is an infrastructure error, never a score. A session that could not start the
tests at all (exit 2-5) scores 0 the same way, with pytest's own exit status in the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rollstream.shared.grading.untrusted import read_untrusted_file

PLUGIN_SOURCE = Path(__file__).with_name("pytest_report_plugin.py")
"""Staged, never imported here: it imports pytest, which the services' images do not have."""
REPORT_DIR_ENV = "ROLLSTREAM_REPORT_DIR"
KEY_FILE = "key"
REPORT_FILE = "report.json"
"""The names the plugin uses (pytest_report_plugin.py has its own copy: it imports nothing of ours)."""
PLUGIN_MODULE_PREFIX = "rollstream_report_"
"""The staged plugin's module name is this and 32 random hex digits, new for every grading."""
PLUGIN_MOUNT = "/grader/plugin"
REPORT_MOUNT = "/grader/report"
MAX_REPORT_BYTES = 32 * 1024 * 1024

HARNESS_OUTCOME = {"passed": "passed", "xfail": "passed", "xpass": "passed", "failed": "failed",
                   "error": "error", "skipped": "skipped"}
"""A recorded outcome in the SWE-bench harness's words: xfail and xpass count as passed; only "passed"
counts for a FAIL_TO_PASS or PASS_TO_PASS id."""

_EXIT_WORDS = {0: "all tests passed", 1: "some tests failed", 2: "interrupted (a collection error?)",
               3: "pytest internal error", 4: "pytest usage error", 5: "no tests collected"}


@dataclass(frozen=True)
class ReportSetup:
    key: bytes
    plugin_dir: Path
    report_dir: Path
    module: str
    """The name the plugin is staged and loaded under for this grading only."""

    def env(self) -> dict[str, str]:
        """What loads the plugin into the session the test command starts."""
        return {"PYTEST_ADDOPTS": f"-p {self.module}", "PYTHONPATH": PLUGIN_MOUNT,
                "PYTHONSAFEPATH": "1", REPORT_DIR_ENV: REPORT_MOUNT}

    def ro_mounts(self) -> dict[str, Path]:
        return {PLUGIN_MOUNT: self.plugin_dir}

    def rw_mounts(self) -> dict[str, Path]:
        return {REPORT_MOUNT: self.report_dir}


@dataclass
class SessionReport:
    collected: list[str]
    outcomes: dict[str, str]
    exitstatus: int | None
    session_finished: bool
    plugin_files: list[str] = field(default_factory=list)
    tampered: list[str] = field(default_factory=list)
    test_files: dict[str, str | None] = field(default_factory=dict)
    """Digest of each collected test module when collection ended, by path relative to the tree."""


def prepare_report(plugin_dir: Path, report_dir: Path) -> ReportSetup:
    """Stage the plugin into `plugin_dir` (readable by the sandbox) under a new random module name, and a
    new key into `report_dir`."""
    module = PLUGIN_MODULE_PREFIX + secrets.token_hex(16)
    target = plugin_dir / f"{module}.py"
    shutil.copyfile(PLUGIN_SOURCE, target)
    target.chmod(0o644)
    key = secrets.token_bytes(32)
    key_file = report_dir / KEY_FILE
    key_file.write_bytes(key)
    key_file.chmod(0o644)
    return ReportSetup(key, plugin_dir, report_dir, module)


def plugin_loaded(setup: ReportSetup) -> bool:
    """Whether the plugin took its key: nothing of the tree under test runs before it does, so when it
    did not, the environment or the test command kept pytest from loading it, not the model's diff."""
    return not (setup.report_dir / KEY_FILE).exists()


def read_report(setup: ReportSetup) -> tuple[SessionReport | None, str]:
    """The plugin's record when it is there and its HMAC is right; else None and why."""
    try:
        data = read_untrusted_file(setup.report_dir, REPORT_FILE, MAX_REPORT_BYTES)
    except ValueError as exc:
        return None, f"the test report was refused: {exc}"
    if data is None:
        return None, "pytest wrote no report (the session did not reach its end, or the plugin was kept out)"
    body, _, rest = data.rstrip(b"\n").rpartition(b"\n")
    expected = hmac.new(setup.key, body, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(rest.strip(), expected):
        return None, "the test report does not carry the grader's signature: written by the code under test"
    try:
        record = json.loads(body)
        if record["module"] != setup.module:
            loaded_as = str(record["module"])[:80]
            return None, f"the test report was written by a plugin loaded as {loaded_as!r}, not the grader's"
        report = SessionReport(
            collected=[str(item) for item in record["collected"]],
            outcomes={str(key): str(value) for key, value in record["outcomes"].items()},
            exitstatus=record["exitstatus"], session_finished=bool(record["session_finished"]),
            plugin_files=[str(item) for item in record["plugin_files"]],
            tampered=[str(item) for item in record["tampered"]],
            test_files={str(key): None if value is None else str(value)
                        for key, value in record["test_files"].items()})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"the test report is malformed ({type(exc).__name__}: {exc})"
    return report, "signed report"


def file_digest(base: Path, relative: str) -> str | None:
    """sha256 of base/relative, read as the grader reads what the sandbox wrote; None when it is not there,
    "unreadable" when it is not a regular file."""
    try:
        data = read_untrusted_file(base, relative, MAX_REPORT_BYTES)
    except ValueError:
        return "unreadable"
    return None if data is None else hashlib.sha256(data).hexdigest()


def judge(report: SessionReport, exit_code: int | None, changed_paths: set[str],
          test_digests: dict[str, str | None], digests_after: dict[str, str | None]) -> str | None:
    """None when the report can be trusted, else why not (see the module docstring). test_digests: the
    test files as the grader restored them; digests_after: the same files after the run."""
    if not report.session_finished or report.exitstatus is None:
        return "the pytest session never finished"
    rewritten = sorted(path for path, digest in test_digests.items()
                       if digests_after.get(path) != digest
                       or (path in report.test_files and report.test_files[path] != digest))
    if rewritten:
        return f"test files were changed while the tests ran: {rewritten[:5]}"
    if exit_code != report.exitstatus:
        return (f"the test process ended with status {exit_code}, but pytest's session ended with "
                f"{report.exitstatus}: something ended or replaced the process after pytest")
    from_diff = sorted(path for path in report.plugin_files if _normal(path) in changed_paths)
    if from_diff:
        return f"pytest plugins or hooks from files the diff changed: {from_diff[:5]}"
    if report.tampered:
        return f"pytest's reporting was replaced by the code under test: {report.tampered[:5]}"
    if report.exitstatus not in (0, 1):
        return None
    failed = sorted(nodeid for nodeid, outcome in report.outcomes.items() if outcome in ("failed", "error"))
    if report.exitstatus == 0 and failed:
        return f"pytest exited 0 with failed tests {failed[:5]}: not a real session"
    if report.exitstatus == 1 and not failed:
        return "pytest exited 1 (tests failed) but every recorded test passed: not a real session"
    missing = [nodeid for nodeid in report.collected if nodeid not in report.outcomes]
    if missing:
        return f"tests were collected but never reported: {missing[:5]}"
    return None


def exit_words(exitstatus: int | None) -> str:
    return f"pytest exit {exitstatus}: {_EXIT_WORDS.get(exitstatus, 'unknown status')}"


def _normal(path: str) -> str:
    return PurePosixPath(path).as_posix()
