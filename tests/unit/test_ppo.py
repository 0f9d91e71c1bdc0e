"""The trainer's loss against a reference written independently, token by token."""

import math

import torch

from services.trainer.ppo import Batch, ppo_clip_loss, token_logprobs


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
                  loss_mask=mask, old_logprobs=old, advantages=advantages)
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
                  old_logprobs=logp.detach(), advantages=torch.tensor([2.0]))
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
