"""Asynchronous against synchronous training on the same work, in the same run: samples trained per
minute and the fleet's busy fraction with train.max_staleness = 0 (the dispatcher admits a batch only
after the previous policy update: generation waits for the slowest episode and for training and weight
sync) and with max_staleness = eta > 0 (generation keeps going).

The workload has heavy-tailed episode lengths (bench/heavy_tail_agent.py: most episodes ~2 turns, ~5%
10-50x longer by default), keyed on the sample index with one seed, so every mode runs the same prompts
with the same episode lengths in the same order. Every mode is the real pipeline: dispatcher, agent-runner,
sandbox-grader, reward and recorder as processes (cli/local_run.py) on the machine's Redis, against
    real   one real vLLM CPU server with the tiny model, started once and shared by every mode (or the server
           --fleet-url names), after an untimed warm-up (vLLM on the CPU speeds up over its first few hundred
           requests);
    sim    `--servers` simulated vLLM servers (bench/sim_fleet.py, one process, a latency model),
and trained by
    --trainer real      the trainer service, on this machine's CPU (its steps take seconds for the tiny model:
                        against 64 simulated servers the fleet then waits for it, as no cluster's would);
    --trainer sim-gpu   bench/sim_trainer.py in its place: the trainer's contract on the bus (BatchReady in,
                        staleness drops, a fleet weight sync, PolicyUpdated out) with the step time of a GPU
                        profile (--gpu-profile h100x8-7b: 40,000 trained tokens/s and 1 s per step, 1 s per
                        weight sync; its docstring says where the numbers come from), or numbers given with
                        --train-tokens-per-s, --step-overhead-s and --sync-s. The simulated servers stay
                        paused for the sync time (their reload), every server at once.
Before each mode every server reloads the starting weights, so every mode starts from the same policy. The
dispatcher goes on admitting past the measured versions, as in a long run (--final-drain: it admits exactly
versions x batch-size samples, and the last version waits for the slowest of them).

Measured, per mode, over the window from the first admitted prompt to PolicyUpdated v`--versions` (event
envelope times):
    samples/min   the headline: sum of PolicyUpdated.trained_samples (batch rows: one per segment of an
                  episode) / window, start-up included; samples dropped do not count
    dropped       beside it: batch rows the trainer left out (stale, invalid) and rollouts the reward service
                  dropped (grading failed, grade timeout, ...), by cause
    steady/min    trained samples of updates 2..V / (time of update V - time of update 1): no start-up ramp
    busy          fraction of the window a server had a request running, averaged over servers, from
                  busy-time counters: the simulator's own (sim:busy_seconds_total; a paused server is not
                  busy); for vLLM those of a metering proxy in front of it (bench/sim_fleet.py --proxy-to: a
                  completion in flight)
    st.busy       busy from update 1 to update V (the window of steady/min)
    run/server    mean number of requests running per server (sim:running_seconds_total, same sources)
    gauge busy    the busy fraction polling vllm:num_requests_running > 0 gives (4 Hz for vLLM, 1 Hz for
                  the simulator); it misses short requests on a CPU vLLM server, whose /metrics is
                  answered between engine outputs
    step s, sync s  mean training step and weight sync of the trainer (PolicyUpdated.metrics)
    trainer       fraction of the window the trainer stepped or synced
    turns, tokens model turns and tokens sampled in the episodes published in the window
    cores         CPU seconds the pipeline's processes (services, fleet, simulated trainer) used per second
                  of the mode: this machine's share of the work, against its cores

One run of a mode varies (a 2-core machine's other work, vLLM's CPU engine): --repeats N runs every mode N
times, the modes in turn and every other round in reverse order, and reports the median of each figure with
every run's beside it, and each run's async/sync ratio against the synchronous run of its round.

    python bench/bench_async.py [--mode real|sim|both] [--etas 0 4] [--repeats 3] [--batch-size 32]
                                [--group 4] [--versions 8] [--servers 64] [--sim-decode-ms 25] [--sim-batch 8]
                                [--trainer real|sim-gpu] [--gpu-profile h100x8-7b] [--keep]
                                [--fleet-url http://127.0.0.1:8000] [--smoke] [--json PATH]

A cluster's proportions: 64 simulated servers, the simulated GPU trainer, eta 0, 1, 2 and 4 in one run
(about 15 minutes on this 2-core machine, 7 of them the synchronous mode):
    python bench/bench_async.py --mode sim --servers 64 --trainer sim-gpu --gpu-profile h100x8-7b \
        --etas 0 1 2 4 --batch-size 256 --group 4 --versions 5 --concurrency 256 \
        --max-tokens 256 --tail-min 3 --tail-max 6
Why these settings: a turn of 256 tokens takes 6.4 s on a simulated server (25 ms a token), so 256 episodes
at once (the agent-runner's concurrency: 4 requests per server) take ~40 turns a second, which the pipeline
serves with about a third of one core; a batch of 256 then makes a version every ~18 s, against which a
weight sync (every server paused for the profile's 1 s, 1.3-2 s here with the HTTP calls) costs under 10%
of the fleet's time; a tail of 3-6x the median (at most 12 turns, ~78 s) keeps the synchronous mode, which
waits for the slowest episode at every version, to ~87 s a version.

Measured with that command (and again with --versions 6 while other jobs kept this machine's load at 4-7):
    eta   samples/min      x sync        steady x      busy, steady busy       stale rows dropped
    0     207.9 | 205.8    1    | 1      1    | 1      0.32 0.32 | 0.31 0.32   0 | 0
    1     525.9 | 470.8    2.53 | 2.29   2.68 | 2.43   0.85 0.85 | 0.79 0.80   207 | 285
    2     691.9 | 675.2    3.33 | 3.28   4.00 | 4.07   0.91 0.93 | 0.86 0.91   145 | 190
    4     775.1 | 760.8    3.73 | 3.70   4.65 | 4.64   0.90 0.92 | 0.88 0.92   0 | 12
What limits it: the agent-runner's concurrency (256: run/server 3.4-3.6 of 4) bounds the generation rate; the
weight sync pauses the whole fleet once a version (~8% of its time at eta 4, more when the machine is loaded);
the start-up (the first batch of 64 complete groups, then a step and a sync: the first update at 39-46 s)
weighs on 5-6 versions (steady x is without it); with eta 1 and 2 the tail's episodes outlive their versions
and are dropped. The CPU is not the bound: the pipeline used 0.24-0.36 of the 2 cores (`cores`; 0.55 below).
With --concurrency 512 at eta 4 (run 1's settings): 983.6 samples/min (4.7x the synchronous 207.9), busy 0.86:
versions every ~11 s, each with its pause.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

# run as a script, so bench/ is first on sys.path
from heavy_tail_agent import ENV as AGENT_ENV
from heavy_tail_agent import TailParams, banned_tokens, episode_turns
from results import Figure, write_result
from results import parse_args as parse_with_smoke
from sim_fleet import parse_metrics
from sim_trainer import PROFILES, SIM_TRAINER_READY, profile_from, starting_model_logprobs

from rollstream.cli.local_run import OPT_IN_SERVICES, SERVICES, LocalRun, ServiceDied
from rollstream.shared.contract.archive import ArchiveReader, StreamHistory, read_history
from rollstream.shared.contract.bus import Bus, StreamName
from rollstream.shared.contract.events import PolicyUpdated, RolloutDropped, TrajectoryTurn, decode
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.config import Settings

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

AGENT = "heavy_tail_agent:heavy_tail_agent"


class BenchFailed(RuntimeError):
    """A mode did not finish; its logs are kept."""


# ------------------------------------------------------------------------------------------ fleets
class SimProcess:
    """A bench simulator (bench/sim_fleet.py, bench/sim_trainer.py) in a process of its own (its event loop
    must not share a GIL with the bench); started once it printed its ready line."""

    def __init__(self, arguments: list[str], log_path: Path, script: str = "sim_fleet.py",
                 ready_line: str = "SIM_FLEET_READY", env: dict[str, str] | None = None) -> None:
        self.command = [sys.executable, str(BENCH / script), *arguments]
        self.log_path = log_path
        self.ready_line = ready_line
        self.env = env
        self.process: subprocess.Popen | None = None

    def start_and_read(self) -> str:
        """Start it; returns what follows its ready line."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=log, text=True,
                                            start_new_session=True, env=self.env)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(self.ready_line + " "):
                return line.split(" ", 1)[1].strip()
        raise RuntimeError(f"{self.command[1:]} exited with {self.process.wait()}; see {self.log_path}")

    def start(self) -> list[str]:
        return json.loads(self.start_and_read())["urls"]

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class RealFleet:
    """One vLLM CPU server, behind a metering proxy (the pipeline talks to the proxy): started here, or the
    running one at `url`."""

    def __init__(self, model: Path, workdir: Path, url: str | None = None) -> None:
        from rollstream.cli.vllm_server import VllmServer, free_port

        self.server = None if url else VllmServer(model, free_port(), log_path=workdir / "vllm.log")
        self.url = url
        self.proxy: SimProcess | None = None
        self.workdir = workdir
        self.servers = 1

    def start(self) -> list[str]:
        if self.server is not None:
            self.server.start()
            self.server.wait_healthy()
            self.url = self.server.url
        self.proxy = SimProcess(["--proxy-to", self.url], self.workdir / "meter.log")
        return self.proxy.start()

    def metric_urls(self, url: str) -> list[str]:
        return [f"{url}/meter/metrics", f"{url}/metrics"]

    def pids(self) -> list[int]:
        return [pid for pid in (self.server and self.server.pid, self.proxy and self.proxy.pid()) if pid]

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.stop()


