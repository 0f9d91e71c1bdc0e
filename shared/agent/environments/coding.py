"""Coding episodes: the model edits a copy of a task's repository and its changes become a diff.

A dataset row asks for it by naming the coding tools and describing the repository in its
metadata:

    {"messages": [...], "agent": "tool_agent",
     "tools": ["read_file", "write_file", "edit_file", "list_files", "run_shell", "run_tests"],
     "metadata": {"repo": "/data/tasks/fix-parser",          # a local directory to copy, or
                  "files": {"calc.py": "...", "test_calc.py": "..."},   # path -> content
                  "test_command": "python3 test_calc.py",     # for run_tests (optional)
                  "limits": {"wall_time_s": 60},               # SandboxLimits fields (optional)
                  "env": {"PYTHONPATH": "/workspace/src"},      # sandbox environment (optional)
                  "workdir": "/workspace",                     # the repository's sandbox path (optional)
                  "sandbox_backend": "bubblewrap"}}            # or "docker", as the grader (optional)

A Harbor task's row (shared/tasks/prompts.py) sets "workdir" to the task's WORKDIR (e.g. /app), so
the model's shell commands find the repository where the task's tests and the grader expect it.

(`CODING_TOOLS` in shared/tasks/rows.py is that list of tool names; a row may name only some of
them.)

The tools share one workspace per episode (coding_workspace.py: a hardened git copy of the task's
repository, its diff stored as `episode.artifacts["diff"]` when the episode ends).

Host-side file tools (read_file, write_file, edit_file, list_files) take relative paths only and
refuse `..`, absolute paths, and symlinks that resolve outside repo/; they only open regular files
(a FIFO the model made cannot block the host) and cap what they read and write. run_shell and
run_tests run in the task's sandbox backend (bubblewrap by default, shared/sandbox/) with repo/
bound at the workdir: no network, rlimits from metadata["limits"] over the defaults of
coding_workspace.py (30 s wall clock). Every call holds the workspace's lock.

    python -m pytest tests/unit/shared/agent/test_coding_env.py -q
"""

from __future__ import annotations

import asyncio
import os
import stat
import uuid
from pathlib import Path

from rollstream.shared.agent.environments.coding_workspace import Workspace, get_workspace, release_workspace
from rollstream.shared.agent.tools import Episode, Tool, ToolError, register_tool
from rollstream.shared.sandbox.base import SandboxResult

MAX_READ_FILE_BYTES = 4 * 1024 * 1024
"""read_file and edit_file refuse larger files (the model can page with run_shell instead)."""
MAX_READ_OUTPUT_CHARS = 40_000
"""read_file returns whole lines up to this many characters, then says where to go on."""
MAX_WRITE_BYTES = 1024 * 1024
"""Largest file write_file or edit_file writes."""
MAX_LIST_ENTRIES = 1000
"""list_files lists at most this many entries."""
MAX_STREAM_CHARS = 10_000
"""run_shell shows at most this much of stdout and of stderr: the head and the (longer) tail."""
MAX_COMMAND_CHARS = 32 * 1024
"""Longest command run_shell accepts."""


class _CodingTool(Tool):
    """Shares the episode's workspace; every call on it holds the workspace's lock."""

    async def create(self, episode: Episode) -> None:
        await get_workspace(episode)

    async def release(self, episode: Episode) -> None:
        await release_workspace(episode)

    async def execute(self, arguments: dict, episode: Episode) -> str:
        if not isinstance(arguments, dict):
            raise ToolError("arguments must be a JSON object")
        workspace = await get_workspace(episode)
        return await asyncio.to_thread(self._locked_run, workspace, arguments)

    def _locked_run(self, workspace: Workspace, arguments: dict) -> str:
        with workspace.lock:
            if workspace.closed:
                raise ToolError("the workspace has been released: the episode is over")
            return self.run(workspace, arguments)

    def run(self, workspace: Workspace, arguments: dict) -> str:
        raise NotImplementedError


def _string(arguments: dict, name: str, default: str | None = None, allow_empty: bool = True) -> str:
    value = arguments.get(name, default)
    if value is None:
        raise ToolError(f"missing required argument '{name}'")
    if not isinstance(value, str):
        raise ToolError(f"argument '{name}' must be a string")
    if not allow_empty and not value:
        raise ToolError(f"argument '{name}' must not be empty")
    return value


def _optional_int(arguments: dict, name: str) -> int | None:
    value = arguments.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ToolError(f"argument '{name}' must be an integer")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ToolError(f"argument '{name}' must be an integer, not {value!r}") from None
    if isinstance(value, float) and value != number:
        raise ToolError(f"argument '{name}' must be an integer, not {value!r}")
    return number


