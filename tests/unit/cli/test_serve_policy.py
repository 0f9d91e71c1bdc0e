"""What a (re)started vLLM server loads (`rollstream serve-policy`, which Compose runs): the run's newest
published policy whose checkpoint is on its disk, found in Redis or, once the recorder trimmed it there, in
the run's archive; the starting model before the first version. Real Redis 7.0 and Valkey, real Parquet
archive; tests/integration/test_serve_policy.py starts the real vLLM server."""

from pathlib import Path

from typer.testing import CliRunner

from rollstream.cli.main import app
from rollstream.cli.vllm_server import newest_policy
from rollstream.shared.contract.archive import trim_stream
from rollstream.shared.contract.events import PolicyUpdated
from rollstream.shared.runtime.config import Settings
from tests.support import archive_all

runner = CliRunner()


def publish_version(bus, version: int, checkpoint: Path, trained: bool = True, written: bool = True) -> None:
    """A PolicyUpdated on `policy`; trained: as the run's trainer publishes it, its batch in the trained
    set; written: its checkpoint on disk."""
    if written:
        checkpoint.mkdir(parents=True)
        (checkpoint / "config.json").write_text("{}")
    batch_id = f"b-{version}" if trained else f"b-forged-{version}"
    bus.publish("policy", PolicyUpdated(version=version, checkpoint_uri=str(checkpoint),
                                        batch_id=batch_id, servers=[], parity_max_abs_diff=0.0, loss=0.0,
                                        trained_samples=1))
    if trained:
        bus.redis.sadd(bus.keys.trained_batches, batch_id)


def settings_for(bus, tmp_path: Path, transport: str = "collective") -> Settings:
    return Settings(run_id=bus.keys.run_id, storage_uri=str(tmp_path / "runs"),
                    model={"path": tmp_path / "start"}, train={"weight_transport": transport})


def test_before_the_first_version_a_server_starts_on_the_starting_model(bus, tmp_path):
    assert newest_policy(bus, settings_for(bus, tmp_path)) == (tmp_path / "start", 0)


def test_a_server_starts_on_the_newest_version_the_trainer_published_wherever_it_is_kept(bus, tmp_path):
    settings = settings_for(bus, tmp_path)
    checkpoints = tmp_path / "runs" / bus.keys.run_id / "checkpoints"
    for version in (1, 2):
        publish_version(bus, version, checkpoints / f"v{version:05d}")
    publish_version(bus, 9, tmp_path / "elsewhere", trained=False)  # written onto `policy` by someone else
    assert newest_policy(bus, settings) == (checkpoints / "v00002", 2)

    archive_all(bus, Path(settings.storage_uri))
    trim_stream(bus, "policy")  # the recorder keeps the newest entry alone in Redis: the forged one
    assert newest_policy(bus, settings) == (checkpoints / "v00002", 2)

    # v3 and v4 published and not checkpointed (train.checkpoint_every, or not written yet): v2 still
    for version in (3, 4):
        publish_version(bus, version, checkpoints / f"v{version:05d}", written=False)
    assert newest_policy(bus, settings) == (checkpoints / "v00002", 2)


def test_with_a_collective_sync_a_server_without_the_runs_storage_starts_on_the_starting_model(bus, tmp_path):
    """The trainer broadcasts every version: a server need not see the checkpoints; it takes the next sync."""
    publish_version(bus, 3, tmp_path / "runs" / bus.keys.run_id / "checkpoints" / "v00003", written=False)
    assert newest_policy(bus, settings_for(bus, tmp_path)) == (tmp_path / "start", 0)


def test_serve_policy_refuses_a_version_whose_checkpoint_it_cannot_see(bus, tmp_path):
    """With the disk transport every version is on the shared storage: one missing means it is not mounted."""
    settings = settings_for(bus, tmp_path, transport="disk")
    # not on this disk
    publish_version(bus, 3, tmp_path / "runs" / bus.keys.run_id / "checkpoints" / "v00003", written=False)
    url = bus.redis.connection_pool.connection_kwargs
    result = runner.invoke(app, ["serve-policy", "--port", "1"], env={
        "RS_REDIS_URL": f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}",
        "RS_RUN_ID": bus.keys.run_id, "RS_STORAGE_URI": settings.storage_uri,
        "RS_MODEL__PATH": str(tmp_path / "start"), "RS_CONFIG_FILE": "",
        "RS_TRAIN__WEIGHT_TRANSPORT": "disk"})
    said = " ".join(result.output.split())
    assert result.exit_code == 1
    assert f"policy version 3 of run '{bus.keys.run_id}'" in said and "holds no model here" in said
