"""One mode of bench/bench_async.py (a fleet, a max staleness, one of the repeated runs): the real pipeline
started on it (cli/local_run.py, the simulated trainer in the trainer's place with --trainer sim-gpu) until
the measured policy version, then measured from its streams (event envelope times) and the fleet's
busy-time counters.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# run as a script, so bench/ is first on sys.path
from async_fleets import MetricsPoller, RealFleet, SimProcess, SimulatedFleet, reload_all, warm_up
from sim_trainer import SIM_TRAINER_READY, starting_model_logprobs

from rollstream.cli.local_run import OPT_IN_SERVICES, SERVICES, LocalRun, ServiceDied
from rollstream.shared.contract.archive import ArchiveReader, StreamHistory, read_history
from rollstream.shared.contract.bus import Bus, StreamName
from rollstream.shared.contract.events import PolicyUpdated, RolloutDropped, TrajectoryTurn, decode
from rollstream.shared.runtime.config import Settings

AGENT = "heavy_tail_agent:heavy_tail_agent"


class BenchFailed(RuntimeError):
    """A mode did not finish; its logs are kept."""


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
