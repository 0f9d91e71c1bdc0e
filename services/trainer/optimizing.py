"""The optimizer steps the trainer takes on a batch (services/trainer/training.py): train.minibatches steps
over one role's rows (services/trainer/ppo.py) on the backend, each rank its share of every minibatch's
micro-batches (services/trainer/ranks.py), with the logprobs that must come before the batch's first update
(the proximal ones of decoupled PPO, the reference's of a KL term) computed first. The trainer's logprobs of
each segment before that update are kept for the console (services/trainer/segment_logprobs.py).

Tests: tests/unit/services/trainer/test_lora_trainer.py; tests/integration/test_trainer_restart.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollstream.services.trainer.ppo import (
    MicroBatch,
    make_micro_batches,
    merge_stats,
    policy_loss,
    split_minibatches,
    token_logprobs,
)
from rollstream.services.trainer.ranks import Ranks
from rollstream.services.trainer.segment_logprobs import SegmentLogprobs, keep_logprobs
from rollstream.shared.contract.batches import BatchRow
from rollstream.shared.runtime.config import TrainSettings

ReferenceLogprobs = Callable[[MicroBatch], torch.Tensor]
"""The reference model's logprobs of a micro-batch (a KL term's)."""


def optimizer_steps(backend, cfg: TrainSettings, ranks: Ranks, pad_id: int, rows: list[BatchRow],
                    reference: ReferenceLogprobs | None,
                    logprobs_before: SegmentLogprobs | None = None) -> list[dict[str, float]]:
    """train.minibatches optimizer steps over the rows with the backend's model as it is (a LoRA backend's
    active role); returns each step's stats on the leader (none on the other ranks). logprobs_before, on the
    leader: filled with the trainer's logprobs of each segment (rollout id, segment index) before the first
    update, where it computes them anyway (every minibatch with decoupled PPO, else the first)."""
    # each rank runs its share of every minibatch's micro-batches; only the real ones count in the stats
    parts = split_minibatches(rows, cfg.minibatches)
    plan = [ranks.own_share(make_micro_batches(part, cfg.loss_aggregation, cfg.micro_batch_tokens, pad_id,
                                               backend.device))
            for part in parts]
    before: SegmentLogprobs = {}
    score_before_update(backend.model, cfg, plan, parts, before, reference)
    per_step: list[dict[str, float]] = []
    for index, (micros, real) in enumerate(plan):
        stats = []
        for micro in micros:
            logprobs = token_logprobs(backend.model, micro)
            if index == 0:
                keep_logprobs(before, parts[0], micro, logprobs.detach())
            if cfg.decoupled and micro.prox_logprobs is None:
                micro.prox_logprobs = logprobs.detach()
            loss, micro_stats = policy_loss(logprobs, micro, clip_eps=cfg.clip_eps, decoupled=cfg.decoupled,
                                            importance_weight_cap=cfg.importance_weight_cap,
                                            kl_coef=cfg.kl_coef)
            backend.backward(loss)
            stats.append(micro_stats)
        every_rank = [s for rank_stats in ranks.gather(stats[:real]) for s in rank_stats]
        grad_norm = backend.step()
        if ranks.leader:
            per_step.append({**merge_stats(every_rank), "grad_norm": grad_norm,
                             "micro_batches": len(every_rank)})
    for rank_before in ranks.gather(before):
        if logprobs_before is not None:
            logprobs_before.update(rank_before)
    return per_step


def score_before_update(model, cfg: TrainSettings, plan: list[tuple[list, int]], parts: list[list[BatchRow]],
                        before: SegmentLogprobs, reference: ReferenceLogprobs | None) -> None:
    """Set, on each micro-batch of the plan, the logprobs its loss compares with that must come before
    the batch's first update: the proximal ones (decoupled PPO, kept in `before`) and the reference
    model's (with a KL term)."""
    with torch.no_grad():  # every minibatch is clipped against the policy before the first update
        for index, (micros, _) in enumerate(plan):
            for micro in micros:
                # the first minibatch's own forward runs before any update: its detached logprobs are it
                if cfg.decoupled and index > 0:
                    micro.prox_logprobs = token_logprobs(model, micro)
                    keep_logprobs(before, parts[index], micro, micro.prox_logprobs)
                if reference is not None:
                    micro.ref_logprobs = reference(micro)


def mean_stats(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """The steps' stats averaged, each under `prefix` (the step's loss weight left out)."""
    if not steps:
        return {}
    return {f"{prefix}{key}": sum(step[key] for step in steps) / len(steps) for key in steps[0]
            if key != "weight"}
