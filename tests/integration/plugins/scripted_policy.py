"""A vLLM logits processor that makes the tiny model answer a coding agent's turns from a script.

The coding-agent tests run Claude Code and Codex CLI, unmodified, against a model whose answers are noise:
what they test is the protocol (the clients' real requests, tool calls carried out inside the sandbox, token-
exact samples), and noise never calls a tool. This processor, loaded into a real vLLM server with
`--logits-processors tests.integration.plugins.scripted_policy:ScriptedPolicy`, forces the sampled ids of
turns whose prompt offers a scripted tool: the turn after k tool results makes the script's k-th call, and
the turn after the last call's result answers with the script's final text. vLLM still samples every id (a
forced id is the only one left with a finite logit), so the same prompt and seed give the same ids, and the
logprobs it returns are the model's own (vLLM computes them before logits processors run).

The script is a JSON file named by RS_SCRIPTED_POLICY, a list of rules tried in order:

    [{"tool": "Bash", "calls": [{"command": "sed -i ..."}], "final": "Fixed."},
     {"tool": "run_shell_command", "calls": [{"tool": "read_file", "arguments": {...}}, {"command": ...}],
      "final": "Fixed."}]

`tool` is the tool whose offer selects the rule, and the tool a call names unless it names its own (a call
is its arguments, or `{"tool", "arguments"}`). A prompt that offers none of the rules' tools is left to the
model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

SCRIPT_ENV = "RS_SCRIPTED_POLICY"


class ScriptedPolicy(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.rules = json.loads(Path(os.environ[SCRIPT_ENV]).read_text())
        self.end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.tool_result = self.tokenizer.convert_tokens_to_ids("<tool_response>")
        self.forced: dict[int, tuple[list[int], list[int]]] = {}
        """Batch index -> (the ids the answer must be, the request's live list of output ids)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def answer_for(self, prompt_ids: list[int]) -> list[int] | None:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        for rule in self.rules:
            if f'"name": "{rule["tool"]}"' not in prompt:
                continue
            made = prompt_ids.count(self.tool_result)
            if made >= len(rule["calls"]):
                text = rule["final"]
            else:
                call = rule["calls"][made]
                if "arguments" in call:
                    call = {"name": call.get("tool", rule["tool"]), "arguments": call["arguments"]}
                else:
                    call = {"name": rule["tool"], "arguments": call}
                text = f"<tool_call>{json.dumps(call)}</tool_call>"
            return [*self.tokenizer.encode(text, add_special_tokens=False), self.end_of_turn]
        return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for index, _params, prompt_ids, output_ids in batch_update.added:
            answer = self.answer_for(list(prompt_ids or ()))
            if answer is None:
                self.forced.pop(index, None)
            else:
                self.forced[index] = (answer, output_ids)
        for source, target, direction in batch_update.moved:
            moving = self.forced.pop(source, None)
            if direction == MoveDirectionality.SWAP:
                other = self.forced.pop(target, None)
                if other is not None:
                    self.forced[source] = other
            if moving is not None:
                self.forced[target] = moving
            else:
                self.forced.pop(target, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (answer, output_ids) in self.forced.items():
            step = len(output_ids)
            token = answer[step] if step < len(answer) else self.end_of_turn
            keep = logits[index, token].clone()
            logits[index] = float("-inf")
            logits[index, token] = keep
        return logits
