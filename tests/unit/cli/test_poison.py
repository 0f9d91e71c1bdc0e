"""The poison generator (cli/chaos/poison_make.py): deterministic per seed, every kind on every stream it
belongs to, bounded sizes, and entries that are what their kind says (undecodable kinds never decode;
a consumer that reads them through the bus dead-letters them, on Redis and on Valkey); writing them
(cli/chaos/poison_inject.py), and the report's count of what became of them (cli/chaos/poison_report.py).

The fuzzing of a live run is tests/integration/test_poison.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from rollstream.cli.chaos.audit import RowLimits
from rollstream.cli.chaos.poison_inject import write_poison
from rollstream.cli.chaos.poison_make import (
    BUS_REJECTED_KINDS,
    KINDS,
    STALLING_KINDS,
    STREAM_KINDS,
    UNDECODABLE_KINDS,
    poison_plan,
)
from rollstream.cli.chaos.poison_report import audit
from rollstream.shared.contract.bus import STREAMS
from rollstream.shared.contract.events import (
    STREAM_EVENTS,
    BatchReady,
    EventDecodeError,
    PolicyUpdated,
    PromptIssued,
    decode,
)
from rollstream.shared.runtime.storage import Storage

SMALL = {"oversized_bytes": 64 << 10, "huge_tokens": 1 << 20}


def test_the_same_seed_gives_the_same_entries_byte_for_byte_and_another_seed_others():
    first = poison_plan(3, "run-a", "/tmp/runs", **SMALL)
    again = poison_plan(3, "run-a", "/tmp/runs", **SMALL)
    other = poison_plan(4, "run-a", "/tmp/runs", **SMALL)
    assert [(p.stream, p.kind, p.fields) for p in first] == [(p.stream, p.kind, p.fields) for p in again]
    assert [p.fields for p in first] != [p.fields for p in other]


def test_every_stream_gets_every_kind_meant_for_it_and_stalling_kinds_only_when_asked():
    rollouts = {("trajectories", "forged"), ("trajectories", "missing_file")}  # a segment and its finish each
    plan = poison_plan(0, "run-a", "/tmp/runs", per_kind=2, **SMALL)
    got = Counter((p.stream, p.kind) for p in plan)
    for stream in STREAMS:
        for kind in STREAM_KINDS[stream]:
            expected = 0 if kind in STALLING_KINDS else 4 if (stream, kind) in rollouts else 2
            assert got[(stream, kind)] == expected, (stream, kind)
    assert set(KINDS) >= {"random_bytes", "truncated", "mutated", "malformed", "unknown_version",
                          "wrong_types", "invalid_payload", "oversized", "huge_tokens", "foreign_event",
                          "missing_file", "forged"}
    stalling = poison_plan(0, "run-a", "/tmp/runs", kinds=STALLING_KINDS, **SMALL)
    assert stalling and {p.kind for p in stalling} == STALLING_KINDS


def test_undecodable_kinds_never_decode_and_the_others_are_valid_events_of_their_kind():
    for poison in poison_plan(1, "run-a", "/tmp/runs", per_kind=3, **SMALL):
        if poison.kind in UNDECODABLE_KINDS or (poison.kind == "huge_tokens"
                                                and poison.stream == "trajectories"):
            with pytest.raises(EventDecodeError):
                decode(poison.fields)
            assert poison.must_dead_letter
        elif poison.kind == "replayed_batch":
            assert poison.needs_real_batch and not poison.fields
        else:
            envelope = decode(poison.fields)
            belongs = envelope.type in {cls.TYPE for cls in STREAM_EVENTS[poison.stream]}
            assert belongs == (poison.kind != "foreign_event"), (poison.stream, poison.kind, envelope.type)
        if poison.kind == "forged" and poison.stream == "policy":
            assert decode(poison.fields).payload.version > 10**5


def test_entries_are_bounded_by_the_sizes_asked_for():
    plan = poison_plan(2, "run-a", "/tmp/runs", oversized_bytes=1 << 20, huge_tokens=1_000_000)
    huge = [p for p in plan if p.kind == "huge_tokens" and p.stream == "trajectories"]
    assert huge and all(8_000_000 < p.size < 10_000_000 for p in huge)  # 10^6 ids, logprobs and mask bytes
    assert max(p.size for p in plan if p not in huge) < 3 << 20
    assert sum(p.size for p in plan) < 32 << 20


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown poison kinds"):
        poison_plan(0, "run-a", "/tmp/runs", kinds=["nonsense"])


def test_a_consumer_dead_letters_every_undecodable_entry_and_the_audit_counts_it(bus, tmp_path):
    storage = Storage(str(tmp_path))
    plan = [p for p in poison_plan(5, bus.keys.run_id, str(tmp_path), **SMALL) if p.stream == "prompts"]
    bus.ensure_group("prompts", "agent-runner")
    injected = [write_poison(bus, storage, poison, set()) for poison in plan]
    while bus.consume("prompts", "agent-runner", "c1", count=100, block_ms=10):
        pass  # decodable entries are handed out (and left pending); the rest is dead-lettered by the bus
    report = audit(bus, str(tmp_path), injected, seed=5, rate=1.0, target_version=0, health={},
                   unhealthy_moments=[], dispatcher_version_seen=0, max_staleness=1,
                   limits=RowLimits(vocab_size=32, max_positions=64))
    figures = report.streams["prompts"]
    assert figures.groups == ("agent-runner",) and figures.tried == len(plan)
    undecodable = [i for i in injected if i.poison.kind in BUS_REJECTED_KINDS]
    for item in undecodable:
        assert report.dead_letters[("prompts", item.entry_id)]["agent-runner"]
    assert figures.dead_lettered == len(undecodable)
    # what decodes is the consumer's to judge: the audit names each that it did not dead-letter
    assert len(figures.missed) == figures.must_dead_letter - len(undecodable) > 0
    # the forged prompts are no admission of the run's: its own audit leaves every injected entry out
    assert report.run.admitted == 0 and report.run.lost == []


def test_a_replayed_batch_re_announces_a_real_batch_of_the_run_under_another_id(bus, tmp_path):
    storage = Storage(str(tmp_path))
    (replayed,) = [p for p in poison_plan(0, bus.keys.run_id, str(tmp_path),
                                          kinds=["replayed_batch"], **SMALL)]
    assert write_poison(bus, storage, replayed, set()) is None  # no batch yet: it waits
    real = BatchReady(batch_id="b-1", uri=str(tmp_path / "b-1.parquet"), sample_count=1, group_ids=["g"],
                      min_policy_version=0, mean_reward=0.5)
    bus.publish("batches", real)
    item = write_poison(bus, storage, replayed, set())
    batch = decode(item.fields).payload
    assert batch.uri == real.uri and batch.batch_id != real.batch_id


def test_a_forged_batch_writes_its_file_first(bus, tmp_path):
    from rollstream.shared.contract.batches import read_batch

    storage = Storage(str(tmp_path))
    (forged,) = [p for p in poison_plan(0, bus.keys.run_id, str(tmp_path), kinds=["forged"],
                                        streams=["batches"], **SMALL)]
    item = write_poison(bus, storage, forged, set())
    batch = decode(item.fields).payload
    rows = read_batch(storage, batch.uri)
    assert len(rows) == batch.sample_count and {r.group_id for r in rows} == set(batch.group_ids)
    assert not isinstance(batch, (PromptIssued, PolicyUpdated))
