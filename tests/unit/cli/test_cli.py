import json

import pytest
from typer.testing import CliRunner

from rollstream.cli import main as cli_main
from rollstream.cli.main import app

runner = CliRunner()


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
