"""Sandbox-grader: grades rollouts in a sandbox (bubblewrap, or docker where an engine runs).

Consumes finished rollouts on `trajectories` that need a sandbox grade (a row's `sandbox_check`
on the answer, or a Harbor / SWE-bench task whose tests judge the episode's stored diff), enqueues
one RQ job per rollout on the run's `sandbox` queue (job id: the run, its incarnation and the rollout, see
Keys.grade_job_id; so a re-delivery enqueues nothing new) with retries and backoff for infrastructure
errors, and runs an RQ worker in the same process: throughput is set by the number of replicas. The job
publishes GradeReported on `grades` (or GradingFailed when the sandbox could not run it, see jobs.py). Every
FAILED_SWEEP_S it publishes GradingFailed for jobs RQ failed without running their failure callback, so
that their groups do not wait for the reward service's grade timeout.

Asked to stop (SIGTERM, SIGINT; SIGHUP and SIGQUIT as SIGTERM), it finishes the running job first (RQ's warm
shutdown), unless Redis is gone: then it exits 1 within the runtime's bound, its work-horse and scheduler
killed, what it held left pending for others to take up (GradingWorker).

A process that can no longer do its job exits non-zero, so that it is restarted: when the enqueuer
thread dies (the worker finishes its job first) or the worker quits on an error of its own. A work-horse
killed mid-job (its job's timeout, or with its grader) leaves its grading workspace behind: at start the
grader removes those of processes that no longer exist (`rs-grade-{pid}-*` in the temp directory).

It grades nothing while its sandbox backend cannot make a sandbox (bubblewrap not installed or not allowed
its namespaces, no Docker engine, a full /tmp): readiness runs a trivial command in a real sandbox
(probe_sandbox), /healthz answers 503 with the reason and what to do, finished rollouts stay on the stream,
and grading starts once a probe succeeds (tried every BACKEND_RECHECK_S seconds). While grading it probes
again every `grader.probe_interval_s`, so that /healthz says why when the sandbox breaks later; jobs that
meet a broken sandbox meanwhile are retried and then end as GradingFailed, never as a grade.

    rollstream-sandbox-grader    # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import redis
from prometheus_client import Counter, Gauge, Histogram
from rq import Callback, Queue, Retry, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from rollstream.services.sandbox_grader.jobs import (
    FAILURE_META,
    VERDICT_META,
    GradeRequest,
    grade_rollout,
    publish_grades_through,
    report_failures_without_verdict,
    report_job_failure,
)
from rollstream.shared.contract.bus import Bus, Delivery, consumer_name, run_consumer
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.contract.events import TrajectoryFinished
from rollstream.shared.errors import BackendUnavailable, TaskError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime
from rollstream.shared.sandbox.backends import probe_sandbox
from rollstream.shared.sandbox.workspace import remove_orphaned_workspaces
from rollstream.shared.tasks.harbor import load_harbor_task

GROUP = consumer_group("sandbox-grader")
RETRY_BACKOFF_S = [2, 10, 30]
JOB_SETUP_S = 60
BACKEND_RECHECK_S = 5
FAILED_SWEEP_S = 10
MAINTENANCE_INTERVAL_S = 30
"""How often the RQ worker cleans its registries and, when no live scheduler holds the queue's lock, starts
its own (RQ's default, 10 minutes, left the retries a killed grader had scheduled waiting that long). An idle
worker waits for jobs this long at a time (worker_ttl - 15), so that the maintenance comes round."""

JOBS = Counter("rollstream_sandbox_grader_jobs_total",
               "Grading jobs this worker ran, by how each ended: graded (a GradeReported), "
               "grading_failed (a GradingFailed, never a score), retry (the sandbox failed; a retry is "
               "scheduled), no_verdict (its run was deleted meanwhile), failed (RQ failed it without a "
               "verdict; the failed-job sweep reports it).", ["outcome"])
JOB_SECONDS = Histogram("rollstream_sandbox_grader_job_seconds",
                        "Wall time of one grading job, its sandbox's start and tests included.",
                        ["backend", "outcome"],
                        buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
GRADING_FAILED = Counter("rollstream_sandbox_grader_grading_failed_total",
                         "GradingFailed verdicts this grader published, by what failed: ungradable (the "
                         "request names what is not there) or infrastructure (the sandbox, after every "
                         "retry).", ["reason"])
QUEUED = Gauge("rollstream_sandbox_grader_queued_jobs", "Grading jobs waiting in the run's sandbox queue.")


class GradingWorker(Worker):
    """RQ's worker, counting how each job ended: the job runs in a forked work-horse, whose own counters would
    end with it, so the worker reads the job's end back from Redis.

    Once work() starts, RQ's handler owns SIGTERM and SIGINT, and a stop request would no longer reach the
    service runtime's: the worker keeps the handler it replaces (the runtime's, installed before the worker
    is made) and RQ's stop passes the request on to it first. The runtime then marks the service stopping
    and watches Redis: RQ's warm shutdown (the running job finished, or handed back) goes on while Redis
    answers, and without Redis, which RQ's teardown would wait for for ever, the runtime ends the process
    (see shared/runtime/service.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime_stop = signal.getsignal(signal.SIGTERM)
        if not callable(self.runtime_stop):
            raise RuntimeError("GradingWorker is made after the ServiceRuntime, whose SIGTERM handler it "
                               f"passes stop requests on to; SIGTERM's handler is {self.runtime_stop!r}")

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.runtime_stop(signum, frame)
        super().request_stop(signum, frame)

    def execute_job(self, job: Job, queue: Queue):
        started = time.monotonic()
        try:
            return super().execute_job(job, queue)
        finally:
            count_job_end(job, time.monotonic() - started)


def count_job_end(job: Job, seconds: float) -> None:
    try:
        job.refresh()
        status = job.get_status()
    except (NoSuchJobError, redis.RedisError):
        return
    verdict = str(job.meta.get(VERDICT_META, ""))
    if verdict == "GradeReported":
        outcome = "graded"
    elif verdict == "GradingFailed":
        outcome = "grading_failed"
        GRADING_FAILED.labels(job.meta.get(FAILURE_META, "infrastructure")).inc()
    elif verdict.startswith("none"):
        outcome = "no_verdict"
    elif status in (JobStatus.SCHEDULED, JobStatus.QUEUED):
        outcome = "retry"
    else:
        outcome = "failed"
    JOBS.labels(outcome).inc()
    backend = job.args[0].get("backend", "") if job.args and isinstance(job.args[0], dict) else ""
    JOB_SECONDS.labels(backend, outcome).observe(seconds)


def job_timeout(event: TrajectoryFinished, settings: Settings) -> float:
    """A Harbor task's own verifier timeout (plus set-up time), else the configured one."""
    if event.grader.get("kind") == "harbor":
        try:
            return load_harbor_task(Path(event.grader["task_dir"])).verifier_timeout_s + JOB_SETUP_S
        except (TaskError, KeyError, TypeError):
            pass  # the job itself finds the task unreadable and says so (GradingFailed), at once
    return settings.grader.job_timeout_s


def check_backend(settings: Settings, runtime: ServiceRuntime) -> bool:
    """Make a real sandbox of the configured backend and run a trivial command in it; /healthz says why
    (503) while that fails. Logs each change between working and not."""
    try:
        probe_sandbox(settings.grader.backend)
    except BackendUnavailable as exc:
        if runtime.not_ready is None:
            runtime.log.error("sandbox backend cannot make a sandbox; not grading",
                              extra={"reason": str(exc)})
        runtime.not_ready = f"sandbox backend {settings.grader.backend!r} cannot run: {exc}"
        return False
    if runtime.not_ready is not None:
        runtime.log.info("sandbox backend makes sandboxes now; grading")
    runtime.not_ready = None
    return True


def wait_for_backend(settings: Settings, runtime: ServiceRuntime) -> bool:
    """Grade nothing until the sandbox backend makes a sandbox (check_backend): until then finished
    rollouts wait on the stream. False when asked to stop first."""
    while not runtime.should_stop():
        if check_backend(settings, runtime):
            return True
        recheck = time.monotonic() + BACKEND_RECHECK_S
        while time.monotonic() < recheck and not runtime.should_stop():
            time.sleep(0.2)
    return False


def remove_orphaned_grading_workspaces(runtime: ServiceRuntime) -> None:
    """Delete the grading workspaces that work-horses killed mid-job (a job timeout, a grader killed with
    them) left in the temp directory, before the backend probe, which needs room there too. Those of live
    processes stay: another replica's, on the same host, are in use."""
    removed = remove_orphaned_workspaces("grade")
    if removed:
        runtime.log.info("removed grading workspaces of dead processes",
                         extra={"workspaces": [str(path) for path in removed]})


def grade_request(settings: Settings, delivery: Delivery, incarnation: str) -> GradeRequest:
    """The job argument that grades the finished rollout `delivery` carries."""
    event, envelope = delivery.event, delivery.envelope
    ids = {k: getattr(envelope, k) for k in ("trajectory_id", "rollout_id", "group_id", "session_id")}
    return GradeRequest(run_id=settings.run_id, storage_uri=settings.storage_uri, ids=ids,
                        backend=settings.grader.backend, wall_time_s=settings.grader.wall_time_s,
                        memory_mb=settings.grader.memory_mb, check=event.sandbox_check,
                        answer=event.response_text, grader=event.grader, diff_uri=event.artifacts.get("diff"),
                        retries=settings.grader.retries, incarnation=incarnation,
                        environments_dir=str(settings.grader.environments_dir or ""))


def job_exists(job_id: str, bus: Bus) -> bool:
    try:
        Job.fetch(job_id, connection=bus.job_redis)
    except NoSuchJobError:
        return False
    return True


class Enqueuer:
    """The thread that turns finished rollouts into grading jobs, one per rollout. Between reads it reports
    the jobs RQ failed without their failure callback, and probes the sandbox backend again."""

    def __init__(self, settings: Settings, runtime: ServiceRuntime, bus: Bus, queue: Queue) -> None:
        self.settings = settings
        self.runtime = runtime
        self.bus = bus
        self.queue = queue
        self.incarnation = bus.incarnation()
        self.enqueued = 0
        self.failure: BaseException | None = None
        self.next_sweep = time.monotonic()
        self.next_probe = time.monotonic() + settings.grader.probe_interval_s

    def run_until_stopped(self, worker: Worker) -> None:
        try:
            run_consumer(self.bus, GROUP, consumer_name(GROUP.name), self.handle,
                         self.runtime.should_stop, between_reads=self.between_reads)
        except BaseException as exc:
            # A process that goes on grading without enqueuing would look healthy and grade nothing new:
            # stop it so that it exits non-zero and is restarted. Through the worker's own SIGTERM handler
            # (installed when work() starts), so that the job it is running is finished first.
            self.failure = exc
            self.runtime.log.critical("enqueuer died; stopping the service", exc_info=True)
            self.runtime.not_ready = f"enqueuer died: {type(exc).__name__}: {exc}"
            while signal.getsignal(signal.SIGTERM) != worker.request_stop:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)

    def handle(self, delivery: Delivery) -> None:
        event = delivery.event
        if not isinstance(event, TrajectoryFinished) or not event.needs_grade:
            return
        job_id = self.bus.keys.grade_job_id(self.incarnation, delivery.envelope.rollout_id)
        if job_exists(job_id, self.bus):
            return
        request = grade_request(self.settings, delivery, self.incarnation)
        retries = self.settings.grader.retries
        retry = Retry(max=retries, interval=RETRY_BACKOFF_S) if retries else None
        self.queue.enqueue(grade_rollout, request.as_job_arg(), job_id=job_id,
                           job_timeout=job_timeout(event, self.settings), result_ttl=3600, failure_ttl=86400,
                           retry=retry, on_failure=Callback(report_job_failure))
        self.enqueued += 1
        self.runtime.status["enqueued"] = self.enqueued

    def between_reads(self) -> None:
        self.report_failed_jobs()
        self.recheck_backend()

    def report_failed_jobs(self) -> None:
        if time.monotonic() < self.next_sweep:
            return
        self.next_sweep = time.monotonic() + FAILED_SWEEP_S
        for job_id in report_failures_without_verdict(self.queue):
            GRADING_FAILED.labels("infrastructure").inc()
            self.runtime.log.warning("job failed without its failure callback; reported GradingFailed",
                                     extra={"job_id": job_id})

    def recheck_backend(self) -> None:
        # Only reports (/healthz): rollouts are still enqueued, and a job that meets the broken sandbox is
        # retried, then GradingFailed. Runs in the enqueuer, so it never overwrites "enqueuer died".
        if time.monotonic() < self.next_probe:
            return
        healthy = check_backend(self.settings, self.runtime)
        interval = self.settings.grader.probe_interval_s if healthy else BACKEND_RECHECK_S
        self.next_probe = time.monotonic() + interval


