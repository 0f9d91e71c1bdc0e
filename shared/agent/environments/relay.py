"""The relay: a two-role episode users can copy. A planner and a solver, two LoRA adapters of one base model
served by one fleet, each trained on its own turns with a reward of its own.

The task is "What is a + b + c?". The planner (role `planner`) computes the first step, a + b, with the
calculator, as a calculator episode of its own ("What is a + b?"); the solver (role `solver`) is handed the
planner's result and finishes: "What is <planner's answer> + c?". One rollout, two segments, two roles:

- the planner is scored by `first_step` (roles.names.planner.reward_function): its answer against a + b;
- the solver takes the rollout's reward, `final_answer` (reward.function): the final answer against a + b + c,
  the team's outcome, so a wrong first step costs the solver too.

The label carries both answers as JSON ({"first": "42", "final": "57"}). `rollstream run --example relay`
runs it (cli/examples.py sets the roles, LoRA and the reward functions, and writes relay_dataset's rows).

    python -m pytest tests/unit/shared/agent/test_relay.py -q
"""

from __future__ import annotations

import json
import random

from rollstream.shared.agent.environments import calculator  # noqa: F401  (registers its tool)
from rollstream.shared.agent.loop import AgentContext, Task, tool_agent
from rollstream.shared.contract.rollouts import Segment
from rollstream.shared.tasks.rows import PromptRow
from rollstream.shared.tasks.scoring import NUMBER, exact_match

ROLES = ("planner", "solver")
AGENT = "rollstream.shared.agent.environments.relay:relay"
"""The loop, as a row names it: an import path, as a loop of your own is named."""


def relay_dataset(size: int, seed: int) -> list[PromptRow]:
    """`size` relay prompts: a, b, c in 0..50 (the range the tiny model's warm-up covers, for each step)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b, c = rng.randint(0, 50), rng.randint(0, 50), rng.randint(0, 50)
        rows.append(PromptRow(
            messages=[{"role": "user", "content": f"What is {a} + {b} + {c}?"}],
            label=json.dumps({"first": str(a + b), "final": str(a + b + c)}),
            agent=AGENT, tools=["calculator"],
            metadata={"task": "relay", "a": a, "b": b, "c": c},
        ))
    return rows


async def relay(task: Task, ctx: AgentContext) -> list[Segment]:
    """The planner's calculator episode on a + b, then the solver's on its result + c."""
    a, b, c = (task.metadata[key] for key in "abc")
    first = Task([{"role": "user", "content": f"What is {a} + {b}?"}], task.label, task.metadata)
    plan = await tool_agent(first, ctx.as_role("planner"))
    numbers = NUMBER.findall(plan.response_text)
    if not numbers:
        return [plan]  # no number to hand on: the rollout's answer is the planner's, with no number: 0
    handed_over = numbers[-1]
    second = Task([{"role": "user", "content": f"What is {handed_over} + {c}?"}], task.label, task.metadata)
    solve = await tool_agent(second, ctx.as_role("solver"), segment_index=1)
    return [plan, solve]


def first_step(response: str, label: str | None) -> float:
    """The planner's reward: its answer against a + b (exact_match's credits)."""
    return exact_match(response, _answers(label)["first"])


def final_answer(response: str, label: str | None) -> float:
    """The rollout's reward, the solver's: the final answer against a + b + c (a planner that handed no
    number on left an answer without one: 0)."""
    return exact_match(response, _answers(label)["final"])


def _answers(label: str | None) -> dict[str, str]:
    try:
        answers = json.loads(label or "")
        return {"first": str(answers["first"]), "final": str(answers["final"])}
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"a relay label is JSON with the answers 'first' and 'final', not "
                         f"{label!r}") from None
