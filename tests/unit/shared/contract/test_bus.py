"""The stream bus on a real Redis 7.0 (the machine's), a real Valkey (embedded) and a real Redis Cluster of
three masters (local redis-server processes): a run's keys share one hash slot, so its transactions, scripts
and multi-stream reads run on a cluster as on one server."""

import time

import pytest

from rollstream.shared.contract.bus import LAST_PAGE, STREAMS, Bus, Keys, StopConsuming, run_consumer
from rollstream.shared.contract.consumers import ConsumerGroup
from rollstream.shared.contract.events import DeadLettered, encode, make_envelope
from rollstream.shared.runtime.config import BusSettings
from tests.support import prompt


@pytest.fixture(params=["redis", "valkey", "cluster"])
def redis_url(request):
    return request.getfixturevalue({"redis": "machine_redis_url", "valkey": "valkey_url",
                                    "cluster": "redis_cluster_url"}[request.param])


def test_keys_are_namespaced_per_run_in_one_cluster_slot():
    from redis.crc import key_slot

    keys = Keys("run1")
    assert keys.stream("prompts") == "rs:{run1}:prompts"
    assert keys.state("reward", "group", "g1") == "rs:{run1}:state:reward:group:g1"
    every_key = [*(keys.stream(stream) for stream in STREAMS), keys.trained_batches, keys.incarnation]
    assert len({key_slot(key.encode()) for key in every_key}) == 1
    assert key_slot(Keys("run2").stream("prompts").encode()) != key_slot(every_key[0].encode())
    assert {Keys.run_of(key) for key in every_key} == {"run1"}
    assert Keys.run_of("rq:queue:default") is None and Keys.run_of("rs:run1:prompts") is None
    with pytest.raises(ValueError, match="unknown stream"):
        keys.stream("nope")
    with pytest.raises(ValueError):
        Keys("a:b")


def test_grade_job_ids_are_ids_rq_takes_whatever_the_run_and_rollout_ids_hold():
    from rq.job import validate_job_id

    plain = Keys("run-1").grade_job_id("abc", "rollout_7")
    assert plain == "grade-run-1-abc-rollout_7"
    odd = [Keys("exp.v2/α").grade_job_id("abc", "r:1"), Keys("exp.v2/α").grade_job_id("abc", "r:2"),
           Keys("exp.v2/α").grade_job_id("abd", "r:1")]
    for job_id in [plain, *odd]:
        validate_job_id(job_id)
    assert len(set(odd)) == 3 and odd[0] == Keys("exp.v2/α").grade_job_id("abc", "r:1")


def test_publish_consume_ack(bus):
    bus.ensure_group("prompts", "g")
    for i in range(5):
        bus.publish("prompts", prompt(i), rollout_id=f"r{i}")
    got = bus.consume("prompts", "g", "c1")
    assert [d.event.sample_index for d in got] == [0, 1, 2, 3, 4]
    assert got[0].envelope.rollout_id == "r0"
    for d in got:
        bus.ack(d, "g")
    assert bus.group_lag("prompts", "g") == (0, 0)
    assert bus.consume("prompts", "g", "c1", block_ms=10) == []


def test_two_groups_each_see_every_entry(bus):
    for group in ("a", "b"):
        bus.ensure_group("prompts", group)
    bus.publish("prompts", prompt(0))
    assert len(bus.consume("prompts", "a", "c")) == 1
    assert len(bus.consume("prompts", "b", "c")) == 1


def test_entry_of_a_dead_consumer_is_reclaimed(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(7))
    first = bus.consume("prompts", "g", "dies")
    assert len(first) == 1  # delivered, never acknowledged: the consumer died
    assert bus.consume("prompts", "g", "alive", block_ms=10) == []  # not idle long enough yet
    time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)
    again = bus.consume("prompts", "g", "alive")
    assert [d.event.sample_index for d in again] == [7]
    bus.ack(again[0], "g")
    assert bus.group_lag("prompts", "g") == (0, 0)


