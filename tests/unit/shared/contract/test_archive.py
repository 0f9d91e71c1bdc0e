"""Stream archives on a real Redis 7.0 and a real Valkey, written and read with real pyarrow."""

from pathlib import Path

import pytest

from rollstream.services.recorder.archive_writer import ArchiveWriter
from rollstream.shared.contract.archive import (
    UNCONSUMED_STREAMS,
    ArchiveReader,
    archived_id,
    list_runs,
    trim_safe_id,
    trim_stream,
)
from rollstream.shared.contract.bus import STREAMS
from rollstream.shared.contract.events import RewardAssigned, decode, encode
from rollstream.shared.errors import ArchiveError
from rollstream.shared.runtime.storage import Storage
from tests.support import archive_all, prompt, turn


def stream_ids(bus, stream) -> list[str]:
    return [entry_id.decode() for entry_id, _ in bus.redis.xrange(bus.keys.stream(stream))]


def test_archive_reads_back_exactly_what_the_streams_held(bus, tmp_path):
    for i in range(4):
        bus.publish("prompts", prompt(i, group_size=2), rollout_id=f"r{i}", group_id="g0")
        bus.publish("trajectories", turn(i), rollout_id=f"r{i}")
    bus.publish("rewards", RewardAssigned(reward=1.0, advantage=0.5, source="exact_match"), rollout_id="r0")
    archive_all(bus, tmp_path)

    reader = ArchiveReader(str(tmp_path), bus.keys.run_id)
    assert reader.streams() == ["prompts", "trajectories", "rewards"]
    for stream in reader.streams():
        live = bus.redis.xrange(bus.keys.stream(stream))
        archived = list(reader.entries(stream))
        assert [e.entry_id for e in archived] == [entry_id.decode() for entry_id, _ in live]
        assert [e.body for e in archived] == [fields[b"body"] for _, fields in live]
        assert [e.fields for e in archived] == [fields for _, fields in live]
        assert [e.envelope for e in archived] == [decode(fields) for _, fields in live]

    merged = [(e.stream, e.entry_id) for e in reader.entries()]
    live_all = [(stream, entry_id) for stream in reader.streams() for entry_id in stream_ids(bus, stream)]
    order = {stream: i for i, stream in enumerate(STREAMS)}
    assert merged == sorted(live_all, key=lambda s_id: (*map(int, s_id[1].split("-")), order[s_id[0]]))
    assert reader.validate() == {"prompts": 4, "trajectories": 4, "rewards": 1}


def test_an_entry_that_is_no_event_is_kept_byte_for_byte(bus, tmp_path):
    odd = {b"type": b"\xff\xfe", b"v": b"1", b"body": b"\x00\x01", b"note": b"kept", b"\x80": b"\x81"}
    entry_id = bus.redis.xadd(bus.keys.stream("dead"), odd).decode()
    archive_all(bus, tmp_path)
    (entry,) = ArchiveReader(str(tmp_path), bus.keys.run_id).entries("dead")
    assert (entry.entry_id, entry.type, entry.fields) == (entry_id, None, odd)


def test_parts_are_laid_out_by_stream_and_hour_and_runs_are_listed(bus, tmp_path):
    key = bus.keys.stream("prompts")
    hour = 3_600_000
    t0 = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC
    ids = [f"{t0}-0", f"{t0}-1", f"{t0 + hour}-0"]
    for i, entry_id in enumerate(ids):
        bus.redis.xadd(key, encode(bus.envelope(prompt(i, group_size=2))), id=entry_id)
    parts = ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id).archive_new(bus, "prompts", 1000)

    base = tmp_path / bus.keys.run_id / "archive" / "prompts"
    assert [Path(p.path) for p in parts] == [
        base / "20231114-22" / f"part-{t0}-0-{t0}-1.parquet",
        base / "20231114-23" / f"part-{t0 + hour}-0-{t0 + hour}-0.parquet",
    ]
    assert sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) == [
        f"20231114-22/part-{t0}-0-{t0}-1.parquet", f"20231114-23/part-{t0 + hour}-0-{t0 + hour}-0.parquet"]
    assert archived_id(bus, "prompts") == ids[-1]

    (tmp_path / "run-without-archive" / "batches").mkdir(parents=True)
    assert list_runs(str(tmp_path)) == [bus.keys.run_id]
    reader = ArchiveReader(str(tmp_path), bus.keys.run_id)
    assert reader.streams() == ["prompts"]
    assert [(p.first_id, p.last_id) for p in reader.parts("prompts")] == [(ids[0], ids[1]), (ids[2], ids[2])]
    assert [e.entry_id for e in reader.entries()] == ids


def test_a_write_interrupted_before_its_rename_is_not_part_of_the_archive(bus, tmp_path):
    bus.publish("prompts", prompt(0, group_size=2))
    archive_all(bus, tmp_path)
    reader = ArchiveReader(str(tmp_path), bus.keys.run_id)
    (part,) = reader.parts("prompts")
    Path(f"{part.path}.tmp-0123abcd").write_bytes(b"half a parq")
    assert [e.entry_id for e in reader.entries()] == stream_ids(bus, "prompts")
    assert reader.validate() == {"prompts": 1}


