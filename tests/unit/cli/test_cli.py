import json

from typer.testing import CliRunner

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
    result = runner.invoke(app, ["run", "--run-id", "bad-data"])
    assert result.exit_code == 1
    assert "prompts.jsonl row 1: missing 'prompt'" in " ".join(result.output.split())
    assert not (tmp_path / "runs" / "bad-data" / "logs").exists()


def test_config_prints_the_resolved_settings(monkeypatch):
    monkeypatch.setenv("RS_TRAIN__MAX_STALENESS", "0")
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 0
    assert json.loads(result.output)["train"]["max_staleness"] == 0


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
