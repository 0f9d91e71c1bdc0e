"""A finished session's training samples, as the same events an agent-runner publishes for its episodes.

Every leaf of the session's turn tree (sessions.py) is one segment: the chain's tokens from the
conversation's root, loss_mask 1 exactly on the ids vLLM sampled, their logprobs, the policy version of each
turn, its turns' role (a session's conversations may be of several roles: sessions.py), and in its metadata
`history_rewritten_turns`: the turns whose prompt continued recorded ids the chat template renders
differently (prompts.py). The segments share the session's rollout id, so the reward service
gives them one reward and one advantage (the fan-out rule). Then TrajectoryFinished, with the grader, label
and artifacts the session was created or finished with; a grader or a check sends the rollout to the
sandbox-grader as usual. The events are published as every rollout's are (shared/contract/rollouts.py).

    python -m pytest tests/unit/services/gateway/test_samples.py -q
"""

from __future__ import annotations

from rollstream.services.gateway.sessions import Session, TurnNode
from rollstream.shared.contract.bus import ENVELOPE_IDS, Bus
from rollstream.shared.contract.rollouts import RolloutFinish, Segment, publish_rollout


def segment_of(chain: list[TurnNode], index: int, status: str, role: str | None = None) -> Segment:
    """The conversation from a root to a leaf as segment `index` of the session's rollout, of its turns' role
    (`role`, the session's, for turns recorded before roles)."""
    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    turns = []
    for number, node in enumerate(chain):
        tokens += node.appended_ids
        loss_mask += [0] * len(node.appended_ids)
        logprobs += [0.0] * len(node.appended_ids)
        turns.append(node.as_turn(number, index, offset=len(tokens)))
        tokens += node.response_ids
        loss_mask += [1] * len(node.response_ids)
        logprobs += node.logprobs
    rewritten = [number for number, node in enumerate(chain) if node.history_rewritten]
    return Segment(tokens=tokens, prompt_length=len(chain[0].appended_ids), loss_mask=loss_mask,
                   rollout_logprobs=logprobs, turn_policy_versions=[node.policy_version for node in chain],
                   status=status, response_text=chain[-1].response_text, turns=turns,
                   metadata={"history_rewritten_turns": rewritten} if rewritten else {},
                   role=chain[-1].role or role)


def publish_samples(bus: Bus, pipe, session: Session, samples: list[list[TurnNode]], *, status: str,
                    reward: float | None, response_text: str | None, artifacts: dict[str, str],
                    error: str | None) -> None:
    """Queue the session's rollout on `pipe`: a segment per chain of `samples`, each completed but the last,
    which ends with the session's `status`."""
    spec = session.spec
    segments = [segment_of(chain, index, status if index == len(samples) - 1 else "completed", spec.role)
                for index, chain in enumerate(samples)]
    metadata = {**spec.metadata, "gateway_session": spec.session_id, "conversations": len(samples)}
    if spec.sampling.get("seed") is not None:
        metadata["sampling_seed"] = spec.sampling["seed"]
    final_text = response_text if response_text is not None else segments[-1].response_text
    finish = RolloutFinish(status=status, response_text=final_text, reward=reward, artifacts=artifacts,
                           error=error)
    first_server = samples[0][0].server_url if samples and samples[0] else None
    publish_rollout(bus, pipe, {name: getattr(spec, name) for name in ENVELOPE_IDS}, spec, segments, finish,
                    metadata=metadata, server_url=first_server or None)
