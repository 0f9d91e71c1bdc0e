"""Episodes/s and generated tokens/s through one agent-runner replica, next to the same vLLM server
called directly at the same concurrency, in the same run.

The direct baseline sends the same single-turn requests with the fleet client and nothing else,
from a process of its own. The agent-runner path adds everything an episode costs: consuming the
prompt from Redis, the chat template, the agent loop, publishing the trajectory events,
acknowledging. vLLM on the CPU speeds up over its first requests and drifts, so two untimed passes
come first and the two paths then alternate for a few rounds; medians are compared.

    python bench/bench_agent_runner.py [--episodes 256] [--concurrency 32] [--max-tokens 64] [--rounds 3]
                                       [--warmup-passes 2] [--smoke] [--json PATH]
                                       [--fleet-url http://127.0.0.1:8000]   # else starts vLLM (CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from results import Figure, parse_args, write_result

from rollstream.cli.embedded_redis import EmbeddedRedis
from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PromptIssued, TrajectoryFinished, TrajectoryTurn, decode
from rollstream.shared.inference.fleet import FleetClient

QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


async def direct(url: str, prompt_ids: list[int], episodes: int, concurrency: int,
                 max_tokens: int) -> tuple[float, int]:
    fleet = FleetClient([url])
    limit = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(index: int) -> None:
        nonlocal tokens
        async with limit:
            completion = await fleet.complete(prompt_ids, max_tokens=max_tokens, session_id=f"direct-{index}")
            tokens += len(completion.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    elapsed = time.perf_counter() - start
    await fleet.aclose()
    return elapsed, tokens


def direct_in_subprocess(url: str, model: Path, episodes: int, concurrency: int,
                         max_tokens: int) -> tuple[float, int]:
    """The direct client in a process of its own, like the agent-runner: the comparison is symmetric."""
    out = subprocess.run([sys.executable, __file__, "--direct-only", url, "--model", str(model),
                          "--episodes", str(episodes), "--concurrency", str(concurrency),
                          "--max-tokens", str(max_tokens)], check=True, capture_output=True, text=True).stdout
    seconds, tokens = out.split()[-2:]
    return float(seconds), int(tokens)


def through_agent_runner(url: str, model: Path, episodes: int, concurrency: int, max_tokens: int,
                         workdir: Path) -> tuple[float, int]:
    redis_server = EmbeddedRedis(workdir / "redis")
    redis_server.start()
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    health = free_port()
    env = {**os.environ, "RS_REDIS_URL": redis_server.url, "RS_RUN_ID": run_id,
           "RS_FLEET__URLS": f'["{url}"]', "RS_MODEL__PATH": str(model),
           "RS_ROLLOUT__CONCURRENCY": str(concurrency), "RS_ROLLOUT__MAX_TOKENS": str(max_tokens),
           "RS_AGENT__MAX_TURNS": "1", "RS_STORAGE_URI": str(workdir / "runs"), "RS_HEALTH_PORT": str(health),
           "RS_LOG_LEVEL": "WARNING"}
    runner = subprocess.Popen([str(Path(sys.executable).with_name("rollstream-agent-runner"))], env=env,
                              stdout=open(workdir / "agent-runner.log", "ab"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if runner.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent-runner did not come up; see {workdir / 'agent-runner.log'}")
            time.sleep(0.2)
        bus = Bus.connect(redis_server.url, run_id)
        pipe = bus.redis.pipeline(transaction=False)
        start = time.perf_counter()
        for index in range(episodes):
            rollout = f"{run_id}-r{index}"
            prompt = PromptIssued(sample_index=index, group_size=1, messages=QUESTION, label="42",
                                  policy_version=0)
            bus.publish("prompts", prompt, pipe=pipe, rollout_id=rollout, trajectory_id=rollout,
                        session_id=rollout, group_id=f"{run_id}-g{index}")
        pipe.execute()
        finished, tokens, cursor = 0, 0, "0-0"
        key = bus.keys.stream("trajectories")
        while finished < episodes:
            for _, entries in bus.redis.xread({key: cursor}, count=1000, block=1000) or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    kind = fields[b"type"].decode()
                    if kind == TrajectoryFinished.TYPE:
                        finished += 1
                    elif kind == TrajectoryTurn.TYPE:
                        tokens += len(decode(fields).payload.response_ids)
            if runner.poll() is not None:
                raise RuntimeError(f"agent-runner died; see {workdir / 'agent-runner.log'}")
        return time.perf_counter() - start, tokens
    finally:
        runner.terminate()
        runner.wait(timeout=60)
        redis_server.stop()


def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, int]]]:
    """Both paths, round after round, against the --fleet-url server or a vLLM started here: per path, the
    (seconds, sampled tokens) of each round."""
    if not args.model.exists():
        from rollstream.cli.model.tiny_model import build_tiny_model

        build_tiny_model(args.model)
    with tempfile.TemporaryDirectory(prefix="rs-bench-") as tmp:
        workdir = Path(tmp)
        server = None
        url = args.fleet_url
        if url is None:
            server = VllmServer(args.model, free_port(), log_path=workdir / "vllm.log").start()
            server.wait_healthy()
            url = server.url
        try:
            # vLLM on the CPU gets much faster over its first few hundred requests (kernels for new
            # batch shapes): a full untimed pass first, so neither path pays for that.
            shape = (args.episodes, args.concurrency, args.max_tokens)
            for _ in range(args.warmup_passes):
                direct_in_subprocess(url, args.model, *shape)
            runs: dict[str, list[tuple[float, int]]] = {"direct": [], "agent-runner": []}
            for _ in range(args.rounds):  # interleaved, so drift of the server's speed hits both alike
                runs["direct"].append(direct_in_subprocess(url, args.model, *shape))
                runs["agent-runner"].append(through_agent_runner(url, args.model, *shape, workdir))
        finally:
            if server is not None:
                server.stop()
    return runs


def report(args: argparse.Namespace, runs: dict[str, list[tuple[float, int]]]) -> None:
    """The table of both paths' medians, the ratio, and the figures (--json)."""
    print(f"{args.episodes} single-turn episodes, concurrency {args.concurrency}, up to {args.max_tokens} "
          f"tokens each, {args.rounds} interleaved rounds (medians)")
    print(f"{'path':<14}{'seconds':>10}{'episodes/s':>12}{'tokens/s':>12}   per round (s)")
    medians = {}
    for name, results in runs.items():
        seconds = statistics.median(r[0] for r in results)
        tokens_per_s = statistics.median(r[1] / r[0] for r in results)
        medians[name] = (args.episodes / seconds, tokens_per_s)
        rounds = " ".join(f"{r[0]:.1f}" for r in results)
        print(f"{name:<14}{seconds:>10.2f}{args.episodes / seconds:>12.1f}{tokens_per_s:>12.0f}   {rounds}")
    (d_eps, d_tps), (a_eps, a_tps) = medians["direct"], medians["agent-runner"]
    print(f"agent-runner / direct: episodes/s {a_eps / d_eps:.2f}, tokens/s {a_tps / d_tps:.2f}")
    write_result(args.json, [
        Figure("agent-runner: episodes", a_eps, "vLLM called directly", d_eps, "episodes/s"),
        Figure("agent-runner: sampled tokens", a_tps, "vLLM called directly", d_tps, "tokens/s")],
        [(f"{args.episodes} single-turn episodes, concurrency {args.concurrency}, up to {args.max_tokens} "
          f"tokens each; medians of {args.rounds} interleaved rounds after {args.warmup_passes} untimed "
          f"pass{'' if args.warmup_passes == 1 else 'es'}")])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--fleet-url", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-passes", type=int, default=2, help="untimed passes of the direct client")
    parser.add_argument("--direct-only", metavar="URL", help=argparse.SUPPRESS)
    args = parse_args(parser, smoke={"episodes": 8, "concurrency": 4, "max_tokens": 8, "rounds": 1,
                                     "warmup_passes": 0})
    if args.direct_only:  # one round of the direct path, in the process direct_in_subprocess started
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompt_ids = list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        seconds, tokens = asyncio.run(direct(args.direct_only, prompt_ids, args.episodes, args.concurrency,
                                             args.max_tokens))
        print(seconds, tokens)
        return
    report(args, measure(args))


if __name__ == "__main__":
    main()