def test_a_consumer_that_keeps_reading_reclaims_a_dead_ones_entry(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(7))
    assert len(bus.consume("prompts", "g", "dies")) == 1
    got, deadline = [], time.monotonic() + bus.settings.reclaim_idle_ms / 1000 * 10
    while not got and time.monotonic() < deadline:
        got = bus.consume("prompts", "g", "alive", block_ms=5)
    assert [d.event.sample_index for d in got] == [7]


def test_a_consumer_looks_for_entries_to_reclaim_now_and_then_not_at_every_read(bus, monkeypatch):
    busy = Bus(bus.redis, bus.keys.run_id, BusSettings(reclaim_idle_ms=60_000))
    busy.ensure_group("prompts", "g")
    looks = []
    look = bus.redis.xautoclaim
    monkeypatch.setattr(bus.redis, "xautoclaim",
                        lambda *args, **kwargs: looks.append(1) or look(*args, **kwargs))
    for index in range(5):
        busy.publish("prompts", prompt(index))
        assert [d.event.sample_index for d in busy.consume("prompts", "g", "c", block_ms=5)] == [index]
    assert len(looks) == 1


def test_malformed_entry_goes_to_dead_letters_and_the_rest_is_delivered(bus):
    bus.ensure_group("prompts", "g")
    bus.redis.xadd(bus.keys.stream("prompts"), {"type": "PromptIssued", "v": "1", "body": b"not msgpack"})
    bus.redis.xadd(bus.keys.stream("prompts"), {"hello": "world"})
    bus.publish("prompts", prompt(1))
    got = bus.consume("prompts", "g", "c")
    assert [d.event.sample_index for d in got] == [1]
    dead = [d.event for d in bus.read_all("dead")]
    assert len(dead) == 2 and all(isinstance(e, DeadLettered) for e in dead)
    assert "not msgpack" in dead[0].error and dead[0].stream == "prompts"
    assert dead[1].fields == {"hello": "world"} and "no 'type'" in dead[1].error
    assert bus.group_lag("prompts", "g") == (0, 1)  # only the good one is pending


def test_an_event_on_a_stream_that_does_not_carry_it_is_dead_lettered_without_its_ids(bus):
    bus.ensure_group("grades", "reward")
    bus.publish("grades", prompt(0), rollout_id="r0", group_id="g0")  # a PromptIssued is no grade
    assert bus.consume("grades", "reward", "c") == []
    (dead,) = bus.read_all("dead")
    assert dead.event.error == "PromptIssued does not belong on grades (it carries GradeReported, GradingFailed)"
    # no part of rollout r0's work: its dead letter must not drop r0 from its group
    assert (dead.envelope.rollout_id, dead.envelope.group_id) == (None, None)


def test_a_dead_letter_shows_a_huge_entry_cut(bus):
    bus.ensure_group("prompts", "g")
    bus.redis.xadd(bus.keys.stream("prompts"), {"type": "PromptIssued", "v": "1", "body": b"\xff" * 2_000_000})
    assert bus.consume("prompts", "g", "c") == []
    (dead,) = bus.read_all("dead")
    assert len(dead.event.fields["body"]) < 70_000 and dead.event.fields["body"].endswith("characters]")


def test_entry_failing_every_delivery_is_dead_lettered_with_the_error(bus):
    bus.publish("prompts", prompt(3))
    attempts = []

    def handle(delivery):
        attempts.append(delivery.entry_id)
        raise ValueError("handler is broken")

    deadline = time.monotonic() + 10
    run_consumer(bus, ConsumerGroup("g", ("prompts",)), "c", handle,
                 should_stop=lambda: bool(bus.read_all("dead")) or time.monotonic() > deadline)
    dead = bus.read_all("dead")
    assert len(dead) == 1
    assert len(attempts) == bus.settings.max_deliveries
    assert "handler is broken" in dead[0].event.error
    assert dead[0].event.deliveries == bus.settings.max_deliveries + 1
    assert bus.group_lag("prompts", "g") == (0, 0)


