"""The trainer's loss and its packed micro-batches, against references written independently: plain
Python loops over rows and tokens, and the model run on one unpacked sample at a time."""

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from rollstream.services.trainer.ppo import (
    MicroBatch,
    make_micro_batches,
    merge_stats,
    policy_loss,
    sequence_logprobs,
    split_minibatches,
    token_logprobs,
)
from rollstream.shared.contract.batches import BatchRow

VOCAB = 11
PAD = 0


def row(rollout: str, tokens: list[int], mask: list[int], behaviour: list[float], advantage: float,
        segment: int = 0) -> BatchRow:
    return BatchRow(sample_index=0, trajectory_id=rollout, rollout_id=rollout, group_id="g",
                    session_id=rollout, segment_index=segment, tokens=tokens, response_length=sum(mask),
                    loss_mask=mask, rollout_logprobs=behaviour, turn_policy_versions=[0], status="completed",
                    reward=0.0, advantage=advantage)


class BigramModel(torch.nn.Module):
    """logits of the next token depend on the current token only: logprobs are known in closed form."""

    config = SimpleNamespace(_attn_implementation="sdpa")

    def __init__(self, seed: int, scale: float = 1.0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=generator) * scale)

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=None):
        return SimpleNamespace(logits=self.table[input_ids])

    def logprob(self, previous: int, token: int) -> float:
        scores = self.table[previous].tolist()
        top = max(scores)
        return scores[token] - top - math.log(sum(math.exp(s - top) for s in scores))

    def row_logprobs(self, tokens: list[int]) -> list[float]:
        return [0.0] + [self.logprob(tokens[t - 1], tokens[t]) for t in range(1, len(tokens))]


def fan_out_rows(proximal: BigramModel) -> list[BatchRow]:
    """Rollout a is split into two segments; behaviour logprobs are the proximal ones plus noise, so
    that importance weights spread well above and below 1."""
    generator = torch.Generator().manual_seed(7)
    specs = [("a", [3, 5, 2, 7, 7, 1], [0, 0, 1, 1, 0, 1], 1.3, 0),
             ("b", [4, 1, 9, 9, 2], [0, 1, 1, 1, 1], -0.8, 0),
             ("a", [3, 5, 2, 7, 7, 1, 6, 8, 10], [0, 0, 0, 0, 0, 0, 1, 1, 1], 1.3, 1),
             ("c", [2, 6, 3], [0, 0, 1], 0.5, 0),
             ("d", [8, 8, 4, 10, 5, 1, 3], [0, 0, 0, 1, 1, 1, 1], -1.1, 0),
             ("e", [5, 9], [0, 1], 0.7, 0),
             ("f", [6, 2, 4], [0, 1, 1], -0.2, 0)]
    rows = []
    for rollout, tokens, mask, advantage, segment in specs:
        exact = proximal.row_logprobs(tokens)
        noise = torch.randn(len(tokens), generator=generator).tolist()
        behaviour = [lp + n if m else 0.0 for lp, n, m in zip(exact, noise, mask)]
        rows.append(row(rollout, tokens, mask, behaviour, advantage, segment))
    return rows


def reference(rows, current, proximal, reference_model, *, aggregation, clip_eps, decoupled, cap, kl_coef):
    sampled = sum(sum(r.loss_mask[1:]) for r in rows)
    per_rollout: dict[str, int] = {}
    for r in rows:
        per_rollout[r.rollout_id] = per_rollout.get(r.rollout_id, 0) + sum(r.loss_mask[1:])
    loss = kl_total = 0.0
    ratios, raw_weights, clipped, capped = [], [], 0, 0
    for r in rows:
        for t in range(1, len(r.tokens)):
            if not r.loss_mask[t]:
                continue
            weight = (1 / sampled if aggregation == "token"
                      else 1 / (len(per_rollout) * per_rollout[r.rollout_id]))
            new = current.logprob(r.tokens[t - 1], r.tokens[t])
            behaviour = r.rollout_logprobs[t]
            prox = proximal.logprob(r.tokens[t - 1], r.tokens[t]) if decoupled else behaviour
            ratio = math.exp(new - prox)
            clipped_ratio = max(min(ratio, 1 + clip_eps), 1 - clip_eps)
            surrogate = -min(ratio * r.advantage, clipped_ratio * r.advantage)
            raw_weight = math.exp(prox - behaviour)
            applied = raw_weight
            if decoupled and cap is not None and raw_weight > cap:
                applied = cap
                capped += 1
            term = applied * surrogate
            if kl_coef:
                to_ref = reference_model.logprob(r.tokens[t - 1], r.tokens[t]) - new
                k3 = math.exp(to_ref) - to_ref - 1
                kl_total += weight * k3
                term += kl_coef * k3
            loss += weight * term
            ratios.append(ratio)
            raw_weights.append(raw_weight)
            clipped += abs(ratio - 1) > clip_eps
    return {"loss": loss, "kl": kl_total, "ratio_mean": sum(ratios) / sampled,
            "clip_fraction": clipped / sampled, "importance_weight_mean": sum(raw_weights) / sampled,
            "importance_weight_max": max(raw_weights), "capped_fraction": capped / sampled, "tokens": sampled}


