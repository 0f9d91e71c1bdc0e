"""A sandbox-grader whose enqueuer thread dies must not go on looking healthy: it exits non-zero (its
supervisor, the local run or Compose, restarts it). A grader that starts removes the grading workspaces
that dead work-horses left behind, and only those."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rollstream.services.sandbox_grader import main as grader

MAKE_A_WORKSPACE_THEN_WAIT = (
    "import sys\n"
    "from rollstream.shared.sandbox.workspace import GitWorkspace\n"
    "print(GitWorkspace.create('grade', None).base, flush=True)\n"
    "sys.stdin.read()\n"
)
"""A work-horse in the middle of a Harbor or SWE-bench job: its grading workspace made, the job running."""


def grader_settings(monkeypatch, redis_url: str, run_id: str, storage: Path) -> None:
    for name, value in {"RS_REDIS_URL": redis_url, "RS_RUN_ID": run_id, "RS_STORAGE_URI": str(storage),
                        "RS_HEALTH_PORT": "0"}.items():
        monkeypatch.setenv(name, value)


GRADER_WITH_A_BROKEN_ENQUEUER = (
    "from rollstream.services.sandbox_grader import main as grader\n"
    "def broken_consumer(*_args, **_kwargs):\n"
    "    raise RuntimeError('enqueuer broke')\n"
    "grader.run_consumer = broken_consumer\n"
    "grader.main()\n"
)
"""The grader as its own process (as it runs): its RQ worker forks a scheduler, which a test runner's threads
must not be part of."""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_grader_exits_non_zero_when_its_enqueuer_dies(monkeypatch, redis_url, run_id, tmp_path):
    grader_settings(monkeypatch, redis_url, run_id, tmp_path)
    result = subprocess.run([sys.executable, "-c", GRADER_WITH_A_BROKEN_ENQUEUER],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "enqueuer died" in result.stdout + result.stderr


def test_a_starting_grader_removes_the_workspaces_of_dead_work_horses_and_keeps_those_of_live_ones(
        monkeypatch, redis_url, run_id, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    horses = [subprocess.Popen([sys.executable, "-c", MAKE_A_WORKSPACE_THEN_WAIT], text=True,
                               env={**os.environ, "TMPDIR": str(temp)}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
              for _ in range(2)]
    killed, running = horses
    try:
        left_behind, in_use = (Path(horse.stdout.readline().strip()) for horse in horses)
        killed.kill()  # a job timeout: the work-horse never gets to delete its workspace
        killed.wait()
        assert (left_behind / "repo").is_dir() and (in_use / "repo").is_dir()

        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        monkeypatch.setattr(grader, "wait_for_backend", lambda settings, runtime: False)  # then stop at once
        grader_settings(monkeypatch, redis_url, run_id, tmp_path / "runs")
        grader.main()
        assert not left_behind.exists()
        assert (in_use / "repo").is_dir()
    finally:
        for horse in horses:
            horse.kill()
            horse.wait()
