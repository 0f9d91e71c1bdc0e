"""Tools the client runs that are not JSON-schema functions, shown to the model as functions all the same.

- Freeform tools (OpenAI's `custom` tools, in Chat Completions and Responses: Codex's apply_patch, for one)
  take one string, optionally in a grammar, and return a string. The model is shown a function whose one
  argument, `input`, is that string (the grammar in its description); a call of it goes back to the client
  as a custom tool call carrying the string, and a custom call the client sends back is that function's
  call again, so it is the same turn under `message_key`.
- Anthropic's client tools (`bash_20250124`, `text_editor_20250728`, ...) have schemas Anthropic defines
  and the client does not send: the model is shown them as functions with those schemas, and a call of
  one is a `tool_use` block like any other.

    python -m pytest tests/unit/services/gateway/test_api_sdk_clients.py -q -k "custom or client_tools"
"""

from __future__ import annotations

import json
from typing import Any

from rollstream.services.gateway.apis.validation import function_tool, require_object, require_str

FREEFORM_ARGUMENT = "input"


def freeform_tool(name: Any, description: Any, text_format: Any, param: str) -> dict[str, Any]:
    """The function the model is shown for a freeform tool; `text_format`: its format, text or a grammar."""
    text_format = require_object(text_format or {"type": "text"}, f"{param}.format")
    argument = "The tool's whole input, as free text."
    if text_format.get("type") == "grammar":
        syntax = require_str(text_format.get("syntax", "lark"), f"{param}.format.syntax")
        definition = require_str(text_format.get("definition"), f"{param}.format.definition", non_empty=True)
        argument = f"The tool's whole input, as text in this {syntax} grammar:\n{definition}"
    parameters = {"type": "object", "required": [FREEFORM_ARGUMENT],
                  "properties": {FREEFORM_ARGUMENT: {"type": "string", "description": argument}}}
    return function_tool(name, description, parameters, param)


def freeform_input(arguments: dict[str, Any]) -> str:
    """What a freeform tool receives from the model's call of its function: the `input` argument (a call that
    did not follow the function's schema gives its arguments as JSON)."""
    text = arguments.get(FREEFORM_ARGUMENT)
    if isinstance(text, str) and len(arguments) == 1:
        return text
    return json.dumps(arguments, ensure_ascii=False)


def freeform_arguments(text: Any, param: str) -> dict[str, Any]:
    """The arguments of the function call a freeform call the client sends back stands for."""
    return {FREEFORM_ARGUMENT: require_str(text, param)}


_BASH = {
    "description": "Run a command in a persistent bash shell. State (working directory, environment) "
                   "persists between calls; `restart` starts a new shell.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the shell instead of running a command."}}},
}
_EDITOR_COMMANDS = ["view", "create", "str_replace", "insert"]
_EDITOR_PROPERTIES = {
    "path": {"type": "string", "description": "Absolute path of the file or directory."},
    "file_text": {"type": "string", "description": "`create`: the new file's content."},
    "old_str": {"type": "string", "description": "`str_replace`: the exact text to replace (found once)."},
    "new_str": {"type": "string", "description": "`str_replace`: the replacement; `insert`: the text."},
    "insert_line": {"type": "integer", "description": "`insert`: the line the text goes after (0: the top)."},
    "view_range": {"type": "array", "items": {"type": "integer"},
                   "description": "`view`: the first and last line to show (-1: to the end)."},
}
_EDITOR_DESCRIPTION = ("View, create and edit files: `view` shows a file with line numbers or lists a "
                       "directory, `create` writes a new file, `str_replace` replaces one exact occurrence "
                       "of a text, `insert` inserts text after a line")


def _editor(version: str) -> dict[str, Any]:
    # the editors before text_editor_20250429 also undo the last edit of a file
    undo = version < "20250429"
    commands = [*_EDITOR_COMMANDS, "undo_edit"] if undo else _EDITOR_COMMANDS
    description = _EDITOR_DESCRIPTION + (", `undo_edit` undoes the last edit of a file." if undo else ".")
    properties = {"command": {"type": "string", "enum": commands}, **_EDITOR_PROPERTIES}
    return {"description": description,
            "parameters": {"type": "object", "properties": properties, "required": ["command", "path"]}}


def anthropic_client_tool(tool: dict[str, Any], param: str) -> dict[str, Any] | None:
    """The function the model is shown for one of Anthropic's client tools (bash, text editor), None for any
    other type. Anthropic defines their schemas; the request gives only a type and a name."""
    kind = tool.get("type")
    if not isinstance(kind, str):
        return None
    family, _, version = kind.rpartition("_")
    if family == "bash":
        shape = _BASH
    elif family == "text_editor" and version.isdigit():
        shape = _editor(version)
    else:
        return None
    return function_tool(tool.get("name"), shape["description"], shape["parameters"], param)
