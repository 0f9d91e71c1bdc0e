"""Hostile diffs against the SWE-bench grader, with the real bubblewrap and docker backends: each diff
leaves median() wrong for even lengths (the row's FAIL_TO_PASS test must fail) and tries to get a 1
anyway, by forging pytest's output, ending the test process early, replacing pytest's configuration,
plugins or reporting, or writing the report itself. Each scores 0, with the reason that stopped it;
the reference patch still scores 1. The same row with a pytest configuration of its own that puts the
tree on sys.path (`pythonpath`, repos/tinystats-pythonpath) is attacked with modules of the tree that
stand in for the grader's plugin or for a module it imports. And a row whose configuration loads a plugin of
the tree through its own `addopts` (repos/tinystats-addopts), which pytest imports before the grader's: a diff
that changes that plugin, a module it imports or what stands in for it is refused before the tests run.

    python -m pytest tests/unit/shared/grading/test_hostile_swebench.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from rollstream.shared.grading.swebench import grade_swebench
from rollstream.shared.grading.validation import reference_diff
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES, edit_diff

LIMITS = SandboxLimits(wall_time_s=60, cpu_time_s=60, memory_mb=1024, max_processes=64,
                       max_file_size_mb=64, max_open_files=256, max_output_bytes=600 * 1024,
                       tmp_size_mb=64)
CORE = "tinystats/core.py"
F2P = "tests/test_core.py::test_median_even"


@pytest.fixture(scope="module")
def swe():
    return load_swebench_rows(FIXTURES / "swebench" / "rows.jsonl")[0]


@pytest.fixture(scope="module")
def swe_pythonpath():
    """The row on a snapshot whose own pyproject.toml sets `pythonpath = ["."]`."""
    return load_swebench_rows(FIXTURES / "swebench" / "rows-pythonpath.jsonl")[0]


def _expected_ids(swe) -> list[str]:
    return [*swe.fail_to_pass, *swe.pass_to_pass]


def _forged_lines(swe) -> str:
    """What pytest -rA prints for a session where every expected test passed."""
    ids = _expected_ids(swe)
    return ("".join(f"PASSED {test_id}\n" for test_id in ids)
            + f"============================== {len(ids)} passed in 0.02s ==============================\n")


def _core_with(swe, code: str) -> str:
    """The row's module under test, still wrong, with `code` run when it is imported."""
    return (swe.repo_dir / CORE).read_text() + "\n" + code


def _grade(swe, backend, edits: dict[str, str]):
    outcome = grade_swebench(swe, edit_diff(swe.repo_dir, edits), backend, LIMITS)
    assert not outcome.infrastructure_error, outcome
    assert outcome.score == 0 and not outcome.passed, outcome
    return outcome


def test_the_reference_patch_scores_1_and_an_empty_diff_0(backend, swe):
    outcome = grade_swebench(swe, reference_diff(swe, backend), backend, LIMITS)
    assert (outcome.score, outcome.infrastructure_error) == (1.0, False), outcome
    assert outcome.tests[F2P] == "passed" and "pytest exit 0" in outcome.reason
    outcome = grade_swebench(swe, "", backend, LIMITS)
    assert outcome.score == 0 and outcome.tests[F2P] == "failed" and "pytest exit 1" in outcome.reason