class SimulatedFleet:
    def __init__(self, model: Path, workdir: Path, args: argparse.Namespace) -> None:
        self.servers = args.servers
        self.process = SimProcess(["--servers", str(args.servers), "--model", str(model),
                                   "--decode-ms", str(args.sim_decode_ms),
                                   "--prefill-ms", str(args.sim_prefill_ms),
                                   "--overhead-ms", str(args.sim_overhead_ms), "--batch", str(args.sim_batch),
                                   "--reload-s", str(args.sim_reload_s), "--seed", str(args.seed)],
                                  workdir / "sim-fleet.log")

    def start(self) -> list[str]:
        return self.process.start()

    def metric_urls(self, url: str) -> list[str]:
        return [f"{url}/metrics"]

    def pids(self) -> list[int]:
        return [pid for pid in (self.process.pid(),) if pid]

    def stop(self) -> None:
        self.process.stop()


async def reload_all(urls: list[str], weights: Path) -> None:
    async with FleetClient(urls) as fleet:
        await asyncio.gather(*(fleet.reload_weights(url, str(weights)) for url in urls))


async def warm_up(url: str, model: Path, requests: int, concurrency: int, max_tokens: int) -> None:
    """Untimed requests of the shapes the bench sends (growing multi-turn prompts, many at once)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    extra = {"ignore_eos": True, "logit_bias": banned_tokens(tokenizer)}
    limit = asyncio.Semaphore(concurrency)
    async with FleetClient([url]) as fleet:
        async def one(index: int) -> None:
            async with limit:
                length = 20 + (index * 37) % (1000 - max_tokens - 20)
                prompt = [3 + (index + i) % 300 for i in range(length)]
                await fleet.complete(prompt, max_tokens=max_tokens, session_id=f"warm-{index % 64}",
                                     extra=extra)

        await asyncio.gather(*(one(i) for i in range(requests)))


# -------------------------------------------------------------------------------- fleet metrics
class MetricsPoller:
    """Scrapes every server's metrics in a thread: (time, values) per server."""

    NAMES = ("vllm:num_requests_running", "sim:busy_seconds_total", "sim:running_seconds_total")

    def __init__(self, servers: dict[str, list[str]], interval_s: float) -> None:
        self.servers = servers
        """server url -> the metrics URLs to scrape for it"""
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, dict[str, float]]]] = {u: [] for u in servers}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.client = httpx.Client(timeout=5.0)

    def scrape(self, urls: list[str]) -> dict[str, float] | None:
        values: dict[str, float] = {}
        try:
            for url in urls:
                values.update(parse_metrics(self.client.get(url).text))
        except httpx.HTTPError:
            return None
        return {name: values[name] for name in self.NAMES if name in values}

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            for server, urls in self.servers.items():
                values = self.scrape(urls)
                if values is not None:
                    self.samples[server].append((time.time(), values))
            self.stopping.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> MetricsPoller:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.client.close()

    def utilisation(self, t0: float, t1: float) -> tuple[float, float, float]:
        """Per server over [t0, t1], averaged over servers: busy fraction and mean running requests from
        the busy-time counters, and the busy fraction the polled vllm:num_requests_running gauge gives."""
        busy, running, gauge = [], [], []
        for samples in self.samples.values():
            if samples and "sim:busy_seconds_total" in samples[0][1]:
                busy.append(_counter_rate(samples, "sim:busy_seconds_total", t0, t1))
                running.append(_counter_rate(samples, "sim:running_seconds_total", t0, t1))
            inside = [v["vllm:num_requests_running"] for t, v in samples
                      if t0 <= t <= t1 and "vllm:num_requests_running" in v]
            if inside:
                gauge.append(sum(r > 0 for r in inside) / len(inside))

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else float("nan")

        return mean(busy), mean(running), mean(gauge)


