"""The docs site and the README stay true to the tree: the site builds with no warning (a page left out of the
navigation, a broken link or anchor fail it), every path into the code that a page names exists, the README's
links lead somewhere, the coding agents' command lines are the ones their test runs, and the README stays a
front door.

    .venv/bin/python -m pytest tests/unit/docs/test_site.py -q
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

from tests.support import REPO

DOCS = REPO / "docs"
README_MAX_LINES = 200
"""A front door, read in a few minutes: the rest belongs in docs/."""
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPOSITORY_PATH = re.compile(r"^(?:shared|services|cli|tests|bench|infra|compose|agents|docs)/[\w./-]*$")
"""A code span that names a path in the repository (placeholders such as <run> and globs are no path)."""
ELSEWHERE = {
    "agents/node_modules": "made by make setup-test",
    "compose/run.env": "the settings of a compose run, written by whoever runs it (git-ignored)",
    "compose/context/wheels": "staged by compose/build-offline-base.sh",
    "tests/test.sh": "a Harbor task's verifier, in the task's own directory",
}
"""Paths the docs name that no clone holds, and why."""
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_the_site_builds_with_no_warning(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_every_path_into_the_code_that_the_docs_name_exists():
    named = {(page.relative_to(REPO), span)
             for page in pages() for span in CODE_SPAN.findall(page.read_text())
             if REPOSITORY_PATH.match(span) and span.rstrip("/") not in ELSEWHERE}
    assert len(named) > 50, "the docs name paths in code spans; the pattern found too few"
    missing = sorted((str(page), span) for page, span in named if not (REPO / span).exists())
    assert missing == [], "these paths are gone: write where the code is now"


def anchors(page: Path) -> set[str]:
    return {slugify(re.sub(r"`", "", title), "-") for title in HEADING.findall(page.read_text())}


def test_the_readmes_links_lead_to_files_and_headings_that_exist():
    broken = []
    for target in LINK.findall((REPO / "README.md").read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if not (REPO / path).exists() or (anchor and anchor not in anchors(REPO / path)):
            broken.append(target)
    assert broken == []


def agents_tested_command_lines() -> dict[str, str]:
    """AGENTS of tests/integration/test_coding_agents.py: the command lines its run gives each CLI, read from
    the source (string literals joined), not imported (that module needs the models and the CLIs)."""
    source = REPO / "tests" / "integration" / "test_coding_agents.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["AGENTS"]:
            return eval(compile(ast.Expression(node.value), str(source), "eval"), {"__builtins__": {}})
    raise AssertionError(f"no AGENTS in {source}")


def test_the_coding_agents_command_lines_are_the_ones_their_test_runs():
    page = (DOCS / "agents" / "coding-agents.md").read_text().splitlines()
    tested = agents_tested_command_lines()
    assert set(tested) == {"claude-code", "codex", "qwen-code"}
    assert [name for name, command in tested.items() if command not in page] == []


def test_the_readme_stays_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, "move what a newcomer does not need first into docs/"