def queue_length(queue: Queue) -> float:
    try:
        return queue.count
    except redis.RedisError:  # a scrape while Redis is away says so, rather than failing
        return float("nan")


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("sandbox-grader", settings)
    if settings.bus.cluster and not settings.bus.job_queue_url:
        runtime.log.error("RQ, the grader's job queue, does not run on a Redis Cluster: give it a Redis of "
                          "its own (bus.job_queue_url, RS_BUS__JOB_QUEUE_URL)")
        runtime.close()
        raise SystemExit(2)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    publish_grades_through(bus.redis)
    remove_orphaned_grading_workspaces(runtime)
    if not wait_for_backend(settings, runtime):
        runtime.close()
        return
    queue = bus.job_queue(settings.grader.queue)
    enqueuer = Enqueuer(settings, runtime, bus, queue)
    QUEUED.set_function(lambda: queue_length(queue))
    worker = GradingWorker([queue], connection=bus.job_redis, name=consumer_name("sandbox-worker"),
                           maintenance_interval=MAINTENANCE_INTERVAL_S,
                           worker_ttl=MAINTENANCE_INTERVAL_S + 15)
    enqueuer_thread = threading.Thread(target=enqueuer.run_until_stopped, args=(worker,), name="enqueuer",
                                       daemon=True)
    enqueuer_thread.start()
    # The worker owns SIGTERM from here on (warm shutdown: it finishes the running job), and passes a stop
    # request on to the runtime (GradingWorker.request_stop).
    # The scheduler moves retries with a back-off interval back onto the queue when they are due.
    worker.work(with_scheduler=True)
    # set by the worker's SIGTERM/SIGINT handler (RQ has no public flag for it)
    asked_to_stop = worker._shutdown_requested_date is not None and enqueuer.failure is None
    runtime.stopping = True
    enqueuer_thread.join(timeout=10)
    runtime.close()
    if not asked_to_stop:
        # the worker quit on its own (an error it does not survive), or the enqueuer died
        raise SystemExit(1)


if __name__ == "__main__":
    main()
