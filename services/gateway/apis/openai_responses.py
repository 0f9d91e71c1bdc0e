"""OpenAI Responses (`POST /v1/responses`): the request into a `ChatRequest`.

The gateway keeps no responses, so every request carries the whole conversation in `input`:
`previous_response_id`, `conversation` and `item_reference` items are refused with a 400 saying so.

`input` is a string (one user message) or a list of items: messages (`input_text` / `output_text`
parts or a plain string; system and developer messages, wherever they are, as system messages),
`function_call` items (`arguments` a JSON string), `custom_tool_call` items (`input` a string) and their
`function_call_output` and `custom_tool_call_output` items. Calls and
assistant text in a row form one assistant turn, as the gateway produced them: a turn's text, its
calls, and any text the model wrote after a call (streamed as a message item of its own). A
`reasoning` item opens the turn it belongs to and becomes its `reasoning_content`: read from the
`encrypted_content` the gateway wrote, else from its `reasoning_text` content, else its summary;
another provider's encrypted reasoning, with nothing readable, is skipped. `instructions` is the
first system message.

Tools are function tools in the flat Responses shape `{"type": "function", "name", "description",
"parameters"}`, and namespaces of them (`{"type": "namespace", "name", "tools": [...]}`), whose
members the model sees as `namespace.name` (a dot is never in an OpenAI function name, so it cannot
collide) and whose calls go back as OpenAI returns them, `{"type": "function_call", "name",
"namespace", ...}`. Custom (freeform) tools `{"type": "custom", "name", "description", "format"}` are
functions of one string to the model (client_tools.py), and their calls go back as `custom_tool_call`
items with that string as `input`. Any other tool (hosted ones such as web_search, file_search,
code_interpreter, image_generation, mcp) is left out of what the model sees. `reasoning.effort` "none"
asks the model not to reason, another effort or a `reasoning.summary` to reason.

Refused with a 400: images and files, structured output (`text.format` other than text), stored
prompts and background mode.

What the generation goes back as, a `response` object or the Responses event stream:
openai_responses_output.py.
"""

from __future__ import annotations

from typing import Any

from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    ToolChoice,
    Tools,
    canonical_tool_call,
    name_tool_messages,
)
from rollstream.services.gateway.apis.client_tools import freeform_arguments, freeform_tool
from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.apis.openai_responses_output import (
    ENCRYPTED_REASONING_INCLUDE,
    decode_reasoning,
)
from rollstream.services.gateway.apis.validation import (
    arguments_from_json,
    bool_field,
    choose_tools,
    function_tool,
    int_field,
    leave_out_tool,
    model_field,
    named_tool_choice,
    number_field,
    require_list,
    require_object,
    require_str,
    thinking_of_effort,
    tool_list,
    unsupported,
)

STATELESS = "this gateway keeps no responses, so send the whole conversation in `input`"
TEXT_PARTS = ("input_text", "output_text")
MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
NAMESPACE_SEPARATOR = "."


def parse_responses(body: Any) -> ChatRequest:
    body = require_object(body, "body")
    model = model_field(body)
    for stateful in ("previous_response_id", "conversation"):
        if body.get(stateful) is not None:
            raise RequestError(400, f"{stateful} is not supported: {STATELESS}", stateful)
    if body.get("prompt") is not None:
        raise unsupported("a stored prompt template (`prompt`)", "prompt")
    if bool_field(body, "background"):
        raise unsupported("background mode", "background")
    text = require_object(body.get("text") or {}, "text")
    text_format = require_object(text.get("format") or {}, "text.format")
    if text_format.get("type", "text") != "text":
        raise unsupported(f"text.format {text_format.get('type')!r}", "text.format",
                          "there is no structured output: describe the format in the prompt")

    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": require_str(body["instructions"], "instructions")})
    if "input" not in body:
        raise RequestError(400, "input is required", "input")
    if isinstance(body["input"], str):
        messages.append({"role": "user", "content": body["input"]})
    else:
        for i, item in enumerate(require_list(body["input"], "input", non_empty=True)):
            _add_item(messages, require_object(item, f"input[{i}]"), f"input[{i}]")
    tools, tool_namespaces, freeform_tools, ignored_tools = _tools(body.get("tools"))
    tool_choice, tools = _tool_choice(body.get("tool_choice"), tools)
    reasoning = require_object(body.get("reasoning") or {}, "reasoning")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    thinking = thinking_of_effort(reasoning.get("effort"), "reasoning.effort")
    if thinking is None and summary is not None:
        thinking = True  # a summary asks for reasoning, unless the effort turns it off
    include = require_list(body.get("include") or [], "include")
    return ChatRequest(
        model=model,
        messages=name_tool_messages(messages),
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=int_field(body, "max_output_tokens", minimum=1),
        temperature=number_field(body, "temperature", minimum=0, maximum=2),
        top_p=number_field(body, "top_p", minimum=0, maximum=1),
        stream=bool_field(body, "stream"),
        thinking=thinking,
        ignored_tools=ignored_tools,
        reasoning_summary=summary is not None,
        encrypted_reasoning=ENCRYPTED_REASONING_INCLUDE in include,
        tool_namespaces=tool_namespaces,
        freeform_tools=freeform_tools,
    )


