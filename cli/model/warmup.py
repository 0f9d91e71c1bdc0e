"""Supervised warm-up on gold calculator episodes: a partly trained starting checkpoint for RL.

From random weights the tiny model never writes a tool call, and a long warm-up solves the task
outright, so RL needs a start in between. `warmup` trains on gold episodes; `evaluate` measures what
a checkpoint does in real episodes. The skills arrive in sudden jumps: copying the operands into the
call around step 300-500 (batch 32), copying the tool's result into the answer later, at a step that
moves by hundreds with the seed and even with floating-point noise. So `warmup` can stop at a target
exact-match rate instead of a fixed step count.

A gold episode is, token for token, what `tool_agent` builds at run time: the prompt rendered with the
calculator's schema from the tool registry, the tool call as the model would sample it (ending in
<|im_end|>), the tool's result as the chat template's delta, then the answer. The loss covers exactly
the sampled tokens. The episode is rendered in one piece here and split by character offsets, a
different route from TokenTrajectory's turn-by-turn deltas, so a test comparing the two can catch
the day they disagree.

`evaluate` runs the real `tool_agent` (hermes parser, registered calculator, the configured per-turn
token limit) against an in-process stand-in for the vLLM fleet that samples with transformers'
`generate`, and scores answers with the exact_match rule.

    rollstream warmup --model models/tiny-llama --out models/tiny-llama-warm --target-exact 0.25
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.shared.agent.environments import calculator  # noqa: F401  (registers the calculator tool)
from rollstream.shared.agent.environments.calculator import evaluate as calculate
from rollstream.shared.agent.environments.calculator import format_number
from rollstream.shared.agent.tools import ToolSet, resolve_tools
from rollstream.shared.inference.serving_weights import write_serving_checkpoint
from rollstream.shared.tasks.scoring import NUMBER, exact_match

TOOL_NAME = "calculator"
# Several phrasings so the policy does not hinge on one template; the number stays last because
# exact_match reads the last number.
ANSWER_STYLES = ("{c}", "The answer is {c}.", "{a} + {b} = {c}", "The result is {c}.")
OPERAND_MAX = 50  # as shared/tasks/datasets.py arithmetic_dataset
DEFAULT_LR = 1e-3
# beta2 0.95 rather than 0.999: the copying skill arrives ~100 steps sooner; 2e-3 and up stalls.
BETAS = (0.9, 0.95)
EVAL_SEED = 1_000_003  # far from the training seeds people pick (0, 1, 2...)
# warm-up's stopping checks: a final evaluation on EVAL_SEED is not the one it stopped on
CHECK_SEED = EVAL_SEED + 1


def calculator_schemas() -> list[dict]:
    """The schemas tool_agent passes to the chat template for a row with tools ["calculator"]."""
    return ToolSet(resolve_tools([TOOL_NAME])).schemas()


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def gold_messages(a: int, b: int, style: int = 0) -> list[dict[str, Any]]:
    """The conversation of a solved episode, as TokenTrajectory records it (call markup in the content)."""
    expression = f"{a} + {b}"
    call = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    result = format_number(calculate(expression))
    answer = ANSWER_STYLES[style % len(ANSWER_STYLES)].format(a=a, b=b, c=result)
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        # the id tool_agent gives the first well-formed call of turn 0
        {"role": "tool", "name": TOOL_NAME, "tool_call_id": "call_0_0", "content": result},
        {"role": "assistant", "content": answer},
    ]


@dataclass(frozen=True)
class GoldEpisode:
    tokens: list[int]
    loss_mask: list[int]
    """1 on the tokens the model samples: each assistant turn, its <|im_end|> included."""
    prompt_length: int
    label: str


def render_episode(tokenizer, messages: Sequence[dict[str, Any]], tools: list[dict]) -> GoldEpisode:
    """Tokens and loss mask of a finished episode whose last message is the assistant's answer."""
    eos = tokenizer.eos_token

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(list(messages[:upto]), tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    # The episode stops at the answer's <|im_end|>: the template's trailing newline is never appended.
    text = render(len(messages), False)
    if not text.endswith(eos + "\n"):
        raise ValueError(f"the chat template does not end a turn with {eos!r} and a newline")
    text = text[:-1]
    spans = []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render(index, True))
            spans.append((start, start + len(message["content"]) + len(eos)))
    if text[spans[-1][1]:]:
        raise ValueError("the last message must be the assistant's answer")
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for begin, end in encoding["offset_mapping"]:
        inside = any(start <= begin and end <= stop for start, stop in spans)
        if not inside and any(begin < stop and start < end for start, stop in spans):
            raise ValueError(f"a token spans the edge of an assistant turn (characters {begin}-{end})")
        mask.append(int(inside))
    tokens = list(encoding["input_ids"])
    label = NUMBER.findall(messages[-1]["content"])[-1]
    return GoldEpisode(tokens=tokens, loss_mask=mask, prompt_length=mask.index(1), label=label)


