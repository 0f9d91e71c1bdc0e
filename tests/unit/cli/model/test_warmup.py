"""The supervised warm-up: gold episodes token-exact with the agent's, a loss on exactly the sampled
tokens, a loadable checkpoint, and an evaluation that runs the real agent loop."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollstream.cli.model.warmup import (
    ANSWER_STYLES,
    LocalFleet,
    calculator_schemas,
    evaluate,
    exact_match,
    gold_episode,
    gold_messages,
    supervised_loss,
    warmup,
)
from rollstream.shared.agent.loop import TokenTrajectory
from rollstream.shared.runtime.config import Settings

CASES = [(0, 0, 0), (7, 3, 1), (12, 7, 2), (50, 50, 3), (9, 41, 0), (33, 42, 1)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tests share two cores with other work: two OpenMP threads that keep losing their core
    spin and run several times slower than one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def warmed(tiny_dir, tmp_path_factory):
    """Long enough that the policy calls the tool and answers with a number; well short of solving it."""
    out = tmp_path_factory.mktemp("warmup") / "warm"
    return out, warmup(tiny_dir, out, steps=80, batch_size=16, seed=0)


def sampled_turns(tokenizer, messages):
    """The ids a model emits for each assistant turn: its text, then <|im_end|>."""
    return [tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            for m in messages if m["role"] == "assistant"]


def trajectory_of(tokenizer, messages, tools):
    """The episode as tool_agent builds it, the gold turns fed in as if the engine had sampled them."""
    trajectory = TokenTrajectory(tokenizer, messages[:1], tools)
    turns = iter(sampled_turns(tokenizer, messages))
    for message in messages[1:]:
        if message["role"] == "assistant":
            ids = next(turns)
            trajectory.append_sampled(ids, [0.0] * len(ids))
        else:
            trajectory.append_messages([message])
    return trajectory


@pytest.mark.parametrize("a,b,style", CASES)
def test_gold_episode_is_token_exact_with_the_agents_trajectory(tokenizer, a, b, style):
    tools = calculator_schemas()
    messages = gold_messages(a, b, style)
    trajectory = trajectory_of(tokenizer, messages, tools)
    gold = gold_episode(tokenizer, a, b, style, tools)
    assert gold.tokens == trajectory.tokens
    assert gold.loss_mask == trajectory.loss_mask
    assert gold.prompt_length == trajectory.prompt_length
    assert trajectory.retokenization_mismatch() is None
    assert gold.label == str(a + b)
    assert exact_match(messages[-1]["content"], gold.label) == 1.0


def test_the_prompt_is_the_one_tool_agent_renders_for_a_calculator_row(tokenizer):
    from rollstream.shared.tasks.datasets import arithmetic_dataset

    row = arithmetic_dataset(1, seed=3, sandbox_every=0)[0]
    a, b = row.metadata["a"], row.metadata["b"]
    gold = gold_episode(tokenizer, a, b)
    agent_prompt = TokenTrajectory(tokenizer, row.messages, calculator_schemas()).tokens
    assert gold.tokens[:gold.prompt_length] == agent_prompt
    assert '"name": "calculator"' in tokenizer.decode(agent_prompt)


@pytest.mark.parametrize("a,b,style", CASES)
def test_the_loss_mask_covers_exactly_the_sampled_tokens(tokenizer, a, b, style):
    messages = gold_messages(a, b, style)
    gold = gold_episode(tokenizer, a, b, style)
    runs, current = [], []
    for token, masked in zip(gold.tokens, gold.loss_mask):
        if masked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    assert runs == sampled_turns(tokenizer, messages)
    assert gold.loss_mask[-1] == 1 and gold.tokens[-1] == tokenizer.eos_token_id
    assert not any(gold.loss_mask[:gold.prompt_length])


def test_every_gold_turn_fits_the_configured_per_turn_limit(tokenizer):
    limit = Settings().rollout.max_tokens
    longest = max(len(ids) for a in range(51) for b in range(51) for style in range(len(ANSWER_STYLES))
                  for ids in sampled_turns(tokenizer, gold_messages(a, b, style)))
    assert longest <= limit


def test_the_shared_prefix_loss_equals_the_plain_loss_and_gradients(tiny_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    episodes = [gold_episode(tokenizer, a, b, style) for a, b, style in CASES]

    width = max(len(e.tokens) for e in episodes)
    ids = torch.zeros((len(episodes), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, e in enumerate(episodes):
        ids[row, :len(e.tokens)] = torch.tensor(e.tokens)
        attention[row, :len(e.tokens)] = 1
        labels[row, :len(e.tokens)] = torch.tensor([t if m else -100 for t, m in zip(e.tokens, e.loss_mask)])
    plain = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shared = supervised_loss(model, episodes)
    shared.backward()
    assert shared.item() == pytest.approx(plain.item(), rel=1e-5)
    for p, expected in zip(model.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6)


def test_exact_match_is_the_reward_services_rule():
    from rollstream.services.reward.rewards import exact_match as service_rule

    for response, label in [("The answer is 19.", "19"), ("12 + 7 = 19", "19"), ("19", "18"),
                            ("no idea", "19"), ("19 or 20", "19"), ("-3", "-3"), ("", "0")]:
        assert exact_match(response, label) == service_rule(response, label)


def test_warmup_lowers_the_loss_and_writes_a_loadable_checkpoint(tiny_dir, tokenizer, warmed):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, stats = warmed
    assert stats["steps"] == 80 and stats["final_loss"] < stats["first_loss"]
    held_out = [gold_episode(tokenizer, a, b, style) for a, b, style in CASES]
    losses = {}
    for name, path in (("before", tiny_dir), ("after", out)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            losses[name] = supervised_loss(model, held_out).item()
    assert losses["after"] < losses["before"] / 2
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert (out / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "warmup.json").read_text())["steps"] == 80
    reloaded = AutoTokenizer.from_pretrained(out)
    messages = gold_messages(3, 4)
    assert reloaded.apply_chat_template(messages, tools=calculator_schemas(), tokenize=False) == \
        tokenizer.apply_chat_template(messages, tools=calculator_schemas(), tokenize=False)
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_warmup_replaces_an_existing_checkpoint(tiny_dir, tmp_path):
    out = tmp_path / "warm"
    warmup(tiny_dir, out, steps=1, batch_size=2)
    (out / "stale.txt").write_text("from an older checkpoint")
    stats = warmup(tiny_dir, out, steps=1, batch_size=2, seed=1)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "warmup.json").read_text())["seed"] == 1 == stats["seed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm"]


def test_warmup_with_a_target_stops_at_the_first_check_that_reaches_it(tiny_dir, tmp_path):
    stats = warmup(tiny_dir, tmp_path / "reached", steps=6, batch_size=2, target_exact=0.0, check_every=2,
                   check_prompts=2)
    assert stats["steps"] == 2 and stats["reached"]
    assert [c["step"] for c in stats["checks"]] == [2]
    stats = warmup(tiny_dir, tmp_path / "missed", steps=3, batch_size=2, target_exact=1.01, check_every=2,
                   check_prompts=2)
    assert stats["steps"] == 3 and not stats["reached"]
    assert [c["step"] for c in stats["checks"]] == [2, 3]
    assert json.loads((tmp_path / "missed" / "warmup.json").read_text())["reached"] is False


def test_local_fleet_batches_like_single_requests_and_reports_raw_logprobs(tokenizer, warmed):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(warmed[0], dtype=torch.float32).eval()
    prompts = [gold_episode(tokenizer, a, b).tokens[:gold_episode(tokenizer, a, b).prompt_length]
               for a, b in [(1, 2), (33, 42), (5, 47)]]
    assert len({len(p) for p in prompts}) > 1  # the batch needs left padding

    async def complete(batch):
        fleet = LocalFleet(model, len(batch))
        return await asyncio.gather(*(fleet.complete(p, max_tokens=24, temperature=0.0, session_id="s")
                                      for p in batch))

    together = asyncio.run(complete(prompts))
    for prompt, completion in zip(prompts, together):
        (alone,) = asyncio.run(complete([prompt]))
        assert completion.token_ids == alone.token_ids
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt + alone.token_ids])).logits[0].log_softmax(-1)
        expected = [logprobs[len(prompt) - 1 + k, t].item() for k, t in enumerate(alone.token_ids)]
        assert completion.logprobs == pytest.approx(expected, abs=1e-4)
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == tokenizer.eos_token_id


def test_evaluate_scores_a_warmed_up_policy_above_the_random_one(tiny_dir, warmed):
    results = {}
    for name, path in (("random", tiny_dir), ("warm", warmed[0])):
        results[name] = evaluate(path, 32, seed=11, temperature=0.0)
    sampled = evaluate(warmed[0], 16, seed=11, temperature=1.0)
    for result in (*results.values(), sampled):
        for key in ("exact", "mean_reward", "correct_tool_call", "completed"):
            assert 0.0 <= result[key] <= 1.0
        assert result["prompts"] in (16, 32)
        assert result["longest_turn_tokens"] <= result["max_tokens_per_turn"]
    # The warmed-up policy ends most episodes with a number (reward >= 0.1); the random one rambles on.
    assert results["warm"]["mean_reward"] >= 0.08 > results["random"]["mean_reward"]
    assert results["warm"]["completed"] >= 0.75 > results["random"]["completed"]
