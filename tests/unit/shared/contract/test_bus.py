"""The stream bus on a real Redis 7.0 (the machine's), a real Valkey (embedded) and a real Redis Cluster of
three masters (local redis-server processes): a run's keys share one hash slot, so its transactions, scripts
and multi-stream reads run on a cluster as on one server. Its reclaim and dead letters have tests of their own
(test_reclaim.py, test_dead_letters.py).

    python -m pytest tests/unit/shared/contract/test_bus.py -q
"""

import pytest

from rollstream.shared.contract.bus import LAST_PAGE, Bus, StopConsuming, run_consumer
from rollstream.shared.contract.consumers import ConsumerGroup
from rollstream.shared.contract.events import encode, make_envelope
from tests.support import prompt

# on a Redis Cluster too: transactions and multi-key commands must hold where a run's keys share one slot
pytestmark = pytest.mark.parametrize("redis_url", ["redis", "valkey", "cluster"], indirect=True)


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


def test_a_run_id_with_glob_characters_reaches_only_its_own_keys(bus):
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
        scheduled = queue.enqueue_in(timedelta(hours=1), finish_the_job,
                                     job_id=f"{bus.keys.run_id}-scheduled")
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
