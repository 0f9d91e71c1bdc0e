"""Does the reward rise because of RL? The main job's run next to its control, in the same session.

Two local runs on the same warm-started tiny model, the same prompts and seeds, real vLLM on the CPU:
RL as configured, and the control with the update switched off (train.learning_rate 0: the same
pipeline, weight syncs included, but the policy never changes). Prints the mean reward of the
samples admitted at each policy version (in windows) and the gain of RL over the control.

    .venv/bin/python bench/bench_learning.py [--versions 30] [--window 5] [--batch-size 32] [--model DIR]
                                             [--fleet-url http://127.0.0.1:8000] [--smoke] [--json PATH]

With --fleet-url both runs use that running vLLM server (of --model's architecture) instead of starting one
each; it is made to serve --model before each run and after the last.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from results import Figure, parse_args, write_result

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.events import PromptIssued, RewardAssigned
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.config import Settings


def rewards_by_version(local: LocalRun) -> dict[int, list[float]]:
    prompts = read_history(local.bus, "prompts", local.settings.storage_uri)
    admitted_at = {d.envelope.rollout_id: d.event.policy_version for d in prompts
                   if isinstance(d.event, PromptIssued)}
    out: dict[int, list[float]] = {}
    for delivery in read_history(local.bus, "rewards", local.settings.storage_uri):
        if isinstance(delivery.event, RewardAssigned):
            out.setdefault(admitted_at[delivery.envelope.rollout_id], []).append(delivery.event.reward)
    return out


async def serve(url: str, model: Path) -> None:
    async with FleetClient([url]) as fleet:
        await fleet.reload_weights(url, str(model.resolve()))


def run(label: str, learning_rate: float | None, args: argparse.Namespace,
        storage: Path) -> dict[int, list[float]]:
    versions = args.versions
    overrides = {"total_versions": versions, "trackers": [], "batch_size": args.batch_size}
    if learning_rate is not None:
        overrides["learning_rate"] = learning_rate
    base = Settings()
    settings = Settings(run_id=f"bench-learning-{label}-{uuid.uuid4().hex[:6]}", storage_uri=str(storage),
                        redis_url=base.redis_url, redis_username=base.redis_username,
                        redis_password=base.redis_password, train={**base.train.model_dump(), **overrides},
                        data={**base.data.model_dump(), "synthetic_sandbox_every": 0},
                        model={**base.model.model_dump(), "path": args.model})
    if args.fleet_url:
        asyncio.run(serve(args.fleet_url, args.model))  # both runs start from the same policy
    local = LocalRun(settings, fleet_urls=[args.fleet_url] if args.fleet_url else None)
    try:
        local.start(on_step=lambda message: print(f"[{label}] {message}", flush=True))
        local.wait_for_version(versions, timeout_s=1800)
        rewards = rewards_by_version(local)  # before stop(): an embedded Redis goes with it
        if settings.redis_url:
            local.bus.delete_run()
    finally:
        local.stop()
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=Settings().train.batch_size)
    parser.add_argument("--model", type=Path, default=Settings().model.path, help="the starting model")
    parser.add_argument("--fleet-url", default=None, help="a running vLLM server both runs use")
    args = parse_args(parser, smoke={"versions": 4, "window": 2, "batch_size": 8})
    if not (args.model / "config.json").exists():
        sys.exit(f"no model at {args.model}: run `make setup` (it builds the warm-started tiny model)")
    with tempfile.TemporaryDirectory(prefix="rs-bench-learning-") as tmp:
        rl = run("rl", None, args, Path(tmp))
        control = run("control", 0.0, args, Path(tmp))
    if args.fleet_url:
        asyncio.run(serve(args.fleet_url, args.model))

    def window_mean(rewards: dict[int, list[float]], first: int) -> float:
        values = [r for version in range(first, first + args.window) for r in rewards.get(version, [])]
        return statistics.fmean(values) if values else float("nan")

    print(f"\nmean reward of samples admitted at each policy version, windows of {args.window} versions")
    print(f"{'versions':>10} {'RL':>8} {'control':>8}")
    for first in range(0, args.versions, args.window):
        print(f"{first:>4}-{first + args.window - 1:<5} {window_mean(rl, first):>8.3f} "
              f"{window_mean(control, first):>8.3f}")
    last = args.versions - args.window
    gain_rl = window_mean(rl, last) - window_mean(rl, 0)
    gain_control = window_mean(control, last) - window_mean(control, 0)
    print(f"\nlast window vs first: RL {gain_rl:+.3f}, control {gain_control:+.3f}; "
          f"RL / control in the last window: {window_mean(rl, last) / window_mean(control, last):.2f}x")
    window = f"versions {last}-{args.versions - 1}"
    write_result(args.json, [Figure(f"RL: mean reward of samples admitted at {window}", window_mean(rl, last),
                                    "control (learning rate 0), same versions", window_mean(control, last),
                                    "reward")],
                 [f"{args.model}, batch {args.batch_size}, {args.versions} versions; last window against the "
                  f"first ({args.window} versions): RL {gain_rl:+.3f}, control {gain_control:+.3f}"])


if __name__ == "__main__":
    main()
