import json
import shutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rollstream.cli import main as cli_main
from rollstream.cli.main import app
from tests.support import FIXTURES

runner = CliRunner()
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")


@pytest.fixture
def wide_console(monkeypatch):
    """validate's table on one line per row, so that its cells can be matched whole."""
    monkeypatch.setattr(cli_main, "console", Console(width=1000))


def test_run_with_a_bad_dataset_fails_before_starting_anything(tmp_path, monkeypatch):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"question": "no prompt"}) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setenv("RS_DATA__PATH", str(data))
    monkeypatch.setenv("RS_MODEL__PATH", str(model))
    monkeypatch.setenv("RS_STORAGE_URI", str(tmp_path / "runs"))
    # the path on one line, however deep the temporary folder
    monkeypatch.setattr(cli_main.console, "width", 400)
    result = runner.invoke(app, ["run", "--run-id", "bad-data"])
    assert result.exit_code == 1
    assert "prompts.jsonl row 1: missing 'prompt'" in " ".join(result.output.split())
    assert not (tmp_path / "runs" / "bad-data" / "logs").exists()


def test_config_prints_the_resolved_settings(monkeypatch):
    monkeypatch.setenv("RS_TRAIN__MAX_STALENESS", "0")
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 0
    assert json.loads(result.output)["train"]["max_staleness"] == 0


def test_config_masks_the_secrets(monkeypatch):
    monkeypatch.setenv("RS_REDIS_URL", "redis://reward:a-redis-password@redis:6379/0")
    monkeypatch.setenv("RS_SECURITY__HTTP_TOKEN", "an-http-token-of-some-length")
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 0
    assert "a-redis-password" not in result.output and "an-http-token-of-some-length" not in result.output
    shown = json.loads(result.output)
    assert shown["redis_url"] == "redis://redis:6379/0" and shown["redis_username"] == "reward"
    assert shown["redis_password"] == "**********" and shown["security"]["http_token"] == "**********"


def test_embedded_redis_keeps_streams_across_a_restart(tmp_path):
    import redis

    from rollstream.cli.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        redis.Redis.from_url(server.url).xadd("rs:x:prompts", {"a": "1"})
    finally:
        server.stop()
    assert server.process.returncode == 0
    again = EmbeddedRedis(tmp_path / "redis", port=server.port)
    again.start()
    try:
        assert redis.Redis.from_url(again.url).xlen("rs:x:prompts") == 1  # append-only file replayed
    finally:
        again.stop()


def test_embedded_redis_with_a_password_asks_for_it_and_keeps_it_off_disk(tmp_path):
    import redis
    from pydantic import SecretStr

    from rollstream.cli.embedded_redis import EmbeddedRedis

    password = "an-embedded-redis-password"
    server = EmbeddedRedis(tmp_path / "redis", username="rollstream", password=SecretStr(password))
    server.start()
    try:
        anonymous = redis.Redis.from_url(server.url)
        assert anonymous.ping()  # readiness checks stay possible
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.get("rs:x:admitted")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(server.url, username="rollstream", password="wrong").ping()
        client = redis.Redis.from_url(server.url, username="rollstream", password=password)
        assert client.xadd("rs:x:prompts", {"a": "1"})
    finally:
        server.stop()
    acl = tmp_path / "redis" / "users.acl"
    assert acl.stat().st_mode & 0o777 == 0o600
    for path in (tmp_path / "redis").rglob("*"):
        if path.is_file():
            assert password.encode() not in path.read_bytes(), path


@needs_bwrap
def test_validate_passes_on_the_harbor_fixtures(wide_console):
    result = runner.invoke(app, ["validate", str(FIXTURES / "harbor")])
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1:-1] for line in result.output.splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        [name, "1", "0", "yes", ""] for name in ("app-stats", "fix-add", "three-functions")]


@needs_bwrap
def test_validate_reports_a_task_whose_reference_solution_fails(tmp_path, wide_console):
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "harbor" / "fix-add", tasks / "fix-add")
    shutil.copytree(FIXTURES / "harbor" / "app-stats", tasks / "broken")
    (tasks / "broken" / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'cannot solve' >&2\nexit 3\n")
    result = runner.invoke(app, ["validate", str(tasks)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:5]]
            for line in result.output.splitlines() if line.startswith("│") and line.split("│")[1].strip()}
    assert rows == {"broken": ["-", "-", "no"], "fix-add": ["1", "0", "yes"]}
    assert "could not grade: reference solution of broken failed (exit 3): [exit 3;" in result.output
    assert "cannot solve" in result.output


def test_validate_names_the_field_of_an_invalid_task(tmp_path):
    task = shutil.copytree(FIXTURES / "harbor" / "fix-add", tmp_path / "fix-add")
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = "abc"\n')
    result = runner.invoke(app, ["validate", str(task)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "[verifier] timeout_sec must be a positive number, got 'abc'" in " ".join(result.output.split())


def test_validate_without_a_usable_sandbox_says_so():
    result = runner.invoke(app, ["validate", str(FIXTURES / "harbor"), "--backend", "nonsense"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "no sandbox: unknown backend 'nonsense'" in result.output


@pytest.mark.parametrize(("set_by_user", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_line_and_what_it_starts_wait_for_openmp_passively(set_by_user, seen):
    """torch's OpenMP threads spinning at a barrier starve a shared core (cli/__init__.py): the command line
    sets the passive wait before torch loads, for itself and every process it starts; a value the user set
    wins."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if set_by_user:
        env["OMP_WAIT_POLICY"] = set_by_user
    grandchild = "import os; print(os.environ['OMP_WAIT_POLICY'])"
    child = f"import subprocess, sys, rollstream.cli; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    printed = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                             check=True)
    assert printed.stdout.strip() == seen
