"""The reward service's CPU time per arriving trajectory segment as its prompt groups grow: groups of 2 to 32
rollouts, each its 512-token segments (one, or --segments) and its TrajectoryFinished, published onto
`trajectories` of a real Redis and handled by a real reward service (`rollstream-reward`, started by the
local run), which records each event in its group, scores the complete groups and writes their batches.

A group size's figure is the service's CPU time (the scheduler's count, /proc/<pid>/schedstat) spent while
it handled that size's entries, over the segments among them: what one more segment costs the service,
its rollout's TrajectoryFinished included. Its baselines, measured in the same run: the same figure for groups
of 2 (a cost that does not grow with the group reads 1.0 at every size) and decode() of one segment's
stream entry in this process, as redis-py hands it back (what a delivery costs at the least). The sizes
run in turns, --repeats times, in one service; a figure is the median of its runs.

    python bench/bench_reward_book.py [--redis redis://127.0.0.1:6379/0] [--sizes 2 4 8 16 32]
        [--rollouts 256] [--segments 1] [--tokens 512] [--repeats 3] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from results import Figure, median, parse_args, write_result

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import TrajectoryFinished, TrajectorySegment, decode, encode_event
from rollstream.shared.runtime.config import Settings

DRAIN_TIMEOUT_S = 600
DRAIN_POLL_S = 0.02


def segment(tokens: int, sample_index: int, group_size: int, index: int = 0) -> TrajectorySegment:
    """A rollout's segment: `tokens` ids, the second half sampled, as an agent-runner publishes it."""
    prompt = tokens // 2
    return TrajectorySegment(
        segment_index=index, attempt="a1", tokens=[(i * 7919) % 151_000 for i in range(tokens)],
        response_length=tokens - prompt, loss_mask=[0] * prompt + [1] * (tokens - prompt),
        rollout_logprobs=[0.0] * prompt + [-0.123456 * (i % 17) for i in range(tokens - prompt)],
        turn_policy_versions=[0], status="completed", response_text="7", sample_index=sample_index,
        group_size=group_size)


def publish_groups(bus: Bus, phase: str, size: int, rollouts: int, segments: int, tokens: int) -> int:
    """`rollouts` rollouts in groups of `size`, each its segments and then its TrajectoryFinished (half of
    each group answers right: a reward to learn from), in one pipeline; returns the segments published."""
    pipe = bus.redis.pipeline(transaction=False)
    for group_index in range(rollouts // size):
        group = f"{phase}-g{group_index}"
        for member in range(size):
            rollout, sample_index = f"{group}-r{member}", group_index * size + member
            ids = {"rollout_id": rollout, "group_id": group, "trajectory_id": rollout, "session_id": rollout}
            for index in range(segments):
                bus.publish("trajectories", segment(tokens, sample_index, size, index), pipe=pipe, **ids)
            finished = TrajectoryFinished(status="completed", attempt="a1", segment_count=segments,
                                          group_size=size, sample_index=sample_index,
                                          response_text=str(member % 2 * 7), label="7")
            bus.publish("trajectories", finished, pipe=pipe, **ids)
    pipe.execute()
    return rollouts // size * size * segments


def cpu_seconds(pid: int) -> float:
    """The process's time on a CPU so far, from the scheduler's own count (nanoseconds; the user and system
    times of /proc/<pid>/stat count in clock ticks of 10 ms, coarser than a few segments' work)."""
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[0]) / 1e9


