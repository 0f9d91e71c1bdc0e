"""The prompt of a turn, token-exactly: the session's earlier ids as sampled, plus the template's delta.

`plan_turn` finds the deepest earlier turn whose conversation the request's history extends (sessions.py
explains the keys). From there the prompt is that turn's chain of exact ids, then the text the chat template
puts after the model's answer (`ChatTemplate.glue_after`: e.g. the newline after `<|im_end|>`, or the whole
turn close when the answer was cut by max_tokens), then the template's rendering of the new messages with
the generation prompt, tokenized once. The model's earlier output is never re-tokenized. A history that
extends no earlier turn starts a new conversation in the session (a compaction, a sub-agent, an edit before
the first answer), rendered and tokenized whole.

Both functions here are synchronous (Jinja rendering and tokenizing hold the GIL for milliseconds): the
gateway runs them in worker threads, never on its event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollstream.services.gateway.apis.canonical import ChatRequest, RequestError, message_key
from rollstream.services.gateway.sessions import ROOT, SessionStore, TurnNode, conversation_keys
from rollstream.shared.errors import TemplateError

PROBE = "\x00probe\x00"


class ChatTemplate:
    """The served model's chat template and tokenizer, and what the template puts after an answer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": PROBE}]
        rendered = self.render(probe, None, add_generation_prompt=False)
        if PROBE not in rendered:
            raise TemplateError("the chat template does not render an assistant message's content as given")
        self.turn_close = rendered[rendered.index(PROBE) + len(PROBE):]
        """What the template writes after an assistant message's content, e.g. '<|im_end|>\\n'."""
        eos = tokenizer.eos_token_id
        self.end_of_turn_ids = {eos} if isinstance(eos, int) else set(eos or ())

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def glue_after(self, node: TurnNode) -> str:
        """The template text between the model's last sampled id and the next message."""
        if node.finish_reason == "stop" and node.response_ids and node.response_ids[-1] in self.end_of_turn_ids:
            end = self.tokenizer.decode(node.response_ids[-1:], skip_special_tokens=False)
            if self.turn_close.startswith(end):
                return self.turn_close[len(end):]
        return self.turn_close


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, separators=(",", ":"))


def turn_key(message: dict[str, Any]) -> str:
    """message_key as text (a tuple of strings: its repr is the same in every process)."""
    return repr(message_key(message))


@dataclass
class PlannedTurn:
    parent: str
    """Node key the turn continues; ROOT when it starts a conversation."""
    prefix_ids: list[int]
    appended_ids: list[int]
    conversation: list[str]
    """The request's message keys (turn_key of each)."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.prefix_ids + self.appended_ids


def plan_turn(template: ChatTemplate, store: SessionStore, session_id: str, request: ChatRequest,
              max_prompt_tokens: int) -> PlannedTurn:
    messages = request.messages
    if not messages:
        raise RequestError(400, "messages: at least one message is needed", param="messages")
    if messages[-1]["role"] == "assistant":
        raise RequestError(400, "the last message is the assistant's: continuing a prefilled answer is not "
                                "supported; end with a user or tool message", param="messages")
    keys = [turn_key(m) for m in messages]
    conversation = conversation_keys(tools_key(request.tools), keys)
    answered = [conversation[i] for i, m in enumerate(messages) if m["role"] == "assistant"]
    planned = None
    full = template.render(messages, request.tools, add_generation_prompt=True)
    found = store.deepest_known(session_id, answered)
    if found is not None:
        parent, node = found
        closes = conversation.index(parent)
        before = template.render(messages[: closes + 1], request.tools, add_generation_prompt=False)
        # A template that renders earlier turns differently once more follow cannot be extended: start over.
        if full.startswith(before):
            chain = store.chain(session_id, parent)
            prefix = [t for n in chain for t in (*n.appended_ids, *n.response_ids)]
            delta = template.glue_after(node) + full[len(before):]
            planned = PlannedTurn(parent, prefix, template.encode(delta), keys)
    if planned is None:
        planned = PlannedTurn(ROOT, [], template.encode(full), keys)
    length = len(planned.prompt_ids)
    if length > max_prompt_tokens:
        raise RequestError(400, f"the prompt is {length} tokens; this gateway takes at most {max_prompt_tokens}",
                           param="messages")
    return planned


def answer_key(request: ChatRequest, planned: PlannedTurn, answer: dict[str, Any]) -> str:
    """The node key of the conversation this turn's answer closes."""
    return conversation_keys(tools_key(request.tools), [*planned.conversation, turn_key(answer)])[-1]
