"""Does the reward rise because of RL? The main job's run next to its control, in the same session.

Two local runs on the same warm-started tiny model, the same prompts and seeds, real vLLM on the CPU:
RL as configured, and the control with the update switched off (train.learning_rate 0: the same
pipeline, weight syncs included, but the policy never changes). Prints the mean reward of the
samples admitted at each policy version (in windows) and the gain of RL over the control.

    .venv/bin/python bench/bench_learning.py [--versions 30] [--window 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.events import PromptIssued, RewardAssigned
from rollstream.shared.runtime.config import Settings


def rewards_by_version(local: LocalRun) -> dict[int, list[float]]:
    admitted_at = {d.envelope.rollout_id: d.event.policy_version for d in read_history(local.bus, "prompts", local.settings.storage_uri)
                   if isinstance(d.event, PromptIssued)}
    out: dict[int, list[float]] = {}
    for delivery in read_history(local.bus, "rewards", local.settings.storage_uri):
        if isinstance(delivery.event, RewardAssigned):
            out.setdefault(admitted_at[delivery.envelope.rollout_id], []).append(delivery.event.reward)
    return out


def run(label: str, learning_rate: float | None, versions: int, storage: Path) -> dict[int, list[float]]:
    overrides = {"total_versions": versions, "trackers": []}
    if learning_rate is not None:
        overrides["learning_rate"] = learning_rate
    base = Settings()
    settings = Settings(run_id=f"bench-learning-{label}-{uuid.uuid4().hex[:6]}", storage_uri=str(storage),
                        redis_url=base.redis_url, redis_username=base.redis_username,
                        redis_password=base.redis_password, train={**base.train.model_dump(), **overrides},
                        data={**base.data.model_dump(), "synthetic_sandbox_every": 0})
    local = LocalRun(settings)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()
    model = Settings().model.path
    if not (model / "config.json").exists():
        sys.exit(f"no model at {model}: run `make setup` (it builds the warm-started tiny model)")
    with tempfile.TemporaryDirectory(prefix="rs-bench-learning-") as tmp:
        rl = run("rl", None, args.versions, Path(tmp))
        control = run("control", 0.0, args.versions, Path(tmp))

    def window_mean(rewards: dict[int, list[float]], first: int) -> float:
        values = [r for version in range(first, first + args.window) for r in rewards.get(version, [])]
        return statistics.fmean(values) if values else float("nan")

    print(f"\nmean reward of samples admitted at each policy version, windows of {args.window} versions")
    print(f"{'versions':>10} {'RL':>8} {'control':>8}")
    for first in range(0, args.versions, args.window):
        print(f"{first:>4}-{first + args.window - 1:<5} {window_mean(rl, first):>8.3f} {window_mean(control, first):>8.3f}")
    last = args.versions - args.window
    gain_rl = window_mean(rl, last) - window_mean(rl, 0)
    gain_control = window_mean(control, last) - window_mean(control, 0)
    print(f"\nlast window vs first: RL {gain_rl:+.3f}, control {gain_control:+.3f}; "
          f"RL / control in the last window: {window_mean(rl, last) / window_mean(control, last):.2f}x")


if __name__ == "__main__":
    main()