def _counter_rate(samples: list[tuple[float, dict[str, float]]], name: str, t0: float, t1: float) -> float:
    times = [t for t, _ in samples]
    values = [v[name] for _, v in samples]

    def at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        if i <= 0:
            return values[0]
        if i >= len(times):
            return values[-1]
        span = times[i] - times[i - 1]
        return values[i - 1] + (values[i] - values[i - 1]) * ((t - times[i - 1]) / span if span else 1.0)

    return (at(t1) - at(t0)) / (t1 - t0) if t1 > t0 else float("nan")


# ------------------------------------------------------------------------------------------ a mode
@dataclass
class Result:
    fleet: str
    servers: int
    eta: int
    versions: int
    repeat: int = 1
    """Which of --repeats runs of this mode (each mode runs once per repeat, the modes in turn)."""
    trained: int = 0
    dropped: int = 0
    """Batch rows the trainer left out (stale or invalid), and rollouts the reward service dropped."""
    drop_causes: dict[str, int] = field(default_factory=dict)
    finished: int = 0
    window_s: float = float("nan")
    total_s: float = float("nan")
    per_min: float = float("nan")
    steady_per_min: float = float("nan")
    busy: float = float("nan")
    steady_busy: float = float("nan")
    """busy from update 1 to update V (the window of steady/min: no start-up)."""
    running: float = float("nan")
    gauge_busy: float = float("nan")
    turns: int = 0
    generated_tokens: int = 0
    step_s: float = float("nan")
    """Mean training step (PolicyUpdated.metrics train/step_seconds: simulated, or the real trainer's)."""
    sync_s: float = float("nan")
    """Mean weight sync (sync/seconds)."""
    trainer_busy: float = float("nan")
    """Fraction of the window the trainer stepped or synced."""
    update_times: list[float] = field(default_factory=list)
    run_dir: str = ""

    cores: float = float("nan")
    """CPU time of the pipeline's processes (services, fleet, simulated trainer) per second of the mode."""

    @property
    def mode(self) -> str:
        return "sync" if self.eta == 0 else "async"


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these processes and their children so far (what exited is lost)."""
    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for each in (process, *process.children(recursive=True)):
                times = each.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # gone meanwhile
            continue
    return total


def mode_settings(kind: str, eta: int, servers: int, args: argparse.Namespace, model: Path,
                  workdir: Path) -> Settings:
    run_id = f"bench-async-{kind}-eta{eta}-{uuid.uuid4().hex[:8]}"
    # Admission goes on past the measured versions, as in a long run, unless --final-drain: the last
    # measured version then waits for the slowest sample admitted, which no long run does at every step.
    admitted_versions = args.versions if args.final_drain else args.versions + eta + 1
    train = {"batch_size": args.batch_size, "max_staleness": eta, "total_versions": admitted_versions,
             "seed": args.seed}
    sync_concurrency = args.sync_concurrency or (servers if args.trainer == "sim-gpu" else None)
    if sync_concurrency:
        train["sync_concurrency"] = sync_concurrency
    # INFO, not less: the local run finds each service's health port in its "service started" line
    return Settings(
        run_id=run_id, redis_url=args.redis_url, storage_uri=str(workdir / "runs"), log_level="INFO",
        model={"path": model},
        data={"samples_per_prompt": args.group, "synthetic_sandbox_every": 0, "seed": args.seed},
        rollout={"max_tokens": args.max_tokens, "concurrency": args.concurrency},
        agent={"default": AGENT, "max_turns": 100_000, "max_total_tokens": args.max_total_tokens},
        train=train,
    )


def pipeline_services(settings: Settings, args: argparse.Namespace) -> tuple[str, ...]:
    """What LocalRun starts by default, less the trainer when the simulated one stands in for it."""
    return tuple(name for name in SERVICES if name not in OPT_IN_SERVICES
                 and (name != "recorder" or settings.recorder.enabled)
                 and (name != "trainer" or args.trainer == "real"))


@functools.cache
def probe_logprobs_json(model_path: str) -> str:
    """Computed once here, so that the simulated trainer needs no torch and is ready within a second."""
    return json.dumps(starting_model_logprobs(model_path))


def start_sim_trainer(local: LocalRun, args: argparse.Namespace) -> SimProcess:
    """bench/sim_trainer.py on the run's configuration (RS_CONFIG_FILE, written by local.start())."""
    arguments = ["--gpu-profile", args.gpu_profile,
                 "--expected-logprobs", probe_logprobs_json(str(local.settings.model.path))]
    if args.train_tokens_per_s is not None:
        arguments += ["--train-tokens-per-s", str(args.train_tokens_per_s)]
    if args.step_overhead_s is not None:
        arguments += ["--step-overhead-s", str(args.step_overhead_s)]
    trainer = SimProcess(arguments, local.log_dir / "sim-trainer.log", script="sim_trainer.py",
                         ready_line=SIM_TRAINER_READY, env=local.env)
    trainer.start_and_read()
    return trainer


