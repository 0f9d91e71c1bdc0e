"""One rollout turn by turn in the terminal: its prompt, tokens coloured by logprob, tools, grade, reward and
batch.

    rollstream inspect trajectory RUN ROLLOUT [--json] [--model DIR]

The rollout's data is shared/contract/rollout_view.py's `rollout_document` (the --json output);
`render_rollout` renders it. A rollout of several roles (or of one role that is not the run's default) shows
each segment's role and each turn's version as its role's ("planner v3"); one of the default role alone reads
as before roles existed ("policy v3").

    python -m pytest tests/unit/cli/test_inspect.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from rich.console import Group
from rich.padding import Padding
from rich.text import Text

from rollstream.cli.inspect.runs import says_more, version_text
from rollstream.shared.contract.events import GradingFailed

LOGPROB_STYLES: tuple[tuple[float | None, str], ...] = ((-0.5, "green"), (-2.0, "yellow"), (None, "red"))
CONTEXT_STYLE = "dim"
SYNC_STYLE = "bold magenta"


def logprob_style(logprob: float) -> str:
    for bound, style in LOGPROB_STYLES:
        if bound is None or logprob >= bound:
            return style
    return LOGPROB_STYLES[-1][1]


def tokens_text(tokens: Iterable[dict[str, Any]]) -> Text:
    """Tokens as rich Text: context (mask 0) dim, sampled ones coloured by their logprob."""
    text = Text()
    for token in tokens:
        text.append(token["text"],
                    style=CONTEXT_STYLE if not token["mask"] else logprob_style(token["logprob"]))
    return text


def logprob_legend() -> Text:
    return Text.assemble("tokens: ", ("sampled, logprob >= -0.5", "green"), "  ",
                         ("sampled, >= -2", "yellow"), "  ", ("sampled, < -2", "red"), "  ",
                         ("context: prompt, tool results (not sampled, mask 0)", CONTEXT_STYLE))


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _indented(renderable: Any) -> Padding:
    return Padding(renderable, (0, 0, 0, 2), expand=False)


def version_label(role: str | None, version: int, roles_shown: bool) -> str:
    """A turn's policy version as its role's ("planner v3") where roles are shown, else "policy v3"."""
    return f"{role if roles_shown and role else 'policy'} v{version}"


def per_role(values: dict[str, Any]) -> str:
    """"planner 1.0, solver 0.0": a value of each role."""
    return ", ".join(f"{role} {value}" for role, value in values.items())


def render_rollout(doc: dict[str, Any]) -> Group:
    """The rollout turn by turn, from rollout_document's data."""
    shown = doc["roles_shown"]
    header = Text.assemble(("rollout ", "bold"), (doc["rollout_id"], "bold cyan"),
                           f"  run {doc['run']}  group ", doc["group_id"] or "-",
                           f"  roles {', '.join(doc['roles'])}" if shown else "")
    legend = (logprob_legend() if doc["tokenizer"] else
              Text("no tokenizer: token ids shown (coloured by logprob, context dim)", style="italic"))
    out: list[Any] = [header, legend]
    out += _render_prompt(doc["prompt"])
    for attempt in doc["attempts"]:
        out += _render_attempt(attempt, shown)
    if not doc["attempts"]:
        out.append(Text("no trajectory events", style="yellow"))
    out += [_render_grade(grade) for grade in doc["grades"]]
    out += [_render_reward(reward) for reward in doc["rewards"]]
    if not doc["rewards"]:
        out.append(Text("RewardAssigned: none yet", style="yellow"))
    for batch in doc["batches"]:
        out += _render_batch(batch, shown)
    if not doc["batches"]:
        out.append(Text("BatchReady: in no batch yet", style="yellow"))
    return Group(*out)


def _render_prompt(prompt: dict[str, Any] | None) -> list[Any]:
    if prompt is None:
        return [Text("PromptIssued: not found", style="yellow")]
    check = f", sandbox check {prompt['sandbox_check']!r}" if prompt["sandbox_check"] else ""
    out: list[Any] = [Text.assemble(("PromptIssued", "bold"),
                                    f"  sample {prompt['sample_index']} of a group of "
                                    f"{prompt['group_size']}, label {prompt['label']!r}, "
                                    f"reward_fn {prompt['reward_fn']}", check,
                                    f", role {prompt['role']}" if prompt.get("role") else "",
                                    f", admitted at policy v{prompt['policy_version']}")]
    for message in prompt["messages"]:
        out.append(_indented(Text.assemble((f"{message.get('role', '?')}: ", "bold"),
                                           _shorten(str(message.get("content", "")), 2000))))
    return out