def test_a_truncated_part_is_an_error_naming_the_file(bus, tmp_path):
    for i in range(3):
        bus.publish("prompts", prompt(i, group_size=2))
    archive_all(bus, tmp_path)
    reader = ArchiveReader(str(tmp_path), bus.keys.run_id)
    (part,) = reader.parts("prompts")
    data = Path(part.path).read_bytes()
    Path(part.path).write_bytes(data[: len(data) // 2])

    with pytest.raises(ArchiveError) as raised:
        list(reader.entries())
    assert str(raised.value).startswith(f"{part.path}: not a readable Parquet file (")
    with pytest.raises(ArchiveError, match="not a readable Parquet file"):
        reader.validate()


@pytest.mark.parametrize("fields, says", [
    ({"type": "PromptIssued", "v": "99"}, "schema version '99' is not supported"),
    ({"type": "PromptRetold", "v": "1"}, "unknown event type 'PromptRetold'"),
])
def test_an_entry_this_code_cannot_decode_is_an_error_naming_file_and_entry(bus, tmp_path, fields, says):
    good = bus.publish("prompts", prompt(0, group_size=2))
    body = encode(bus.envelope(prompt(1, group_size=2)))["body"]
    bad = bus.redis.xadd(bus.keys.stream("prompts"), {**fields, "body": body}).decode()
    archive_all(bus, tmp_path)
    reader = ArchiveReader(str(tmp_path), bus.keys.run_id)
    (part,) = reader.parts("prompts")

    first, second = reader.entries("prompts")  # decoding is lazy: listing entries does not fail
    good_fields = bus.redis.xrange(bus.keys.stream("prompts"), good, good)[0][1]
    assert first.envelope.event_id == decode(good_fields).event_id
    with pytest.raises(ArchiveError) as raised:
        _ = second.envelope
    assert str(raised.value).startswith(f"{part.path} entry {bad}: ") and says in str(raised.value)
    with pytest.raises(ArchiveError, match=f"entry {bad}: "):
        reader.validate()


def test_trimming_spares_undelivered_pending_and_unarchived_entries(bus, tmp_path):
    ids = [bus.publish("prompts", prompt(i, group_size=2)) for i in range(10)]
    for group in ("fast", "slow"):
        bus.ensure_group("prompts", group)
    for delivery in bus.consume("prompts", "fast", "c", count=10):
        bus.ack(delivery, "fast")
    slow = bus.consume("prompts", "slow", "c", count=6)  # ids[6:] not yet delivered to `slow`
    for delivery in slow:
        if delivery.entry_id != ids[2]:  # ids[2] stays pending
            bus.ack(delivery, "slow")

    assert trim_safe_id(bus, "prompts") is None  # nothing archived yet
    assert trim_stream(bus, "prompts") == 0

    writer = ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id)
    writer.archive_new(bus, "prompts", 4)  # archived up to ids[3]
    assert trim_safe_id(bus, "prompts") == ids[1]  # the entry pending in `slow` binds
    assert trim_stream(bus, "prompts") == 2
    assert stream_ids(bus, "prompts") == ids[2:]

    bus.ack(slow[2], "slow")
    assert trim_safe_id(bus, "prompts") == ids[3]  # now the archive binds
    assert trim_stream(bus, "prompts") == 2

    writer.archive_new(bus, "prompts", 100)
    assert trim_safe_id(bus, "prompts") == ids[5]  # ids[6:] are not delivered to `slow`
    assert trim_stream(bus, "prompts") == 2
    assert stream_ids(bus, "prompts") == ids[6:]

    for delivery in bus.consume("prompts", "slow", "c", count=10):
        bus.ack(delivery, "slow")
    # Everything is acked and archived; the newest entry stays for readers of the latest state.
    assert trim_stream(bus, "prompts") == 3
    assert stream_ids(bus, "prompts") == ids[9:]
    assert [e.entry_id for e in ArchiveReader(str(tmp_path), bus.keys.run_id).entries()] == ids


def test_a_consumed_stream_without_groups_is_never_trimmed(bus, tmp_path):
    ids = [bus.publish("batches", prompt(i, group_size=2)) for i in range(3)]
    archive_all(bus, tmp_path)
    assert trim_safe_id(bus, "batches") is None  # its consumer (the trainer) has not made its group yet
    assert trim_stream(bus, "batches") == 0 and stream_ids(bus, "batches") == ids
    assert trim_stream(bus, "grades") == 0  # no such stream at all


@pytest.mark.parametrize("stream", UNCONSUMED_STREAMS)
def test_a_stream_no_group_reads_is_trimmed_behind_the_archive_down_to_its_newest_entry(bus, tmp_path,
                                                                                         stream):
    ids = [bus.publish(stream, prompt(i, group_size=2)) for i in range(5)]
    assert trim_stream(bus, stream) == 0  # nothing archived: everything stays
    writer = ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id)
    writer.archive_new(bus, stream, 2)
    assert trim_stream(bus, stream) == 2 and stream_ids(bus, stream) == ids[2:]
    assert trim_stream(bus, stream, require_archived=False) == 0  # without recording nothing else keeps them
    writer.archive_new(bus, stream, 100)
    # Bus.last still reads the newest
    assert trim_stream(bus, stream) == 2 and stream_ids(bus, stream) == ids[4:]
    assert bus.last(stream).entry_id == ids[4]
    garbage = bus.redis.xadd(bus.keys.stream(stream),
                             {"type": "PolicyUpdated", "v": "1", "body": b"\x00"}).decode()
    writer.archive_new(bus, stream, 100)
    # not trimmed away behind garbage
    assert trim_stream(bus, stream) == 0 and bus.last(stream).entry_id == ids[4]
    assert stream_ids(bus, stream) == [ids[4], garbage]


def test_without_recording_trimming_follows_the_groups_alone(bus):
    ids = [bus.publish("prompts", prompt(i, group_size=2)) for i in range(4)]
    bus.ensure_group("prompts", "g")
    for delivery in bus.consume("prompts", "g", "c", count=3):
        bus.ack(delivery, "g")
    assert trim_safe_id(bus, "prompts") is None
    assert trim_safe_id(bus, "prompts", require_archived=False) == ids[2]
    assert trim_stream(bus, "prompts", require_archived=False) == 3
    assert stream_ids(bus, "prompts") == ids[3:]
