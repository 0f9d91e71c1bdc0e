"""`rollstream run` refuses to start when the dataset needs a sandbox that cannot run here: a run
without one would only collect rollouts nobody can grade."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from rollstream.cli.main import app
from rollstream.cli.run_preflight import check_sandbox
from rollstream.shared.errors import BackendUnavailable
from rollstream.shared.runtime.config import Settings
from tests.support import BWRAP_NO_USERNS, break_bwrap, sandbox_bin_dir

runner = CliRunner()


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    """A PATH on which bubblewrap cannot be found (everything else the check needs is in-process)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_run_refuses_before_starting_anything_when_the_sandbox_cannot_run(tmp_path, monkeypatch, no_bwrap):
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setenv("RS_MODEL__PATH", str(model))
    monkeypatch.setenv("RS_STORAGE_URI", str(tmp_path / "runs"))
    # the synthetic task: every 4th prompt sandboxed
    result = runner.invoke(app, ["run", "--run-id", "no-sandbox"])
    said = " ".join(result.output.split())
    assert result.exit_code == 1
    assert "250 of the dataset's 1000 prompts are graded in a sandbox" in said
    assert "apt-get install bubblewrap" in said
    assert not (tmp_path / "runs" / "no-sandbox" / "logs").exists()


def test_a_dataset_without_sandboxed_rows_needs_no_sandbox(tmp_path, monkeypatch, no_bwrap):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1?", "label": "2"}) + "\n")
    check_sandbox(Settings(data={"path": data}), ("dispatcher", "sandbox-grader", "reward"))
    check_sandbox(Settings(data={"synthetic_sandbox_every": 0}), ("dispatcher", "sandbox-grader", "reward"))


def test_a_sandboxed_row_needs_the_graders_backend(tmp_path, monkeypatch, no_bwrap):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "say 7", "sandbox_check": "grep -q 7 answer.txt"}) + "\n")
    with pytest.raises(BackendUnavailable, match="1 of the dataset's 1 prompts"):
        check_sandbox(Settings(data={"path": data}), ("dispatcher", "sandbox-grader", "reward"))
    # a replay that starts no grader does not need one
    check_sandbox(Settings(data={"path": data}), ("reward",))


def test_run_refuses_when_bwrap_is_there_but_cannot_make_a_sandbox(tmp_path, monkeypatch):
    bin_dir = sandbox_bin_dir()
    try:
        break_bwrap(bin_dir)  # as on Ubuntu 24.04, or in a container without the security options
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        model = tmp_path / "model"
        model.mkdir()
        monkeypatch.setenv("RS_MODEL__PATH", str(model))
        monkeypatch.setenv("RS_STORAGE_URI", str(tmp_path / "runs"))
        result = runner.invoke(app, ["run", "--run-id", "no-namespaces"])
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
    said = " ".join(result.output.split())
    assert result.exit_code == 1
    assert "graded in a sandbox" in said and BWRAP_NO_USERNS in said
    assert "kernel.apparmor_restrict_unprivileged_userns=0" in said and "seccomp=unconfined" in said
    assert not (tmp_path / "runs" / "no-namespaces" / "logs").exists()