def wait_handled(local: LocalRun) -> None:
    """Until the reward service has handled (acknowledged) every entry published so far."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while local.backlog():
        local.check_alive(restart=False)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the reward service did not handle its entries in {DRAIN_TIMEOUT_S} s: "
                               f"{local.backlog()}")
        time.sleep(DRAIN_POLL_S)


def service_us_per_segment(local: LocalRun, phase: str, size: int, args: argparse.Namespace,
                           rollouts: int | None = None) -> float:
    service = local.processes["reward"].pid
    before = cpu_seconds(service)
    segments = publish_groups(local.bus, phase, size, rollouts or args.rollouts, args.segments, args.tokens)
    wait_handled(local)
    return (cpu_seconds(service) - before) / segments * 1e6


def decode_us(tokens: int, repeat: int) -> tuple[float, float]:
    """decode() of one segment's stream entry, in µs: as redis-py hands it back (bytes keys), and with str
    keys (an entry rebuilt by hand), which misses the fast path."""
    fields = encode_event(segment(tokens, 0, 2), run_id="bench", rollout_id="r", group_id="g")
    as_read = {key.encode(): value if isinstance(value, bytes) else value.encode()
               for key, value in fields.items()}
    out = []
    for entry in (as_read, fields):
        started = time.perf_counter()
        for _ in range(repeat):
            decode(entry)
        out.append((time.perf_counter() - started) / repeat * 1e6)
    return out[0], out[1]


def measure(args: argparse.Namespace, root: Path) -> dict[int, list[float]]:
    """Each group size's runs, the sizes in turns, on one reward service."""
    run_id = f"bench-reward-{uuid.uuid4().hex[:8]}"
    settings = Settings(run_id=run_id, redis_url=args.redis, storage_uri=str(root / "runs"),
                        data={"samples_per_prompt": 2}, train={"batch_size": args.batch_size},
                        recorder={"enabled": False})
    local = LocalRun(settings, services=("reward",))
    runs: dict[int, list[float]] = {size: [] for size in args.sizes}
    try:
        local.start()
        # a first pass that is not counted: the service's code paths warm, its connections open
        service_us_per_segment(local, "warm", args.sizes[0], args, rollouts=args.batch_size)
        for repeat in range(args.repeats):
            for size in args.sizes:
                runs[size].append(service_us_per_segment(local, f"p{repeat}-{size}", size, args))
            print("  ".join(f"groups of {size}: {runs[size][-1]:.0f} us" for size in args.sizes), flush=True)
    finally:
        local.stop()
        if local.bus is not None:
            local.bus.delete_run()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="group sizes")
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts per size and run")
    parser.add_argument("--segments", type=int, default=1, help="segments per rollout")
    parser.add_argument("--batch-size", type=int, default=64, help="the service's train.batch_size")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per segment")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each size; figures are their medians")
    parser.add_argument("--decode-repeat", type=int, default=2000)
    args = parse_args(parser, smoke={"sizes": [2, 4], "rollouts": 16, "batch_size": 8, "repeats": 2,
                                     "decode_repeat": 20})
    bad = [size for size in args.sizes if args.rollouts % size or args.batch_size % size]
    if bad:
        parser.error(f"--rollouts ({args.rollouts}) and --batch-size ({args.batch_size}) must be multiples "
                     f"of every group size; not of {bad}")
    print(f"{args.rollouts} rollouts of {args.segments} {args.tokens}-token segments per size and run, "
          f"{args.repeats} runs, {args.redis}")
    with tempfile.TemporaryDirectory(prefix="bench-reward-") as root:
        runs = measure(args, Path(root))
    fast, slow = decode_us(args.tokens, args.decode_repeat)
    decoded = f"decode() of one {args.tokens}-token segment's stream entry"
    smallest = args.sizes[0]
    figures = []
    for size in args.sizes:
        what = f"reward service: CPU per arriving {args.tokens}-token segment, groups of {size}"
        if size != smallest:
            figures.append(Figure.repeated(what, runs[size], f"the same, groups of {smallest}",
                                           runs[smallest], "us"))
        figures.append(Figure(what, median(runs[size]), decoded, fast, "us", tuple(runs[size])))
    for figure in figures:
        print(f"{figure.what} against {figure.baseline_what}: {figure.value:.1f} / {figure.baseline:.1f} us "
              f"= {figure.ratio:.2f}")
    notes = [f"{args.rollouts} rollouts of {args.segments} segments per size and run, median of "
             f"{args.repeats} runs; batch size {args.batch_size}",
             f"{decoded}: {fast:.1f} us as redis-py hands it back, {slow:.1f} us with str keys "
             "(no fast path)"]
    print(notes[-1])
    write_result(args.json, figures, notes)


if __name__ == "__main__":
    main()
