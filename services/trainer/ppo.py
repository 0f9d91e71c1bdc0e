"""The policy-gradient loss (AReaL's decoupled PPO) and the packed micro-batches it is computed on.

Three policies meet in one update:
    behaviour  the policy vLLM sampled with: BatchRow.rollout_logprobs, possibly several versions old
    proximal   the trainer's policy before the batch's first optimizer step (prox_logprobs, no grad)
    current    the policy being optimised (the logprobs passed to `policy_loss`)

Per sampled token, with A the sample's advantage:
    ratio = exp(current - proximal)
    w     = min(exp(proximal - behaviour), cap)     (detached; cap None: untruncated)
    term  = -w * min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)  +  kl_coef * k3(reference, current)
Clipping against the proximal policy keeps the trust region about the policy being trained however
stale the samples are; w corrects for them having been drawn from another one. decoupled=False is
plain PPO-clip against the behaviour policy (proximal := behaviour, w = 1).

Token weights (`aggregation`) are fixed over a whole minibatch before it is cut into micro-batches, so
the sum of the micro-batches' losses is exactly the minibatch's loss: accumulating their gradients
is unbiased whatever the packing.

Packing: samples (segments) are laid end to end in rows, position ids restart at 0 at each sample,
and a block-diagonal causal mask keeps every token to the earlier tokens of its own sample. The
mask is handed to the model as a 4D mask (transformers uses a 4D mask as given); attention
implementations that take no 4D mask (flash, flex) get none and find the samples from the
restarting position ids instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from rollstream.shared.contract.batches import BatchRow

AGGREGATIONS = ("token", "rollout")
MEAN_STATS = ("ratio_mean", "clip_fraction", "importance_weight_mean", "capped_fraction")
WEIGHTED_STATS = ("loss", "pg_loss", "kl")


@dataclass
class MicroBatch:
    """One forward pass. A row may hold several samples; padding sits at the end of rows."""

    tokens: torch.Tensor              # [R, T] long
    position_ids: torch.Tensor        # [R, T] long, restarting at 0 at each sample; 0 on padding
    attention_mask: torch.Tensor | None  # [R, 1, T, T] bool, True where a query token may attend a key token;
    # None when every row holds one sample: plain causal attention is then exact (padding only follows it)
    loss_mask: torch.Tensor           # [R, T] float, 1 on sampled (trainable) tokens
    behaviour_logprobs: torch.Tensor  # [R, T] vLLM's logprob of each sampled token
    advantages: torch.Tensor          # [R, T] float, each token carries its sample's advantage
    weights: torch.Tensor             # [R, T] float, loss weight per token (0 off the sampled tokens)
    prox_logprobs: torch.Tensor | None = None  # [R, T] filled by the trainer before any update on the batch
    ref_logprobs: torch.Tensor | None = None   # [R, T] reference model, only when kl_coef > 0
    placement: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Where each sample sits: (its index in the rows packed, micro-batch row, offset, length)."""

    def per_sample(self, values: torch.Tensor) -> dict[int, list[float]]:
        """An [R, T] tensor's values of each sample, by the sample's index in the rows packed."""
        return {index: values[r, offset:offset + length].tolist()
                for index, r, offset, length in self.placement}


def split_minibatches(rows: list[BatchRow], minibatches: int) -> list[list[BatchRow]]:
    """Cut a batch into minibatches of whole rollouts (all segments of a rollout stay together), as
    even in rollouts as possible, keeping the rows' order. A batch of fewer rollouts than
    `minibatches` gives one minibatch per rollout."""
    if minibatches < 1:
        raise ValueError(f"minibatches must be at least 1, got {minibatches}")
    if not rows:
        raise ValueError("cannot split an empty batch into minibatches")
    rollouts = list(dict.fromkeys(row.rollout_id for row in rows))
    parts = min(minibatches, len(rollouts))
    base, extra = divmod(len(rollouts), parts)
    part_of: dict[str, int] = {}
    start = 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        for rollout in rollouts[start:start + size]:
            part_of[rollout] = part
        start += size
    out: list[list[BatchRow]] = [[] for _ in range(parts)]
    for row in rows:
        out[part_of[row.rollout_id]].append(row)
    return out


