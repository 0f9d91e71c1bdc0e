"""The recorder service, run in-process on a real Redis 7.0 and a real Valkey."""

import json
import logging
import os
import signal
import threading
import time
import urllib.request

import pytest
import redis

from rollstream.services.recorder import archive_writer
from rollstream.services.recorder.archive_writer import ArchiveWriter
from rollstream.services.recorder.main import Recorder, main, record_once
from rollstream.shared.contract.archive import ArchiveReader, archived_id
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryStarted
from rollstream.shared.runtime.storage import Storage
from tests.support import free_port, prompt


def started(i: int) -> TrajectoryStarted:
    return TrajectoryStarted(sample_index=i)


def live(bus, stream) -> list[tuple[str, dict]]:
    return [(entry_id.decode(), fields) for entry_id, fields in bus.redis.xrange(bus.keys.stream(stream))]


def archived(tmp_path, bus, stream) -> list[tuple[str, dict]]:
    return [(e.entry_id, e.fields) for e in ArchiveReader(str(tmp_path), bus.keys.run_id).entries(stream)]


def test_record_once_archives_every_stream_then_trims_behind_its_groups(bus, tmp_path):
    for i in range(5):
        bus.publish("prompts", prompt(i))
        bus.publish("trajectories", started(i))
    bus.ensure_group("prompts", "runner")
    for delivery in bus.consume("prompts", "runner", "c", count=10):
        bus.ack(delivery, "runner")
    before = {stream: live(bus, stream) for stream in ("prompts", "trajectories")}
    writer = ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id)

    results = record_once(bus, writer, part_entries=2)
    assert set(results) == {"prompts", "trajectories"}  # the other streams do not exist yet
    assert [len(r.parts) for r in results.values()] == [3, 3]  # 2 + 2 + 1 entries each
    assert {s: (r.archived, r.trimmed, r.lost) for s, r in results.items()} == {
        "prompts": (5, 4, 0), "trajectories": (5, 0, 0)}  # no group reads trajectories
    assert live(bus, "prompts") == before["prompts"][-1:]
    for stream, entries in before.items():
        assert archived(tmp_path, bus, stream) == entries
        assert archived_id(bus, stream) == entries[-1][0]

    again = record_once(bus, writer, part_entries=2)
    assert {s: (r.archived, r.trimmed, r.parts) for s, r in again.items()} == {
        "prompts": (0, 0, []), "trajectories": (0, 0, [])}


def test_the_recorder_takes_nothing_away_from_a_group(bus, tmp_path):
    ids = [bus.publish("prompts", prompt(i)) for i in range(3)]
    bus.ensure_group("prompts", "runner")
    results = record_once(bus, ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id))
    assert (results["prompts"].archived, results["prompts"].trimmed) == (3, 0)
    assert bus.group_lag("prompts", "runner") == (3, 0)
    assert [d.entry_id for d in bus.consume("prompts", "runner", "c", count=10)] == ids


def test_a_crash_between_part_and_position_loses_nothing_and_duplicates_nothing(bus, tmp_path, monkeypatch):
    for i in range(3):
        bus.publish("prompts", prompt(i))
    writer = ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id)

    class Crash(Exception):
        pass

    def crash(*_args):
        raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(archive_writer, "advance_archived", crash)
        with pytest.raises(Crash):
            record_once(bus, writer)
    assert archived_id(bus, "prompts") is None
    assert len(ArchiveReader(str(tmp_path), bus.keys.run_id).parts("prompts")) == 1

    for i in range(3, 5):
        bus.publish("prompts", prompt(i))
    results = record_once(bus, writer)
    assert results["prompts"].archived == 5  # the crashed flush's entries are written again

    reader = ArchiveReader(str(tmp_path), bus.keys.run_id)
    assert len(reader.parts("prompts")) == 2
    assert archived(tmp_path, bus, "prompts") == live(bus, "prompts")
    assert reader.validate() == {"prompts": 5}


def test_a_stream_a_part_behind_is_flushed_before_the_interval(bus, tmp_path):
    recorder = Recorder(bus, ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id), part_entries=3)
    bus.publish("trajectories", started(0))
    assert recorder.backlogged() == []
    for i in range(7):
        bus.publish("prompts", prompt(i))
    assert recorder.backlogged() == ["prompts"]

    results = recorder.flush(recorder.backlogged())
    assert [p.entries for p in results["prompts"].parts] == [3, 3, 1]
    assert recorder.backlogged() == []
    status = recorder.status()
    assert status["archived"]["prompts"] == 7 and status["archived"]["trajectories"] == 0
    assert status["archived_to"]["prompts"] == live(bus, "prompts")[-1][0]
    assert status["parts"] == 3 and status["lost_before_archive"] == {}


def test_entries_deleted_before_they_were_archived_are_reported(bus, tmp_path):
    for i in range(4):
        bus.publish("prompts", prompt(i))
    bus.redis.xtrim(bus.keys.stream("prompts"), maxlen=2, approximate=False)
    results = record_once(bus, ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id))
    assert (results["prompts"].lost, results["prompts"].archived) == (2, 2)
    bus.redis.xdel(bus.keys.stream("prompts"), bus.publish("prompts", prompt(4)))
    bus.publish("prompts", prompt(5))
    again = record_once(bus, ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id))
    assert (again["prompts"].lost, again["prompts"].archived) == (1, 1)
    assert record_once(bus, ArchiveWriter(Storage(str(tmp_path)), bus.keys.run_id))["prompts"].lost == 0


@pytest.fixture
def restored_process_state():
    """main() installs signal handlers and JSON logging for the whole process; give them back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    root = logging.getLogger()
    logging_state = (root.handlers[:], root.level)
    yield handlers[signal.SIGTERM]
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    root.handlers[:], level = logging_state
    root.setLevel(level)


def test_the_service_drains_on_sigterm(redis_url, run_id, tmp_path, monkeypatch, restored_process_state):
    port = free_port()
    for name, value in {"RS_REDIS_URL": redis_url, "RS_RUN_ID": run_id, "RS_STORAGE_URI": str(tmp_path),
                        "RS_HEALTH_PORT": str(port), "RS_RECORDER__FLUSH_S": "3600"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RS_CONFIG_FILE", raising=False)
    bus = Bus(redis.Redis.from_url(redis_url), run_id)
    bus.publish("prompts", prompt(0))
    failures = []

    def drive():
        # The first flush happens at start; the next is an hour away, so only the drain archives prompt 1.
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
                        if json.load(reply).get("flushes", 0) >= 1:
                            break
                except OSError:
                    pass
                time.sleep(0.05)
            else:
                failures.append("the recorder never reported its first flush")
            bus.publish("prompts", prompt(1))
        except Exception as exc:  # reported below: the main thread must still be stopped
            failures.append(repr(exc))
        finally:
            if signal.getsignal(signal.SIGTERM) is not restored_process_state:
                os.kill(os.getpid(), signal.SIGTERM)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        main()
    finally:
        driver.join(timeout=90)
        entries = live(bus, "prompts")
        bus.delete_run()
        bus.redis.close()
    assert failures == []
    assert archived(tmp_path, bus, "prompts") == entries and len(entries) == 2
    assert len(ArchiveReader(str(tmp_path), run_id).parts("prompts")) == 2