def _render_attempt(attempt: dict[str, Any], roles_shown: bool) -> list[Any]:
    label = attempt["attempt"] or "(unnamed)"
    out: list[Any] = [Text.assemble(("\nattempt ", "bold"), label,
                                    f"  server {attempt['server_url'] or '-'}")]
    for turn in attempt["turns"]:
        out += _render_turn(turn, roles_shown)
    for segment in attempt["segments"]:
        role = f" ({segment['role']})" if roles_shown else ""
        versions = (", ".join(f"{segment['role']} v{v}" for v in segment["turn_policy_versions"])
                    if roles_shown else str(segment["turn_policy_versions"]))
        out.append(Text(f"segment {segment['segment_index']}{role}: {segment['status']}, {segment['tokens']} "
                        f"tokens ({segment['sampled_tokens']} sampled), turn versions {versions}"))
    finished = attempt["finished"]
    if finished is None:
        out.append(Text("TrajectoryFinished: not found (still running, or lost)", style="yellow"))
    else:
        out.append(Text.assemble(("TrajectoryFinished", "bold"), f"  status {finished['status']}, "
                                 f"{finished['segment_count']} segment(s)",
                                 f", error {finished['error']}" if finished["error"] else "",
                                 "\n  response_text: ", _shorten(finished["response_text"], 2000)))
    return out


def _render_turn(turn: dict[str, Any], roles_shown: bool) -> list[Any]:
    version = version_label(turn["role"], turn["policy_version"], roles_shown)
    if turn["synced_mid_turn"]:
        versions = Text(f"{version} -> v{turn['policy_version_end']} (weights synced mid-turn)",
                        style=SYNC_STYLE)
    else:
        versions = Text(version)
    out: list[Any] = [Text.assemble((f"segment {turn['segment_index']} turn {turn['turn']}", "bold"), "  ",
                                    versions,
                                    f"  finish {turn['finish_reason']}  server {turn['server_url']}")]
    context = [t for t in turn["tokens"] if not t["mask"]]
    response = [t for t in turn["tokens"] if t["mask"]]
    if context:
        out.append(_indented(Text.assemble((f"context ({len(context)} tokens): ", "italic"),
                                           tokens_text(context))))
    out.append(_indented(Text.assemble((f"response ({len(response)} tokens): ", "italic"),
                                       tokens_text(response))))
    for tool in turn["tools"]:
        outcome = (Text("ok", style="green") if tool["ok"]
                   else Text(f"error ({tool['error_kind'] or 'unknown'})", style="red"))
        out.append(_indented(Text.assemble(("tool ", "bold"), (tool["name"], "bold cyan"),
                                           f"({json.dumps(tool['arguments'])}) -> ", outcome, ": ",
                                           _shorten(tool["content"]))))
    return out


def _render_grade(grade: dict[str, Any]) -> Text:
    if grade["type"] == GradingFailed.TYPE:
        return Text.assemble(("GradingFailed", "bold red"), f"  the sandbox could not grade it after "
                             f"{grade['attempts']} attempt(s): {grade['reason']!r}; no reward, left out "
                             "of its group's batch")
    return Text.assemble(("GradeReported", "bold"), f"  score {grade['score']}, ",
                         ("passed", "green") if grade["passed"] else ("failed", "red"),
                         f", reason {grade['reason']!r}, {grade['duration_s']:.2f}s")


def _render_reward(reward: dict[str, Any]) -> Text:
    """The rollout's reward and advantage, and each role's where its roles have their own."""
    role_rewards, role_advantages = reward["role_rewards"], reward["role_advantages"]
    return Text.assemble(("RewardAssigned", "bold"), f"  reward {reward['reward']}, advantage "
                         f"{reward['advantage']}, source {reward['source']}",
                         f"; per role: rewards {per_role(role_rewards)}"
                         if says_more(role_rewards, reward["reward"]) else "",
                         f"; per role: advantages {per_role(role_advantages)}"
                         if says_more(role_advantages, reward["advantage"]) else "")


def _render_batch(batch: dict[str, Any], roles_shown: bool) -> list[Any]:
    policies = batch["policies"]
    trained = ((", trained into " + ", ".join(version_text(p["version"], p["role_versions"])
                                              for p in policies)) if policies else ", not trained yet")
    out: list[Any] = [Text.assemble(("BatchReady", "bold"),
                                    f"  {batch['batch_id']}: {batch['sample_count']} samples, "
                                    f"min policy v{batch['min_policy_version']}, mean reward "
                                    f"{batch['mean_reward']:.4g}{trained}")]
    if batch["rows_error"]:
        out.append(_indented(Text(f"batch file unreadable: {batch['rows_error']}", style="yellow")))
    for row in batch["rows"] or []:
        role = f" ({row['role']})" if roles_shown else ""
        out.append(_indented(Text(f"row segment {row['segment_index']}{role}: {row['tokens']} tokens "
                                  f"({row['sampled_tokens']} sampled), reward {row['reward']}, "
                                  f"advantage {row['advantage']}")))
    return out