def gold_episode(tokenizer, a: int, b: int, style: int = 0, tools: list[dict] | None = None) -> GoldEpisode:
    return render_episode(tokenizer, gold_messages(a, b, style),
                          tools if tools is not None else calculator_schemas())


def gold_episode_drawer(tokenizer, seed: int) -> Callable[[], GoldEpisode]:
    """Draws gold episodes of random operands and answer styles from `seed`; each one drawn again is
    rendered only once (rendering costs about a third of a step)."""
    tools = calculator_schemas()
    rng = random.Random(seed)
    cache: dict[tuple[int, int, int], GoldEpisode] = {}

    def draw() -> GoldEpisode:
        key = (rng.randint(0, OPERAND_MAX), rng.randint(0, OPERAND_MAX), rng.randrange(len(ANSWER_STYLES)))
        if key not in cache:
            cache[key] = gold_episode(tokenizer, *key, tools=tools)
        return cache[key]

    return draw


# ---------------------------------------------------------------------------------------- training
def supervised_loss(model, episodes: Sequence[GoldEpisode]):
    """Mean next-token cross-entropy over the sampled tokens of a batch.

    The episodes share a long prefix (the system turn with the tool schema, ~85% of each episode's
    tokens): it runs once and its keys and values are repeated for the batch, which is several times
    faster than running every episode whole and gives the same loss and gradients.
    """
    import torch

    first = episodes[0].tokens
    # Stop before the first sampled token: its prediction would need the prefix's logits.
    shared = min(e.prompt_length for e in episodes) - 1
    for episode in episodes[1:]:
        shared = next((i for i in range(shared) if episode.tokens[i] != first[i]), shared)
    prefix = model.model(input_ids=torch.tensor([first[:shared]]), use_cache=True).past_key_values
    prefix.batch_repeat_interleave(len(episodes))

    width = max(len(e.tokens) for e in episodes) - shared
    ids = torch.full((len(episodes), width), model.config.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(episodes), shared + width), dtype=torch.long)
    attention[:, :shared] = 1
    targets = torch.full((len(episodes), width), -100, dtype=torch.long)
    for row, episode in enumerate(episodes):
        n = len(episode.tokens) - shared
        ids[row, :n] = torch.tensor(episode.tokens[shared:])
        attention[row, shared:shared + n] = 1
        targets[row, :n] = torch.where(torch.tensor(episode.loss_mask[shared:]) == 1, ids[row, :n], -100)
    positions = torch.arange(shared, shared + width).expand(len(episodes), -1)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=prefix,
                   use_cache=True).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                             targets[:, 1:].reshape(-1), ignore_index=-100)