def accumulated(rows, micro_batches, current, proximal, reference_model, **loss_args):
    losses, stats = [], []
    for micro in micro_batches:
        with torch.no_grad():
            micro.prox_logprobs = token_logprobs(proximal, micro)
            micro.ref_logprobs = token_logprobs(reference_model, micro)
        loss, micro_stats = policy_loss(token_logprobs(current, micro), micro, **loss_args)
        losses.append(loss)
        stats.append(micro_stats)
    return torch.stack(losses).sum(), merge_stats(stats)


@pytest.mark.parametrize("aggregation, decoupled, cap, kl_coef",
                         list(itertools.product(["token", "rollout"], [True, False], [1.5, None],
                                                [0.0, 0.3])))
def test_loss_and_stats_match_the_reference(aggregation, decoupled, cap, kl_coef):
    current, proximal, reference_model = BigramModel(0), BigramModel(1, scale=0.9), BigramModel(2)
    drift = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        current.table.copy_(proximal.table + 0.4 * drift)
    rows = fan_out_rows(proximal)
    micro_batches = make_micro_batches(rows, aggregation, micro_batch_tokens=18, pad_id=PAD, device="cpu")
    assert len(micro_batches) > 1 and most_samples_in_a_row(micro_batches) > 1

    loss, stats = accumulated(rows, micro_batches, current, proximal, reference_model, clip_eps=0.2,
                              decoupled=decoupled, importance_weight_cap=cap, kl_coef=kl_coef)
    expected = reference(rows, current, proximal, reference_model, aggregation=aggregation, clip_eps=0.2,
                         decoupled=decoupled, cap=cap, kl_coef=kl_coef)
    assert 0 < expected["clip_fraction"] < 1
    if decoupled and cap is not None:
        assert 0 < expected["capped_fraction"] < 1
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-5)
    assert stats["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    for key in ("ratio_mean", "clip_fraction", "importance_weight_mean", "importance_weight_max",
                "capped_fraction", "tokens"):
        assert stats[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    if kl_coef:
        assert stats["kl"] == pytest.approx(expected["kl"], abs=1e-6) and stats["kl"] > 0


def test_rollout_aggregation_weighs_rollouts_equally_and_token_aggregation_tokens():
    rows = [row("a", [1, 2, 3, 4], [0, 1, 1, 1], [0.0] * 4, 1.0),
            row("a", [1, 2, 3, 4, 5], [0, 0, 0, 0, 1], [0.0] * 5, 1.0),
            row("b", [6, 7], [0, 1], [0.0] * 2, -1.0)]
    by_rollout = make_micro_batches(rows, "rollout", 100, PAD, "cpu")
    by_token = make_micro_batches(rows, "token", 100, PAD, "cpu")
    (micro,) = by_rollout
    weights = {round(w, 6) for w in micro.weights[micro.loss_mask > 0].tolist()}
    assert weights == {0.125, 0.5}  # a: 4 tokens share 1/2; b: 1 token holds 1/2
    assert {round(w, 6) for w in by_token[0].weights[by_token[0].loss_mask > 0].tolist()} == {0.2}
    assert micro.weights.sum().item() == pytest.approx(1.0)


def test_on_policy_ppo_gradient_is_the_policy_gradient():
    model = BigramModel(0)
    rows = [row("a", [1, 4, 2, 6], [0, 1, 1, 1], [0.0] * 4, 2.0),
            row("b", [3, 3, 5], [0, 1, 1], [0.0] * 3, -1.0)]
    for r in rows:
        r.rollout_logprobs = [lp if m else 0.0 for lp, m in zip(model.row_logprobs(r.tokens), r.loss_mask)]
    (micro,) = make_micro_batches(rows, "token", 100, PAD, "cpu")
    logprobs = token_logprobs(model, micro)
    loss, stats = policy_loss(logprobs, micro, clip_eps=0.2, decoupled=False, importance_weight_cap=None,
                              kl_coef=0.0)
    (grad,) = torch.autograd.grad(loss, model.table, retain_graph=True)
    vanilla = -(micro.weights * micro.advantages * logprobs).sum()
    (expected,) = torch.autograd.grad(vanilla, model.table)
    assert torch.allclose(grad, expected, atol=1e-6) and grad.abs().sum() > 0
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_fraction"] == 0


def test_token_logprobs_restart_at_each_packed_sample():
    model = BigramModel(0)
    rows = [row("a", [1, 4, 2, 6], [0, 1, 1, 1], [0.0] * 4, 1.0), row("b", [3, 5], [0, 1], [0.0] * 2, 1.0)]
    (padded,) = make_micro_batches(rows, "token", 100, PAD, "cpu")
    assert padded.tokens.tolist() == [[1, 4, 2, 6], [3, 5, PAD, PAD]]
    rows.append(row("c", [7, 8], [0, 1], [0.0] * 2, 1.0))
    (micro,) = make_micro_batches(rows, "token", 8, PAD, "cpu")
    assert micro.tokens.tolist() == [[1, 4, 2, 6], [3, 5, 7, 8]]  # rows are as wide as the longest sample
    assert micro.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    logprobs = token_logprobs(model, micro)[1].tolist()
    assert logprobs[0] == 0 and logprobs[2] == 0  # no context at a sample's first token
    assert logprobs[1] == pytest.approx(model.logprob(3, 5))
    assert logprobs[3] == pytest.approx(model.logprob(7, 8))
    assert token_logprobs(model, padded)[1, 2:].tolist() == [0, 0]
    (unscorable,) = make_micro_batches([row("a", [1, 4], [1, 1], [-1.0, -1.0], 1.0)], "token", 8, PAD, "cpu")
    assert unscorable.loss_mask.tolist() == [[0, 1]]  # a first token has no context to be scored in


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model


def random_rows(lengths: list[int], seed: int) -> list[BatchRow]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index, length in enumerate(lengths):
        tokens = torch.randint(3, 340, (length,), generator=generator).tolist()
        prompt = length // 3
        mask = [0] * prompt + [1] * (length - prompt)
        behaviour = [(-2.0 - torch.rand(1, generator=generator).item()) if m else 0.0 for m in mask]
        advantage = torch.randn(1, generator=generator).item()
        rows.append(row(f"r{index // 2}", tokens, mask, behaviour, advantage, segment=index % 2))
    return rows


def unpacked_logprobs(model, tokens: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.stack([torch.zeros(())] + [logp[t - 1, tokens[t]] for t in range(1, len(tokens))])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_samples_get_the_logprobs_they_get_alone(tiny_dir, attention):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=attention)
    rows = random_rows([7, 3, 12, 5, 2, 9, 4, 6], seed=0)
    micro_batches = make_micro_batches(rows, "token", micro_batch_tokens=24, pad_id=PAD, device="cpu")
    assert most_samples_in_a_row(micro_batches) > 1

    with torch.no_grad():
        alone = {tuple(r.tokens): unpacked_logprobs(model, r.tokens) for r in rows}
        found = 0
        for micro in micro_batches:
            logprobs = token_logprobs(model, micro)
            for r, start, length in sample_spans(micro):
                sample = tuple(micro.tokens[r, start:start + length].tolist())
                assert torch.allclose(logprobs[r, start:start + length], alone[sample], atol=1e-5)
                found += 1
            assert (logprobs[micro.tokens == PAD] == 0).all()
    assert found == len(rows)
    model.train()
    assert sequence_logprobs(model, rows[2].tokens) == pytest.approx(
        alone[tuple(rows[2].tokens)][1:].tolist(), abs=1e-5)
    assert model.training


def test_each_packed_sample_gets_its_own_logprobs_back_by_its_row(tiny_dir):
    """What the trainer writes beside a batch (its logprob of every token of each segment): read back out of
    the packed micro-batches, each batch row's values are the ones that row gets alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rows = random_rows([7, 3, 12, 5, 2, 9, 4, 6], seed=1)
    micro_batches = make_micro_batches(rows, "token", micro_batch_tokens=24, pad_id=PAD, device="cpu")
    assert most_samples_in_a_row(micro_batches) > 1
    found: dict[int, list[float]] = {}
    with torch.no_grad():
        for micro in micro_batches:
            found.update(micro.per_sample(token_logprobs(model, micro)))
        assert sorted(found) == list(range(len(rows)))
        for index, sample in enumerate(rows):
            assert found[index] == pytest.approx(unpacked_logprobs(model, sample.tokens).tolist(), abs=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rows_of_one_sample_take_no_mask_and_get_the_logprobs_they_get_alone(tiny_dir, attention):
    """A long sample (a coding agent's, tens of thousands of tokens) is alone in its row: a T x T mask would
    cost T^2 memory, and plain causal attention is exact there, padding only following the sample."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=attention)
    rows = random_rows([12, 11, 10], seed=2)  # three rows of 12: no two samples fit in one
    micro_batches = make_micro_batches(rows, "token", micro_batch_tokens=36, pad_id=PAD, device="cpu")
    assert all(micro.attention_mask is None for micro in micro_batches)
    assert any((micro.tokens == PAD).any() for micro in micro_batches), "some row is padded"
    with torch.no_grad():
        alone = {tuple(r.tokens): unpacked_logprobs(model, r.tokens) for r in rows}
        spans = [(micro, r, start, length)
                 for micro in micro_batches for r, start, length in sample_spans(micro)]
        assert len(spans) == len(rows)
        for micro, r, start, length in spans:
            logprobs = token_logprobs(model, micro)
            sample = tuple(micro.tokens[r, start:start + length].tolist())
            assert torch.allclose(logprobs[r, start:start + length], alone[sample], atol=1e-5)


def sample_spans(micro: MicroBatch, pad: int = PAD):
    """(row, start, length) of every sample, read back from the restarting position ids."""
    for r in range(micro.tokens.shape[0]):
        positions = micro.position_ids[r].tolist()
        starts = [t for t, p in enumerate(positions) if p == 0 and micro.tokens[r, t] != pad]
        for start in starts:
            length = 1
            while start + length < len(positions) and positions[start + length] == length:
                length += 1
            yield r, start, length


def most_samples_in_a_row(micro_batches: list[MicroBatch]) -> int:
    return max(sum(1 for row_index, _, _ in sample_spans(m) if row_index == r)
               for m in micro_batches for r in range(m.tokens.shape[0]))


def test_the_block_mask_is_what_keeps_packed_samples_apart(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rows = random_rows([10, 6, 4], seed=1)
    (micro,) = make_micro_batches(rows, "token", micro_batch_tokens=20, pad_id=PAD, device="cpu")
    assert micro.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    with torch.no_grad():
        packed = token_logprobs(model, micro)
        leaky = copy.copy(micro)
        leaky.attention_mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
        across = token_logprobs(model, leaky)
    # the first sample sees nothing else either way
    assert torch.allclose(packed[1, :6], across[1, :6], atol=1e-6)
    assert (packed[1, 7:] - across[1, 7:]).abs().max() > 1e-3


def test_accumulated_micro_batches_equal_the_whole_batch_unpacked_in_loss_and_gradient(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    proximal, reference_model = copy.deepcopy(model), copy.deepcopy(model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for other, scale in ((proximal, 0.02), (reference_model, 0.05)):
            for p in other.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * scale)
    rows = random_rows([9, 4, 7, 3, 6, 2, 5, 2], seed=2)
    settings = dict(clip_eps=0.2, decoupled=True, importance_weight_cap=3.0, kl_coef=0.1)

    micro_batches = make_micro_batches(rows, "rollout", micro_batch_tokens=16, pad_id=PAD, device="cpu")
    assert len(micro_batches) > 1 and most_samples_in_a_row(micro_batches) > 1
    loss, stats = accumulated(rows, micro_batches, model, proximal, reference_model, **settings)
    model.zero_grad()
    for micro in micro_batches:
        micro_loss, _ = policy_loss(token_logprobs(model, micro), micro, **settings)
        micro_loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    expected = whole_batch_loss(rows, model, proximal, reference_model)
    expected.backward()
    assert 0 < stats["clip_fraction"] < 1
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    for packed_grad, p in zip(packed_grads, model.parameters()):
        assert torch.allclose(packed_grad, p.grad, atol=1e-6, rtol=1e-4)


def whole_batch_loss(rows, model, proximal, reference_model, clip_eps=0.2, cap=3.0, kl_coef=0.1):
    """Rollout-aggregated decoupled PPO with KL, one unpacked sample at a time, token by token."""
    per_rollout: dict[str, int] = {}
    for r in rows:
        per_rollout[r.rollout_id] = per_rollout.get(r.rollout_id, 0) + sum(r.loss_mask[1:])
    total = torch.zeros(())
    for r in rows:
        current = unpacked_logprobs(model, r.tokens)
        with torch.no_grad():
            prox = unpacked_logprobs(proximal, r.tokens)
            ref = unpacked_logprobs(reference_model, r.tokens)
        for t in range(1, len(r.tokens)):
            if not r.loss_mask[t]:
                continue
            weight = 1 / (len(per_rollout) * per_rollout[r.rollout_id])
            ratio = torch.exp(current[t] - prox[t])
            surrogate = -torch.minimum(ratio * r.advantage,
                                       ratio.clamp(1 - clip_eps, 1 + clip_eps) * r.advantage)
            importance = min(math.exp(prox[t].item() - r.rollout_logprobs[t]), cap)
            to_ref = ref[t] - current[t]
            total = total + weight * (importance * surrogate + kl_coef * (torch.exp(to_ref) - to_ref - 1))
    return total


def test_micro_batches_hold_every_sample_once_within_the_token_budget():
    pad = 999
    rows = random_rows([7, 3, 12, 5, 1, 9, 4, 30, 2, 2], seed=3)
    micro_batches = make_micro_batches(rows, "token", micro_batch_tokens=16, pad_id=pad, device="cpu")
    seen = []
    for micro in micro_batches:
        samples = [micro.tokens[r, s:s + n].tolist() for r, s, n in sample_spans(micro, pad)]
        seen.extend(samples)
        if micro.tokens.numel() > 16:
            assert len(samples) == 1 and len(samples[0]) > 16  # only a sample over budget gets more
    assert sorted(seen) == sorted(r.tokens for r in rows)
    assert sum(m.weights.sum().item() for m in micro_batches) == pytest.approx(1.0)
    assert sum(m.tokens.numel() for m in micro_batches) < 16 * len(rows)  # short samples shared micro-batches


def test_minibatches_keep_rollouts_whole_even_and_in_order():
    names = ["a", "b", "a", "c", "d", "c", "e", "c"]
    rows = [row(name, [1, 2], [0, 1], [0.0, -1.0], 0.0, segment=i) for i, name in enumerate(names)]
    first, second = split_minibatches(rows, 2)
    assert [(r.rollout_id, r.segment_index) for r in first] == [
        ("a", 0), ("b", 1), ("a", 2), ("c", 3), ("c", 5), ("c", 7)]
    assert [(r.rollout_id, r.segment_index) for r in second] == [("d", 4), ("e", 6)]
    assert [len({r.rollout_id for r in part}) for part in split_minibatches(rows, 3)] == [2, 2, 1]
    assert len(split_minibatches(rows, 9)) == 5  # never an empty minibatch
    with pytest.raises(ValueError, match="at least 1"):
        split_minibatches(rows, 0)
    with pytest.raises(ValueError, match="empty batch"):
        split_minibatches([], 2)


def test_merged_stats_over_minibatches_average_their_losses():
    model = BigramModel(0)
    rows = fan_out_rows(model)
    losses, stats = [], []
    for part in split_minibatches(rows, 2):
        part_stats = []
        for micro in make_micro_batches(part, "token", 8, PAD, "cpu"):
            micro.prox_logprobs = token_logprobs(model, micro).detach()
            part_stats.append(policy_loss(token_logprobs(model, micro), micro, clip_eps=0.2, decoupled=True,
                                          importance_weight_cap=None, kl_coef=0.0)[1])
        losses.append(merge_stats(part_stats)["loss"])
        stats.extend(part_stats)
    assert merge_stats(stats)["loss"] == pytest.approx(sum(losses) / 2)
    assert merge_stats(stats)["tokens"] == sum(sum(r.loss_mask[1:]) for r in rows)


def test_bad_input_is_named():
    good = [row("a", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 1.0)]
    with pytest.raises(ValueError, match="unknown loss aggregation 'sequence'"):
        make_micro_batches(good, "sequence", 64, PAD, "cpu")
    with pytest.raises(ValueError, match="no rows"):
        make_micro_batches([], "token", 64, PAD, "cpu")
    with pytest.raises(ValueError, match="equally long"):
        make_micro_batches([row("a", [1, 2, 3], [0, 1], [0.0, -1.0, -1.0], 1.0)], "token", 64, PAD, "cpu")
    with pytest.raises(ValueError, match="no sampled tokens"):
        make_micro_batches([row("a", [1, 2], [0, 0], [0.0, 0.0], 1.0)], "token", 64, PAD, "cpu")
    (micro,) = make_micro_batches(good, "token", 64, PAD, "cpu")
    logprobs = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="prox_logprobs"):
        policy_loss(logprobs, micro, clip_eps=0.2, decoupled=True, importance_weight_cap=None, kl_coef=0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, micro, clip_eps=0.2, decoupled=False, importance_weight_cap=None, kl_coef=0.1)
