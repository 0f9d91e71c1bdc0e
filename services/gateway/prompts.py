"""The prompt of a turn, token-exactly: the session's earlier ids as sampled, plus the template's delta.

`plan_turn` finds the deepest earlier turn whose conversation the request's history extends (sessions.py
explains the keys). From there the prompt is that turn's chain of exact ids, then the text the chat template
puts after the model's answer (`ChatTemplate.glue_after`: e.g. the newline after `<|im_end|>`, or the whole
turn close when the answer was cut by max_tokens), then the template's rendering of the new messages with
the generation prompt, tokenized once. The model's earlier output is never re-tokenized. A history that
extends no earlier turn starts a new conversation in the session (a compaction, a sub-agent, an edit before
the first answer), rendered and tokenized whole.

Templates that rewrite history (Qwen3-style: earlier turns' reasoning is dropped once a new user message
follows; a template that writes an empty think block only on the last answer) render the answered history
differently from the ids recorded for it. The session stays token-exact all the same: the prompt is the
recorded ids (what the model saw and sampled, reasoning included), then the new messages as the template
renders them after an answer (`ChatTemplate.text_after`), and the turn says `history_rewritten`, which the
sample's metadata reports. gateway.on_rewritten_history = "fork" starts a new conversation instead.

A request's `History` (its messages' node keys) is made before its session is read, which reads the nodes of
every conversation the history holds (the chain of the deepest one) in the same round trip. `plan_turn` then
renders and tokenizes in a worker thread: Jinja rendering and tokenizing hold the GIL for milliseconds
(tokenizing about 0.4 us a character). A request of fewer than INLINE_CHARACTERS is rendered and tokenized on
the event loop: that takes less than the hop to a thread.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from rollstream.services.gateway.apis.canonical import ChatRequest, message_key
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.sessions import ROOT, Session, SessionStore, TurnNode, conversation_keys
from rollstream.shared.errors import TemplateError

INLINE_CHARACTERS = 2048
"""Requests whose messages (content, tool calls, reasoning) and tools are shorter are rendered and tokenized
on the event loop (under a millisecond); longer ones in a worker thread."""
PROBE = "\x00probe\x00"
MARKER = "\x00rollstream-continuation\x00"


class ChatTemplate:
    """The served model's chat template and tokenizer, and what the template puts after an answer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = {}
        """Variables the template is rendered with besides messages and tools (see `with_thinking`)."""
        turn_close = self._after_probe([{"role": "user", "content": "u"},
                                        {"role": "assistant", "content": PROBE}])
        if turn_close is None:
            raise TemplateError("the chat template does not render an assistant message's content as given")
        self.turn_close = turn_close
        """What the template writes after an assistant message's content, e.g. '<|im_end|>\\n'."""
        self.user_turn_close = self._after_probe([{"role": "user", "content": PROBE}])
        """What the template writes after a user message's content."""
        eos = tokenizer.eos_token_id
        self.end_of_turn_ids = {eos} if isinstance(eos, int) else set(eos or ())

    def _after_probe(self, messages: list[dict[str, Any]]) -> str | None:
        """What the template writes after the last message's content, PROBE; None when it does not render
        it."""
        rendered = self.render(messages, None, add_generation_prompt=False)
        at = rendered.find(PROBE)
        return None if at < 0 else rendered[at + len(PROBE):]

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
               add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def with_thinking(self, thinking: bool | None) -> ChatTemplate:
        """This template rendering with `enable_thinking` as a request asks (the switch of hybrid reasoning
        templates such as Qwen3's; a template that does not read it renders as before); itself when the
        request does not say."""
        if thinking is None:
            return self
        switched = copy.copy(self)
        switched.template_kwargs = {**self.template_kwargs, "enable_thinking": thinking}
        return switched

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text_after(self, messages: list[dict[str, Any]], closes: int, tools: list[dict] | None,
                   full: str) -> str | None:
        """How the template renders messages[closes + 1:] (and the generation prompt) after the answer at
        `closes`, for a template that renders that answer differently once more follows: rendered with a
        marker user message between the two, the text after the marker's turn. None when that text is not
        how `full` (the rendering without the marker) ends: the template renders the new messages
        differently too, and there is no exact continuation."""
        if self.user_turn_close is None:
            return None
        marked = [*messages[: closes + 1], {"role": "user", "content": MARKER}, *messages[closes + 1:]]
        rendered = self.render(marked, tools, add_generation_prompt=True)
        at = rendered.find(MARKER + self.user_turn_close)
        if at < 0:
            return None
        after = rendered[at + len(MARKER) + len(self.user_turn_close):]
        return after if full.endswith(after) else None

    def glue_after(self, node: TurnNode) -> str:
        """The template text between the model's last sampled id and the next message."""
        ended_its_turn = node.response_ids and node.response_ids[-1] in self.end_of_turn_ids
        if node.finish_reason == "stop" and ended_its_turn:
            end = self.tokenizer.decode(node.response_ids[-1:], skip_special_tokens=False)
            if self.turn_close.startswith(end):
                return self.turn_close[len(end):]
        return self.turn_close


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, separators=(",", ":"))