def test_forged_pass_lines_to_every_inherited_descriptor_then_exit_0(backend, swe):
    forge = (f"import os\n_lines = {_forged_lines(swe)!r}.encode()\n"
             "for _fd in range(256):\n"
             "    try:\n        os.write(_fd, _lines)\n    except OSError:\n        pass\n"
             "os._exit(0)\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
    assert "PASSED " + F2P in outcome.log  # the forgery reached the output, and was not believed
    assert "pytest wrote no report" in outcome.reason


def test_an_early_exit_0_when_imported(backend, swe):
    outcome = _grade(swe, backend, {CORE: _core_with(swe, "import os\nos._exit(0)\n")})
    assert "pytest wrote no report" in outcome.reason


def test_sys_exit_0_when_imported(backend, swe):
    outcome = _grade(swe, backend, {CORE: _core_with(swe, "import sys\nsys.exit(0)\n")})
    assert outcome.tests[F2P] == "error"


def test_killing_its_own_test_process_or_its_parent(backend, swe):
    for victim in ("os.getpid()", "os.getppid()"):
        forge = f"import os, signal, sys\nsys.stdout.write({_forged_lines(swe)!r})\nsys.stdout.flush()\n" \
                f"os.kill({victim}, signal.SIGKILL)\n"
        outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
        assert "pytest wrote no report" in outcome.reason or "ended with status" in outcome.reason, outcome


def test_exit_0_after_pytest_wrote_its_report(backend, swe):
    forge = (f"import atexit, os, sys\n"
             f"atexit.register(lambda: (sys.stdout.write({_forged_lines(swe)!r}), sys.stdout.flush(), "
             f"os._exit(0)))\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
    assert "ended with status 0, but pytest's session ended with 1" in outcome.reason, outcome.reason


def test_editing_the_test_files_through_the_patch(backend, swe):
    test_file = swe.repo_dir / "tests" / "test_core.py"
    trivial = test_file.read_text() + "\n\ndef test_median_even():\n    assert True\n"
    outcome = _grade(swe, backend, {"tests/test_core.py": trivial})
    assert outcome.tests[F2P] == "failed" and "restored ['tests/test_core.py']" in outcome.reason


def test_rewriting_a_test_file_before_pytest_collects_it(backend, swe):
    """Code under test imported by a first test module rewrites the next one before pytest collects it, and
    puts it back when the process exits."""
    first = edit_diff(swe.repo_dir, {"tests/test_a_first.py": "import tinystats\n\n\ndef test_imports():\n"
                                                               "    assert tinystats.mean([1]) == 1\n"})
    task = dataclasses.replace(swe, test_patch=swe.test_patch + first,
                               fail_to_pass=["tests/test_a_first.py::test_imports", *swe.fail_to_pass])
    forge = ("import atexit, pathlib\n_test = pathlib.Path('tests/test_core.py')\n_real = _test.read_text()\n"
             "_test.write_text(_real.replace('assert median([4, 1, 3, 2]) == 2.5', 'assert True'))\n"
             "atexit.register(_test.write_text, _real)\n")
    outcome = grade_swebench(task, edit_diff(swe.repo_dir, {CORE: _core_with(swe, forge)}), backend, LIMITS)
    assert (outcome.score, outcome.infrastructure_error) == (0, False), outcome
    assert ("test files were changed while the tests ran: ['tests/test_core.py']"
            in outcome.reason), outcome.reason


def test_a_conftest_added_by_the_patch(backend, swe):
    conftest = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n"
                "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    outcome = _grade(swe, backend, {"conftest.py": conftest, "tests/conftest.py": conftest})
    assert outcome.tests[F2P] == "failed" and "conftest.py" in outcome.reason


def test_a_pytest_plugin_added_through_the_configuration(backend, swe):
    plugin = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
              "def pytest_runtest_makereport(item, call):\n"
              "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    for config, text in (("pytest.ini", "[pytest]\naddopts = -p forged_passes\npythonpath = .\n"),
                         ("setup.cfg", "[tool:pytest]\naddopts = -p forged_passes\npythonpath = .\n"),
                         ("tests/pytest.ini", "[pytest]\naddopts = -p forged_passes\npythonpath = ..\n"),
                         ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-p forged_passes'\n"
                                            "pythonpath = ['.']\n")):
        outcome = _grade(swe, backend, {"forged_passes.py": plugin, config: text})
        assert outcome.tests[F2P] == "failed" and config in outcome.reason, (config, outcome)


