"""A plug-in agent loop with heavy-tailed episode lengths, for the async-vs-sync benchmark.

    RS_AGENT__DEFAULT=heavy_tail_agent:heavy_tail_agent   PYTHONPATH=bench   (bench/bench_async.py sets both)

The number of model turns of an episode is drawn from a seeded distribution keyed on the sample's
index in the run (from its rollout id), so every run with the same seed and batch order does the same
work whatever its staleness: most episodes take about `median_turns` turns, a `tail_fraction` of them
`tail_min`..`tail_max` times that (log-uniform). Each turn samples exactly rollout.max_tokens tokens
(`ignore_eos`, with the tokenizer's added tokens banned through logit_bias so that no sampled token
breaks the chat template), then a user message asks for more. When the next turn would not fit in
agent.max_total_tokens the context is compacted: the segment is closed and a new one starts from the
prompt, so a long episode is one rollout of several segments. Turns are capped by agent.max_turns.

Sampled tokens go through `TokenTrajectory` exactly as the built-in tool agent's do. The final answer
is the label for a seeded `solved_fraction` of samples, so rewards differ within groups and the
trainer takes real steps.

Parameters come from the environment variable HEAVY_TAIL_AGENT, a JSON object, e.g.
    HEAVY_TAIL_AGENT='{"seed": 0, "median_turns": 2, "tail_fraction": 0.05, "tail_min": 10, "tail_max": 50}'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from rollstream.shared.agent.loop import (
    AgentContext,
    Segment,
    Task,
    TemplateError,
    TokenTrajectory,
)
from rollstream.shared.contract.events import TrajectoryTurn

ENV = "HEAVY_TAIL_AGENT"
OBSERVATION_RESERVE = 32
"""Tokens kept free for the next user message (about 22 with the tiny model's template)."""
BANNED_BIAS = -100


@dataclass(frozen=True)
class TailParams:
    seed: int = 0
    median_turns: int = 2
    tail_fraction: float = 0.05
    tail_min: float = 10.0
    tail_max: float = 50.0
    solved_fraction: float = 0.5

    @classmethod
    def from_env(cls) -> TailParams:
        raw = os.environ.get(ENV)
        return cls(**json.loads(raw)) if raw else cls()

    def to_env(self) -> str:
        return json.dumps(asdict(self))


def _rng(params: TailParams, sample_index: int, purpose: str) -> random.Random:
    digest = hashlib.blake2b(f"{params.seed}:{sample_index}:{purpose}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def episode_turns(sample_index: int, params: TailParams) -> int:
    """Model turns of the sample's episode; the same for every run with the same parameters."""
    rng = _rng(params, sample_index, "turns")
    if rng.random() < params.tail_fraction:
        factor = math.exp(rng.uniform(math.log(params.tail_min), math.log(params.tail_max)))
        return max(1, round(params.median_turns * factor))
    return max(1, round(params.median_turns * math.exp(rng.gauss(0.0, 0.35))))


def is_solved(sample_index: int, params: TailParams) -> bool:
    return _rng(params, sample_index, "solved").random() < params.solved_fraction


def sample_index_of(episode_id: str) -> int:
    """The dispatcher names rollouts `<run>-r<sample index>`; anything else hashes to a stable index."""
    match = re.search(r"-r(\d+)$", episode_id)
    if match:
        return int(match.group(1))
    return int.from_bytes(hashlib.blake2b(episode_id.encode(), digest_size=4).digest(), "big")


def banned_tokens(tokenizer) -> dict[str, float]:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = set(added) | set(getattr(tokenizer, "all_special_ids", []) or [])
    return {str(i): BANNED_BIAS for i in sorted(ids)}


async def heavy_tail_agent(task: Task, ctx: AgentContext) -> list[Segment]:
    params = TailParams.from_env()
    index = sample_index_of(ctx.episode.episode_id)
    drawn = episode_turns(index, params)
    turns_total = min(drawn, ctx.limits.max_turns)
    per_turn = ctx.limits.max_tokens_per_turn
    banned = banned_tokens(ctx.tokenizer)
    sampling: dict[str, Any] = {"ignore_eos": True, "logit_bias": banned, **ctx.sampling}

    segments: list[Segment] = []
    trajectory = TokenTrajectory(ctx.tokenizer, task.messages)
    turns: list[TrajectoryTurn] = []
    text, status, error = "", "completed", None
    try:
        for turn in range(turns_total):
            if turn and len(trajectory.tokens) + OBSERVATION_RESERVE + per_turn > ctx.limits.max_total_tokens:
                segments.append(trajectory.segment("completed", text, turns, [], {"compacted": True}))
                compacted = {"role": "user",
                             "content": f"(Earlier work was compacted; continue from step {turn + 1}.)"}
                trajectory = TokenTrajectory(ctx.tokenizer, [*task.messages, compacted])
                turns = []
            elif turn:
                trajectory.append_messages([{"role": "user", "content": f"Go on (step {turn + 1})."}])
            budget = ctx.limits.max_total_tokens - len(trajectory.tokens)
            if budget <= 0:
                status = "truncated"
                break
            before = await ctx.versions()
            completion = await ctx.fleet.complete(trajectory.tokens, session_id=ctx.session_id,
                                                  max_tokens=min(per_turn, budget),
                                                  temperature=ctx.temperature, extra=sampling)
            after = await ctx.versions()
            appended, offset = trajectory.pending_ids, len(trajectory.tokens)
            text = trajectory.append_sampled(completion.token_ids, completion.logprobs)
            version = before.get(completion.server_url, 0)
            turns.append(TrajectoryTurn(turn=len(turns), segment_index=len(segments), offset=offset,
                                        appended_ids=appended, response_ids=list(completion.token_ids),
                                        logprobs=list(completion.logprobs), policy_version=version,
                                        policy_version_end=after.get(completion.server_url, version),
                                        finish_reason=completion.finish_reason,
                                        server_url=completion.server_url))
    except TemplateError as exc:
        status, error = "failed", str(exc)
    answer = task.label if task.label is not None and is_solved(index, params) else text
    metadata: dict[str, Any] = {"sample_index": index, "turns_drawn": drawn, "segments": len(segments) + 1,
                                "turns": sum(len(s.turns) for s in segments) + len(turns)}
    if error:
        metadata["error"] = error
    segments.append(trajectory.segment(status, answer, turns, [], metadata))
    return segments