def run_mode(kind: str, fleet, urls: list[str], eta: int, repeat: int, args: argparse.Namespace, model: Path,
             workdir: Path) -> Result:
    asyncio.run(reload_all(urls, model))
    settings = mode_settings(kind, eta, len(urls), args, model, workdir)
    result = Result(fleet=kind, servers=fleet.servers, eta=eta, versions=args.versions, repeat=repeat)
    poller = MetricsPoller({url: fleet.metric_urls(url) for url in urls},
                           interval_s=0.25 if len(urls) == 1 else 1.0).start()
    local = LocalRun(settings, fleet_urls=urls, services=pipeline_services(settings, args))
    trainer: SimProcess | None = None
    result.run_dir = str(local.run_dir)
    started = time.time()
    print(f"  {kind} eta={eta} (run {repeat} of {args.repeats}): run {settings.run_id}, "
          f"logs in {local.log_dir}", flush=True)

    def check_trainer(_progress) -> None:
        if trainer is not None and trainer.exit_code() is not None:
            raise ServiceDied(f"sim-trainer exited with {trainer.exit_code()}:\n"
                              + tail(trainer.log_path, 30))

    try:
        local.start()
        if args.trainer == "sim-gpu":
            trainer = start_sim_trainer(local, args)
        pids = [p.pid for p in local.processes.values()] + fleet.pids() + ([trainer.pid()] if trainer else [])
        cpu_started, measuring_since = cpu_seconds(pids), time.time()
        progress = local.wait_for_version(args.versions, timeout_s=args.timeout, on_progress=check_trainer)
        result.cores = (cpu_seconds(pids) - cpu_started) / (time.time() - measuring_since)
        result.total_s = time.time() - started
        result.finished = progress.finished
    except BaseException as exc:
        if isinstance(exc, (ServiceDied, TimeoutError)):
            for name in local.processes:
                print(f"--- {name} (last lines)\n{local.log_tail(name, 30)}", file=sys.stderr)
        if trainer is not None:
            trainer.stop()
        local.stop()
        poller.stop()
        if local.bus is not None:
            local.bus.delete_run()
        if isinstance(exc, (ServiceDied, TimeoutError, RuntimeError)):
            raise BenchFailed(f"{kind} eta={eta} failed: {exc}; logs in {local.log_dir}") from exc
        raise
    time.sleep(2 * poller.interval_s + 0.5)  # a scrape past the last update: the counters cover the window
    poller.stop()
    if trainer is not None:
        trainer.stop()
    measure(result, local, poller)
    local.stop()
    if not args.keep:
        local.bus.delete_run()
    print(f"    window {result.window_s:.1f}s, trained {result.trained}, dropped {result.dropped}, "
          f"{result.per_min:.1f} samples/min, busy {result.busy:.2f}, step {result.step_s:.2f}s, "
          f"sync {result.sync_s:.2f}s; updates at " + ", ".join(f"{t:.0f}" for t in result.update_times)
          + " s", flush=True)
    return result


