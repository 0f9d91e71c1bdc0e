"""Hostile diffs, test.sh and solutions through grade_harbor with the real bubblewrap and docker backends:
each is contained, reported with a reason, and the host is unaffected afterwards.

    python -m pytest tests/unit/shared/grading/test_hostile_grading.py -q   (skipped where `bwrap` is missing)

Network tests only ever use this machine's loopback (127.0.0.1).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from rollstream.shared.errors import GradingError
from rollstream.shared.grading.harbor import grade_harbor
from rollstream.shared.grading.outcome import MAX_LOG_CHARS
from rollstream.shared.grading.validation import reference_diff
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.workspace import prepare_workspace
from rollstream.shared.tasks.harbor import HarborTask
from tests.support import sandbox_uid_processes

LIMITS = SandboxLimits(wall_time_s=8, cpu_time_s=8, memory_mb=256, max_processes=32,
                       max_file_size_mb=16, max_open_files=256, max_output_bytes=64 * 1024,
                       tmp_size_mb=16)
REWARD = "/logs/verifier/reward.txt"


@pytest.fixture(scope="module", params=["bubblewrap", "docker"])
def backend(request):
    """Every attack against both real sandboxes: bubblewrap here, and containers on a real engine."""
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    elif shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")
    return get_backend(request.param)


@pytest.fixture
def make_task(tmp_path):
    def make(test_sh: str, files: dict[str, str] | None = None, timeout: float = 8,
             solve_sh: str | None = None) -> HarborTask:
        root = tmp_path / f"task-{uuid.uuid4().hex[:6]}"
        (root / "environment" / "workspace").mkdir(parents=True)
        (root / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
        for name, content in (files or {"app.py": "print('hi')\n"}).items():
            (root / "environment" / "workspace" / name).write_text(content)
        (root / "tests").mkdir()
        (root / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
        solution = None
        if solve_sh is not None:
            (root / "solution").mkdir()
            solution = root / "solution" / "solve.sh"
            solution.write_text("#!/bin/bash\n" + solve_sh)
        return HarborTask(name=root.name, path=root, instruction="", config={},
                          workspace=root / "environment" / "workspace",
                          dockerfile=root / "environment" / "Dockerfile", tests_dir=root / "tests",
                          solution=solution, verifier_timeout_s=timeout, agent_timeout_s=timeout)
    return make


@pytest.fixture(autouse=True)
def host_unaffected():
    """After each test: nothing of the sandbox runs, no grading workspace is left, we can fork."""
    before = set(Path(tempfile.gettempdir()).glob("rs-grade-*"))
    yield
    assert sandbox_uid_processes() == []
    assert set(Path(tempfile.gettempdir()).glob("rs-grade-*")) - before == set()
    assert subprocess.run(["true"]).returncode == 0


def _diff(source: Path, edits: dict[str, str], symlinks: dict[str, str] | None = None) -> str:
    with prepare_workspace(source) as workspace:
        for path, content in edits.items():
            (workspace.root / path).parent.mkdir(parents=True, exist_ok=True)
            (workspace.root / path).write_text(content)
        for path, target in (symlinks or {}).items():
            os.symlink(target, workspace.root / path)
        return workspace.diff()


def test_network_access_is_refused(backend, make_task):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    task = make_task(f"""python3 app.py && echo 1 > {REWARD} || echo 0 > {REWARD}\n""")
    diff = _diff(task.workspace, {"app.py": (
        "import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=3)\n"
        "print('CONNECTED')\n" % port)})
    try:
        outcome = grade_harbor(task, diff, backend, LIMITS)
    finally:
        listener.close()
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert "ConnectionRefusedError" in outcome.log and "CONNECTED" not in outcome.log
    assert accepted == []


def test_fork_bomb_is_contained(backend, make_task):
    task = make_task(f"bomb() {{ bomb | bomb & }}; bomb; wait; sleep 1; echo 0 > {REWARD}\n",
                     timeout=4)
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert "Resource temporarily unavailable" in outcome.log  # the process limit held
    assert outcome.duration_s < 15


def test_memory_bomb_is_stopped(backend, make_task):
    task = make_task(f"python3 -c 'x = bytearray(8 * 1024 ** 3)' && echo 1 > {REWARD} "
                     f"|| echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    # stopped by the address-space rlimit (bubblewrap: MemoryError) or the memory cgroup (docker: SIGKILL);
    # either way the code under test's own outcome, never an infrastructure error
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert ("MemoryError" if backend.name == "bubblewrap" else "Killed") in outcome.log, outcome


def test_disk_fill_is_stopped_by_the_file_size_limit(backend, make_task):
    before = shutil.disk_usage(tempfile.gettempdir()).free
    task = make_task(f"dd if=/dev/zero of=big bs=1M count=4096 2>&1; echo size=$(stat -c %s big)\n"
                     f"echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    after = shutil.disk_usage(tempfile.gettempdir()).free
    limit = LIMITS.max_file_size_mb * 1024 * 1024
    assert "File size limit exceeded" in outcome.log or "size=%d" % limit in outcome.log, outcome.log
    size = int(outcome.log.split("size=")[1].split()[0])
    assert size <= limit
    assert before - after < limit + 64 * 1024 * 1024  # others share this disk: some slack


def test_infinite_loop_hits_the_wall_clock(backend, make_task):
    task = make_task(f"echo 1 > {REWARD}\nwhile :; do :; done\n", timeout=2)
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and "wall-clock limit 2s" in outcome.reason, outcome.reason
    assert not outcome.infrastructure_error and outcome.duration_s < 10


def test_gigabytes_of_output_are_capped(backend, make_task):
    task = make_task(f"yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx | head -c 2G\n"
                     f"yes yyyy | head -c 100M >&2\necho 0.5 > {REWARD}\n", timeout=30)
    outcome = grade_harbor(task, "", backend, LIMITS)
    # the flood is the code's own business: the grade still comes (the start marker is in the kept head)
    assert outcome.score == 0.5 and not outcome.infrastructure_error, outcome.reason
    assert len(outcome.log) <= MAX_LOG_CHARS + 200
    assert "output truncated" in outcome.log


def test_secrets_on_the_host_are_unreadable(backend, make_task):
    planted = []
    base = Path(tempfile.mkdtemp(prefix="rs-hostile-"))
    base.chmod(0o711)
    planted.append(base / "secret.txt")
    if os.access("/root", os.W_OK):
        planted.append(Path("/root") / f"rs-hostile-{uuid.uuid4().hex}.txt")
    try:
        for path in planted:
            path.write_text("TOP-SECRET\n")
            path.chmod(0o644)
        reads = "; ".join(f"cat {p} && found=1" for p in planted)
        task = make_task(f"found=0; {reads}; cat /etc/shadow && found=1; echo $found > {REWARD}\n")
        outcome = grade_harbor(task, "", backend, LIMITS)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
    assert outcome.score == 0, outcome
    assert "TOP-SECRET" not in outcome.log and "No such file" in outcome.log


def test_writes_outside_the_workspace_leave_the_host_unchanged(backend, make_task):
    marker = f"rs-pwned-{uuid.uuid4().hex}"
    targets = [f"/tmp/{marker}", f"/root/{marker}", f"/work/main/{marker}", f"/{marker}",
               f"/usr/{marker}", f"/tests/{marker}"]
    writes = "; ".join(f"echo x > {t}" for t in targets)
    task = make_task(f"{writes}; echo x > ../{marker}; echo x > /tests/test.sh; "
                     f"echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    for target in targets:
        assert not Path(target).exists(), target
    assert (task.tests_dir / "test.sh").read_text().startswith("#!/bin/bash\n")
    assert "Read-only file system" in outcome.log


def test_reward_symlinks_to_host_files_are_not_followed(backend, make_task):
    base = Path(tempfile.mkdtemp(prefix="rs-hostile-"))
    try:
        (base / "verifier").mkdir()
        (base / "verifier" / "reward.txt").write_text("1\n")
        (base / "one.txt").write_text("1\n")
        task = make_task(f"ln -sf {base}/one.txt {REWARD}\n")
        outcome = grade_harbor(task, "", backend, LIMITS)
        assert outcome.score == 0 and "symlink" in outcome.reason, outcome.reason
        task = make_task(f"rm -rf /logs/verifier; ln -s {base}/verifier /logs/verifier\n")
        outcome = grade_harbor(task, "", backend, LIMITS)
        assert outcome.score == 0 and "not a plain directory" in outcome.reason, outcome.reason
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_symlink_out_of_the_workspace_in_the_diff(backend, make_task):
    task = make_task(f"cat secret > /dev/null && echo 1 > {REWARD} || echo 0 > {REWARD}\n")
    diff = _diff(task.workspace, {}, symlinks={"secret": "/etc/passwd"})
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert outcome.score == 0 and "patch did not apply" in outcome.reason
    assert "symlink" in outcome.reason and "/etc/passwd" in outcome.reason


def test_a_diff_editing_the_tests_does_not_count(backend, make_task):
    task = make_task(f"python3 app.py | grep -q fixed && echo 1 > {REWARD} || echo 0 > {REWARD}\n")
    cheat = f"#!/bin/bash\necho 1 > {REWARD}\n"
    diff = _diff(task.workspace, {"tests/test.sh": cheat, "test.sh": cheat})
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert outcome.score == 0, outcome.reason
    escape = ("diff --git a/../tests/test.sh b/../tests/test.sh\n--- a/../tests/test.sh\n"
              "+++ b/../tests/test.sh\n@@ -1 +1 @@\n-#!/bin/bash\n+echo 1 > /logs/verifier/reward.txt\n")
    outcome = grade_harbor(task, escape, backend, LIMITS)
    assert outcome.score == 0 and "outside the workspace" in outcome.reason, outcome.reason


@pytest.mark.parametrize("kill", ["kill -9 $PPID", "kill -9 -1",
                                  "python3 -c 'import os; os.kill(os.getppid(), 9)'"])
def test_killing_the_parent(backend, make_task, kill):
    # model code that writes a reward and then kills test.sh before it writes the real one
    task = make_task(f"echo 1 > {REWARD}; bash -c '{kill}'; sleep 1; echo 0 > {REWARD}\n"
                     if "python" not in kill else
                     f"echo 1 > {REWARD}; {kill}; echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert "did not finish" in outcome.reason and "SIGKILL" in outcome.reason, outcome.reason
    again = grade_harbor(make_task(f"echo 1 > {REWARD}\n"), "", backend, LIMITS)
    assert again.score == 1  # the grader is fine


def test_hostile_solution_in_reference_diff(backend, make_task):
    task = make_task(f"echo 0 > {REWARD}\n", solve_sh="kill -9 -1\n")
    with pytest.raises(GradingError, match="reference solution"):
        reference_diff(task, backend, LIMITS)
    task = make_task(f"echo 0 > {REWARD}\n",
                     solve_sh="echo ok > result.txt; ln -s /etc/passwd leak; mkfifo pipe\n")
    diff = reference_diff(task, backend, LIMITS)
    assert "result.txt" in diff and "leak" in diff and "pipe" not in diff
    outcome = grade_harbor(task, diff, backend, LIMITS)  # its own symlink is refused too
    assert "symlink" in outcome.reason
