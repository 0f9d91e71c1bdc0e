"""The latency model of a simulated vLLM server (bench/sim_fleet.py) and its time accounting.

A request costs `overhead + uncached prompt tokens x prefill + generated tokens x decode` seconds of work.
Up to `batch` concurrent requests each progress at full speed (continuous batching is free up to the batch
size); beyond it the server's throughput is shared, so every request progresses at batch/running. While
paused, requests freeze. `Engine` keeps the accounting without a clock of its own (callers pass `now`), so
its tests are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

WORK_EPSILON = 1e-6


@dataclass(frozen=True)
class LatencyModel:
    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.025
    overhead_s: float = 0.002
    batch_size: int = 8
    reload_s: float = 0.05

    def work(self, uncached_prompt_tokens: int, generated_tokens: int) -> float:
        """Seconds the request takes when it runs within the batch size."""
        return (self.overhead_s + uncached_prompt_tokens * self.prefill_s_per_token
                + generated_tokens * self.decode_s_per_token)

    def rate(self, running: int) -> float:
        """Work-seconds each running request gets per second."""
        return 1.0 if running <= self.batch_size else self.batch_size / running


@dataclass(eq=False)
class Job:
    work: float
    remaining: float
    finished_at: float | None = None


class Engine:
    """The time accounting of one server, clock-free: callers pass `now`, so it is testable exactly."""

    def __init__(self, latency: LatencyModel, now: float = 0.0) -> None:
        self.latency = latency
        self.jobs: list[Job] = []
        self.paused = False
        self.started = now
        self.last = now
        self.busy_s = 0.0
        self.running_s = 0.0

    def advance(self, now: float) -> list[Job]:
        """Progress every job to `now`; returns (and drops) the ones that are done."""
        dt = max(0.0, now - self.last)
        self.last = max(self.last, now)
        if self.paused or not self.jobs or dt == 0.0:
            return []
        self.busy_s += dt
        self.running_s += dt * len(self.jobs)
        step = dt * self.latency.rate(len(self.jobs))
        done = []
        for job in self.jobs:
            job.remaining -= step
            if job.remaining <= WORK_EPSILON:
                job.finished_at = now
                done.append(job)
        if done:
            self.jobs = [job for job in self.jobs if job.finished_at is None]
        return done

    def submit(self, work: float, now: float) -> tuple[Job, list[Job]]:
        done = self.advance(now)
        job = Job(work=work, remaining=work)
        self.jobs.append(job)
        return job, done

    def remove(self, job: Job, now: float) -> list[Job]:
        done = self.advance(now)
        if job in self.jobs:
            self.jobs.remove(job)
        return done

    def pause(self, now: float) -> list[Job]:
        done = self.advance(now)
        self.paused = True
        return done

    def resume(self, now: float) -> None:
        self.last = max(self.last, now)  # the paused interval is neither busy nor progress
        self.paused = False

    def next_completion(self) -> float | None:
        """Absolute time the first running job finishes if nothing changes; None when none runs."""
        if self.paused or not self.jobs:
            return None
        return self.last + min(job.remaining for job in self.jobs) / self.latency.rate(len(self.jobs))