def measure(result: Result, local: LocalRun, poller: MetricsPoller) -> None:
    """The mode's numbers, from its streams (event envelope times) and the fleet's counters."""
    bus = local.bus
    assert bus is not None
    storage_uri = local.settings.storage_uri
    t0 = decode(history(bus, "prompts", storage_uri, count=1)[0][1]).time
    # the trainer goes on past the measured versions while admission does: those updates are not measured
    updates = [(d.envelope.time, d.event) for d in read_history(bus, "policy", storage_uri)
               if isinstance(d.event, PolicyUpdated) and d.event.version <= result.versions]
    times = [t for t, _ in updates]
    t1 = times[-1]
    result.turns, result.generated_tokens = episode_work(bus, storage_uri, until=t1)
    result.update_times = [t - t0 for t in times]
    result.trained = sum(u.trained_samples for _, u in updates)
    result.drop_causes = dropped_in_window(bus, storage_uri, updates, until=t1)
    result.dropped = sum(result.drop_causes.values())
    result.window_s = t1 - t0
    result.per_min = 60 * result.trained / result.window_s
    if len(updates) >= 2 and t1 > times[0]:
        result.steady_per_min = 60 * sum(u.trained_samples for _, u in updates[1:]) / (t1 - times[0])
        result.steady_busy = poller.utilisation(times[0], t1)[0]
    result.busy, result.running, result.gauge_busy = poller.utilisation(t0, t1)
    steps = [u.metrics.get("train/step_seconds", float("nan")) for _, u in updates]
    syncs = [u.metrics.get("sync/seconds", float("nan")) for _, u in updates]
    result.step_s = sum(steps) / len(steps)
    result.sync_s = sum(syncs) / len(syncs)
    result.trainer_busy = (sum(steps) + sum(syncs)) / result.window_s


