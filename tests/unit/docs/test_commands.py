"""Every command in the shell blocks of the README and of the getting-started page is run by a test.

The commands are read from the Markdown itself. Each is listed in COVERAGE with how it is checked: run here
(cheap and safe: `rollstream --help`, `rollstream config`), run here as `make -n TARGET` (the target exists,
and its recipe runs what the docs say it does), or covered by a named test elsewhere in the suite, which must
exist. A command added to those pages without an entry fails here, and so does an entry whose command the
pages no longer give.

    .venv/bin/python -m pytest tests/unit/docs/test_commands.py -q
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass

import pytest

from tests.support import REPO

PAGES = ("README.md", "docs/getting-started.md")
"""The pages whose shell blocks a newcomer copies from."""
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^\s*```\s*([\w-]*)\s*$")


@dataclass(frozen=True)
class RunHere:
    """Run by this test from the repository's root, with no RS_* variable of ours: it must exit 0 and print
    `prints`."""

    prints: str


@dataclass(frozen=True)
class DryRun:
    """A make target, run here as `make -n TARGET` (make prints the recipes, runs nothing): the target must
    exist, and what it would run must include `runs`."""

    runs: str


@dataclass(frozen=True)
class CoveredBy:
    """Too long or too heavy to run here: the named test (a pytest node id) does what the command does."""

    node_id: str


Check = RunHere | DryRun | CoveredBy

COVERAGE: dict[str, tuple[Check, ...]] = {
    "make run": (DryRun("rollstream run"),
                 CoveredBy("tests/integration/test_learning.py::test_rl_raises_the_reward_by_a_clear_margin")),
    "make test": (DryRun("pytest"),),
    "make setup": (DryRun("bwrap"),),
    "make setup-test": (DryRun("chromium"),),
    "make lint": (DryRun("ruff check"),),
    "make docs": (DryRun("mkdocs build --strict"),
                  CoveredBy("tests/unit/docs/test_site.py::test_the_site_builds_with_no_warning")),
    "make bench": (DryRun("bench/run_all.py"),
                   CoveredBy("tests/unit/bench/test_run_all.py::"
                             "test_the_report_has_the_machine_and_each_benchmarks_command_and_figures")),
    ".venv/bin/rollstream config": (RunHere('"run_id": "local"'),),
    "RS_TRAIN__MAX_STALENESS=0 .venv/bin/rollstream config": (RunHere('"max_staleness": 0'),),
    ".venv/bin/rollstream config --markdown": (RunHere("| `RS_TRAIN__MAX_STALENESS` | `1` |"),),
    ".venv/bin/rollstream --help": (RunHere("Usage: rollstream"),),
    ".venv/bin/rollstream run --help": (RunHere("--versions"),),
}
"""Every command of PAGES, and how a test runs it."""


def without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (outside quotes, at the start or after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_blocks(markdown: str) -> list[list[str]]:
    """The commands of each fenced shell block, in order: comments dropped, continued lines joined, spaces
    collapsed. Blocks of other languages (python, yaml, text) are passed over."""
    blocks: list[list[str]] = []
    inside, commands, pending = False, None, ""
    for line in markdown.splitlines():
        fence = FENCE.match(line)
        if fence:
            if inside and commands is not None:
                blocks.append(commands)
            inside = not inside
            commands = [] if inside and fence.group(1) in SHELL_LANGUAGES else None
            pending = ""
            continue
        if commands is None:
            continue
        text = pending + without_comment(line).strip()
        pending = text[:-1].rstrip() + " " if text.endswith("\\") else ""
        if text and not pending:
            commands.append(" ".join(text.split()))
    return blocks


def documented_commands() -> dict[str, list[str]]:
    """Page -> the commands of its shell blocks."""
    return {page: [c for block in shell_blocks((REPO / page).read_text()) for c in block] for page in PAGES}


def uncovered(commands: list[str], coverage: dict[str, tuple[Check, ...]]) -> list[str]:
    return [command for command in commands if not coverage.get(command)]


def checks_of(kind: type) -> list[tuple[str, Check]]:
    return [(command, check) for command, checks in COVERAGE.items()
            for check in checks if isinstance(check, kind)]


def check_id(value: str | Check) -> str:
    """A parameter's id: the command itself, and what its check looks for."""
    match value:
        case RunHere(prints=shown) | DryRun(runs=shown) | CoveredBy(node_id=shown):
            return shown
    return value


def test_the_extraction_reads_commands_comments_and_continuations():
    markdown = "\n".join(["```bash", "make run     # the main job", "# a comment", "",
                          "FOO='a # b' tool \\", "    --flag   x   # why", "```",
                          "```python", "print(1)", "```", "```text", "not a command", "```"])
    assert shell_blocks(markdown) == [["make run", "FOO='a # b' tool --flag x"]]


def test_every_command_of_the_readme_and_getting_started_is_run_by_a_test():
    found = documented_commands()
    assert all(found.values()), f"no shell block found in {[page for page, cs in found.items() if not cs]}"
    missing = {page: uncovered(commands, COVERAGE) for page, commands in found.items()}
    assert not any(missing.values()), (
        f"commands no test runs: {missing}; add each to COVERAGE in {__file__} with the test that runs it")


def test_every_covered_command_is_one_the_pages_give():
    given = {command for commands in documented_commands().values() for command in commands}
    assert sorted(set(COVERAGE) - given) == [], "the pages no longer give these commands: drop their entries"


def test_dropping_any_entry_leaves_its_command_uncovered():
    """The check above is no formality: without its entry, each command is reported, and only it."""
    commands = [command for commands in documented_commands().values() for command in commands]
    for command in COVERAGE:
        rest = {other: checks for other, checks in COVERAGE.items() if other != command}
        assert set(uncovered(commands, rest)) == {command}


def test_the_readme_gives_the_two_commands_first():
    """Right after the pitch and the diagram: the first shell block is `make run` and `make test`."""
    readme = (REPO / "README.md").read_text()
    first_section = readme.split("\n## ", 2)[1]
    assert first_section.startswith("The two commands")
    assert shell_blocks(readme)[0] == ["make run", "make test"]


@pytest.mark.parametrize("command,check", checks_of(RunHere), ids=check_id)
def test_the_command_runs_as_documented(command, check):
    env = {key: value for key, value in os.environ.items() if not key.startswith("RS_")}
    done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert check.prints in done.stdout


@pytest.mark.parametrize("command,check", checks_of(DryRun), ids=check_id)
def test_the_make_target_exists_and_runs_what_the_docs_say(command, check):
    target = command.removeprefix("make ").split()
    assert command.startswith("make ") and len(target) == 1, f"{command!r} is no `make TARGET`"
    done = subprocess.run(["make", "-n", *target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert check.runs in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("command,check", checks_of(CoveredBy), ids=check_id)
def test_the_test_named_for_a_command_exists(command, check):
    path, *names = check.node_id.split("::")
    source = REPO / path
    assert source.is_file(), f"{check.node_id}: no file {path}"
    scope: list[ast.stmt] = ast.parse(source.read_text()).body
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for name in names:
        found = [node for node in scope if isinstance(node, definitions) and node.name == name.split("[")[0]]
        assert found, f"{check.node_id}: no {name} in {path}"
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
