"""rollstream.shared.agent.environments.coding against real bubblewrap and git: a coding episode on a small
task repository, driven through the tools directly (create / execute / release with an Episode, no agent
loop).

    python -m pytest tests/unit/shared/agent/test_coding_env.py -q   (skipped where `bwrap` is not installed)

Network tests only ever use this machine's loopback.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rollstream.shared.agent.environments import coding
from rollstream.shared.agent.tools import Episode, ToolCall, ToolError, ToolSet, resolve_tools
from rollstream.shared.errors import CodingTaskError
from rollstream.shared.grading.harbor import grade_harbor
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.prompts import task_prompt_row
from rollstream.shared.tasks.rows import CODING_TOOLS
from tests.support import FIXTURES

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST_SCRIPT = ("from calc import add, mul\n"
               "assert add(2, 3) == 5, f'add(2, 3) gave {add(2, 3)}'\n"
               "assert mul(2, 3) == 6\n"
               "print('all tests ok')\n")


def _tempdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    return path


def _make_source(as_git_repo: bool) -> Path:
    """The task repository: a module with a bug, a test script, a file the fix deletes, a binary;
    optionally a git repository with one commit (and a .gitignore the diff must not obey)."""
    path = _tempdir("rs-coding-src-")
    (path / "calc.py").write_text(CALC)
    (path / "test_calc.py").write_text(TEST_SCRIPT)
    (path / "old_notes.txt").write_text("obsolete\n")
    (path / "docs").mkdir()
    (path / "docs" / "README.md").write_text("# calc\n")
    (path / "data.bin").write_bytes(bytes(range(256)))
    if as_git_repo:
        (path / ".gitignore").write_text("pkg/\n")
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c",
               "init.defaultBranch=main"]
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "task baseline"]):
            subprocess.run(git + args, cwd=path, check=True, capture_output=True)
    return path


@pytest.fixture
def source():
    path = _make_source(as_git_repo=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=[False, True], ids=["plain-dir", "git-repo"])
def any_source(request):
    path = _make_source(as_git_repo=request.param)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def workspaces(monkeypatch):
    """The workspace directories each test makes; removed afterwards should a failing test leave one."""
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def tracking_mkdtemp(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        if str(kwargs.get("prefix", "")).startswith("rs-ws-"):
            made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", tracking_mkdtemp)
    yield made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store():
    path = _tempdir("rs-coding-store-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree(path: Path) -> dict[str, tuple]:
    """Everything about a directory tree that an episode must not change."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath, name)
            st = full.lstat()
            content = full.read_bytes() if stat.S_ISREG(st.st_mode) else None
            found[str(full.relative_to(path))] = (st.st_mode, st.st_uid, st.st_mtime_ns, content)
    return found


def _tools() -> dict[str, coding.Tool]:
    return {t.name: t for t in resolve_tools(list(CODING_TOOLS))}


async def _start(tools, episode):
    for t in tools.values():
        await t.create(episode)


async def _finish(tools, episode):
    for t in reversed(list(tools.values())):
        await t.release(episode)


def _episode(metadata, store=None, episode_id="ep-1") -> Episode:
    return Episode(episode_id=episode_id, run_id="run-1", metadata=metadata,
                   storage_uri=None if store is None else str(store))


