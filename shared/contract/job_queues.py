"""Deleting a run's RQ queues: the grader's sandbox jobs live in RQ's keys, outside the run's namespace, so
Bus.delete_run deletes them here, with every job they hold (a queued or failed job left behind would be run,
or reported, into the next run under the same id).
"""

from __future__ import annotations

import redis


def delete_job_queues(job_redis: redis.Redis, queue_prefix: str) -> int:
    """Delete the RQ queues whose names start with `queue_prefix` (a run's: Keys.job_queue("")), their
    registries and every job they hold; returns how many jobs."""
    from rq import Queue
    from rq.job import Job

    prefix = Queue.redis_queue_namespace_prefix + queue_prefix
    deleted = 0
    for queue_key in job_redis.smembers(Queue.redis_queues_keys):
        queue_key = queue_key.decode()
        if not queue_key.startswith(prefix):
            continue
        queue = Queue.from_queue_key(queue_key, connection=job_redis)
        registries = (queue.started_job_registry, queue.finished_job_registry, queue.failed_job_registry,
                      queue.deferred_job_registry, queue.scheduled_job_registry, queue.canceled_job_registry)
        # Read straight from Redis: a registry's get_job_ids() first cleans it up, which may fail jobs and
        # run their failure callbacks, publishing into the run being deleted.
        job_ids = {job_id.decode() for key in (queue.key, queue.intermediate_queue_key)
                   for job_id in job_redis.lrange(key, 0, -1)}
        job_ids |= {job_id.decode() for registry in registries
                    for job_id in job_redis.zrange(registry.key, 0, -1)}
        for job in Job.fetch_many(sorted(job_ids), connection=job_redis):
            if job is not None:
                job.delete(remove_from_queue=False)
                deleted += 1
        job_redis.delete(queue.intermediate_queue_key, queue.registry_cleaning_key,
                         *(registry.key for registry in registries))
        queue.delete(delete_jobs=False)
    return deleted