def warmup(model_path: Path, out_path: Path, steps: int, batch_size: int = 32, lr: float = DEFAULT_LR,
           seed: int = 0, target_exact: float | None = None, check_every: int = 50,
           check_prompts: int = 64) -> dict[str, Any]:
    """Train on fresh gold episodes for `steps` AdamW steps; save weights and tokenizer to out_path.

    With `target_exact`, the policy is evaluated every `check_every` steps (temperature 1, on prompts
    disjoint in seed from `evaluate`'s default ones) and training stops at the first check at or above
    it; `steps` is then the most it trains. The copying skill arrives in a sudden jump whose step
    varies from run to run, so a target places the start more reliably than a step count.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 1 or batch_size < 1 or check_every < 1:
        raise ValueError("steps, batch_size and check_every must be at least 1")
    model_path, out_path = Path(model_path), Path(out_path)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    draw = gold_episode_drawer(tokenizer, seed)
    losses: list[float] = []
    checks: list[dict[str, Any]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS)
        for step in range(1, steps + 1):
            loss = supervised_loss(model, [draw() for _ in range(batch_size)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if target_exact is not None and (step % check_every == 0 or step == steps):
                model.eval()
                result = evaluate_policy(model, tokenizer, check_prompts, seed=CHECK_SEED, temperature=1.0)
                model.train()
                checks.append({"step": step, "exact": result["exact"], "mean_reward": result["mean_reward"]})
                if result["exact"] >= target_exact:
                    break
    stats = {"source": str(model_path), "steps": len(losses), "batch_size": batch_size, "lr": lr,
             "seed": seed, "first_loss": losses[0], "final_loss": losses[-1],
             "seconds": round(time.monotonic() - started, 2)}
    if target_exact is not None:
        stats.update(target_exact=target_exact, reached=checks[-1]["exact"] >= target_exact, checks=checks)
    save_checkpoint(model, model_path, out_path, stats)
    return {**stats, "out": str(out_path)}


def save_checkpoint(model, source: Path, out_path: Path, stats: dict[str, Any]) -> None:
    """Write into a temporary sibling directory and rename it into place: a reader never sees half a
    checkpoint, and an older one at out_path is replaced only once the new one is complete."""
    from rollstream.shared.runtime.storage import replace_dir

    out_path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        write_serving_checkpoint(model, temp, tokenizer_source=source)
        (temp / "warmup.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        temp.chmod(0o755)  # mkdtemp makes it 0700
        replace_dir(temp, out_path)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


# -------------------------------------------------------------------------------------- evaluation
class LocalFleet:
    """Stands in for FleetClient in `tool_agent`: samples with transformers' generate.

    The episodes run concurrently; once every unfinished episode is waiting for a completion, their
    requests are generated as one left-padded batch. Completions follow FleetClient's contract: the
    <|im_end|> that stops a turn is included, logprobs are raw (before temperature) like vLLM's.
    """

    server_url = "local"

    def __init__(self, model, episodes: int) -> None:
        self.model = model
        self.active = episodes
        self.pending: list[tuple[list[int], int, float, asyncio.Future]] = []

    async def complete(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0,
                       session_id: str, extra: dict | None = None):
        if extra:
            raise ValueError(f"the local fleet takes no extra sampling parameters, got {sorted(extra)}")
        future = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), max_tokens, temperature, future))
        self._generate_when_all_wait()
        return await future

    def episode_finished(self) -> None:
        self.active -= 1
        self._generate_when_all_wait()

    def _generate_when_all_wait(self) -> None:
        if not self.pending or len(self.pending) < self.active:
            return
        batch, self.pending = self.pending, []
        try:
            completions = self._generate(batch)
        except Exception as exc:
            for *_, future in batch:
                future.set_exception(exc)
            return
        for (*_, future), completion in zip(batch, completions):
            future.set_result(completion)

    def _generate(self, batch):
        import torch

        from rollstream.shared.inference.fleet import Completion

        temperatures = {temperature for _, _, temperature, _ in batch}
        if len(temperatures) != 1:
            raise ValueError(f"one temperature per batch, got {sorted(temperatures)}")
        temperature = temperatures.pop()
        config = self.model.config
        pad, eos = config.pad_token_id, config.eos_token_id
        width = max(len(ids) for ids, *_ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, *_ in batch])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, *_ in batch])
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                    if temperature > 0 else {"do_sample": False})
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attention,
                                      max_new_tokens=max(limit for _, limit, _, _ in batch),
                                      eos_token_id=eos, pad_token_id=pad, output_logits=True,
                                      return_dict_in_generate=True, **sampling)
        new = out.sequences[:, width:]
        vocab_logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
        logprobs = vocab_logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row, (_, limit, _, _) in enumerate(batch):
            tokens = new[row, :limit].tolist()
            finish = "length"
            if eos in tokens:
                tokens, finish = tokens[: tokens.index(eos) + 1], "stop"
            completions.append(Completion(token_ids=tokens, logprobs=logprobs[row, : len(tokens)].tolist(),
                                          finish_reason=finish, server_url=self.server_url))
        return completions


def evaluate(model_path: Path, prompts: int, seed: int = EVAL_SEED, temperature: float = 1.0,
             max_tokens: int | None = None, max_turns: int | None = None) -> dict[str, Any]:
    """Run `prompts` calculator episodes (arithmetic_dataset rows from `seed`) with tool_agent and
    score their answers with exact_match. Limits default to the configuration (rollout.max_tokens,
    agent.max_turns, agent.max_total_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return evaluate_policy(model, tokenizer, prompts, seed=seed, temperature=temperature,
                           max_tokens=max_tokens, max_turns=max_turns)


def evaluate_policy(model, tokenizer, prompts: int, seed: int = EVAL_SEED, temperature: float = 1.0,
                    max_tokens: int | None = None, max_turns: int | None = None) -> dict[str, Any]:
    """`evaluate` for a model already in memory."""
    import torch

    from rollstream.shared.agent.loop import AgentContext, Limits, Task, tool_agent
    from rollstream.shared.agent.tool_calls import get_format
    from rollstream.shared.agent.tools import Episode
    from rollstream.shared.runtime.config import Settings
    from rollstream.shared.tasks.datasets import arithmetic_dataset

    if prompts < 1:
        raise ValueError("evaluate needs at least one prompt")
    settings = Settings()
    limits = Limits(max_turns=max_turns or settings.agent.max_turns,
                    max_tokens_per_turn=max_tokens or settings.rollout.max_tokens,
                    max_total_tokens=settings.agent.max_total_tokens)
    rows = arithmetic_dataset(prompts, seed=seed, sandbox_every=0)
    fleet = LocalFleet(model, len(rows))
    hermes = get_format("hermes")
    started = time.monotonic()

    async def episode(index: int, row):
        ctx = AgentContext(fleet=fleet, tokenizer=tokenizer, tools=ToolSet(resolve_tools(row.tools)),
                           tool_format=hermes, limits=limits, episode=Episode(episode_id=f"eval-{index}"),
                           session_id=f"eval-{index}", temperature=temperature)
        try:
            task = Task(messages=row.messages, label=row.label, metadata=dict(row.metadata))
            return await tool_agent(task, ctx)
        finally:
            fleet.episode_finished()

    async def run_all():
        return await asyncio.gather(*(episode(i, row) for i, row in enumerate(rows)))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        segments = asyncio.run(run_all())
    rewards = [exact_match(s.response_text, row.label) for s, row in zip(segments, rows)]
    right_calls = sum(any(t.ok and t.name == TOOL_NAME and t.content == row.label for t in s.tools)
                      for s, row in zip(segments, rows))
    longest = max(len(t.response_ids) for s in segments for t in s.turns)
    return {
        "prompts": len(rows),
        "temperature": temperature,
        "exact": sum(r == 1.0 for r in rewards) / len(rows),
        "mean_reward": sum(rewards) / len(rows),
        "rewards": rewards,
        "correct_tool_call": right_calls / len(rows),
        "completed": sum(s.status == "completed" for s in segments) / len(rows),
        "truncated_turns": sum(t.finish_reason == "length" for s in segments for t in s.turns),
        "longest_turn_tokens": longest,
        "max_tokens_per_turn": limits.max_tokens_per_turn,
        "seconds": round(time.monotonic() - started, 2),
        "examples": [{"question": row.messages[-1]["content"], "answer": s.response_text, "reward": r}
                     for s, row, r in list(zip(segments, rows, rewards))[:3]],
    }