def turn_key(message: dict[str, Any]) -> str:
    """message_key as text (a tuple of strings: its repr is the same in every process)."""
    return repr(message_key(message))


@dataclass(frozen=True)
class History:
    """A request's messages as the session's tree names them (sessions.py): each message's key (`turn_key`),
    the node key of the conversation up to each message, and of those an answer closes, deepest last: the
    turns the request may continue, whose nodes are read with the session."""

    tools: str
    """The request's tools as `tools_key` writes them."""
    keys: list[str]
    conversation: list[str]
    answered: list[str]
    named_role: str | None = None
    """The role of the run the request's model names, whose conversations are apart from its session's own
    (conversation_keys); None: the session's role."""

    @classmethod
    def of(cls, request: ChatRequest, roles: Collection[str] = ()) -> History:
        """The request's history; `roles`: the run's roles, which its model may name."""
        tools = tools_key(request.tools)
        named_role = request.model if request.model in roles else None
        keys = [turn_key(m) for m in request.messages]
        conversation = conversation_keys(tools, keys, named_role)
        answered = [conversation[i] for i, m in enumerate(request.messages) if m["role"] == "assistant"]
        return cls(tools, keys, conversation, answered, named_role)


@dataclass
class PlannedTurn:
    parent: str
    """Node key the turn continues; ROOT when it starts a conversation."""
    prefix_ids: list[int]
    appended_ids: list[int]
    conversation: list[str]
    """The request's message keys (turn_key of each)."""
    history_rewritten: bool = False
    """The template renders the history this turn continues differently from the ids recorded for it (a
    Qwen3-style template drops earlier turns' reasoning once a new user message follows); the prompt is
    the recorded ids all the same: they are what the model saw and sampled."""
    named_role: str | None = None
    """History.named_role: the role the request names instead of its session's."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.prefix_ids + self.appended_ids


async def plan_turn(template: ChatTemplate, store: SessionStore, session: Session, request: ChatRequest,
                    history: History, max_prompt_tokens: int,
                    on_rewritten_history: str = "continue") -> PlannedTurn:
    """The prompt of the request's turn, in `session` as read with the nodes of `history.answered`. When the
    template renders the answered history differently now that more follows (`history_rewritten`),
    "continue" keeps the recorded ids and appends the new messages as the template renders them after an
    answer; "fork" starts a new conversation."""
    messages = request.messages
    if not messages:
        raise RequestError(400, "messages: at least one message is needed", param="messages")
    if messages[-1]["role"] == "assistant":
        raise RequestError(400, "the last message is the assistant's: continuing a prefilled answer is not "
                                "supported; end with a user or tool message", param="messages")
    parent = next((key for key in reversed(history.answered) if key in session.nodes), ROOT)
    chain = await store.chain(session.spec.session_id, parent, session.nodes)
    work = (template, request, history, chain, parent, on_rewritten_history)
    # the message keys hold each message's content, calls and arguments; the reasoning they leave out
    size = (len(history.tools) + sum(map(len, history.keys))
            + sum(len(m.get("reasoning_content") or "") for m in messages))
    if size < INLINE_CHARACTERS:
        planned = _render_turn(*work)
    else:
        planned = await asyncio.to_thread(_render_turn, *work)
    planned.named_role = history.named_role
    length = len(planned.prompt_ids)
    if length > max_prompt_tokens:
        raise RequestError(400, f"the prompt is {length} tokens; this gateway takes at most "
                                f"{max_prompt_tokens}", param="messages")
    return planned


def _render_turn(template: ChatTemplate, request: ChatRequest, history: History, chain: list[TurnNode],
                 parent: str, on_rewritten_history: str) -> PlannedTurn:
    """The turn's prompt: after `chain`, the deepest recorded turn the history continues, when the template
    lets it continue there; else the whole history rendered and tokenized."""
    messages = request.messages
    full = template.render(messages, request.tools, add_generation_prompt=True)
    if chain:
        closes = history.conversation.index(parent)
        before = template.render(messages[: closes + 1], request.tools, add_generation_prompt=False)
        if full.startswith(before):
            new_text, rewritten = full[len(before):], False
        else:
            new_text, rewritten = template.text_after(messages, closes, request.tools, full), True
        if new_text is not None and not (rewritten and on_rewritten_history == "fork"):
            prefix = [t for n in chain for t in (*n.appended_ids, *n.response_ids)]
            delta = template.glue_after(chain[-1]) + new_text
            return PlannedTurn(parent, prefix, template.encode(delta), history.keys, rewritten)
    return PlannedTurn(ROOT, [], template.encode(full), history.keys)


def answer_key(request: ChatRequest, planned: PlannedTurn, answer: dict[str, Any]) -> str:
    """The node key of the conversation this turn's answer closes."""
    return conversation_keys(tools_key(request.tools), [*planned.conversation, turn_key(answer)],
                             planned.named_role)[-1]
