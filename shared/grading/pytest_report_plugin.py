"""The pytest plugin the SWE-bench grader loads into the test session, inside the sandbox.

Staged read-only into the sandbox under a fresh random module name for each grading
(`rollstream_report_<hex>`, see shared/grading/pytest_report.py) and loaded with
`PYTEST_ADDOPTS=-p <that name>`; it imports only the standard library and pytest. It records what
pytest itself decided about every test (setup, call and teardown reports), the ids collected, the
session's exit status, whether the session finished, the digest of every test module once collection
ended, the source files of every plugin and hook implementation that lie in the tree under test, and
whether pytest's own reporting functions were replaced. At the end of the session it writes that record as
JSON, with the name it was loaded under, and an HMAC under a key that the grader put in the report
directory and that this module reads and deletes when it is imported: pytest imports `-p` plugins given
on its command line or in PYTEST_ADDOPTS before any conftest.py or test module, so the key is gone before
code under test runs.

Nothing of the tree may run before the key is read, yet the tree can be on sys.path by then: pytest (8 and
later) applies the repository's own `pythonpath` setting before it imports `-p` plugins, and an editable
install's .pth adds the tree at start-up. So no module of the tree can be imported in this one's place
(the diff was written before the name was drawn), and the standard library modules this one imports first
are looked up in the standard library's own directories only. PYTHONSAFEPATH keeps the working directory
off sys.path until then; `python -m pytest`'s own sys.path[0] (the working directory) is put back right
after.

It judges nothing: shared/grading/pytest_report.py, on the grader's side, does. A pytest session started
inside the tests (pytester, a subprocess) finds no key and records nothing.
"""

import os  # os and sys are loaded by the interpreter's start-up, before any path of the tree is seen
import sys


def _standard_library_path() -> list:
    """The sys.path entries of the standard library's own directories (lib-dynload among them): nothing
    the tree under test can write."""
    stdlib = getattr(sys, "_stdlib_dir", None) or os.path.dirname(getattr(os, "__file__", None) or "")
    if not stdlib:
        return []  # the imports below fail, so no key is taken: an infrastructure error, never a score
    stdlib = os.path.realpath(stdlib)
    return [entry for entry in sys.path if isinstance(entry, str) and entry and (
        os.path.realpath(entry) == stdlib or os.path.realpath(entry).startswith(stdlib + os.sep))]


_full_path = sys.path[:]
sys.path[:] = _standard_library_path()
try:
    import hashlib
    import hmac
    import json
finally:
    sys.path[:] = _full_path

REPORT_DIR_ENV = "ROLLSTREAM_REPORT_DIR"
KEY_FILE = "key"
REPORT_FILE = "report.json"

_report_dir = os.environ.pop(REPORT_DIR_ENV, None)
_mac = None
if _report_dir:
    try:
        with open(os.path.join(_report_dir, KEY_FILE), "rb") as _key_file:
            _mac = hmac.new(_key_file.read(), digestmod=hashlib.sha256)
        os.unlink(os.path.join(_report_dir, KEY_FILE))
    except OSError:
        _mac = None
if os.environ.pop("PYTHONSAFEPATH", None) is not None and sys.argv and \
        sys.argv[0].endswith(os.path.join("pytest", "__main__.py")):
    sys.path.insert(0, os.getcwd())

import _pytest.main  # noqa: E402 - after the key is read: nothing else may run first
import _pytest.python  # noqa: E402
import _pytest.reports  # noqa: E402
import _pytest.runner  # noqa: E402
import _pytest.skipping  # noqa: E402, F401 - looked up in sys.modules (GUARDED)

GUARDED = (
    "runner.call_and_report", "runner.runtestprotocol", "runner.call_runtest_hook",
    "runner.CallInfo.from_call", "runner.pytest_runtest_makereport",
    "reports.TestReport.from_item_and_call", "reports.TestReport.__init__",
    "reports.BaseReport.passed", "reports.BaseReport.failed", "reports.BaseReport.outcome",
    "python.pytest_pyfunc_call", "python.Function.runtest", "main.pytest_runtestloop",
    "skipping.pytest_runtest_makereport",
)
"""The functions through which pytest decides and reports an outcome (module under _pytest, then the
attribute path). Code under test that replaces one, or its code, is seen at the end of the session."""


def _resolve(name: str):
    """The function behind `name` now (a property's getter, a classmethod's function), or None."""
    module_name, _, attribute_path = name.partition(".")
    target = sys.modules.get(f"_pytest.{module_name}")
    *owners, attribute = attribute_path.split(".")
    for owner in owners:
        target = getattr(target, owner, None)
    value = target.__dict__.get(attribute) if isinstance(target, type) else getattr(target, attribute, None)
    if isinstance(value, property):
        return value.fget
    return getattr(value, "__func__", value) if isinstance(value, (classmethod, staticmethod)) else value