def make_micro_batches(rows: list[BatchRow], aggregation: str, micro_batch_tokens: int, pad_id: int,
                       device: torch.device | str = "cpu") -> list[MicroBatch]:
    """Pack one minibatch's samples into micro-batches of at most `micro_batch_tokens` tokens,
    padding included (a sample longer than that gets a micro-batch of its own).

    Token weights are computed over all of `rows` first, so they sum to 1 over the minibatch's
    sampled tokens and summing `policy_loss` over the micro-batches gives the minibatch's loss.
    Samples go first-fit by decreasing length; a micro-batch's rows are as long as its longest
    sample and shorter samples share rows.
    """
    if not rows:
        raise ValueError("no rows to make micro-batches of")
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    for row in rows:
        if not (len(row.tokens) == len(row.loss_mask) == len(row.rollout_logprobs)) or not row.tokens:
            raise ValueError(f"rollout {row.rollout_id} segment {row.segment_index}: tokens, loss_mask and "
                             f"rollout_logprobs must be equally long and non-empty, got {len(row.tokens)}, "
                             f"{len(row.loss_mask)}, {len(row.rollout_logprobs)}")
    weights = token_weights(rows, aggregation)
    return [_micro_batch(rows, weights, layout, pad_id, device)
            for layout in _pack([len(row.tokens) for row in rows], micro_batch_tokens)]


