"""A finished session's training samples, as the same events an agent-runner publishes for its episodes.

Every leaf of the session's turn tree (sessions.py) is one TrajectorySegment: the chain's tokens from
the conversation's root, loss_mask 1 exactly on the ids vLLM sampled, their logprobs, the policy version of
each turn, and in its metadata `history_rewritten_turns`: the turns whose prompt continued recorded ids the chat
template renders differently (prompts.py). The segments share the session's rollout id, so the reward service gives them one reward and one
advantage (the fan-out rule). Then TrajectoryFinished, with the grader, label and artifacts the session was
created or finished with; a grader or a check sends the rollout to the sandbox-grader as usual.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from rollstream.services.gateway.sessions import Session, TurnNode
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import (
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTurn,
)


def segment_of(chain: list[TurnNode]) -> dict[str, Any]:
    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for node in chain:
        tokens += node.appended_ids
        loss_mask += [0] * len(node.appended_ids)
        logprobs += [0.0] * len(node.appended_ids)
        tokens += node.response_ids
        loss_mask += [1] * len(node.response_ids)
        logprobs += node.logprobs
    prompt_length = len(chain[0].appended_ids)
    return {"tokens": tokens, "loss_mask": loss_mask, "rollout_logprobs": logprobs,
            "response_length": len(tokens) - prompt_length,
            "turn_policy_versions": [n.policy_version for n in chain]}


def publish_samples(bus: Bus, pipe, session: Session, samples: list[list[TurnNode]], *, status: str,
                    reward: float | None, response_text: str | None, artifacts: dict[str, str],
                    error: str | None) -> None:
    spec = session.spec
    ids = {"trajectory_id": spec.trajectory_id, "rollout_id": spec.rollout_id, "group_id": spec.group_id,
           "session_id": spec.session_id}
    rollout, attempt = spec.rollout_id, uuid.uuid4().hex[:12]
    publish = functools.partial(bus.publish, "trajectories", pipe=pipe, **ids)
    first_server = samples[0][0].server_url if samples and samples[0] else None
    publish(TrajectoryStarted(sample_index=spec.sample_index, server_url=first_server or None),
            event_id=f"{rollout}:{attempt}:started")
    metadata = {**spec.metadata, "gateway_session": spec.session_id, "conversations": len(samples)}
    if spec.sampling.get("seed") is not None:
        metadata["sampling_seed"] = spec.sampling["seed"]
    for index, chain in enumerate(samples):
        offset = 0
        for number, node in enumerate(chain):
            offset += len(node.appended_ids)
            publish(TrajectoryTurn(turn=number, segment_index=index, offset=offset, appended_ids=node.appended_ids,
                                   response_ids=node.response_ids, logprobs=node.logprobs,
                                   policy_version=node.policy_version, policy_version_end=node.policy_version_end,
                                   finish_reason=node.finish_reason, server_url=node.server_url),
                    event_id=f"{rollout}:{attempt}:turn:{index}:{number}")
            offset += len(node.response_ids)
        last = chain[-1]
        rewritten = [number for number, node in enumerate(chain) if node.history_rewritten]
        segment_metadata = {**metadata, "history_rewritten_turns": rewritten} if rewritten else metadata
        segment_status = status if index == len(samples) - 1 else "completed"
        publish(TrajectorySegment(segment_index=index, attempt=attempt, status=segment_status,
                                  response_text=last.response_text, sample_index=spec.sample_index,
                                  group_size=spec.group_size, metadata=segment_metadata, **segment_of(chain)),
                event_id=f"{rollout}:{attempt}:segment:{index}")
    final_text = response_text if response_text is not None else samples[-1][-1].response_text
    publish(TrajectoryFinished(status=status, attempt=attempt, segment_count=len(samples), group_size=spec.group_size,
                               sample_index=spec.sample_index, sandbox_check=spec.sandbox_check,
                               grader=dict(spec.grader), response_text=final_text, label=spec.label,
                               reward_fn=spec.reward_fn, reward=reward, artifacts=dict(artifacts), error=error),
            event_id=f"{rollout}:{attempt}:finished")