def _read_regular(real: Path, shown: str) -> bytes:
    """The bytes of a regular file (never blocking on a FIFO, never following a last symlink)."""
    if real.is_dir():
        raise ToolError(f"{shown} is a directory (use list_files)")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ToolError(f"{shown}: no such file") from None
    except OSError as exc:
        raise ToolError(f"{shown}: cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{shown} is not a regular file")
        if st.st_size > MAX_READ_FILE_BYTES:
            raise ToolError(f"{shown} is {st.st_size} bytes, more than the {MAX_READ_FILE_BYTES} "
                            "this tool reads; look at parts of it with run_shell (head, sed -n, grep)")
        data = handle.read(MAX_READ_FILE_BYTES + 1)
    if len(data) > MAX_READ_FILE_BYTES:
        raise ToolError(f"{shown} is larger than {MAX_READ_FILE_BYTES} bytes")
    return data


def _write_regular(real: Path, shown: str, data: bytes) -> bool:
    """Write a regular file atomically (temp file + rename), making parent directories; keeps an
    existing file's mode. Returns whether the file existed."""
    if len(data) > MAX_WRITE_BYTES:
        raise ToolError(f"content is {len(data)} bytes; at most {MAX_WRITE_BYTES} may be written at once")
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ToolError(f"{shown} is {kind}; cannot write it")
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ToolError(f"{shown}: a parent of it is a file, not a directory") from None
    except OSError as exc:
        raise ToolError(f"{shown}: cannot create its directory ({exc.strerror})") from None
    temp = real.with_name(f".{real.name}.rs-tmp-{uuid.uuid4().hex[:8]}")
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o644
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, mode)
        os.replace(temp, real)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise ToolError(f"{shown}: cannot write ({exc.strerror})") from None
    return st is not None


