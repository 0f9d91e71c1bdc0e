"""The report of bench/bench_async.py: the workload and the fleet described, a table of every run, the
headline (samples trained per minute, each async mode against the synchronous mode of its fleet, medians
over the repeated runs with each run beside them), and the figures it writes with --json.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

# run as a script, so bench/ is first on sys.path
from async_modes import Result
from heavy_tail_agent import TailParams, episode_turns
from results import Figure, write_result
from sim_trainer import profile_from


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