def dropped_in_window(bus: Bus, storage_uri: str, updates: list[tuple[float, PolicyUpdated]],
                      until: float) -> dict[str, int]:
    """What the window's updates left out of their batches (`rows <cause>`: stale, invalid) and the rollouts
    the reward service dropped up to `until` (`rollouts <cause>`: grading failed, grade timeout, ...)."""
    causes: Counter[str] = Counter()
    for _, update in updates:
        causes.update({f"rows {cause}": count for cause, count in update.dropped.items()})
    for delivery in read_history(bus, "rewards", storage_uri):
        if isinstance(delivery.event, RolloutDropped) and delivery.envelope.time <= until:
            causes[f"rollouts {delivery.event.cause}"] += 1
    return {cause: count for cause, count in sorted(causes.items()) if count}


def tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def history(bus: Bus, stream: StreamName, storage_uri: str, count: int | None = None) -> list:
    """A stream's raw entries from its start: the recorder trims the live streams behind its archive."""
    return StreamHistory(bus, stream, ArchiveReader(storage_uri, bus.keys.run_id)).new_entries(count)


def episode_work(bus: Bus, storage_uri: str, until: float) -> tuple[int, int]:
    """Turns and sampled tokens of the episodes published up to `until` (the fleet's own counters also
    count the trainer's parity probes, and admission goes on after the window)."""
    turns = tokens = 0
    for _, fields in history(bus, "trajectories", storage_uri):
        if fields.get(b"type") == TrajectoryTurn.TYPE.encode():
            envelope = decode(fields)
            if envelope.time <= until:
                turns += 1
                tokens += len(envelope.payload.response_ids)
    return turns, tokens


def run_fleet(kind: str, args: argparse.Namespace, model: Path, workdir: Path) -> list[Result]:
    if kind == "real":
        fleet = RealFleet(model, workdir, args.fleet_url)
    else:
        fleet = SimulatedFleet(model, workdir, args)
    what = "vLLM (CPU)" if kind == "real" else f"{args.servers} simulated servers"
    print(f"{kind}: starting {what}", flush=True)
    results = []
    try:
        urls = fleet.start()
        if kind == "real" and args.warmup:
            print(f"  warm-up: {args.warmup} untimed requests", flush=True)
            asyncio.run(warm_up(urls[0], model, args.warmup, args.concurrency, args.max_tokens))
        for repeat in range(1, args.repeats + 1):
            # the modes in turn, every other repeat in reverse order (A B B A ...): what the first runs pay
            # (cold caches, a warming fleet) and a drift of the machine fall on each mode alike
            for eta in (args.etas if repeat % 2 else args.etas[::-1]):
                results.append(run_mode(kind, fleet, urls, eta, repeat, args, model, workdir))
    finally:
        fleet.stop()
    return results


# ------------------------------------------------------------------------------------------ report
def report(results: list[Result], args: argparse.Namespace, params: TailParams) -> None:
    turns = [episode_turns(i, params) for i in range(args.batch_size * args.versions)]
    long = sum(t >= params.median_turns * params.tail_min for t in turns)
    print()
    print(f"workload: B={args.batch_size} (n={args.group}), {args.versions} versions = {len(turns)} "
          f"episodes, {args.max_tokens} tokens/turn, turns median {sorted(turns)[len(turns) // 2]}, "
          f"max {max(turns)}, "
          f"{long} episodes >= {params.tail_min:g}x median, {sum(turns)} turns in all; "
          f"agent-runner concurrency {args.concurrency}; seed {args.seed}; "
          + ("admitting only these" if args.final_drain else "admission going on past them"))
    if any(r.fleet == "sim" for r in results):
        print(f"simulated servers: decode {args.sim_decode_ms} ms/token, prefill {args.sim_prefill_ms} "
              f"ms/token, overhead {args.sim_overhead_ms} ms/request, full speed up to {args.sim_batch} "
              f"requests, reload {args.sim_reload_s} s")
    if args.trainer == "sim-gpu":
        profile = profile_from(args.gpu_profile, args.train_tokens_per_s, args.step_overhead_s, args.sync_s)
        print(f"trainer: simulated GPUs (bench/sim_trainer.py), {profile.describe_step()}, sync "
              f"{profile.sync_s:g} s per server, {args.sync_concurrency or 'every server'} at once")
    else:
        print("trainer: the trainer service (services/trainer) on this machine's CPU")
    print_table(results)
    headline = headline_lines(results)
    print("\n".join(headline))
    write_result(args.json, figures_of(results), [
        f"B={args.batch_size} (n={args.group}), {args.versions} versions measured, {args.max_tokens} tokens "
        f"a turn, agent-runner concurrency {args.concurrency}, trainer {args.trainer}"
        + (f" ({args.gpu_profile})" if args.trainer == "sim-gpu" else "")
        + f", {args.repeats} run{'s' if args.repeats > 1 else ''} of each mode, the modes in turn, every "
          "other round reversed", *headline])


