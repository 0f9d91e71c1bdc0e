"""Hostile diffs, test.sh and solutions through grade_harbor with the real bubblewrap and docker backends:
each is contained, reported with a reason, and the host is unaffected afterwards. The reward-integrity
attacks are solutions that try to get a reward for a wrong answer by writing, protecting, replacing or
rewriting /logs/verifier's reward files from the code the verifier runs: each scores 0.

    python -m pytest tests/unit/shared/grading/test_hostile_grading.py -q   (skipped where `bwrap` is missing)

Network tests only ever use this machine's loopback (127.0.0.1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from rollstream.shared.errors import GradingError
from rollstream.shared.grading.harbor import grade_harbor
from rollstream.shared.grading.outcome import MAX_LOG_CHARS
from rollstream.shared.grading.untrusted import parse_reward, prepare_reward_files
from rollstream.shared.grading.validation import reference_diff
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.workspace import workspace_prefix
from rollstream.shared.tasks.harbor import HarborTask
from tests.support import edit_diff, host_listener, sandbox_uid_processes

LIMITS = SandboxLimits(wall_time_s=8, cpu_time_s=8, memory_mb=256, max_processes=32,
                       max_file_size_mb=16, max_open_files=256, max_output_bytes=64 * 1024,
                       tmp_size_mb=16)
REWARD = "/logs/verifier/reward.txt"


@pytest.fixture
def make_task(tmp_path):
    def make(test_sh: str, files: dict[str, str] | None = None, timeout: float = 8,
             solve_sh: str | None = None) -> HarborTask:
        root = tmp_path / f"task-{uuid.uuid4().hex[:6]}"
        (root / "environment" / "workspace").mkdir(parents=True)
        (root / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
        for name, content in (files or {"app.py": "print('hi')\n"}).items():
            (root / "environment" / "workspace" / name).write_text(content)
        (root / "tests").mkdir()
        (root / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
        solution = None
        if solve_sh is not None:
            (root / "solution").mkdir()
            solution = root / "solution" / "solve.sh"
            solution.write_text("#!/bin/bash\n" + solve_sh)
        return HarborTask(name=root.name, path=root, instruction="", config={},
                          workspace=root / "environment" / "workspace",
                          dockerfile=root / "environment" / "Dockerfile", tests_dir=root / "tests",
                          solution=solution, verifier_timeout_s=timeout, agent_timeout_s=timeout)
    return make


@pytest.fixture(autouse=True)
def host_unaffected():
    """After each test: nothing of the sandbox runs, no grading workspace is left, we can fork.
    (Only this process's workspaces: other test runs may share the temp directory.)"""
    ours = f"{workspace_prefix('grade')}*"
    before = set(Path(tempfile.gettempdir()).glob(ours))
    yield
    assert sandbox_uid_processes() == []
    assert set(Path(tempfile.gettempdir()).glob(ours)) - before == set()
    assert subprocess.run(["true"]).returncode == 0


def test_network_access_is_refused(backend, make_task):
    with host_listener() as (port, accepted):
        task = make_task(f"""python3 app.py && echo 1 > {REWARD} || echo 0 > {REWARD}\n""")
        diff = edit_diff(task.workspace, {"app.py": (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "print('CONNECTED')\n")})
        outcome = grade_harbor(task, diff, backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert "ConnectionRefusedError" in outcome.log and "CONNECTED" not in outcome.log
    assert accepted == []


def test_fork_bomb_is_contained(backend, make_task):
    task = make_task(f"bomb() {{ bomb | bomb & }}; bomb; wait; sleep 1; echo 0 > {REWARD}\n",
                     timeout=4)
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert "Resource temporarily unavailable" in outcome.log  # the process limit held
    assert outcome.duration_s < 15


def test_memory_bomb_is_stopped(backend, make_task):
    task = make_task(f"python3 -c 'x = bytearray(8 * 1024 ** 3)' && echo 1 > {REWARD} "
                     f"|| echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    # stopped by the memory rlimit (bubblewrap: MemoryError) or the memory cgroup (docker: SIGKILL);
    # either way the code under test's own outcome, never an infrastructure error
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert ("MemoryError" if backend.name == "bubblewrap" else "Killed") in outcome.log, outcome


def test_disk_fill_is_stopped_by_the_file_size_limit(backend, make_task):
    before = shutil.disk_usage(tempfile.gettempdir()).free
    task = make_task(f"dd if=/dev/zero of=big bs=1M count=4096 2>&1; echo size=$(stat -c %s big)\n"
                     f"echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    after = shutil.disk_usage(tempfile.gettempdir()).free
    limit = LIMITS.max_file_size_mb * 1024 * 1024
    assert "File size limit exceeded" in outcome.log or f"size={limit}" in outcome.log, outcome.log
    size = int(outcome.log.split("size=")[1].split()[0])
    assert size <= limit
    assert before - after < limit + 64 * 1024 * 1024  # others share this disk: some slack


def test_infinite_loop_hits_the_wall_clock(backend, make_task):
    task = make_task(f"echo 1 > {REWARD}\nwhile :; do :; done\n", timeout=2)
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and "wall-clock limit 2s" in outcome.reason, outcome.reason
    assert not outcome.infrastructure_error and outcome.duration_s < 10


def test_gigabytes_of_output_are_capped(backend, make_task):
    task = make_task(f"yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx | head -c 2G\n"
                     f"yes yyyy | head -c 100M >&2\necho 0.5 > {REWARD}\n", timeout=30)
    outcome = grade_harbor(task, "", backend, LIMITS)
    # the flood is the code's own business: the grade still comes (the start marker is in the kept head)
    assert outcome.score == 0.5 and not outcome.infrastructure_error, outcome.reason
    assert len(outcome.log) <= MAX_LOG_CHARS + 200
    assert "output truncated" in outcome.log


def test_secrets_on_the_host_are_unreadable(backend, make_task):
    planted = []
    base = Path(tempfile.mkdtemp(prefix="rs-hostile-"))
    base.chmod(0o711)
    planted.append(base / "secret.txt")
    if os.access("/root", os.W_OK):
        planted.append(Path("/root") / f"rs-hostile-{uuid.uuid4().hex}.txt")
    try:
        for path in planted:
            path.write_text("TOP-SECRET\n")
            path.chmod(0o644)
        reads = "; ".join(f"cat {p} && found=1" for p in planted)
        task = make_task(f"found=0; {reads}; cat /etc/shadow && found=1; echo $found > {REWARD}\n")
        outcome = grade_harbor(task, "", backend, LIMITS)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
    assert outcome.score == 0, outcome
    assert "TOP-SECRET" not in outcome.log and "No such file" in outcome.log


def test_writes_outside_the_workspace_leave_the_host_unchanged(backend, make_task):
    marker = f"rs-pwned-{uuid.uuid4().hex}"
    targets = [f"/tmp/{marker}", f"/root/{marker}", f"/work/main/{marker}", f"/{marker}",
               f"/usr/{marker}", f"/tests/{marker}"]
    writes = "; ".join(f"echo x > {t}" for t in targets)
    task = make_task(f"{writes}; echo x > ../{marker}; echo x > /tests/test.sh; "
                     f"echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    for target in targets:
        assert not Path(target).exists(), target
    assert (task.tests_dir / "test.sh").read_text().startswith("#!/bin/bash\n")
    assert "Read-only file system" in outcome.log


def test_reward_symlinks_to_host_files_are_not_followed(backend, make_task):
    base = Path(tempfile.mkdtemp(prefix="rs-hostile-"))
    try:
        (base / "verifier").mkdir()
        (base / "verifier" / "reward.txt").write_text("1\n")
        (base / "one.txt").write_text("1\n")
        for test_sh in (f"ln -sf {base}/one.txt {REWARD}\n",
                        f"rm -rf /logs/verifier; ln -sfn {base}/verifier /logs/verifier\n"):
            outcome = grade_harbor(make_task(test_sh), "", backend, LIMITS)
            # the grader's reward files cannot be removed, so no link takes their place
            assert outcome.score == 0 and "no reward" in outcome.reason, outcome.reason
            assert "Operation not permitted" in outcome.log or "Permission denied" in outcome.log
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_symlink_out_of_the_workspace_in_the_diff(backend, make_task):
    task = make_task(f"cat secret > /dev/null && echo 1 > {REWARD} || echo 0 > {REWARD}\n")
    diff = edit_diff(task.workspace, {}, symlinks={"secret": "/etc/passwd"})
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert outcome.score == 0 and "patch did not apply" in outcome.reason
    assert "symlink" in outcome.reason and "/etc/passwd" in outcome.reason


def test_a_diff_editing_the_tests_does_not_count(backend, make_task):
    task = make_task(f"python3 app.py | grep -q fixed && echo 1 > {REWARD} || echo 0 > {REWARD}\n")
    cheat = f"#!/bin/bash\necho 1 > {REWARD}\n"
    diff = edit_diff(task.workspace, {"tests/test.sh": cheat, "test.sh": cheat})
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert outcome.score == 0, outcome.reason
    escape = ("diff --git a/../tests/test.sh b/../tests/test.sh\n--- a/../tests/test.sh\n"
              "+++ b/../tests/test.sh\n@@ -1 +1 @@\n-#!/bin/bash\n+echo 1 > /logs/verifier/reward.txt\n")
    outcome = grade_harbor(task, escape, backend, LIMITS)
    assert outcome.score == 0 and "outside the workspace" in outcome.reason, outcome.reason


@pytest.mark.parametrize("kill", ["kill -9 $PPID", "kill -9 -1",
                                  "python3 -c 'import os; os.kill(os.getppid(), 9)'"])
def test_killing_the_parent(backend, make_task, kill):
    # model code that writes a reward and then kills test.sh before it writes the real one
    task = make_task(f"echo 1 > {REWARD}; bash -c '{kill}'; sleep 1; echo 0 > {REWARD}\n"
                     if "python" not in kill else
                     f"echo 1 > {REWARD}; {kill}; echo 0 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome
    assert "did not finish" in outcome.reason and "SIGKILL" in outcome.reason, outcome.reason
    again = grade_harbor(make_task(f"echo 1 > {REWARD}\n"), "", backend, LIMITS)
    assert again.score == 1  # the grader is fine


def test_hostile_solution_in_reference_diff(backend, make_task):
    task = make_task(f"echo 0 > {REWARD}\n", solve_sh="kill -9 -1\n")
    with pytest.raises(GradingError, match="reference solution"):
        reference_diff(task, backend, LIMITS)
    task = make_task(f"echo 0 > {REWARD}\n",
                     solve_sh="echo ok > result.txt; ln -s /etc/passwd leak; mkfifo pipe\n")
    diff = reference_diff(task, backend, LIMITS)
    assert "result.txt" in diff and "leak" in diff and "pipe" not in diff
    outcome = grade_harbor(task, diff, backend, LIMITS)  # its own symlink is refused too
    assert "symlink" in outcome.reason


# Reward integrity: the verifier imports solution.py and writes its reward on every path; each
# solution below answers wrongly and attacks the reward files from the verifier's own sandbox.

REWARD_JSON = "/logs/verifier/reward.json"
CHECK = 'python3 -c "import solution, sys; sys.exit(solution.answer() != 42)"'
VERIFY_TXT = f"if {CHECK}; then echo 1 > {REWARD}; else echo 0 > {REWARD}; fi\n"
VERIFY_JSON = (f"if {CHECK}; then echo '{{\"reward\": 1}}' > {REWARD_JSON}; "
               f"else echo '{{\"reward\": 0}}' > {REWARD_JSON}; fi\n")

ATTACK_PRELUDE = f'''import os, sys
R, J, V = {REWARD!r}, {REWARD_JSON!r}, "/logs/verifier"


def attempt(what, action):
    try:
        action()
        print(f"attack: {{what}}: done", file=sys.stderr)
    except OSError as exc:
        print(f"attack: {{what}}: {{exc.strerror}}", file=sys.stderr)


def write(path, text):
    with open(path, "w") as handle:
        handle.write(text)


'''


def _wrong_answer(attack: str) -> dict[str, str]:
    """solution.py that runs `attack` when the verifier imports it, and answers wrongly."""
    return {"solution.py": ATTACK_PRELUDE + attack + "\n\ndef answer():\n    return 0\n"}


def _answer_task(make_task, verify: str = VERIFY_TXT, after: str = ""):
    return make_task(verify + after, files={"solution.py": "def answer():\n    return 0\n"})


def test_the_answer_task_scores_an_honest_answer(backend, make_task):
    """The task the attacks below use: the right answer scores 1, and a wrong one 0."""
    for verify in (VERIFY_TXT, VERIFY_JSON):
        task = _answer_task(make_task, verify)
        right = grade_harbor(task,
                             edit_diff(task.workspace, {"solution.py": "def answer():\n    return 42\n"}),
                             backend, LIMITS)
        assert (right.score, right.infrastructure_error) == (1.0, False), right
        wrong = grade_harbor(task, "", backend, LIMITS)
        assert wrong.score == 0 and "reward 0 from" in wrong.reason, wrong.reason


def test_a_reward_made_read_only_is_overwritten_by_the_verifier(backend, make_task):
    # the reported defect: reward 1 planted, file and directory chmod-ed so the verifier's write failed
    task = _answer_task(make_task)
    diff = edit_diff(task.workspace, _wrong_answer(
        'attempt("plant", lambda: write(R, "1\\n"))\n'
        'attempt("chmod reward.txt", lambda: os.chmod(R, 0o444))\n'
        'attempt("chmod verifier/", lambda: os.chmod(V, 0o555))\n'))
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert "attack: plant: done" in outcome.log
    assert "attack: chmod reward.txt: Operation not permitted" in outcome.log, outcome.log
    assert "attack: chmod verifier/: Operation not permitted" in outcome.log
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    assert outcome.reason == "reward 0 from reward.txt (test.sh: exit 0)", outcome.reason


@pytest.mark.parametrize("planted", ["reward.txt", "reward.json"])
def test_a_reward_planted_before_the_tests_run_does_not_count(backend, make_task, planted):
    # written when the verifier imports the code, before it checks anything
    task = _answer_task(make_task)
    content = "1\n" if planted == "reward.txt" else '{"reward": 1}'
    plant = f'attempt("plant", lambda: write(V + "/{planted}", {content!r}))\n'
    diff = edit_diff(task.workspace, _wrong_answer(plant))
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert "attack: plant: done" in outcome.log
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    if planted == "reward.txt":
        assert outcome.reason.startswith("reward 0 from reward.txt"), outcome.reason
    else:
        assert "both reward.txt and reward.json were written" in outcome.reason, outcome.reason


@pytest.mark.parametrize("verify, other", [(VERIFY_TXT, "J"), (VERIFY_JSON, "R")],
                         ids=["verifier-writes-txt", "verifier-writes-json"])
def test_writing_the_other_reward_file_does_not_count(backend, make_task, verify, other):
    task = _answer_task(make_task, verify)
    content = '{"reward": 1}' if other == "J" else "1\n"
    write_other = f'attempt("write the other file", lambda: write({other}, {content!r}))\n'
    diff = edit_diff(task.workspace, _wrong_answer(write_other))
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert "attack: write the other file: done" in outcome.log
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    assert "both reward.txt and reward.json were written" in outcome.reason, outcome.reason


REPLACEMENTS = {
    "rename": 'attempt("rename", lambda: os.rename(R, R + ".old"))\n'
              'attempt("create", lambda: write(R, "1\\n"))\n'
              'attempt("chmod", lambda: os.chmod(R, 0o444))\n',
    "delete-and-recreate": 'attempt("delete", lambda: os.unlink(R))\n'
                           'attempt("create", lambda: write(R, "1\\n"))\n'
                           'attempt("chmod", lambda: os.chmod(R, 0o444))\n',
    "replace-atomically": 'attempt("stage", lambda: write(V + "/staged", "1\\n"))\n'
                          'attempt("chmod", lambda: os.chmod(V + "/staged", 0o444))\n'
                          'attempt("replace", lambda: os.replace(V + "/staged", R))\n',
    "swap-the-directory": 'attempt("move verifier/", lambda: os.rename(V, V + ".old"))\n'
                          'attempt("make verifier/", lambda: os.mkdir(V))\n'
                          'attempt("create", lambda: write(R, "1\\n"))\n'
                          'attempt("chmod", lambda: os.chmod(R, 0o444))\n'
                          'attempt("chmod verifier/", lambda: os.chmod(V, 0o555))\n',
    "delete-the-directory": 'import shutil\n'
                            'attempt("delete verifier/", lambda: shutil.rmtree(V))\n'
                            'attempt("make verifier/", lambda: os.mkdir(V))\n'
                            'attempt("create", lambda: write(R, "1\\n"))\n'
                            'attempt("chmod", lambda: os.chmod(R, 0o444))\n',
}


@pytest.mark.parametrize("replacement", sorted(REPLACEMENTS))
def test_replacing_the_reward_file_or_its_directory_does_not_count(backend, make_task, replacement):
    task = _answer_task(make_task)
    diff = edit_diff(task.workspace, _wrong_answer(REPLACEMENTS[replacement]))
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert ": Operation not permitted" in outcome.log or ": Permission denied" in outcome.log, outcome.log
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    assert outcome.reason.startswith("reward 0 from reward.txt"), outcome.reason


SYMLINKS = {
    # a file the code controls, read-only, so that a write through the link would fail
    "reward.txt": 'attempt("own file", lambda: write("/app/mine.txt", "1\\n"))\n'
                  'attempt("chmod own file", lambda: os.chmod("/app/mine.txt", 0o444))\n'
                  'attempt("delete", lambda: os.unlink(R))\n'
                  'attempt("link reward.txt", lambda: os.symlink("/app/mine.txt", R))\n'
                  'attempt("link beside", lambda: os.symlink("/app/mine.txt", R + ".new"))\n'
                  'attempt("move link over", lambda: os.replace(R + ".new", R))\n',
    "verifier": 'attempt("own directory", lambda: os.mkdir("/app/fake"))\n'
                'attempt("own reward", lambda: write("/app/fake/reward.txt", "1\\n"))\n'
                'attempt("chmod own reward", lambda: os.chmod("/app/fake/reward.txt", 0o444))\n'
                'attempt("move verifier/", lambda: os.rename(V, V + ".old"))\n'
                'attempt("link verifier/", lambda: os.symlink("/app/fake", V))\n'
                'attempt("link beside", lambda: os.symlink("/app/fake", "/logs/fake"))\n'
                'attempt("move link over", lambda: os.replace("/logs/fake", V))\n',
}


@pytest.mark.parametrize("linked", sorted(SYMLINKS))
def test_symlinks_in_place_of_the_reward_files_do_not_count(backend, make_task, linked):
    task = _answer_task(make_task)
    diff = edit_diff(task.workspace, _wrong_answer(SYMLINKS[linked]))
    outcome = grade_harbor(task, diff, backend, LIMITS)
    assert "attack: own" in outcome.log
    assert ": Operation not permitted" in outcome.log or ": Permission denied" in outcome.log, outcome.log
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    assert outcome.reason.startswith("reward 0 from reward.txt"), outcome.reason


REWRITER = '''
import os, time
deadline = time.time() + 30
while time.time() < deadline:
    try:
        with open(R) as handle:
            if handle.read().strip() == "0":
                write(R, "1\\n")
                os.write(2, b"attack: rewrote the verifier's reward\\n")
    except OSError:
        pass
    time.sleep(0.001)
'''


@pytest.mark.parametrize("after_reward", ["", "sleep 0.5\n"], ids=["reward-last", "more-work-after"])
def test_a_process_left_running_to_rewrite_the_reward_does_not_count(backend, make_task, after_reward):
    # detached from the verifier's process tree, it waits for the verifier's 0 and writes 1 over it
    task = _answer_task(make_task, after=after_reward)
    rewriter = ATTACK_PRELUDE + REWRITER
    diff = edit_diff(task.workspace, _wrong_answer(
        "import subprocess\n"
        f"subprocess.Popen([sys.executable, '-c', {rewriter!r}], start_new_session=True)\n"))
    outcome = grade_harbor(task, diff, backend, LIMITS)
    if after_reward:
        assert "attack: rewrote the verifier's reward" in outcome.log, outcome.log
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    assert "test.sh left processes running" in outcome.reason and "not trusted" in outcome.reason


def test_an_honest_test_sh_that_leaves_a_process_running_is_not_trusted(backend, make_task):
    """Nothing tells its background process from the code under test's: the reason says what to fix."""
    task = make_task(f"sleep 30 &\necho 1 > {REWARD}\n")
    outcome = grade_harbor(task, "", backend, LIMITS)
    assert outcome.score == 0 and not outcome.infrastructure_error, outcome.reason
    assert "left processes running" in outcome.reason
    assert "rs-grader: still running after the command:" in outcome.log


def test_an_exit_status_of_254_from_test_sh_is_its_own(backend, make_task):
    outcome = grade_harbor(make_task(f"echo 1 > {REWARD}\nexit 254\n"), "", backend, LIMITS)
    assert outcome.score == 0 and "did not finish (exit 255)" in outcome.reason, outcome.reason


# The same attacks made on the host as the grader's own user: what a sandbox running as the grader's
# user (bubblewrap, not root) could do, which only the check after the run stands against.

def _swap_directory(verifier: Path) -> None:
    verifier.rename(verifier.with_name("verifier.old"))
    verifier.mkdir()
    (verifier / "reward.txt").write_text("1\n")


def _symlink_file(verifier: Path) -> None:
    (verifier.parent / "mine.txt").write_text("1\n")
    (verifier / "reward.txt").unlink()
    (verifier / "reward.txt").symlink_to(verifier.parent / "mine.txt")


def _symlink_directory(verifier: Path) -> None:
    mine = verifier.parent / "mine"
    mine.mkdir()
    (mine / "reward.txt").write_text("1\n")
    verifier.rename(verifier.with_name("verifier.old"))
    verifier.symlink_to(mine)


def _replace_file(verifier: Path) -> None:
    (verifier / "staged").write_text("1\n")
    os.replace(verifier / "staged", verifier / "reward.txt")


TAMPERING = {
    "chmod-file": (lambda v: ((v / "reward.txt").write_text("1\n"), (v / "reward.txt").chmod(0o444)),
                   "/logs/verifier/reward.txt has mode 444, made 666"),
    "chmod-directory": (lambda v: v.chmod(0o555), "/logs/verifier has mode 555, made 1777"),
    "chmod-logs": (lambda v: v.parent.chmod(0o755), "/logs has mode 755, made 1777"),
    "replace-file": (_replace_file, "/logs/verifier/reward.txt was replaced"),
    "symlink-file": (_symlink_file, "/logs/verifier/reward.txt is now a symlink"),
    "swap-directory": (_swap_directory, "/logs/verifier was replaced"),
    "symlink-directory": (_symlink_directory, "/logs/verifier is now a symlink"),
    "delete-other-file": (lambda v: (v / "reward.json").unlink(), "/logs/verifier/reward.json is gone"),
    "hard-link": (lambda v: os.link(v / "reward.txt", v / "alias"), "reward.txt has 2 hard links"),
}


@pytest.mark.parametrize("tampering", sorted(TAMPERING))
def test_reward_files_changed_after_they_were_made_are_refused(tmp_path, tampering):
    files = prepare_reward_files(tmp_path / "logs")
    tamper, change = TAMPERING[tampering]
    tamper(tmp_path / "logs" / "verifier")
    score, reason, _ = parse_reward(files)
    assert score is None and change in reason, reason
    assert reason.startswith("reward files were changed by the code under test") and "not trusted" in reason


def test_reward_files_as_made_are_read_as_written(tmp_path):
    files = prepare_reward_files(tmp_path / "logs")
    verifier = tmp_path / "logs" / "verifier"
    for name in ("reward.txt", "reward.json"):
        st = os.lstat(verifier / name)
        assert (st.st_size, oct(st.st_mode & 0o7777), st.st_uid) == (0, "0o666", os.getuid())
    assert oct(os.lstat(verifier).st_mode & 0o7777) == "0o1777"
    assert parse_reward(files)[1] == ("no reward: neither /logs/verifier/reward.txt nor reward.json "
                                      "was written")
    with open(verifier / "reward.json", "w") as handle:  # as a verifier writes: open, truncate, write
        handle.write('{"tests": {"a": "passed", "b": "failed"}}')
    assert parse_reward(files) == (0.5, "1/2 tests passed (reward.json)", {"a": "passed", "b": "failed"})
    (verifier / "reward.txt").write_text("0.25\n")
    score, reason, _ = parse_reward(files)
    assert score is None and reason.startswith("both reward.txt and reward.json were written")
    (verifier / "reward.json").write_text("")
    assert parse_reward(files)[:2] == (0.25, "reward 0.25 from reward.txt")
    (verifier / "ctrf.json").write_text("{}")  # what else a verifier leaves beside the reward is fine
    assert parse_reward(files)[0] == 0.25