def _content(content: Any, param: str, *, role: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(require_list(content, param)):
        part = require_object(part, f"{param}[{i}]")
        if part.get("type") not in TEXT_PARTS:
            raise unsupported(f"content part type {part.get('type')!r}", f"{param}[{i}].type",
                              "only input_text and output_text parts are")
        texts.append(require_str(part.get("text"), f"{param}[{i}].text"))
    # An assistant turn's parts are pieces of one sampled text; a user's are paragraphs of their own.
    return ("" if role == "assistant" else "\n").join(texts)


def _last_assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message when it is the assistant's: no tool output or user message came after it."""
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _open_assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a call belongs to: the last message when it is the assistant's, else a
    new one."""
    turn = _last_assistant_turn(messages)
    if turn is None:
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    return turn


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(400, f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}",
                               f"{param}.role")
        role = MESSAGE_ROLES[role]
        content = _content(item.get("content"), f"{param}.content", role=role)
        turn = _last_assistant_turn(messages)
        # Text the model wrote after a call, or the text of a turn its reasoning item opened: the same turn.
        if role == "assistant" and turn is not None and (turn.get("tool_calls") or not turn["content"]):
            turn["content"] += content
        else:
            messages.append({"role": role, "content": content})
    elif kind in ("function_call", "custom_tool_call"):
        turn = _open_assistant_turn(messages)
        name = require_str(item.get("name"), f"{param}.name", non_empty=True)
        if item.get("namespace") is not None:
            name = _namespaced(require_str(item["namespace"], f"{param}.namespace", non_empty=True), name)
        if kind == "function_call":
            arguments = arguments_from_json(item.get("arguments", ""), f"{param}.arguments")
        else:
            arguments = freeform_arguments(item.get("input"), f"{param}.input")
        turn.setdefault("tool_calls", []).append(canonical_tool_call(
            require_str(item.get("call_id"), f"{param}.call_id", non_empty=True), name, arguments))
    elif kind == "reasoning":
        reasoning = _reasoning_of(item, param)
        if reasoning:
            # Reasoning comes first in its turn: it opens one, unless another reasoning item just did.
            turn = _last_assistant_turn(messages)
            if turn is None or turn["content"] or turn.get("tool_calls"):
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            turn["reasoning_content"] = turn.get("reasoning_content", "") + reasoning
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = require_str(item.get("call_id"), f"{param}.call_id", non_empty=True)
        output = _content(item.get("output"), f"{param}.output", role="tool")
        messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
    elif kind == "item_reference":
        raise RequestError(400, f"item_reference is not supported: {STATELESS}", f"{param}.type")
    else:
        raise unsupported(f"input item type {kind!r}", f"{param}.type",
                          "only message, function_call, custom_tool_call, their outputs and reasoning "
                          "items are")


def _reasoning_of(item: dict[str, Any], param: str) -> str:
    """The text of a reasoning item sent back ("" when there is none the gateway can read)."""
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        decoded = decode_reasoning(require_str(encrypted, f"{param}.encrypted_content"))
        if decoded is not None:
            return decoded
    for key, kind, joiner in (("content", "reasoning_text", ""), ("summary", "summary_text", "\n\n")):
        parts = [require_object(part, f"{param}.{key}[{j}]")
                 for j, part in enumerate(require_list(item.get(key) or [], f"{param}.{key}"))]
        texts = [require_str(part.get("text"), f"{param}.{key}[{j}].text")
                 for j, part in enumerate(parts) if part.get("type") == kind]
        if texts:
            return joiner.join(texts)
    return ""


def _namespaced(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


class _ToolList:
    """The functions the model is shown for a request's tools, and how their calls go back."""

    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.namespaced: dict[str, tuple[str, str]] = {}
        self.freeform: set[str] = set()
        self.ignored: list[str] = []

    def add(self, tool: dict[str, Any], param: str, namespace: str | None = None) -> None:
        """A function or custom tool (a member of `namespace` when given); any other is left out."""
        if tool.get("type") not in ("function", "custom"):
            leave_out_tool(self.ignored, tool.get("type"), f"{param}.type")
            return
        member = require_str(tool.get("name"), f"{param}.name", non_empty=True)
        name = member if namespace is None else _namespaced(namespace, member)
        if tool["type"] == "function":
            self.functions.append(function_tool(name, tool.get("description"), tool.get("parameters"), param))
        else:
            self.functions.append(freeform_tool(name, tool.get("description"), tool.get("format"), param))
            self.freeform.add(name)
        if namespace is not None:
            self.namespaced[name] = (namespace, member)


def _tools(tools: Any) -> tuple[Tools, dict[str, tuple[str, str]], set[str], list[str]]:
    """The function and custom tools (namespaces' members flattened) as the request's tools, the namespaced
    names, the custom tools' names, and the types of the tools left out."""
    found = _ToolList()
    for i, tool in enumerate(require_list(tools if tools is not None else [], "tools")):
        tool = require_object(tool, f"tools[{i}]")
        if tool.get("type") == "namespace":
            namespace = require_str(tool.get("name"), f"tools[{i}].name", non_empty=True)
            for j, member in enumerate(require_list(tool.get("tools"), f"tools[{i}].tools")):
                member_param = f"tools[{i}].tools[{j}]"
                found.add(require_object(member, member_param), member_param, namespace)
        else:
            found.add(tool, f"tools[{i}]")
    return tool_list(found.functions, "tools"), found.namespaced, found.freeform, found.ignored


def _tool_choice(choice: Any, tools: Tools) -> tuple[ToolChoice, Tools]:
    if choice is None:
        return "auto", tools
    if choice in ("auto", "none", "required"):
        return choose_tools(choice, tools, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return named_tool_choice(choice.get("name"), tools, "tool_choice.name"), tools
    raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            f"{{'type': 'function' or 'custom', 'name': ...}}, not {choice!r}", "tool_choice")