def modes(results: list[Result]) -> dict[tuple[str, int], list[Result]]:
    """Each fleet's modes (fleet, eta), each with its runs in the order they ran."""
    grouped: dict[tuple[str, int], list[Result]] = {}
    for result in results:
        grouped.setdefault((result.fleet, result.eta), []).append(result)
    return grouped


def async_against_sync(results: list[Result]):
    """(fleet, eta, the async mode's runs, the synchronous mode's runs) for each async mode of a fleet that
    has a synchronous one; run i of each beside the other (those that both finished)."""
    grouped = modes(results)
    for (kind, eta), runs in grouped.items():
        sync = grouped.get((kind, 0))
        if eta != 0 and sync:
            count = min(len(runs), len(sync))
            yield kind, eta, runs[:count], sync[:count]


def headline_lines(results: list[Result]) -> list[str]:
    """The headline, samples trained per minute over each run (start-up included), with its spread over the
    repeated runs and what each run dropped beside it."""
    lines = []
    for (kind, eta), runs in modes(results).items():
        rates = [r.per_min for r in runs]
        drops = Counter()
        for r in runs:
            drops.update(r.drop_causes)
        lines.append(f"{kind} eta={eta}: samples trained per minute {describe(rates)}; dropped "
                     + (", ".join(f"{count} {cause}" for cause, count in drops.items()) or "nothing")
                     + f" in {len(runs)} run{'s' if len(runs) > 1 else ''}")
    for kind, eta, runs, sync in async_against_sync(results):
        ratios = ", ".join(f"x{a.per_min / s.per_min:.2f}" for a, s in zip(runs, sync))
        middle = statistics.median(r.per_min for r in runs) / statistics.median(s.per_min for s in sync)
        lines.append(f"async/sync {kind} eta={eta}: samples trained per minute x{middle:.2f} (medians; "
                     f"each run against its synchronous run: {ratios})")
    return lines