def token_weights(rows: list[BatchRow], aggregation: str) -> list[list[float]]:
    """Per-token loss weights of each row, summing to 1 over the rows' sampled tokens.

    token: every sampled token weighs the same, however its rollout was split into segments.
    rollout: every rollout (with sampled tokens) weighs the same, shared equally by its tokens over
    all its segments, so long rollouts do not outweigh short ones.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
    masks = [_trainable(row) for row in rows]
    sampled = [sum(mask) for mask in masks]
    total = sum(sampled)
    if total == 0:
        raise ValueError("the rows have no sampled tokens to train on (every loss_mask is 0)")
    if aggregation == "token":
        return [[m / total for m in mask] for mask in masks]
    per_rollout: dict[str, int] = defaultdict(int)
    for row, count in zip(rows, sampled):
        per_rollout[row.rollout_id] += count
    rollouts = sum(1 for count in per_rollout.values() if count)
    return [[m / (per_rollout[row.rollout_id] * rollouts) for m in mask] for row, mask in zip(rows, masks)]


def _trainable(row: BatchRow) -> list[int]:
    # A sample's first token has no context to be scored in, so it cannot be trained on even if marked
    # sampled.
    return [0] + [1 if m else 0 for m in row.loss_mask[1:]]


def _pack(lengths: list[int], budget: int) -> list[list[list[int]]]:
    """First-fit decreasing: micro-batches of rows of sample indices, with rows x width <= budget
    (width: the micro-batch's first, longest, sample) unless one sample alone exceeds it."""
    micro_batches: list[tuple[int, list[list[int]], list[int]]] = []  # (width, rows, free tokens per row)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        for width, rows, free in micro_batches:
            row = next((r for r, room in enumerate(free) if room >= length), None)
            if row is not None:
                rows[row].append(index)
                free[row] -= length
                break
            if (len(rows) + 1) * width <= budget:
                rows.append([index])
                free.append(width - length)
                break
        else:
            micro_batches.append((length, [[index]], [0]))
    return [rows for _, rows, _ in micro_batches]


def _micro_batch(rows: list[BatchRow], weights: list[list[float]], layout: list[list[int]], pad_id: int,
                 device: torch.device | str) -> MicroBatch:
    width = max(sum(len(rows[i].tokens) for i in row) for row in layout)
    shape = (len(layout), width)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    sample_ids = torch.full(shape, -1, dtype=torch.long)
    loss_mask, behaviour, advantages, token_weight = (torch.zeros(shape) for _ in range(4))
    placement = []
    for r, row in enumerate(layout):
        offset = 0
        for index in row:
            sample = rows[index]
            placement.append((index, r, offset, len(sample.tokens)))
            span = slice(offset, offset + len(sample.tokens))
            tokens[r, span] = torch.tensor(sample.tokens, dtype=torch.long)
            positions[r, span] = torch.arange(len(sample.tokens))
            sample_ids[r, span] = index
            loss_mask[r, span] = torch.tensor(_trainable(sample), dtype=torch.float32)
            behaviour[r, span] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
            advantages[r, span] = sample.advantage
            token_weight[r, span] = torch.tensor(weights[index], dtype=torch.float32)
            offset += len(sample.tokens)
    if all(len(row) == 1 for row in layout):
        # A T x T mask is T^2 bytes, and with one the attention kernel materialises T^2 scores per head (a
        # 60k-token coding-agent sample: tens of GB); without one it attends causally in memory linear in T.
        attention_mask = None
    else:
        same_sample = sample_ids[:, :, None] == sample_ids[:, None, :]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        # Padding is one block of its own: real tokens never attend it, and it attends no real token.
        attention_mask = (same_sample & causal)[:, None].to(device)
    return MicroBatch(tokens=tokens.to(device), position_ids=positions.to(device),
                      attention_mask=attention_mask, loss_mask=loss_mask.to(device),
                      behaviour_logprobs=behaviour.to(device), advantages=advantages.to(device),
                      weights=token_weight.to(device), placement=placement)


def _model_attention_mask(model, mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == "sdpa":
        return mask
    if implementation == "eager":
        # eager attention adds the mask to its scores
        dtype = getattr(model, "dtype", torch.float32)
        zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return zeros.masked_fill(~mask, torch.finfo(dtype).min)
    # flash and flex attention take no 4D mask: transformers reads the packing from the position ids
    return None


def _next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logprob of tokens[:, t + 1] under logits[:, t]; [R, T - 1]."""
    logits = logits[:, :-1].float()
    picked = logits.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(model, micro: MicroBatch) -> torch.Tensor:
    """[R, T]: logprob of each token given the earlier tokens of its own sample; 0 at each sample's
    first position (nothing to condition on) and on padding."""
    output = model(input_ids=micro.tokens, position_ids=micro.position_ids,
                   attention_mask=_model_attention_mask(model, micro.attention_mask), use_cache=False)
    shifted = _next_token_logprobs(output.logits, micro.tokens)
    logprobs = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)
    # A sample's first token was predicted from the previous sample's last one: meaningless.
    return logprobs.masked_fill(micro.position_ids == 0, 0.0)


def sequence_logprobs(model, ids: list[int]) -> list[float]:
    """logprob of ids[1:], each given the ids before it, in eval mode without gradient: what a
    server's prompt logprobs of the same ids must match after a weight sync."""
    if len(ids) < 2:
        return []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tokens = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
            logits = model(input_ids=tokens, use_cache=False).logits
            return _next_token_logprobs(logits, tokens)[0].tolist()
    finally:
        model.train(was_training)


def policy_loss(logprobs: torch.Tensor, micro: MicroBatch, *, clip_eps: float, decoupled: bool,
                importance_weight_cap: float | None, kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of its minibatch's loss (see the module docstring), and its stats.

    Stats: loss, pg_loss and kl are this micro-batch's contributions (weighted sums); ratio_mean,
    clip_fraction, importance_weight_mean and capped_fraction are means over its sampled tokens;
    importance weights are reported before truncation (capped_fraction says how often the cap cut
    one); tokens counts sampled tokens, weight the share of the loss weight. `merge_stats`
    combines them.
    """
    _check_loss_settings(micro, clip_eps=clip_eps, decoupled=decoupled,
                         importance_weight_cap=importance_weight_cap, kl_coef=kl_coef)
    sampled = micro.loss_mask > 0
    zero = torch.zeros_like(logprobs)
    weights = _importance_weights(micro, sampled, zero, decoupled, importance_weight_cap)
    ratio = torch.exp(torch.where(sampled, logprobs - weights.proximal, zero))
    advantages = micro.advantages
    surrogate = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    pg_loss = (micro.weights * weights.truncated.detach() * surrogate).sum()
    if micro.ref_logprobs is not None:
        to_reference = torch.where(sampled, micro.ref_logprobs.detach() - logprobs, zero)
        kl = (micro.weights * (torch.exp(to_reference) - to_reference - 1)).sum()
    else:
        kl = zero.sum()
    loss = pg_loss + kl_coef * kl
    return loss, _loss_stats(micro, loss, pg_loss, kl, ratio, weights, sampled, zero, clip_eps)


def _check_loss_settings(micro: MicroBatch, *, clip_eps: float, decoupled: bool,
                         importance_weight_cap: float | None, kl_coef: float) -> None:
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be positive, got {clip_eps}")
    if importance_weight_cap is not None and importance_weight_cap <= 0:
        raise ValueError(f"importance_weight_cap must be positive or None, got {importance_weight_cap}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and micro.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs the reference model's logprobs in micro.ref_logprobs")
    if decoupled and micro.prox_logprobs is None:
        raise ValueError("decoupled PPO needs micro.prox_logprobs: the policy's logprobs before the "
                         "batch's first update")


@dataclass(frozen=True)
class ImportanceWeights:
    """Per token: the proximal logprobs the ratio is taken against, w before and after its cap, and
    where the cap cut it."""

    proximal: torch.Tensor
    raw: torch.Tensor
    truncated: torch.Tensor
    capped: torch.Tensor


def _importance_weights(micro: MicroBatch, sampled: torch.Tensor, zero: torch.Tensor, decoupled: bool,
                        importance_weight_cap: float | None) -> ImportanceWeights:
    behaviour = micro.behaviour_logprobs
    if decoupled:
        proximal = micro.prox_logprobs.detach()
        # Masked before exp: prompt positions hold arbitrary values and must not overflow.
        raw_weight = torch.exp(torch.where(sampled, proximal - behaviour, zero))
    else:
        proximal = behaviour
        raw_weight = torch.ones_like(behaviour)
    capped = torch.zeros_like(sampled)
    importance_weight = raw_weight
    if decoupled and importance_weight_cap is not None:
        capped = sampled & (raw_weight > importance_weight_cap)
        importance_weight = raw_weight.clamp(max=importance_weight_cap)
    return ImportanceWeights(proximal, raw_weight, importance_weight, capped)


def _loss_stats(micro: MicroBatch, loss: torch.Tensor, pg_loss: torch.Tensor, kl: torch.Tensor,
                ratio: torch.Tensor, weights: ImportanceWeights, sampled: torch.Tensor, zero: torch.Tensor,
                clip_eps: float) -> dict[str, float]:
    with torch.no_grad():
        mask = sampled.float()
        tokens = mask.sum()
        per_token = tokens.clamp(min=1)
        clipped = ((ratio - 1).abs() > clip_eps).float()
        values = torch.stack([
            loss, pg_loss, kl,
            (ratio * mask).sum() / per_token,
            (clipped * mask).sum() / per_token,
            (weights.raw * mask).sum() / per_token,
            torch.where(sampled, weights.raw, zero).max() if bool(sampled.any()) else zero.sum(),
            weights.capped.float().sum() / per_token,
            tokens,
            micro.weights.sum(),
        ]).tolist()
    names = ("loss", "pg_loss", "kl", "ratio_mean", "clip_fraction", "importance_weight_mean",
             "importance_weight_max", "capped_fraction", "tokens", "weight")
    return dict(zip(names, values))


def merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """Combine `policy_loss` stats of micro-batches. Over one minibatch's micro-batches, loss is the
    minibatch's loss; over several minibatches, the mean of their losses."""
    if not stats:
        raise ValueError("no stats to merge")
    tokens = sum(s["tokens"] for s in stats)
    weight = sum(s["weight"] for s in stats)
    merged = {key: sum(s[key] for s in stats) / weight if weight else 0.0 for key in WEIGHTED_STATS}
    merged.update({key: sum(s[key] * s["tokens"] for s in stats) / tokens if tokens else 0.0
                   for key in MEAN_STATS})
    merged["importance_weight_max"] = max(s["importance_weight_max"] for s in stats)
    merged["tokens"] = tokens
    merged["weight"] = weight
    return merged