def test_a_plugin_registered_by_the_code_under_test(backend, swe):
    forge = ("import gc, pytest\nfrom _pytest.config import Config\n\n"
             "class _Passes:\n"
             "    @pytest.hookimpl(hookwrapper=True)\n"
             "    def pytest_runtest_makereport(self, item, call):\n"
             "        outcome = yield\n        outcome.get_result().outcome = 'passed'\n\n"
             "for _config in [o for o in gc.get_objects() if isinstance(o, Config)]:\n"
             "    _config.pluginmanager.register(_Passes())\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
    assert "pytest plugins or hooks from files the diff changed" in outcome.reason, outcome.reason


def test_monkeypatching_pytests_reports(backend, swe):
    forge = ("from _pytest import reports\n_init = reports.TestReport.__init__\n\n"
             "def _passed(self, *args, **kwargs):\n"
             "    _init(self, *args, **kwargs)\n    self.outcome = 'passed'\n    self.longrepr = None\n\n"
             "reports.TestReport.__init__ = _passed\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
    assert "pytest's reporting was replaced" in outcome.reason, outcome.reason


def test_writing_the_report_itself(backend, swe):
    """A forged report in every writable place the code can find, signed with no key or a guessed one."""
    record = {"version": 1, "pytest": "9", "collected": _expected_ids(swe),
              "outcomes": {test_id: "passed" for test_id in _expected_ids(swe)}, "exitstatus": 0,
              "session_finished": True, "plugin_files": [], "tampered": []}
    forge = (f"import atexit, hashlib, hmac, os\n_body = {json.dumps(record, sort_keys=True)!r}.encode()\n"
             "def _forge():\n"
             "    for _dir in {os.environ.get('ROLLSTREAM_REPORT_DIR', ''), '/grader/report', '/tmp', '.'}:\n"
             "        try:\n"
             "            with open(os.path.join(_dir, 'report.json'), 'wb') as f:\n"
             "                f.write(_body + b'\\n'"
             " + hmac.new(b'', _body, hashlib.sha256).hexdigest().encode())\n"
             "        except OSError:\n            pass\n"
             "    os._exit(0)\n"
             "atexit.register(_forge)\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
    assert "signature" in outcome.reason or "ended with status" in outcome.reason, outcome.reason


def test_shadowing_pytest_from_the_tree(backend, swe):
    fake = (f"import sys\nsys.stdout.write({_forged_lines(swe)!r})\nsys.exit(0)\n")
    outcome = _grade(swe, backend, {"pytest.py": fake, "hmac.py": fake, "json.py": fake})
    assert outcome.tests[F2P] == "failed", outcome


def test_an_output_flood_that_pushes_the_results_out_of_the_kept_tail(backend, swe):
    flood = (f"import sys\nsys.stdout.write('x' * 99 + '\\n')\n"
             f"for _ in range(12000):\n    sys.stdout.write('noise ' * 16 + '\\n')\n"
             f"sys.stdout.write({_forged_lines(swe)!r})\nsys.stdout.flush()\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, flood)})
    assert outcome.tests[F2P] == "failed"
    reference = reference_diff(swe, backend)
    fixed = grade_swebench(swe, reference + edit_diff(swe.repo_dir, {"tinystats/__init__.py": (
        swe.repo_dir / "tinystats" / "__init__.py").read_text() + "\n" + flood}), backend, LIMITS)
    assert fixed.score == 1.0, fixed  # the real results do not live in the output


def test_a_process_left_running_to_rewrite_the_report(backend, swe):
    forge = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.closerange(0, 4096)\n"
             "    time.sleep(20)\n    os._exit(0)\n")
    outcome = _grade(swe, backend, {CORE: _core_with(swe, forge)})
    assert "left processes running" in outcome.reason, outcome.reason


def _key_thief(swe, imports: str = "import hashlib, hmac, os\n") -> str:
    """A module that takes the grader's key when it is imported and, as the process exits, writes a report
    signed with it in which every expected test passed, then exits 0 to match it."""
    record = {"version": 1, "pytest": "9", "collected": _expected_ids(swe),
              "outcomes": {test_id: "passed" for test_id in _expected_ids(swe)}, "exitstatus": 0,
              "session_finished": True, "plugin_files": [], "tampered": [], "test_files": {}}
    return (imports + "import atexit\n"
            "_dir = os.environ.get('ROLLSTREAM_REPORT_DIR', '/grader/report')\n"
            "with open(os.path.join(_dir, 'key'), 'rb') as _file:\n    _key = _file.read()\n"
            "os.unlink(os.path.join(_dir, 'key'))\n"
            f"_body = {json.dumps(record, sort_keys=True)!r}.encode()\n\n"
            "def _forge():\n"
            "    with open(os.path.join(_dir, 'report.json'), 'wb') as out:\n"
            "        out.write(_body + b'\\n' + hmac.new(_key, _body, hashlib.sha256).hexdigest().encode())\n"
            "    os._exit(0)\n\n"
            "atexit.register(_forge)\n")


def test_a_module_of_the_tree_named_like_the_plugin(backend, swe_pythonpath):
    """The snapshot's own configuration puts the tree first on sys.path: a module there named as the
    plugin once was would be imported in its place, take the key and sign a forged report."""
    swe = swe_pythonpath
    reference = grade_swebench(swe, reference_diff(swe, backend), backend, LIMITS)
    assert (reference.score, reference.infrastructure_error) == (1.0, False), reference
    thief = _key_thief(swe)
    outcome = _grade(swe, backend, {"rollstream_report.py": thief, "tinystats/rollstream_report.py": thief,
                                    "tests/rollstream_report.py": thief})
    assert outcome.tests[F2P] == "failed" and "pytest exit 1" in outcome.reason, outcome


def test_a_module_of_the_tree_named_like_one_the_plugin_imports(backend, swe_pythonpath):
    """pytest has not imported hmac by the time it loads `-p` plugins, and the tree is first on sys.path:
    the plugin's own `import hmac` would run the tree's, which steals the key and then puts the real hmac
    in its own place."""
    swe = swe_pythonpath
    stand_in = ("import hashlib, os, sys\n_path = sys.path[:]\n"
                "sys.path[:] = [p for p in _path if os.path.realpath(p or '.') != os.path.realpath('.')]\n"
                "del sys.modules['hmac']\nimport hmac\nsys.modules['hmac'] = hmac\nsys.path[:] = _path\n")
    outcome = _grade(swe, backend, {"hmac.py": _key_thief(swe, stand_in)})
    assert outcome.tests[F2P] == "failed" and "pytest exit 1" in outcome.reason, outcome


@pytest.fixture(scope="module")
def swe_addopts():
    """The row on a snapshot whose own pyproject.toml loads a plugin of the tree: `addopts = "-p
    tinystats_plugin"`, a module at the root that imports tinystats_markers."""
    return load_swebench_rows(FIXTURES / "swebench" / "rows-addopts.jsonl")[0]


def _thief_loaded_first(swe) -> str:
    """A module pytest imports before the grader's plugin: it reads the key and leaves it there, so the
    plugin runs the session as usual; as the process exits it replaces the plugin's report with one signed
    with that key, naming the plugin's module (from PYTEST_ADDOPTS), in which every expected test passed,
    and exits 0 to match it."""
    ids = _expected_ids(swe)
    return ("import atexit, hashlib, hmac, json, os\n"
            "_dir = os.environ.get('ROLLSTREAM_REPORT_DIR', '/grader/report')\n"
            "with open(os.path.join(_dir, 'key'), 'rb') as _file:\n    _key = _file.read()\n"
            f"_ids = {ids!r}\n"
            "_body = json.dumps({'version': 1, 'module': os.environ['PYTEST_ADDOPTS'].split()[-1],\n"
            "                    'collected': _ids, 'outcomes': {i: 'passed' for i in _ids},\n"
            "                    'exitstatus': 0, 'session_finished': True, 'plugin_files': [],\n"
            "                    'tampered': [], 'test_files': {}}, sort_keys=True).encode()\n\n"
            "def _forge():\n"
            "    with open(os.path.join(_dir, 'report.json'), 'wb') as out:\n"
            "        out.write(_body + b'\\n' + hmac.new(_key, _body, hashlib.sha256).hexdigest().encode())\n"
            "    os._exit(0)\n\n"
            "atexit.register(_forge)\n")


LOADED_FIRST = ("which the repository's own pytest configuration pyproject.toml loads with "
                "`-p tinystats_plugin` (its addopts) before the grader's plugin")


def test_the_reference_patch_scores_1_beside_a_plugin_of_the_trees_addopts(backend, swe_addopts):
    outcome = grade_swebench(swe_addopts, reference_diff(swe_addopts, backend), backend, LIMITS)
    assert (outcome.score, outcome.infrastructure_error) == (1.0, False), outcome
    assert "tinystats markers: slow" in outcome.log  # the tree's plugin ran, before the tests


def test_a_plugin_of_the_trees_addopts_rewritten_to_take_the_key(backend, swe_addopts):
    """pytest imports the configuration's own `-p` plugin before the grader's: rewritten, it takes the key
    and signs a report in which every test passed (it scores 1 when nothing refuses it)."""
    outcome = _grade(swe_addopts, backend, {"tinystats_plugin.py": _thief_loaded_first(swe_addopts)})
    assert f"the diff changed tinystats_plugin.py, {LOADED_FIRST}" in outcome.reason, outcome.reason
    assert outcome.tests == {}, outcome  # refused before any test ran


def test_a_module_the_trees_addopts_plugin_imports_or_a_package_in_its_place(backend, swe_addopts):
    swe = swe_addopts
    thief = _thief_loaded_first(swe)
    outcome = _grade(swe, backend, {"tinystats_markers.py": thief + "MARKERS = ()\n"})
    assert (f"the diff changed tinystats_markers.py, imported by tinystats_plugin.py, {LOADED_FIRST}"
            in outcome.reason), outcome.reason
    outcome = _grade(swe, backend, {"tinystats_plugin/__init__.py": thief})  # a package wins over a module
    assert f"the diff changed tinystats_plugin/__init__.py, {LOADED_FIRST}" in outcome.reason, outcome.reason


def test_a_diff_beside_the_trees_addopts_plugin_is_graded_as_usual(backend, swe_addopts):
    swe = swe_addopts
    unrelated = {"tinystats/extra.py": "def span(values):\n    return max(values) - min(values)\n",
                 "README.md": (swe.repo_dir / "README.md").read_text() + "\nspan() too.\n"}
    fixed = grade_swebench(swe, reference_diff(swe, backend) + edit_diff(swe.repo_dir, unrelated), backend,
                           LIMITS)
    assert (fixed.score, fixed.infrastructure_error) == (1.0, False), fixed
    outcome = _grade(swe, backend, unrelated)
    assert outcome.tests[F2P] == "failed" and "FAIL_TO_PASS 0/1 passed" in outcome.reason, outcome.reason