def test_a_handler_that_fails_once_succeeds_on_redelivery(bus):
    bus.publish("prompts", prompt(4))
    seen = []

    def handle(delivery):
        seen.append(delivery.event.sample_index)
        if len(seen) == 1:
            raise RuntimeError("transient")

    deadline = time.monotonic() + 10
    run_consumer(bus, ConsumerGroup("g", ("prompts",)), "c", handle,
                 should_stop=lambda: len(seen) >= 2 or time.monotonic() > deadline)
    assert seen == [4, 4]
    assert bus.read_all("dead") == []
    assert bus.group_lag("prompts", "g") == (0, 0)


def test_last_passes_over_entries_that_do_not_decode(bus):
    assert bus.last("policy") is None
    key = bus.keys.stream("policy")
    bus.redis.xadd(key, {"type": "BatchReady", "v": "1", "body": b"\x81\xa3key\xa2\xff\xfe"})
    assert bus.last("policy") is None  # nothing decodes: as if empty, never an exception
    good = bus.publish("policy", prompt(0))
    for _ in range(LAST_PAGE + 3):  # more malformed entries after it than one page holds
        bus.redis.xadd(key, {"type": "PolicyUpdated", "v": "1", "body": b"\x00garbage"})
    newest = bus.last("policy")
    assert newest.entry_id == good and newest.event.sample_index == 0


def test_encoded_fields_go_through_redis_unchanged(bus):
    envelope = make_envelope(prompt(0), run_id=bus.keys.run_id, event_id="fixed")
    bus.publish("prompts", envelope)
    assert bus.last("prompts").envelope == envelope
    raw = bus.redis.xrange(bus.keys.stream("prompts"))[0][1]
    assert raw[b"body"] == encode(envelope)["body"]


def test_stop_consuming_leaves_the_entry_and_the_rest_pending(bus):
    for i in range(3):
        bus.publish("prompts", prompt(i))
    handled = []

    def handle(delivery):
        handled.append(delivery.event.sample_index)
        if delivery.event.sample_index == 1:
            raise StopConsuming("must not skip ahead")

    with pytest.raises(StopConsuming):
        run_consumer(bus, ConsumerGroup("g", ("prompts",)), "c", handle, should_stop=lambda: False)
    assert handled == [0, 1]
    assert bus.group_lag("prompts", "g") == (0, 2)  # 1 and 2 wait for the next consumer


def test_keep_alive_stops_a_live_consumers_entry_from_being_reclaimed(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(5))
    (working,) = bus.consume("prompts", "g", "busy")
    for _ in range(3):
        time.sleep(bus.settings.reclaim_idle_ms / 1000 * 0.6)
        bus.keep_alive("prompts", "g", "busy", [working.entry_id])
    assert bus.consume("prompts", "g", "other", block_ms=10) == []  # idle time was reset each time
    time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)  # the busy consumer died
    assert [d.entry_id for d in bus.consume("prompts", "g", "other")] == [working.entry_id]


def test_a_late_keep_alive_neither_hands_an_entry_back_to_its_consumer_nor_counts_a_delivery(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(5))
    (working,) = bus.consume("prompts", "g", "busy")
    for _ in range(bus.settings.max_deliveries + 1):  # a keep-alive late each time (the event loop was busy)
        time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)
        assert bus.consume("prompts", "g", "busy", block_ms=10, held={working.entry_id}) == []
    (pending,) = bus.redis.xpending_range(bus.keys.stream("prompts"), "g", "-", "+", 10)
    assert pending["times_delivered"] == 1 and pending["consumer"] == b"busy"
    assert bus.read_all("dead") == []
    time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)  # then the busy consumer died: another takes it over
    assert [d.entry_id for d in bus.consume("prompts", "g", "other")] == [working.entry_id]