def _lines(text: str) -> list[str]:
    """Lines split at '\\n' only (the numbering `grep -n` and editors use)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _numbered(lines: list[str], first: int) -> list[str]:
    return [f"{first + i:>6}\t{line}" for i, line in enumerate(lines)]


def _cap_stream(text: str) -> str:
    if len(text) <= MAX_STREAM_CHARS:
        return text
    head = MAX_STREAM_CHARS * 3 // 10
    tail = MAX_STREAM_CHARS - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[-tail:]}"


def _format_result(result: SandboxResult) -> str:
    status = "none" if result.exit_code is None else str(result.exit_code)
    header = f"exit code: {status}"
    if result.reason != f"exit {result.exit_code}":
        header += f" ({result.reason})"
    parts = [header]
    if result.output_truncated:
        parts.append("(output was longer than the sandbox keeps; the end of it was dropped)")
    parts.append("stdout:\n" + (_cap_stream(result.stdout) if result.stdout else "(empty)"))
    parts.append("stderr:\n" + (_cap_stream(result.stderr) if result.stderr else "(empty)"))
    return "\n".join(parts)


@register_tool("read_file")
class ReadFile(_CodingTool):
    name = "read_file"
    description = ("Read a text file of the repository, with line numbers. Optionally only lines "
                   "start_line..end_line (1-based, inclusive).")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the repository root."},
            "start_line": {"type": "integer", "minimum": 1, "description": "First line to show (default 1)."},
            "end_line": {"type": "integer", "minimum": 1,
                         "description": "Last line to show (default: the end)."},
        },
        "required": ["path"],
        "additionalProperties": False,
    }

    def run(self, workspace: Workspace, arguments: dict) -> str:
        real = workspace.resolve(_string(arguments, "path"))
        shown = workspace.display(real)
        data = _read_regular(real, shown)
        if b"\0" in data[:8192]:
            raise ToolError(f"{shown} looks like a binary file; inspect it with run_shell")
        lines = _lines(data.decode("utf-8", errors="replace"))
        start = _optional_int(arguments, "start_line") or 1
        end = _optional_int(arguments, "end_line") or len(lines)
        if not lines:
            return f"{shown} is empty"
        if start < 1 or end < start:
            raise ToolError(f"bad line range {start}..{end}: need 1 <= start_line <= end_line")
        if start > len(lines):
            raise ToolError(f"start_line {start} is past the end: {shown} has {len(lines)} lines")
        end = min(end, len(lines))
        out: list[str] = []
        size = 0
        for number, line in zip(range(start, end + 1), _numbered(lines[start - 1:end], start)):
            if size + len(line) + 1 > MAX_READ_OUTPUT_CHARS and out:
                out.append(f"[... output truncated at line {number - 1} of {len(lines)}; "
                           f"call read_file with start_line={number} to go on]")
                break
            out.append(line)
            size += len(line) + 1
        return "\n".join(out)


@register_tool("write_file")
class WriteFile(_CodingTool):
    name = "write_file"
    description = ("Create or overwrite a file of the repository with the given content "
                   "(parent directories are created).")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the repository root."},
            "content": {"type": "string", "description": "The complete new content of the file."},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    }

    def run(self, workspace: Workspace, arguments: dict) -> str:
        real = workspace.resolve(_string(arguments, "path"))
        shown = workspace.display(real)
        data = _string(arguments, "content").encode("utf-8")
        existed = _write_regular(real, shown, data)
        return f"{'Overwrote' if existed else 'Created'} {shown} ({len(data)} bytes)"


@register_tool("edit_file")
class EditFile(_CodingTool):
    name = "edit_file"
    description = ("Replace one exact occurrence of `old` in a file with `new`. `old` must match "
                   "the file exactly (whitespace and indentation included) and occur exactly once; "
                   "include surrounding lines to make it unique.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path relative to the repository root."},
            "old": {"type": "string", "description": "The exact text to replace (must occur once)."},
            "new": {"type": "string", "description": "The replacement text."},
        },
        "required": ["path", "old", "new"],
        "additionalProperties": False,
    }

    def run(self, workspace: Workspace, arguments: dict) -> str:
        real = workspace.resolve(_string(arguments, "path"))
        shown = workspace.display(real)
        old = _string(arguments, "old", allow_empty=False)
        new = _string(arguments, "new")
        try:
            text = _read_regular(real, shown).decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{shown} is not UTF-8 text; edit it with run_shell") from None
        count = text.count(old)
        first = text.find(old)
        if count == 1 and text.find(old, first + 1) != -1:
            count = 2  # overlapping occurrences: still ambiguous
        if count == 0:
            raise ToolError(f"`old` was not found in {shown} (0 occurrences); it must match the "
                            "file exactly, including whitespace and indentation (read_file shows it)")
        if count > 1:
            raise ToolError(f"`old` occurs {count} times in {shown}; it must occur exactly once: "
                            "include more surrounding lines to pick one")
        updated = text[:first] + new + text[first + len(old):]
        _write_regular(real, shown, updated.encode("utf-8"))
        first_line = text.count("\n", 0, first) + 1
        lines = _lines(updated)
        last_line = first_line + new.count("\n")
        lo, hi = max(1, first_line - 2), min(len(lines), last_line + 2, first_line + 40)
        snippet = "\n".join(_numbered(lines[lo - 1:hi], lo)) if lines else "(the file is now empty)"
        return f"Edited {shown}: replaced 1 occurrence at line {first_line}. Now:\n{snippet}"


@register_tool("list_files")
class ListFiles(_CodingTool):
    name = "list_files"
    description = ("List the files and directories under a directory of the repository, "
                   "recursively (directories end in '/', symlinks show their target).")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string",
                     "description": "Directory relative to the repository root (default '.')."},
        },
        "additionalProperties": False,
    }

    def run(self, workspace: Workspace, arguments: dict) -> str:
        real = workspace.resolve(_string(arguments, "path", default="."))
        shown = workspace.display(real)
        if not real.exists():
            raise ToolError(f"{shown}: no such file or directory")
        if not real.is_dir():
            return workspace.display(real)
        out: list[str] = []
        stack = [real]
        truncated = False
        while stack and not truncated:
            directory = stack.pop()
            try:
                with os.scandir(directory) as scan:
                    entries = sorted(scan, key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                if len(out) >= MAX_LIST_ENTRIES:
                    truncated = True
                    break
                relative = workspace.display(Path(entry.path))
                if entry.is_symlink():
                    out.append(f"{relative} -> {os.readlink(entry.path)}")
                elif entry.is_dir(follow_symlinks=False):
                    if entry.name == ".git":
                        out.append(f"{relative}/ (git metadata, not listed)")
                    else:
                        out.append(f"{relative}/")
                        stack.append(Path(entry.path))
                else:
                    out.append(relative)
        out.sort()
        if truncated:
            out.append(f"[... listing stopped at {MAX_LIST_ENTRIES} entries; list a subdirectory]")
        return "\n".join(out) if out else f"{shown} is empty"


@register_tool("run_shell")
class RunShell(_CodingTool):
    name = "run_shell"
    description = ("Run a shell command (/bin/sh -c) in the repository root, inside a sandbox with "
                   "no network and a time limit. Returns the exit code, stdout and stderr.")
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The shell command to run."},
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    def run(self, workspace: Workspace, arguments: dict) -> str:
        command = _string(arguments, "command", allow_empty=False)
        if len(command) > MAX_COMMAND_CHARS:
            raise ToolError(f"command is {len(command)} characters; at most {MAX_COMMAND_CHARS}")
        if "\0" in command:
            raise ToolError("command must not contain NUL characters")
        return _format_result(workspace.run(command))


@register_tool("run_tests")
class RunTests(_CodingTool):
    name = "run_tests"
    description = "Run the task's tests in the sandbox. Returns the exit code, stdout and stderr."
    parameters = {"type": "object", "properties": {}, "additionalProperties": False}

    def run(self, workspace: Workspace, arguments: dict) -> str:
        if not workspace.test_command:
            raise ToolError("this task has no test command; use run_shell to run checks")
        result = workspace.run(workspace.test_command)
        verdict = "tests passed" if result.exit_code == 0 else "tests failed"
        return f"{verdict}\n{_format_result(result)}"