def describe(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    middle = statistics.median(values)
    return (f"median {middle:.1f}, runs " + ", ".join(f"{v:.1f}" for v in values)
            + f" (spread {100 * (max(values) - min(values)) / middle:.0f}% of the median)")


SYNC = "eta=0 (synchronous)"


def figures_of(results: list[Result]) -> list[Figure]:
    """Each async mode against the synchronous mode of its fleet, medians over the runs: samples trained per
    minute over the run (the headline) and the fleet's busy fraction. What was dropped is said beside them
    (headline_lines): against a synchronous mode that drops nothing, it has no ratio."""
    figures = []
    for kind, eta, runs, sync in async_against_sync(results):
        fleet = "real vLLM (CPU)" if kind == "real" else f"{runs[0].servers} simulated servers"
        what = f"{fleet}, eta={eta}"
        for title, attribute, unit in (("samples trained per minute over the run", "per_min", "samples/min"),
                                       ("fleet busy", "busy", "fraction of time")):
            figures.append(Figure.repeated(f"{what}: {title}", [getattr(r, attribute) for r in runs], SYNC,
                                           [getattr(r, attribute) for r in sync], unit))
    return figures


COLUMNS = (  # title, width, Result attribute, format
    ("fleet", 6, "fleet", "<"), ("servers", 8, "servers", ""), ("mode", 7, "mode", ""), ("eta", 5, "eta", ""),
    ("run", 5, "repeat", ""),
    ("versions", 9, "versions", ""), ("trained", 9, "trained", ""), ("dropped", 9, "dropped", ""),
    ("window s", 10, "window_s", ".1f"), ("samples/min", 13, "per_min", ".1f"),
    ("steady/min", 12, "steady_per_min", ".1f"), ("busy", 7, "busy", ".2f"),
    ("st.busy", 9, "steady_busy", ".2f"), ("run/server", 12, "running", ".2f"),
    ("gauge busy", 12, "gauge_busy", ".2f"), ("step s", 8, "step_s", ".2f"), ("sync s", 8, "sync_s", ".2f"),
    ("trainer", 9, "trainer_busy", ".2f"), ("turns", 7, "turns", ""), ("tokens", 9, "generated_tokens", ""),
    ("cores", 7, "cores", ".2f"), ("wall s", 8, "total_s", ".1f"),
)


def print_table(results: list[Result]) -> None:
    header = "".join(f"{title:{'<' if align == '<' else '>'}{width}}" for title, width, _, align in COLUMNS)
    print(header)
    print("-" * len(header))
    for r in results:
        print("".join(f"{getattr(r, name):{'<' if spec == '<' else '>'}{width}{'' if spec == '<' else spec}}"
                      for _, width, name, spec in COLUMNS))


SMOKE = {"etas": [0, 1], "batch_size": 4, "group": 2, "versions": 2, "max_tokens": 4, "concurrency": 8,
         "servers": 4, "warmup": 0, "trainer": "sim-gpu", "train_tokens_per_s": 1e6, "step_overhead_s": 0.05,
         "sync_s": 0.05, "timeout": 300.0, "repeats": 2}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--mode", choices=("real", "sim", "both"), default="both")
    add("--eta", type=int, default=4, help="max staleness of the async mode (> 0)")
    add("--etas", type=int, nargs="+", default=None,
        help="max staleness of each mode, run in this order (0: synchronous); default: 0 and --eta")
    add("--batch-size", type=int, default=32)
    add("--group", type=int, default=4, help="samples per prompt (n)")
    add("--versions", type=int, default=8, help="policy versions measured")
    add("--final-drain", action="store_true",
        help="admit only versions x batch-size samples (the last version waits for every one of them); "
             "default: admission goes on past the measured versions")
    add("--max-tokens", type=int, default=16, help="tokens per turn")
    add("--max-total-tokens", type=int, default=1024, help="context of one segment")
    add("--concurrency", type=int, default=256, help="episodes the agent-runner runs at once")
    add("--seed", type=int, default=0)
    add("--repeats", type=int, default=1,
        help="runs of each mode, the modes in turn; figures are their medians, with the spread beside them")
    add("--median-turns", type=int, default=2)
    add("--tail-fraction", type=float, default=0.05)
    add("--tail-min", type=float, default=10.0)
    add("--tail-max", type=float, default=50.0)
    add("--servers", type=int, default=64, help="simulated servers")
    add("--sim-decode-ms", type=float, default=25.0)
    add("--sim-prefill-ms", type=float, default=0.1)
    add("--sim-overhead-ms", type=float, default=2.0)
    add("--sim-batch", type=int, default=8)
    add("--sim-reload-s", type=float, default=None,
        help="a server's weight reload; default: the sync time of the GPU profile with --trainer sim-gpu, "
             "else 0.05")
    add("--trainer", choices=("real", "sim-gpu"), default="real",
        help="the trainer service on this CPU, or bench/sim_trainer.py with a GPU profile's step time")
    add("--gpu-profile", choices=sorted(PROFILES), default="h100x8-7b")
    add("--train-tokens-per-s", type=float, default=None, help="overrides the GPU profile's")
    add("--step-overhead-s", type=float, default=None, help="overrides the GPU profile's")
    add("--sync-s", type=float, default=None,
        help="overrides the GPU profile's sync time (the simulated servers' reload)")
    add("--sync-concurrency", type=int, default=None,
        help="train.sync_concurrency; default: every server at once with --trainer sim-gpu (as a broadcast "
             "would), else the trainer's default")
    add("--warmup", type=int, default=400, help="untimed requests to vLLM before the real modes")
    add("--order", choices=("sync-first", "async-first"), default="sync-first", help="without --etas")
    add("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    add("--redis-url", default=os.environ.get("RS_REDIS_URL", "redis://127.0.0.1:6379/0"))
    add("--timeout", type=float, default=1500.0, help="seconds one mode may take")
    add("--workdir", type=Path, default=None, help="default: a new directory under /tmp")
    add("--keep", action="store_true",
        help="keep the work directory (logs, checkpoints) and the runs' Redis streams")
    add("--fleet-url", default=None, help="the real modes use this running vLLM server of --model")
    args = parse_with_smoke(parser, smoke=SMOKE)
    if args.eta < 1:
        parser.error("--eta is the async mode's staleness and must be at least 1")
    if args.etas is None:
        args.etas = [0, args.eta] if args.order == "sync-first" else [args.eta, 0]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if min(args.etas) < 0:
        parser.error("--etas must be 0 (synchronous) or more")
    if args.sim_reload_s is None:
        profile = profile_from(args.gpu_profile, sync_s=args.sync_s)
        args.sim_reload_s = profile.sync_s if args.trainer == "sim-gpu" else 0.05
    return args


def main() -> None:
    args = parse_args()
    model = args.model.resolve()
    if not (model / "config.json").exists():
        from rollstream.cli.model.tiny_model import build_tiny_model

        build_tiny_model(model)
    params = TailParams(seed=args.seed, median_turns=args.median_turns, tail_fraction=args.tail_fraction,
                        tail_min=args.tail_min, tail_max=args.tail_max)
    # the services inherit the environment: this makes the plug-in agent importable and parameterised
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p)
    os.environ[AGENT_ENV] = params.to_env()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rs-bench-async-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work directory {workdir}", flush=True)
    results: list[Result] = []
    try:
        for kind in (("real", "sim") if args.mode == "both" else (args.mode,)):
            results += run_fleet(kind, args, model, workdir)
    except BenchFailed as exc:
        if results:
            report(results, args, params)
        raise SystemExit(str(exc)) from None
    report(results, args, params)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
