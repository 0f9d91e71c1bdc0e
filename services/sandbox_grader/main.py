"""Sandbox-grader: runs a task's check command on a rollout inside a bubblewrap sandbox.

Consumes finished rollouts on `trajectories` whose task carries a `sandbox_check`, enqueues one RQ
job per rollout on the `sandbox` queue (job id = rollout id, so a re-delivery enqueues nothing new),
and runs an RQ worker in the same process. The job publishes GradeReported on `grades`.

    rollstream-sandbox-grader    # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import threading

from rq import Callback, Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job

from shared.bus import Bus, Delivery, consumer_name, run_consumer
from shared.config import Settings
from shared.events import TrajectoryFinished
from shared.service import ServiceRuntime

from services.sandbox_grader.jobs import grade_rollout, report_job_failure

GROUP = "sandbox-grader"


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("sandbox-grader", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    queue = Queue(f"{bus.keys.prefix}:{settings.grader.queue}", connection=bus.redis)
    enqueued = 0

    def handle(delivery: Delivery) -> None:
        nonlocal enqueued
        event = delivery.event
        if not isinstance(event, TrajectoryFinished) or not event.sandbox_check or event.status == "failed":
            return
        envelope = delivery.envelope
        job_id = f"grade-{envelope.rollout_id}"
        try:
            Job.fetch(job_id, connection=bus.redis)
            return
        except NoSuchJobError:
            pass
        ids = {k: getattr(envelope, k) for k in ("trajectory_id", "rollout_id", "group_id", "session_id")}
        queue.enqueue(grade_rollout, settings.redis, settings.run_id, settings.storage_uri, ids,
                      event.sandbox_check, event.response_text, settings.grader.wall_time_s,
                      settings.grader.memory_mb, job_id=job_id, job_timeout=settings.grader.job_timeout_s,
                      result_ttl=3600, failure_ttl=86400,
                      on_failure=Callback(report_job_failure))
        enqueued += 1
        runtime.status["enqueued"] = enqueued

    enqueuer = threading.Thread(target=run_consumer, name="enqueuer", daemon=True,
                                args=(bus, ("trajectories",), GROUP, consumer_name(GROUP), handle, runtime.should_stop))
    enqueuer.start()
    worker = Worker([queue], connection=bus.redis, name=consumer_name("sandbox-worker"))
    # The worker owns SIGTERM from here on (warm shutdown: it finishes the running job).
    worker.work(with_scheduler=False)
    runtime.stopping = True
    enqueuer.join(timeout=10)
    runtime.close()


if __name__ == "__main__":
    main()
