"""SWE rows' environments under real bubblewrap: a virtual environment built once per key with real pip from
PyPI, the row graded in it (reference 1, empty diff 0) for a src-layout package that nothing else puts on the
path, the editable install pointing at the graded tree (a diff's change is what the tests import), reuse, a
failing install as an infrastructure error with the log's tail, and what the bubblewrap sandbox refuses.

    python -m pytest tests/unit/shared/sandbox/test_venv_environments.py -q   (needs bwrap and PyPI)
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from rollstream.shared.grading.runs import DEFAULT_GRADE_LIMITS
from rollstream.shared.grading.swebench import grade_swebench
from rollstream.shared.sandbox.bubblewrap import BubblewrapBackend
from rollstream.shared.sandbox.venv_environments import (
    INSTALL_LOG,
    MANIFEST,
    EnvironmentUnsupported,
    VenvEnvironments,
    sandbox_python_version,
)
from rollstream.shared.tasks.environment_spec import environment_spec
from rollstream.shared.tasks.swebench import load_swebench_rows
from tests.support import FIXTURES

ENV_ROWS = FIXTURES / "swebench-env" / "rows.jsonl"


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (`bwrap`) is not installed"),
    pytest.mark.skipif(not pypi_reachable(), reason="PyPI (pypi.org:443) is not reachable: environments "
                                                    "install packages from it"),
]


@contextmanager
def environments_root():
    """A fresh environments directory the sandbox may mount at its own path: not under /tmp (the sandbox's
    own tmpfs), so under /var/tmp."""
    path = Path(tempfile.mkdtemp(prefix="rs-test-environments-", dir="/var/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def backend():
    with environments_root() as root:
        yield BubblewrapBackend(environments_dir=root)


@pytest.fixture(scope="module")
def srcstats(backend):
    """The src-layout row and its environment, built once for the module."""
    [task] = load_swebench_rows(ENV_ROWS)
    prepared = backend.environments.prepare(environment_spec(task))
    return task, prepared


def test_a_src_layout_row_grades_reference_1_and_empty_0_in_its_environment(backend, srcstats):
    task, prepared = srcstats
    assert prepared.built and prepared.size_mb > 0
    reference = grade_swebench(task, task.gold_patch, backend)
    assert (reference.score, reference.infrastructure_error) == (1.0, False), reference.reason + reference.log
    empty = grade_swebench(task, "", backend)
    assert (empty.score, empty.infrastructure_error) == (0.0, False), empty.reason
    assert "not passing: ['tests/test_core.py::test_spread_unsorted']" in empty.reason


def test_without_its_environment_the_row_cannot_import_its_package(backend, srcstats):
    task, _ = srcstats
    bare = replace(task, install=None)
    assert environment_spec(bare) is None
    outcome = grade_swebench(bare, task.gold_patch, backend)
    assert outcome.score == 0 and "No module named 'srcstats'" in outcome.log


@pytest.fixture
def base():
    """A host directory others may enter (as /tmp/rs-grade-* are), for a workspace the sandbox's user reaches
    when we are root."""
    path = Path(tempfile.mkdtemp(prefix="rs-env-test-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_editable_install_imports_the_graded_tree_never_a_copy(backend, srcstats, base):
    task, prepared = srcstats
    environment = backend.environment_for(environment_spec(task))
    assert environment.env["PATH"].startswith(f"{prepared.path}/bin:")
    workspace = shutil.copytree(task.repo_dir, base / "workspace")
    (workspace / "src" / "srcstats" / "core.py").write_text("def spread(values):\n    return 'graded tree'\n")
    result = backend.run("python -c 'import srcstats; print(srcstats.__file__, srcstats.spread([1]))'; "
                         "python -m pytest --version", workspace, limits=DEFAULT_GRADE_LIMITS,
                         ro_mounts=environment.ro_mounts, env=environment.env)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == "/workspace/src/srcstats/__init__.py graded tree"
    site = next(prepared.path.glob("lib/python3*/site-packages"))
    recorded = "".join(path.read_text() for path in [*site.glob("*.pth"), *site.glob("__editable__*.py")])
    assert "/workspace" in recorded and not list(prepared.path.parent.glob(".tree-*"))


def test_an_environment_is_built_once_and_reused_with_its_manifest(backend, srcstats):
    task, prepared = srcstats
    again = backend.environments.prepare(environment_spec(task))
    assert (again.built, again.action, again.path) == (False, "reused", prepared.path)
    assert again.seconds < 5
    manifest = json.loads((prepared.path / MANIFEST).read_text())
    assert manifest["spec"]["key"] == prepared.key and manifest["spec"]["install"] == ["pip install -e ."]
    assert manifest["python"] == sandbox_python_version() and manifest["disk_bytes"] > 1_000_000
    assert any(line.lower().startswith("srcstats") or "srcstats" in line for line in manifest["pip_freeze"])
    assert any(line.startswith("pytest==") for line in manifest["pip_freeze"])
    assert "pip install -e ." in (prepared.path / INSTALL_LOG).read_text()
    assert prepared.key in [p.name for p in prepared.path.parent.iterdir()]


def test_two_graders_that_need_the_same_environment_build_it_once(backend, srcstats):
    task, _ = srcstats
    builds = backend.environments.root / "builds.txt"
    spec = environment_spec(replace(task, install=(f"echo built >> {builds}",)))
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: backend.environments.prepare(spec), range(2))
    assert sorted([first.built, second.built]) == [False, True] and first.path == second.path
    assert builds.read_text() == "built\n"


def test_a_failing_install_is_an_infrastructure_error_with_the_log_tail(backend, srcstats):
    task, _ = srcstats
    failing = replace(task, install=("echo the-install-printed-this; exit 3",))
    outcome = grade_swebench(failing, task.gold_patch, backend)
    assert outcome.infrastructure_error and outcome.score == 0
    assert "the-install-printed-this" in outcome.reason and "exit 3" in outcome.reason
    key = environment_spec(failing).key
    assert not (backend.environments.root / key).exists()
    assert not [p for p in backend.environments.root.iterdir() if p.name.startswith((".building", ".tree"))]


def test_another_python_is_refused_with_what_to_do(backend, srcstats):
    task, _ = srcstats
    other = "3.7" if sandbox_python_version() != "3.7" else "3.8"
    outcome = grade_swebench(replace(task, python=other), task.gold_patch, backend)
    assert outcome.infrastructure_error and f"wants Python {other}" in outcome.reason
    assert "--backend docker" in outcome.reason


def test_an_environments_directory_the_sandbox_cannot_mount_is_refused(srcstats):
    task, _ = srcstats
    with pytest.raises(EnvironmentUnsupported, match=r"under\) the sandbox's /tmp.*environments_dir"):
        VenvEnvironments(Path(tempfile.gettempdir()) / "rs-environments").prepare(environment_spec(task))
