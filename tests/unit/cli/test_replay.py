"""Replay of recorded runs on a real Redis 7.0 and a real Valkey, archives in real Parquet."""

from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from rollstream.cli.main import app
from rollstream.cli.replay.plan import Pace, ReplayError, ReplayPlan, check_fresh, publish
from rollstream.services.recorder.archive_writer import ArchiveWriter
from rollstream.shared.contract.archive import StreamHistory, read_history, trim_stream
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryFinished, decode, encode
from rollstream.shared.runtime.storage import Storage
from tests.support import archive_all, prompt, turn

runner = CliRunner()


def finished(i: int) -> TrajectoryFinished:
    return TrajectoryFinished(status="completed", segment_count=1, group_size=2, sample_index=i,
                              response_text=f"{i}", label="1")


def record_a_run(bus, tmp_path: Path) -> None:
    """Two rollouts finish (r0, r1), one does not (r2); then everything is archived."""
    for i in range(3):
        bus.publish("prompts", prompt(i, group_size=2), rollout_id=f"r{i}", group_id="g0",
                    event_id=f"r{i}:prompt")
        bus.publish("trajectories", turn(i), rollout_id=f"r{i}", event_id=f"r{i}:turn")
    for i in range(2):
        bus.publish("trajectories", finished(i), rollout_id=f"r{i}", event_id=f"r{i}:finished")
    archive_all(bus, tmp_path)


@pytest.fixture
def target(redis_url, run_id):
    bus = Bus(redis.Redis.from_url(redis_url), f"{run_id}-replay")
    yield bus
    bus.delete_run()


def raw(bus, stream):
    return [fields for _, fields in bus.redis.xrange(bus.keys.stream(stream))]


def test_a_replay_republishes_every_entry_byte_for_byte_in_the_original_order(bus, target, tmp_path):
    record_a_run(bus, tmp_path)
    plan = ReplayPlan(bus.keys.run_id, str(tmp_path))
    assert plan.validate() == {"prompts": 3, "trajectories": 5, "grades": 0, "rewards": 0, "batches": 0,
                               "policy": 0}
    counts = publish(plan, target, Pace.parse("fast"))
    assert counts["prompts"] == 3 and counts["trajectories"] == 5
    for stream in ("prompts", "trajectories"):
        assert raw(target, stream) == raw(bus, stream)
    # the interleaving across streams is kept too: every prompt i after trajectory events of i - 1.
    # Ids of two streams written in the same millisecond are equal, so across streams the order
    # shows only as ids that never go back.
    ids = {stream: [tuple(map(int, entry_id.split(b"-")))
                    for entry_id, _ in target.redis.xrange(target.keys.stream(stream))]
           for stream in ("prompts", "trajectories")}
    assert ids["prompts"][1] >= ids["trajectories"][0] and ids["prompts"][2] >= ids["trajectories"][1]


def test_finished_only_leaves_out_the_rollouts_that_never_finished(bus, target, tmp_path):
    record_a_run(bus, tmp_path)
    plan = ReplayPlan(bus.keys.run_id, str(tmp_path), streams=("prompts", "trajectories"), finished_only=True)
    assert plan.validate() == {"prompts": 2, "trajectories": 4}
    publish(plan, target, Pace.parse("fast"))
    rollouts = {decode(fields).rollout_id for stream in ("prompts", "trajectories")
                for fields in raw(target, stream)}
    assert rollouts == {"r0", "r1"}


def test_a_live_source_is_read_whole_though_the_recorder_trimmed_it(bus, target, tmp_path):
    """The live namespace's trimmed part comes from the archive, the rest from Redis."""
    record_a_run(bus, tmp_path)
    bus.ensure_group("trajectories", "reader")
    for delivery in bus.consume("trajectories", "reader", "c", count=100):
        bus.ack(delivery, "reader")
    assert trim_stream(bus, "trajectories") == 4  # the newest entry stays
    bus.publish("trajectories", finished(2), rollout_id="r2", event_id="r2:finished")  # after the archive
    history = StreamHistory(bus, "trajectories", None)
    assert len(history.new_entries()) == 2  # Redis alone has lost the trimmed entries...
    whole = read_history(bus, "trajectories", str(tmp_path))
    assert [d.envelope.event_id for d in whole] == ["r0:turn", "r1:turn", "r2:turn", "r0:finished",
                                                    "r1:finished", "r2:finished"]
    plan = ReplayPlan(bus.keys.run_id, str(tmp_path), source_bus=bus, streams=("trajectories",))
    assert plan.validate() == {"trajectories": 6}
    publish(plan, target, Pace.parse("fast"))
    assert [decode(f).event_id for f in raw(target, "trajectories")] == [d.envelope.event_id for d in whole]


