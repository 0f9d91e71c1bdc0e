"""The policy-gradient step: PPO-clip with the importance ratio against the rollout logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.batches import BatchRow


@dataclass
class Batch:
    tokens: torch.Tensor          # [B, T] long
    attention_mask: torch.Tensor  # [B, T] 0/1
    loss_mask: torch.Tensor       # [B, T] float, 1 on sampled tokens
    old_logprobs: torch.Tensor    # [B, T] float, the engine's logprob of each sampled token
    advantages: torch.Tensor      # [B] float
    rollout_index: torch.Tensor   # [B] long: which rollout each row (segment) belongs to


def collate(rows: list[BatchRow], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    length = max(len(r.tokens) for r in rows)

    def padded(values: list, fill, dtype) -> torch.Tensor:
        return torch.tensor([list(v) + [fill] * (length - len(v)) for v in values], dtype=dtype, device=device)

    return Batch(
        tokens=padded([r.tokens for r in rows], pad_id, torch.long),
        attention_mask=padded([[1] * len(r.tokens) for r in rows], 0, torch.long),
        loss_mask=padded([r.loss_mask for r in rows], 0, torch.float32),
        old_logprobs=padded([r.rollout_logprobs for r in rows], 0.0, torch.float32),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        rollout_index=torch.tensor(_rollout_indices([r.rollout_id for r in rows]), dtype=torch.long, device=device),
    )


def _rollout_indices(rollout_ids: list[str]) -> list[int]:
    first_seen: dict[str, int] = {}
    return [first_seen.setdefault(rollout, len(first_seen)) for rollout in rollout_ids]


def token_weights(batch: Batch, aggregation: str) -> torch.Tensor:
    """Per-token weights of the loss, summing to 1 over the batch's sampled tokens.

    token: every sampled token weighs the same, however a rollout is split into segments.
    rollout: every rollout weighs the same (its tokens share 1 / rollouts), over all its segments.
    """
    mask = batch.loss_mask
    if aggregation == "token":
        return mask / mask.sum().clamp(min=1)
    if aggregation == "rollout":
        rollouts = int(batch.rollout_index.max().item()) + 1
        per_rollout = torch.zeros(rollouts, dtype=mask.dtype, device=mask.device)
        per_rollout.index_add_(0, batch.rollout_index, mask.sum(dim=1))
        row_tokens = per_rollout[batch.rollout_index].clamp(min=1)
        return mask / row_tokens[:, None] / rollouts
    raise ValueError(f"unknown loss aggregation {aggregation!r}: use 'token' or 'rollout'")


def token_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """logprob of each token given the ones before it; position 0 (no context) is 0."""
    logits = model(input_ids=tokens, attention_mask=attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def ppo_clip_loss(logprobs: torch.Tensor, batch: Batch, clip_eps: float,
                  aggregation: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip: -min(r A, clip(r) A) per sampled token, averaged with `token_weights`."""
    mask = batch.loss_mask
    ratio = torch.exp((logprobs - batch.old_logprobs) * mask)
    advantages = batch.advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * token_weights(batch, aggregation)).sum()
    with torch.no_grad():
        stats = {
            "loss": loss.item(),
            "ratio_mean": ((ratio * mask).sum() / tokens).item(),
            "clip_fraction": ((((ratio - 1).abs() > clip_eps).float() * mask).sum() / tokens).item(),
            "tokens": tokens.item(),
        }
    return loss, stats
