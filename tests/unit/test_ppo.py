"""The trainer's loss against a reference written independently, token by token."""

import math

import torch

from services.trainer.ppo import Batch, collate, ppo_clip_loss, token_logprobs
from shared.batches import BatchRow


def reference_loss(new_logp, old_logp, mask, advantages, eps):
    total, count = 0.0, 0
    for i in range(len(new_logp)):
        for t in range(len(new_logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(new_logp[i][t] - old_logp[i][t])
            a = advantages[i]
            total += -min(ratio * a, max(min(ratio, 1 + eps), 1 - eps) * a)
            count += 1
    return total / count


def test_ppo_clip_matches_the_reference():
    generator = torch.Generator().manual_seed(0)
    new = -torch.rand(3, 6, generator=generator) * 2
    old = new + (torch.rand(3, 6, generator=generator) - 0.5)  # ratios well outside the clip range too
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]], dtype=torch.float32)
    advantages = torch.tensor([1.5, -0.7, 0.3])
    batch = Batch(tokens=torch.zeros(3, 6, dtype=torch.long), attention_mask=torch.ones(3, 6, dtype=torch.long),
                  loss_mask=mask, old_logprobs=old, advantages=advantages, rollout_index=torch.arange(3))
    loss, stats = ppo_clip_loss(new, batch, clip_eps=0.2)
    expected = reference_loss(new.tolist(), old.tolist(), mask.tolist(), advantages.tolist(), 0.2)
    assert abs(loss.item() - expected) < 1e-6
    assert stats["tokens"] == 9
    assert 0 < stats["clip_fraction"] < 1


def test_on_policy_gradient_is_the_policy_gradient():
    logits = torch.randn(1, 4, 5, requires_grad=True)
    tokens = torch.tensor([[0, 3, 1, 2]])
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros(1, 1), logp], 1)
    mask = torch.tensor([[0.0, 1, 1, 1]])
    batch = Batch(tokens=tokens, attention_mask=torch.ones_like(tokens), loss_mask=mask,
                  old_logprobs=logp.detach(), advantages=torch.tensor([2.0]), rollout_index=torch.tensor([0]))
    loss, _ = ppo_clip_loss(logp, batch, 0.2)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (expected,) = torch.autograd.grad(-(2.0 * logp * mask).sum() / 3, logits)
    assert torch.allclose(grad, expected, atol=1e-6)


class ToyModel(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_token_logprobs_score_each_token_given_the_previous_one():
    table = torch.log_softmax(torch.randn(7, 7), -1)
    tokens = torch.tensor([[1, 4, 2, 6]])
    got = token_logprobs(ToyModel(table), tokens)
    assert got[0, 0] == 0
    for t in range(1, 4):
        assert torch.isclose(got[0, t], table[tokens[0, t - 1], tokens[0, t]])


def row(rollout: str, tokens: list[int], mask: list[int], logprobs: list[float], advantage: float) -> BatchRow:
    return BatchRow(sample_index=0, trajectory_id=rollout, rollout_id=rollout, group_id="g", session_id=rollout,
                    segment_index=0, tokens=tokens, response_length=sum(mask), loss_mask=mask,
                    rollout_logprobs=logprobs, turn_policy_versions=[0], status="completed", reward=0.0,
                    advantage=advantage)


def loss_of(rows, new_logprobs, aggregation):
    batch = collate(rows, pad_id=0)
    new = torch.zeros_like(batch.old_logprobs)
    for i, values in enumerate(new_logprobs):
        new[i, : len(values)] = torch.tensor(values)
    return ppo_clip_loss(new, batch, 0.2, aggregation)[0].item()


def test_a_rollout_split_into_segments_weighs_what_it_weighs_whole():
    whole = [row("a", [1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0, -1.0, -1.0, -1.0, -1.0], 1.0),
             row("b", [1, 2, 3], [0, 1, 1], [0, -1.0, -1.0], -1.0)]
    split = [row("a", [1, 2, 3], [0, 1, 1], [0, -1.0, -1.0], 1.0),
             row("a", [1, 4, 5], [0, 1, 1], [0, -1.0, -1.0], 1.0),
             whole[1]]
    new_whole = [[0, -0.9, -1.1, -0.8, -1.2], [0, -0.7, -1.3]]
    new_split = [[0, -0.9, -1.1], [0, -0.8, -1.2], [0, -0.7, -1.3]]
    for aggregation in ("token", "rollout"):
        assert abs(loss_of(whole, new_whole, aggregation) - loss_of(split, new_split, aggregation)) < 1e-6


def test_rollout_aggregation_is_the_mean_over_rollouts_of_their_token_means():
    rows = [row("a", [1, 2, 3], [0, 1, 1], [0, -1.0, -1.0], 1.0),
            row("a", [1, 4], [0, 1], [0, -1.0], 1.0),
            row("b", [1, 2], [0, 1], [0, -1.0], -2.0)]
    new = [[0, -0.9, -1.05], [0, -0.95], [0, -1.1]]

    def term(new_lp, advantage):
        ratio = math.exp(new_lp + 1.0)
        return -min(ratio * advantage, max(min(ratio, 1.2), 0.8) * advantage)

    rollout_a = (term(-0.9, 1.0) + term(-1.05, 1.0) + term(-0.95, 1.0)) / 3
    rollout_b = term(-1.1, -2.0)
    assert abs(loss_of(rows, new, "rollout") - (rollout_a + rollout_b) / 2) < 1e-6
    token_level = (3 * rollout_a + rollout_b) / 4
    assert abs(loss_of(rows, new, "token") - token_level) < 1e-6