def test_the_target_must_be_a_fresh_namespace(bus, target, tmp_path):
    record_a_run(bus, tmp_path)
    check_fresh(target, str(tmp_path))
    target.redis.set(target.keys.state("x", "y"), 1)
    with pytest.raises(ReplayError, match="already has keys"):
        check_fresh(target, str(tmp_path))
    target.delete_run()
    (tmp_path / target.keys.run_id).mkdir()
    (tmp_path / target.keys.run_id / "leftover").write_text("x")
    with pytest.raises(ReplayError, match="already holds files"):
        check_fresh(target, str(tmp_path))


@pytest.mark.parametrize("text, speed", [("fast", None), ("original", 1.0), ("10", 10.0), ("2.5x", 2.5)])
def test_pace_parsing(text, speed):
    assert Pace.parse(text).speed == speed


@pytest.mark.parametrize("text", ["slow", "0", "-3", "x"])
def test_a_bad_pace_is_a_clear_error(text):
    with pytest.raises(ValueError, match="use fast, original, or a speed-up factor"):
        Pace.parse(text)


def test_original_pace_keeps_the_recorded_gaps_scaled(bus, target, tmp_path):
    """Entries recorded 0, 1000 and 3000 ms apart are published at those offsets divided by the speed-up."""
    base = 1_700_000_000_000
    entries = [(f"{base + offset}-0", encode(bus.envelope(prompt(i, group_size=2), rollout_id=f"r{i}")))
               for i, offset in enumerate((0, 1000, 3000))]
    ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id).write_part("prompts", entries)
    plan = ReplayPlan(bus.keys.run_id, str(tmp_path), streams=("prompts",))
    plan.validate()
    now, sleeps = [0.0], []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    publish(plan, target, Pace.parse("2x"), sleep=sleep, clock=lambda: now[0])
    assert sleeps == [0.5, 1.0] and now[0] == 1.5
    assert [decode(f).rollout_id for f in raw(target, "prompts")] == ["r0", "r1", "r2"]
    sleeps.clear()
    target.delete_run()
    publish(plan, target, Pace.parse("fast"), sleep=sleep, clock=lambda: now[0])
    assert sleeps == [] and len(raw(target, "prompts")) == 3


def test_a_damaged_archive_fails_naming_the_file_and_nothing_reaches_the_target(bus, target, tmp_path):
    record_a_run(bus, tmp_path)
    part = next((tmp_path / bus.keys.run_id / "archive" / "trajectories").rglob("*.parquet"))
    part.write_bytes(part.read_bytes()[:100])
    result = runner.invoke(app, ["replay", bus.keys.run_id, "--to", target.keys.run_id, "--from", "archive"],
                           env=env_for(target, tmp_path))
    assert result.exit_code == 1
    assert f"{part}: not a readable Parquet file" in result.output
    assert not target.has_keys()
    assert not (tmp_path / target.keys.run_id).exists()


def test_an_unknown_event_version_fails_naming_the_file_and_entry(bus, target, tmp_path):
    record_a_run(bus, tmp_path)
    entry_id = "9999999999999-0"
    part = ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id).write_part(
        "rewards", [(entry_id, {b"type": b"RewardAssigned", b"v": b"99", b"body": b"\x80"})])
    result = runner.invoke(app, ["replay", bus.keys.run_id, "--to", target.keys.run_id, "--from", "archive"],
                           env=env_for(target, tmp_path))
    assert result.exit_code == 1
    output = "".join(result.output.split())
    assert Path(part.path).name in output and entry_id in output and "version'99'" in output
    assert not target.has_keys()


def test_the_command_publishes_a_subset_and_reports_it(bus, target, tmp_path):
    record_a_run(bus, tmp_path)
    result = runner.invoke(app, ["replay", bus.keys.run_id, "--to", target.keys.run_id, "--streams",
                                 "trajectories", "--finished-only", "--from", "archive"],
                           env=env_for(target, tmp_path))
    assert result.exit_code == 0, result.output
    assert "trajectories" in result.output and "4" in result.output
    assert len(raw(target, "trajectories")) == 4 and not raw(target, "prompts")
    # running it again is refused: the target is no longer fresh
    again = runner.invoke(app, ["replay", bus.keys.run_id, "--to", target.keys.run_id, "--from", "archive"],
                          env=env_for(target, tmp_path))
    assert again.exit_code == 1 and "already has keys" in again.output


