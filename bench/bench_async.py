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
import os
import shutil
import tempfile
from pathlib import Path

# run as a script, so bench/ is first on sys.path
from async_fleets import BENCH
from async_modes import BenchFailed, Result, run_fleet
from async_report import report
from heavy_tail_agent import ENV as AGENT_ENV
from heavy_tail_agent import TailParams
from results import parse_args as parse_with_smoke
from sim_trainer import PROFILES, profile_from

ROOT = BENCH.parent

SMOKE = {"etas": [0, 1], "batch_size": 4, "group": 2, "versions": 2, "max_tokens": 4, "concurrency": 8,
         "servers": 4, "warmup": 0, "trainer": "sim-gpu", "train_tokens_per_s": 1e6, "step_overhead_s": 0.05,
         "sync_s": 0.05, "timeout": 300.0, "repeats": 2}


def add_mode_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("modes").add_argument
    add("--mode", choices=("real", "sim", "both"), default="both")
    add("--eta", type=int, default=4, help="max staleness of the async mode (> 0)")
    add("--etas", type=int, nargs="+", default=None,
        help="max staleness of each mode, run in this order (0: synchronous); default: 0 and --eta")
    add("--order", choices=("sync-first", "async-first"), default="sync-first", help="without --etas")
    add("--repeats", type=int, default=1,
        help="runs of each mode, the modes in turn; figures are their medians, with the spread beside them")


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("workload").add_argument
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
    add("--median-turns", type=int, default=2)
    add("--tail-fraction", type=float, default=0.05)
    add("--tail-min", type=float, default=10.0)
    add("--tail-max", type=float, default=50.0)


def add_fleet_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("fleet").add_argument
    add("--servers", type=int, default=64, help="simulated servers")
    add("--sim-decode-ms", type=float, default=25.0)
    add("--sim-prefill-ms", type=float, default=0.1)
    add("--sim-overhead-ms", type=float, default=2.0)
    add("--sim-batch", type=int, default=8)
    add("--sim-reload-s", type=float, default=None,
        help="a server's weight reload; default: the sync time of the GPU profile with --trainer sim-gpu, "
             "else 0.05")
    add("--warmup", type=int, default=400, help="untimed requests to vLLM before the real modes")
    add("--fleet-url", default=None, help="the real modes use this running vLLM server of --model")
    add("--model", type=Path, default=ROOT / "models" / "tiny-llama")


def add_trainer_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("trainer").add_argument
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


def add_run_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("the run").add_argument
    add("--redis-url", default=os.environ.get("RS_REDIS_URL", "redis://127.0.0.1:6379/0"))
    add("--timeout", type=float, default=1500.0, help="seconds one mode may take")
    add("--workdir", type=Path, default=None, help="default: a new directory under /tmp")
    add("--keep", action="store_true",
        help="keep the work directory (logs, checkpoints) and the runs' Redis streams")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for add_options in (add_mode_options, add_workload_options, add_fleet_options, add_trainer_options,
                        add_run_options):
        add_options(parser)
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