def test_a_restarted_lone_consumer_finishes_its_predecessors_entries_first_in_order(bus):
    for i in range(4):
        bus.publish("prompts", prompt(i))
    handled = []

    def crash_at_1(delivery):
        handled.append(delivery.event.sample_index)
        if delivery.event.sample_index == 1:
            raise StopConsuming("killed mid-entry")

    bus.ensure_group("prompts", "g")
    bus.consume("prompts", "g", "old-process", count=1)  # delivered to a process that then vanished
    with pytest.raises(StopConsuming):
        run_consumer(bus, ConsumerGroup("g", ("prompts",)), "trainer", crash_at_1, should_stop=lambda: False,
                     take_over_pending=True)
    assert handled == [0, 1]

    handled.clear()
    run_consumer(bus, ConsumerGroup("g", ("prompts",)), "trainer", lambda d: handled.append(d.event.sample_index),
                 should_stop=lambda: len(handled) >= 3, take_over_pending=True)
    # no reclaim timeout waited for, nothing skipped, nothing repeated that was acknowledged
    assert handled == [1, 2, 3]
    assert bus.group_lag("prompts", "g") == (0, 0)


def test_a_run_id_with_glob_characters_reaches_only_its_own_keys(bus):
    from rollstream.shared.contract.bus import Bus

    starred = Bus(bus.redis, "a*")
    neighbour = Bus(bus.redis, "ab-" + bus.keys.run_id)
    try:
        neighbour.publish("prompts", prompt(0))
        assert not starred.has_keys()
        starred.publish("prompts", prompt(1))
        assert starred.has_keys()
        assert starred.delete_run() == 1
        assert neighbour.has_keys() and not starred.has_keys()
    finally:
        starred.delete_run()
        neighbour.delete_run()


def finish_the_job() -> str:
    return "done"


def fail_the_job() -> None:
    raise RuntimeError("the job failed")


def test_deleting_a_run_deletes_its_rq_queue_and_every_job_it_holds_and_no_other_runs(bus, redis_url,
                                                                                         machine_redis_url):
    """RQ keeps a queue and its jobs under its own prefix, outside the run's namespace: a job left behind
    would be run, or reported as failed, into the next run under the same id. On a Redis Cluster, where RQ
    does not run, the queues are on a Redis of their own (bus.job_queue_url)."""
    from datetime import timedelta

    from redis.cluster import RedisCluster
    from rq import SimpleWorker
    from rq.job import Job

    from rollstream.shared.contract.bus import Bus

    if isinstance(bus.redis, RedisCluster):
        settings = bus.settings.model_copy(update={"job_queue_url": machine_redis_url})
        bus = Bus.connect(redis_url, bus.keys.run_id, settings, ride_out_outages=False)
        assert not isinstance(bus.job_redis, RedisCluster)
    neighbour = Bus(bus.redis, bus.keys.run_id + "-2", job_client=bus.job_redis)  # its queue's name starts
    queue = bus.job_queue("sandbox")                                                 # with this run's id
    other_queue = neighbour.job_queue("sandbox")
    try:
        finished = queue.enqueue(finish_the_job, job_id=f"{bus.keys.run_id}-finished")
        failed = queue.enqueue(fail_the_job, job_id=f"{bus.keys.run_id}-failed")
        SimpleWorker([queue], connection=bus.job_redis).work(burst=True)
        queued = queue.enqueue(finish_the_job, job_id=f"{bus.keys.run_id}-queued")
        scheduled = queue.enqueue_in(timedelta(hours=1), finish_the_job, job_id=f"{bus.keys.run_id}-scheduled")
        others = other_queue.enqueue(finish_the_job, job_id=f"{bus.keys.run_id}-others")
        assert (finished.get_status(), failed.get_status(), queued.get_status(), scheduled.get_status()) == (
            "finished", "failed", "queued", "scheduled")

        assert bus.delete_run() == 4
        assert not any(Job.exists(job.id, connection=bus.job_redis)
                       for job in (finished, failed, queued, scheduled))
        assert queue.count == 0 and queue.failed_job_registry.count == 0
        assert queue.scheduled_job_registry.count == 0 and queue.finished_job_registry.count == 0
        leftovers = [key for key in bus.job_redis.scan_iter(match="rq:*", count=1000)
                     if bus.keys.job_queue("").encode() in key]
        assert leftovers == []
        assert Job.fetch(others.id, connection=bus.job_redis).get_status() == "queued"
        assert other_queue.count == 1
    finally:
        neighbour.delete_run()