def env_for(target: Bus, storage: Path) -> dict:
    url = target.redis.connection_pool.connection_kwargs
    return {"RS_REDIS_URL": f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}",
            "RS_STORAGE_URI": str(storage), "RS_CONFIG_FILE": ""}


def test_streams_must_exist(tmp_path):
    with pytest.raises(ValueError, match="unknown streams nope"):
        ReplayPlan("r", str(tmp_path), streams=("nope",))


def test_entries_the_source_dead_lettered_can_be_left_out(bus, target, tmp_path):
    """A malformed entry the original services dead-lettered is the source's own bad input: by default the
    replay refuses it like any damage; with skip_dead_lettered it leaves exactly that entry out."""
    record_a_run(bus, tmp_path)
    bad = bus.redis.xadd(bus.keys.stream("prompts"),
                         {"type": "PromptIssued", "v": "99", "body": b""}).decode()
    bus.ensure_group("prompts", "runner")
    bus.dead_letter("prompts", "runner", bad, {b"type": b"PromptIssued", b"v": b"99"}, 1,
                    "schema version '99'")
    archive_all(bus, tmp_path)
    with pytest.raises(ReplayError, match=f"entry {bad}: PromptIssued schema version '99'"):
        ReplayPlan(bus.keys.run_id, str(tmp_path), streams=("prompts",)).validate()
    plan = ReplayPlan(bus.keys.run_id, str(tmp_path), streams=("prompts",), skip_dead_lettered=True)
    assert plan.validate() == {"prompts": 3} and plan.dead_lettered == {("prompts", bad)}
    publish(plan, target, Pace.parse("fast"))
    assert raw(target, "prompts") == [fields
                                      for entry_id, fields in bus.redis.xrange(bus.keys.stream("prompts"))
                                      if entry_id.decode() != bad]


def test_a_run_with_nothing_recorded_is_a_clear_error(bus, target, tmp_path):
    with pytest.raises(ReplayError, match=f"run '{bus.keys.run_id}' has no entries in trajectories"):
        ReplayPlan(bus.keys.run_id, str(tmp_path), streams=("trajectories",)).validate()
    result = runner.invoke(app, ["replay", bus.keys.run_id, "--to", bus.keys.run_id],
                           env=env_for(target, tmp_path))
    assert result.exit_code == 1 and "must differ from the source" in result.output


def test_entries_of_dead_that_do_not_decode_are_replayed_as_they_are_and_counted(bus, target, tmp_path):
    """Junk written straight onto `dead` is the source's record of what went wrong, not archive damage: a
    replay that takes `dead` (or reads it to skip what the source dead-lettered) carries it over."""
    record_a_run(bus, tmp_path)
    junk = {b"type": b"Nonsense", b"v": b"1", b"body": b"\x00\xff"}
    handled = bus.redis.xadd(bus.keys.stream("dead"), junk).decode()
    bus.ensure_group("dead", "reward")
    # as the reward service does
    bus.dead_letter("dead", "reward", handled, junk, 1, "unknown event type 'Nonsense'")
    bus.redis.xadd(bus.keys.stream("dead"), junk)  # came after the reward service stopped
    archive_all(bus, tmp_path)

    every = runner.invoke(app, ["replay", bus.keys.run_id, "--to", target.keys.run_id, "--streams",
                                "prompts,dead", "--from", "archive"], env=env_for(target, tmp_path))
    assert every.exit_code == 0, every.output
    assert "dead: 2 entries that do not decode were replayed as they are" in every.output
    assert raw(target, "dead") == raw(bus, "dead") and len(raw(target, "prompts")) == 3

    target.delete_run()
    skipping = runner.invoke(app, ["replay", bus.keys.run_id, "--to", target.keys.run_id, "--streams",
                                   "prompts,dead", "--skip-dead-lettered", "--from", "archive"],
                             env=env_for(target, tmp_path))
    assert skipping.exit_code == 0, skipping.output
    assert "dead: 1 entries that do not decode were replayed as they are" in skipping.output
    # the junk the source's reward service dead-lettered is left out; its dead letter and the later junk
    # are not
    assert raw(target, "dead") == [fields for entry_id, fields in bus.redis.xrange(bus.keys.stream("dead"))
                                   if entry_id.decode() != handled]
