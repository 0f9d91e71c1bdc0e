"""Do two roles learn together? The relay's planner and solver, both trained, next to a control whose planner
is frozen, in the same session.

Two local runs of the relay example (cli/examples.py: a planner computes a + b with the calculator, a solver
adds c to the planner's answer; two LoRA adapters of one model on one vLLM CPU server) on the same
warm-started tiny model, the same prompts and seeds: "both", the example as it is, and "control", the same
run with the planner frozen (roles.names.planner.trained false, its reward function kept). A frozen role is
sampled from the base model without an adapter, which is where a trained adapter starts (its B matrices are
zeros), so the control's planner is the starting planner throughout while its solver trains. Prints, per role
and run, the mean reward of the rollouts admitted at each policy version, in windows: the planner's is its
own (RewardAssigned.role_rewards["planner"]: its answer against a + b), the solver's the rollout's
(RewardAssigned.reward: the team's final answer against a + b + c, 0 where the planner handed on no number).

    .venv/bin/python bench/bench_roles_learning.py [--versions 31] [--window 5] [--batch-size 32]
                                                   [--learning-rate 2e-3] [--model DIR]
                                                   [--smoke] [--json PATH]

Its smoke run is tested in tests/unit/bench/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench_learning import rewards_by_version
from results import Figure, parse_args, write_result

from rollstream.cli.examples import EXAMPLES, example_settings
from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.events import PolicyUpdated, PromptIssued, RewardAssigned
from rollstream.shared.runtime.config import Settings

PLANNER, SOLVER = "planner", "solver"
RUNS = ("both", "control")
RUN_TIMEOUT_S = 1800

Rewards = dict[int, list[float]]
"""Policy version at admission -> the rewards of the rollouts admitted at it."""


def planner_rewards_by_version(local: LocalRun) -> Rewards:
    """The planner's own reward of each rollout, by the policy version at which the rollout was admitted; a
    reward event without one is an error (the reward service scores every rollout's planner)."""
    prompts = read_history(local.bus, "prompts", local.settings.storage_uri)
    admitted_at = {d.envelope.rollout_id: d.event.policy_version for d in prompts
                   if isinstance(d.event, PromptIssued)}
    out: Rewards = {}
    for delivery in read_history(local.bus, "rewards", local.settings.storage_uri):
        if not isinstance(delivery.event, RewardAssigned):
            continue
        if PLANNER not in delivery.event.role_rewards:
            raise RuntimeError(f"rollout {delivery.envelope.rollout_id} was scored without a {PLANNER} "
                               f"reward: role_rewards {delivery.event.role_rewards}")
        out.setdefault(admitted_at[delivery.envelope.rollout_id], []).append(
            delivery.event.role_rewards[PLANNER])
    return out


def final_role_versions(local: LocalRun) -> dict[str, int]:
    """Each trained role's version after the run's last update."""
    updates = [d.event for d in read_history(local.bus, "policy", local.settings.storage_uri)
               if isinstance(d.event, PolicyUpdated)]
    return dict(updates[-1].role_versions) if updates else {}


def relay_settings(label: str, args: argparse.Namespace, storage: Path) -> Settings:
    """The relay example's settings for this run: its roles (the planner frozen in the control), LoRA and
    reward functions, with the bench's versions, batch and learning rate."""
    base = Settings()
    example = example_settings("relay", f"bench-roles-{label}-{uuid.uuid4().hex[:6]}",
                               storage_uri=str(storage), redis_url=base.redis_url,
                               redis_username=base.redis_username, redis_password=base.redis_password,
                               model={**base.model.model_dump(), "path": args.model})
    train = {**example.train.model_dump(), "total_versions": args.versions, "trackers": [],
             "batch_size": args.batch_size, "learning_rate": args.learning_rate}
    roles = example.roles.model_dump()
    if label == "control":
        roles["names"][PLANNER]["trained"] = False
    # built again rather than copied: the roles and LoRA settings are validated together
    return Settings(**{**dict(example), "train": train, "roles": roles})


def run(label: str, args: argparse.Namespace, storage: Path) -> tuple[dict[str, Rewards], dict[str, int]]:
    """One local run to args.versions: each role's rewards by version, and the roles' final versions."""
    settings = relay_settings(label, args, storage)
    local = LocalRun(settings)
    started = time.monotonic()
    try:
        local.start(on_step=lambda message: print(f"[{label}] {message}", flush=True))
        local.wait_for_version(args.versions, timeout_s=RUN_TIMEOUT_S)
        # read before stop(): an embedded Redis goes with it
        rewards = {PLANNER: planner_rewards_by_version(local), SOLVER: rewards_by_version(local)}
        versions = final_role_versions(local)
        if settings.redis_url:
            local.bus.delete_run()
    finally:
        local.stop()
    print(f"[{label}] {args.versions} versions in {time.monotonic() - started:.0f} s; the roles' versions at "
          f"the end: {versions}", flush=True)
    return rewards, versions


def check_control(versions: dict[str, dict[str, int]]) -> None:
    """The comparison means something only if the control's planner never trained and the rest did."""
    if versions["control"].get(PLANNER, 0) != 0:
        raise RuntimeError(f"the control's planner was trained (its version {versions['control'][PLANNER]}): "
                           "it is not a control")
    should_train = (("both", PLANNER), ("both", SOLVER), ("control", SOLVER))
    untrained = [f"{label} {role}" for label, role in should_train if versions[label].get(role, 0) == 0]
    if untrained:
        raise RuntimeError(f"roles that should have trained did not: {', '.join(untrained)} ({versions})")


def window_mean(rewards: Rewards, first: int, window: int) -> float:
    values = [r for version in range(first, first + window) for r in rewards.get(version, [])]
    return statistics.fmean(values) if values else float("nan")


def last_window_start(rewards: dict[str, dict[str, Rewards]], window: int) -> int:
    """The first version of the last window: the window ending at the last version any rollout was admitted
    at (a run of V versions admits its last rollouts at V - 2: the trainer's last version trains them)."""
    admitted = max(max(by_version) for runs in rewards.values() for by_version in runs.values())
    return max(admitted - window + 1, 0)


def print_windows(rewards: dict[str, dict[str, Rewards]], window: int, last: int) -> None:
    series = [(label, role) for role in (PLANNER, SOLVER) for label in RUNS]
    print(f"\nmean reward of the rollouts admitted at each policy version, windows of {window} versions")
    print(f"{'versions':>10} " + " ".join(f"{f'{role} {label}':>16}" for label, role in series))
    for first in [*range(0, last, window), last]:
        means = [window_mean(rewards[label][role], first, window) for label, role in series]
        print(f"{first:>4}-{first + window - 1:<5} " + " ".join(f"{mean:>16.3f}" for mean in means))


def summary_lines(rewards: dict[str, dict[str, Rewards]], window: int, last: int) -> list[str]:
    """Per role and run: first window, last window, rise; and per role, "both" against the control in each
    window (in the first, both runs sample the same starting policies: the difference there is noise)."""
    lines = [f"{'role':<8} {'run':<8} {'first':>7} {'last':>7} {'rise':>7}"]
    for role in (PLANNER, SOLVER):
        for label in RUNS:
            first_mean = window_mean(rewards[label][role], 0, window)
            last_mean = window_mean(rewards[label][role], last, window)
            lines.append(f"{role:<8} {label:<8} {first_mean:>7.3f} {last_mean:>7.3f} "
                         f"{last_mean - first_mean:>+7.3f}")
    for role in (PLANNER, SOLVER):
        first, final = ([window_mean(rewards[label][role], start, window) for label in RUNS]
                        for start in (0, last))
        lines.append(f"{role}: both - control {first[0] - first[1]:+.3f} in the first window (the same "
                     f"starting policies), {final[0] - final[1]:+.3f} in the last")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=31)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=Settings().train.batch_size)
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="the adapters' learning rate (default: the relay example's)")
    parser.add_argument("--model", type=Path, default=Settings().model.path, help="the starting model")
    # 3 versions: rollouts are admitted at versions 0 and 1, a first window and a last
    args = parse_args(parser, smoke={"versions": 3, "window": 1, "batch_size": 8})
    if not (args.model / "config.json").exists():
        sys.exit(f"no model at {args.model}: run `make setup` (it builds the warm-started tiny model)")
    if not 0 < args.window < args.versions:
        sys.exit(f"--window {args.window} must be at least 1 and below --versions ({args.versions})")
    example_train = EXAMPLES["relay"]().settings["train"]
    args.lora_rank = example_train["lora_rank"]
    if args.learning_rate is None:
        args.learning_rate = example_train["learning_rate"]
    rewards, versions = {}, {}
    with tempfile.TemporaryDirectory(prefix="rs-bench-roles-") as tmp:
        for label in RUNS:
            rewards[label], versions[label] = run(label, args, Path(tmp))
    check_control(versions)
    last = last_window_start(rewards, args.window)
    print_windows(rewards, args.window, last)
    summary = summary_lines(rewards, args.window, last)
    print("\nlast window against the first, per role and run\n" + "\n".join(summary))
    report(rewards, summary, args, last)


def report(rewards: dict[str, dict[str, Rewards]], summary: list[str], args: argparse.Namespace,
           last: int) -> None:
    window = f"versions {last}-{last + args.window - 1}"
    planner, solver = ([window_mean(rewards[label][role], last, args.window) for label in RUNS]
                       for role in (PLANNER, SOLVER))
    print(f"\nthe planner at {window}: both trained {planner[0]:.3f}, control (frozen) {planner[1]:.3f}, "
          f"difference {planner[0] - planner[1]:+.3f}")
    write_result(args.json, [
        Figure(f"planner trained: its mean reward at {window}", planner[0],
               "control (planner frozen), same versions", planner[1], "reward"),
        Figure(f"solver beside a trained planner: team's mean reward at {window}", solver[0],
               "control (solver beside the frozen planner), same versions", solver[1], "reward"),
    ], [f"relay on {args.model}, batch {args.batch_size} (groups of "
        f"{Settings().data.samples_per_prompt}), {args.versions} versions, LoRA rank {args.lora_rank}, "
        f"learning rate {args.learning_rate}; per role and run, the mean reward in the first window of "
        f"{args.window} versions and the last:\n" + "\n".join(summary)])


if __name__ == "__main__":
    main()