def _fingerprint(name: str):
    function = _resolve(name)
    return function, getattr(function, "__code__", None)


_GUARDED = {name: _fingerprint(name) for name in GUARDED}


class _Recorder:
    def __init__(self, config) -> None:
        self.config = config
        self.root = os.path.realpath(os.getcwd())
        self.phases: dict = {}
        self.collected: list = []
        self.test_files: dict = {}
        self.exitstatus = None
        self.finished = False
        self.plugin_files: set = set()
        self.plugins_seen: set = set()

    # what pytest decided

    def pytest_collection_finish(self, session) -> None:
        self.collected = [item.nodeid for item in session.items]
        self.test_files = {}
        for item in session.items:
            path = os.path.realpath(str(getattr(item, "path", None) or item.fspath))
            relative = os.path.relpath(path, self.root)
            if relative not in self.test_files and path.startswith(self.root + os.sep):
                try:
                    with open(path, "rb") as source:
                        self.test_files[relative] = hashlib.sha256(source.read()).hexdigest()
                except OSError:
                    self.test_files[relative] = None
        self._note_plugins()

    def pytest_runtest_logreport(self, report) -> None:
        self.phases.setdefault(report.nodeid, {})[report.when] = (
            report.outcome, hasattr(report, "wasxfail"))
        self._note_plugins()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.exitstatus = int(exitstatus)
        self.finished = True
        self._note_plugins()

    # who could have changed it

    def _note_plugins(self) -> None:
        manager = self.config.pluginmanager
        plugins = manager.get_plugins()
        if {id(plugin) for plugin in plugins} <= self.plugins_seen:
            return
        self.plugins_seen |= {id(plugin) for plugin in plugins}
        for plugin in plugins:
            self._note_source(getattr(plugin, "__file__", None))
            self._note_source(getattr(sys.modules.get(type(plugin).__module__), "__file__", None))
        for name in dir(manager.hook):
            caller = getattr(manager.hook, name, None)
            for impl in getattr(caller, "get_hookimpls", lambda: [])():
                code = getattr(impl.function, "__code__", None)
                self._note_source(code.co_filename if code is not None else None)

    def _note_source(self, filename) -> None:
        if not filename:
            return
        path = os.path.realpath(filename)
        if path.startswith(self.root + os.sep):
            self.plugin_files.add(os.path.relpath(path, self.root))

    # the record

    def outcomes(self) -> dict:
        return {nodeid: _outcome(phases) for nodeid, phases in self.phases.items()}

    def write(self) -> None:
        tampered = sorted(name for name, (function, code) in _GUARDED.items()
                          if _fingerprint(name) != (function, code))
        body = json.dumps({
            "version": 1,
            "module": __name__,
            "pytest": getattr(sys.modules.get("pytest"), "__version__", "?"),
            "collected": self.collected,
            "outcomes": self.outcomes(),
            "exitstatus": self.exitstatus,
            "session_finished": self.finished,
            "plugin_files": sorted(self.plugin_files),
            "test_files": self.test_files,
            "tampered": tampered,
        }, sort_keys=True).encode()
        mac = _mac.copy()
        mac.update(body)
        temp = os.path.join(_report_dir, f".{REPORT_FILE}.{os.getpid()}")
        with open(temp, "wb") as out:
            out.write(body + b"\n" + mac.hexdigest().encode() + b"\n")
        os.replace(temp, os.path.join(_report_dir, REPORT_FILE))


def _outcome(phases: dict) -> str:
    """One test's outcome from its phases: an error in setup or teardown wins, then the call's outcome;
    xfail and xpass are told apart from plain skipped and passed."""
    for when in ("setup", "teardown"):
        outcome, _ = phases.get(when, ("passed", False))
        if outcome == "failed":
            return "error"
    if "call" not in phases:
        outcome, xfail = phases.get("setup", ("skipped", False))
        return "xfail" if xfail else "skipped" if outcome == "skipped" else "error"
    outcome, xfail = phases["call"]
    if xfail:
        return "xpass" if outcome == "passed" else "xfail"
    return outcome


_recorder = None


def pytest_configure(config) -> None:
    global _recorder
    if _mac is not None and _recorder is None:
        _recorder = _Recorder(config)
        config.pluginmanager.register(_recorder, "rollstream-report-recorder")


def pytest_unconfigure(config) -> None:
    if _recorder is not None and config is _recorder.config:
        _recorder.write()