def test_fix_a_bug_and_store_the_diff(any_source, store, workspaces):
    source = any_source
    is_git = (source / ".git").is_dir()
    before = _tree(source)
    tools = _tools()
    episode = _episode({"repo": str(source), "test_command": "python3 test_calc.py"}, store)

    async def scenario():
        await asyncio.gather(*(t.create(episode) for t in tools.values()))  # one workspace for all
        workspace = episode.state["workspace"]

        listing = await tools["list_files"].execute({}, episode)
        expected = ["calc.py", "data.bin", "docs/", "docs/README.md", "old_notes.txt", "test_calc.py"]
        if is_git:
            expected = [".git/ (git metadata, not listed)", ".gitignore", *expected]
            log = await tools["run_shell"].execute({"command": "git log --oneline"}, episode)
            assert "task baseline" in log, log  # the task's history is there for the model
        assert listing.splitlines() == expected
        shown = await tools["read_file"].execute({"path": "calc.py"}, episode)
        assert "     2\t    return a - b" in shown
        assert await tools["read_file"].execute({"path": "calc.py", "start_line": 5, "end_line": 6},
                                                episode) == "     5\tdef mul(a, b):\n     6\t    return a * b"
        failing = await tools["run_tests"].execute({}, episode)
        assert failing.startswith("tests failed") and "add(2, 3) gave -1" in failing

        edited = await tools["edit_file"].execute(
            {"path": "calc.py", "old": "return a - b", "new": "return a + b"}, episode)
        assert "replaced 1 occurrence at line 2" in edited
        passing = await tools["run_tests"].execute({}, episode)
        assert passing.startswith("tests passed\nexit code: 0") and "all tests ok" in passing

        assert "Created" in await tools["write_file"].execute(
            {"path": "pkg/helpers.py", "content": "def double(x):\n    return 2 * x\n"}, episode)
        removed = await tools["run_shell"].execute({"command": "rm old_notes.txt && ls"}, episode)
        assert removed.startswith("exit code: 0") and "old_notes.txt" not in removed
        return workspace

    async def release_all():
        await _finish(tools, episode)
        stored = episode.artifacts.get("diff")
        await _finish(tools, episode)  # twice: harmless
        assert episode.artifacts.get("diff") == stored

    workspace = asyncio.run(scenario())
    assert len(workspaces) == 1  # the tools' create()s ran at once and shared one workspace
    assert workspace.base.exists()
    asyncio.run(release_all())

    assert not workspace.base.exists() and not Path(workspaces[0]).exists()
    diff_path = Path(episode.artifacts["diff"])
    assert diff_path == store / "run-1" / "artifacts" / "ep-1.diff"
    diff = diff_path.read_text()
    assert "-    return a - b\n+    return a + b\n" in diff
    assert "diff --git a/pkg/helpers.py b/pkg/helpers.py\nnew file mode 100644" in diff
    assert "diff --git a/old_notes.txt b/old_notes.txt\ndeleted file mode 100644" in diff
    assert "data.bin" not in diff and "test_calc.py" not in diff and "__pycache__" not in diff

    assert _tree(source) == before  # the source was only read

    fresh = _tempdir("rs-coding-apply-")
    try:
        shutil.copytree(source, fresh / "repo")
        check = subprocess.run(["git", "apply", "--check", str(diff_path)], cwd=fresh / "repo",
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        subprocess.run(["git", "apply", str(diff_path)], cwd=fresh / "repo", check=True)
        assert (fresh / "repo" / "calc.py").read_text() == CALC.replace("a - b", "a + b")
        assert not (fresh / "repo" / "old_notes.txt").exists()
        assert (fresh / "repo" / "pkg" / "helpers.py").exists()
        result = subprocess.run([sys.executable, "test_calc.py"], cwd=fresh / "repo",
                                capture_output=True, text=True)
        assert result.returncode == 0 and "all tests ok" in result.stdout
    finally:
        shutil.rmtree(fresh, ignore_errors=True)

    with pytest.raises(ToolError, match="released"):
        asyncio.run(tools["read_file"].execute({"path": "calc.py"}, episode))


def test_path_escapes_are_refused(source):
    tools = _tools()
    episode = _episode({"repo": str(source)})

    async def scenario():
        await _start(tools, episode)
        read, write = tools["read_file"], tools["write_file"]
        for bad, message in [("../x", r"contains '\.\.'"), ("docs/../../x", r"contains '\.\.'"),
                             ("/etc/passwd", "absolute path"), ("", "non-empty")]:
            with pytest.raises(ToolError, match=message):
                await read.execute({"path": bad}, episode)
            with pytest.raises(ToolError, match=message):
                await write.execute({"path": bad, "content": "x"}, episode)
            with pytest.raises(ToolError, match=message):
                await tools["edit_file"].execute({"path": bad, "old": "a", "new": "b"}, episode)
            with pytest.raises(ToolError, match=message):
                await tools["list_files"].execute({"path": bad}, episode)

        made = await tools["run_shell"].execute(
            {"command": "ln -s /etc etc && ln -s /etc/passwd pw && ln -s calc.py alias.py && ls -l"},
            episode)
        assert made.startswith("exit code: 0")
        for bad in ["etc/passwd", "pw", "etc"]:
            with pytest.raises(ToolError, match="resolves outside the repository"):
                await read.execute({"path": bad}, episode)
        with pytest.raises(ToolError, match="resolves outside the repository"):
            await write.execute({"path": "etc/evil.conf", "content": "x"}, episode)
        with pytest.raises(ToolError, match="resolves outside the repository"):
            await write.execute({"path": "pw", "content": "x"}, episode)
        with pytest.raises(ToolError, match="resolves outside the repository"):
            await tools["list_files"].execute({"path": "etc"}, episode)
        # a symlink that stays inside is fine
        assert "return a - b" in await read.execute({"path": "alias.py"}, episode)
        listing = await tools["list_files"].execute({}, episode)
        assert "etc -> /etc" in listing and "pw -> /etc/passwd" in listing

        # a FIFO the model made cannot block the host
        await tools["run_shell"].execute({"command": "mkfifo pipe"}, episode)
        with pytest.raises(ToolError, match="not a regular file"):
            await read.execute({"path": "pipe"}, episode)
        with pytest.raises(ToolError, match="not a regular file"):
            await write.execute({"path": "pipe", "content": "x"}, episode)
        await _finish(tools, episode)

    asyncio.run(scenario())
    assert not Path("/etc/evil.conf").exists()


def test_edit_file_needs_exactly_one_match(source):
    tools = _tools()
    episode = _episode({"repo": str(source)})

    async def scenario():
        await _start(tools, episode)
        edit = tools["edit_file"]
        with pytest.raises(ToolError, match=r"not found in calc.py \(0 occurrences\)"):
            await edit.execute({"path": "calc.py", "old": "return a / b", "new": "x"}, episode)
        with pytest.raises(ToolError, match="occurs 2 times in calc.py; it must occur exactly once"):
            await edit.execute({"path": "calc.py", "old": "def ", "new": "async def "}, episode)
        with pytest.raises(ToolError, match="no such file"):
            await edit.execute({"path": "nope.py", "old": "a", "new": "b"}, episode)
        assert (episode.state["workspace"].root / "calc.py").read_text() == CALC
        await _finish(tools, episode)

    asyncio.run(scenario())


def test_run_shell_has_no_network(source):
    tools = _tools()
    episode = _episode({"repo": str(source)})
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    script = ("import socket\n"
              "s = socket.socket()\n"
              "s.settimeout(3)\n"
              "try:\n"
              f"    s.connect(('127.0.0.1', {port}))\n"
              "    print('CONNECTED')\n"
              "except OSError as e:\n"
              "    print('FAILED', e)\n")

    async def scenario():
        await _start(tools, episode)
        await tools["write_file"].execute({"path": "probe.py", "content": script}, episode)
        out = await tools["run_shell"].execute({"command": "python3 probe.py"}, episode)
        await _finish(tools, episode)
        return out

    try:
        out = asyncio.run(scenario())
        assert "FAILED" in out and "CONNECTED" not in out
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
    finally:
        listener.close()


def test_nothing_hides_from_the_diff_and_host_git_ignores_model_config(store):
    """A .gitignore, a nested repository and a .git/config the model wrote: the diff has every file,
    and no command the model's config names runs on the host."""
    marker_dir = _tempdir("rs-coding-marker-")
    marker = marker_dir / "pwned"
    tools = _tools()
    episode = _episode({"files": {"app.py": "print('hi')\n"}}, store, episode_id="ep-2")
    evil_config = (f"[core]\n\tfsmonitor = touch {marker}\n\thooksPath = hooks\n"
                   f"[filter \"evil\"]\n\tclean = touch {marker}\n")

    async def scenario():
        await _start(tools, episode)
        write = tools["write_file"]
        await write.execute({"path": ".gitignore", "content": "*\n"}, episode)
        await write.execute({"path": "hidden.txt", "content": "still here\n"}, episode)
        await write.execute({"path": ".gitattributes", "content": "* filter=evil\n"}, episode)
        await write.execute({"path": ".git/config", "content": evil_config}, episode)
        await write.execute({"path": "hooks/pre-commit", "content": f"#!/bin/sh\ntouch {marker}\n"},
                            episode)
        out = await tools["run_shell"].execute(
            {"command": "git init -q nested && echo inner > nested/inner.txt && "
                        "mkdir -p __pycache__ && echo junk > __pycache__/x.pyc && echo ok"}, episode)
        assert out.startswith("exit code: 0"), out
        with pytest.raises(ToolError, match="no test command"):
            await tools["run_tests"].execute({}, episode)
        await _finish(tools, episode)

    try:
        asyncio.run(scenario())
        diff = Path(episode.artifacts["diff"]).read_text()
        for name in ["hidden.txt", ".gitignore", ".gitattributes", "hooks/pre-commit",
                     "nested/inner.txt"]:
            assert f"diff --git a/{name} b/{name}\nnew file mode" in diff, name
        assert ".git/" not in diff.replace(".gitignore", "").replace(".gitattributes", "")
        assert "__pycache__" not in diff and "app.py" not in diff
        assert not marker.exists()
    finally:
        shutil.rmtree(marker_dir, ignore_errors=True)


def test_through_a_toolset_and_without_storage(source):
    """The ToolSet path the agent loop uses; with no storage_uri the diff is not stored but the
    workspace still goes."""
    toolset = ToolSet(resolve_tools(list(CODING_TOOLS)))
    episode = _episode({"repo": str(source), "test_command": "python3 test_calc.py",
                        "limits": {"wall_time_s": 2}})

    async def scenario():
        await toolset.start(episode)
        workspace = episode.state["workspace"]
        assert workspace.limits.wall_time_s == 2
        results = await toolset.execute([
            ToolCall("1", "edit_file", {"path": "calc.py", "old": "a - b", "new": "a + b"}),
            ToolCall("2", "read_file", {"path": "../secret"}),
            ToolCall("3", "run_shell", {"command": "sleep 30"}),
        ], episode)
        assert results[0].ok
        assert not results[1].ok and "contains '..'" in results[1].content
        assert results[2].ok and "killed: wall-clock limit 2s" in results[2].content
        tests = await toolset.execute([ToolCall("4", "run_tests", {})], episode)
        assert tests[0].content.startswith("tests passed")
        await toolset.close(episode)
        await toolset.close(episode)
        return workspace

    workspace = asyncio.run(scenario())
    assert "diff" not in episode.artifacts
    assert not workspace.base.exists()


def test_a_harbor_tasks_repository_is_at_its_workdir_and_its_diff_grades(store):
    """The agent sees an /app task's files at /app, as its tests and the grader do, and what it
    changes there by absolute path is its diff."""
    task = load_harbor_task(FIXTURES / "harbor" / "app-stats")
    row = task_prompt_row(task)
    assert row.metadata["workdir"] == "/app"
    tools = _tools()
    episode = _episode(row.metadata, store)
    check = ("python3 -c 'import sys; sys.path.insert(0, \"/app\"); from stats import variance; "
             "print(variance([1, 2, 3, 4]))'")

    async def scenario():
        await _start(tools, episode)
        where = await tools["run_shell"].execute({"command": "pwd; echo $HOME; ls /app"}, episode)
        assert where.startswith("exit code: 0\nstdout:\n/app\n/app\nstats.py\n"), where
        before = await tools["run_shell"].execute({"command": check}, episode)
        assert "1.6666666666666667" in before
        fixed = await tools["run_shell"].execute(
            {"command": "sed -i 's|/ (len(values) - 1)|/ len(values)|' /app/stats.py && " + check},
            episode)
        assert fixed.startswith("exit code: 0") and "1.25" in fixed, fixed
        await _finish(tools, episode)

    asyncio.run(scenario())
    diff = Path(episode.artifacts["diff"]).read_text()
    assert diff.startswith("diff --git a/stats.py b/stats.py")
    outcome = grade_harbor(task, diff, get_backend("bubblewrap"))
    assert (outcome.score, outcome.infrastructure_error) == (1.0, False), outcome


def test_without_a_workdir_the_repository_is_at_workspace(source):
    tool = _tools()["run_shell"]
    episode = _episode({"repo": str(source)})

    async def scenario():
        await tool.create(episode)
        try:
            return await tool.execute({"command": "pwd"}, episode)
        finally:
            await tool.release(episode)

    assert asyncio.run(scenario()).startswith("exit code: 0\nstdout:\n/workspace\n")


def test_bad_task_metadata_is_a_clear_error(source, workspaces):
    tool = _tools()["read_file"]
    for metadata, message in [({}, "needs metadata\\['repo'\\]"),
                              ({"repo": str(source / "missing")}, "is not a directory"),
                              ({"files": {"../up.py": "x"}}, "contains '..'"),
                              ({"repo": str(source), "limits": {"wall": 3}}, "unknown fields"),
                              ({"repo": str(source), "workdir": "app"}, "must be an absolute path"),
                              ({"repo": str(source), "workdir": "/etc/app"},
                               "metadata\\['workdir'\\] '/etc/app' is \\(under\\) the sandbox's /etc"),
                              ({"repo": str(source), "workdir": 7}, "metadata\\['workdir'\\] 7 must be")]:
        with pytest.raises(CodingTaskError, match=message):
            asyncio.run(tool.create(_episode(metadata)))
    assert workspaces and not any(Path(path).exists() for path in workspaces)  # a failed create cleans up
