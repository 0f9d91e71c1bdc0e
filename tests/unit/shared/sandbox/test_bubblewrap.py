"""rollstream.shared.sandbox against real bubblewrap: isolation, limits and output capture.

    python -m pytest tests/unit/shared/sandbox/test_bubblewrap.py -q  (skipped where `bwrap` is not installed)

Network tests only ever use this machine's loopback.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollstream.shared.errors import SandboxError, SandboxUnavailable, WorkspaceError
from rollstream.shared.sandbox import bubblewrap
from rollstream.shared.sandbox.base import SandboxLimits
from rollstream.shared.sandbox.bubblewrap import run_in_sandbox
from tests.support import DOES_NOT_APPLY, host_listener, sandbox_uid_processes, skip_does_not_apply

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")

AS_ROOT = os.geteuid() == 0


@pytest.fixture
def base():
    """A host directory that others may enter (like /tmp/rs-grade-*), holding the workspace and,
    next to it, a world-readable secret the sandbox must not see."""
    path = Path(tempfile.mkdtemp(prefix="rs-sandbox-test-"))
    path.chmod(0o711)
    (path / "workspace").mkdir()
    secret = path / "secret.txt"
    secret.write_text("TOP-SECRET-NEXT-TO-WORKSPACE\n")
    secret.chmod(0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workspace(base):
    return base / "workspace"


def _python(script: str) -> str:
    """A shell command that runs `script` with the sandbox's Debian python3."""
    return "python3 - <<'EOF'\n" + script + "\nEOF"


def _processes_with(marker: bytes) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if marker in Path(entry.path, "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture(autouse=True)
def no_process_outlives_its_sandbox():
    yield
    assert sandbox_uid_processes() == []


def test_exit_codes_and_output(workspace):
    result = run_in_sandbox("echo out; echo err >&2; exit 3", workspace)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert result.reason == "exit 3" and not result.timed_out and not result.output_truncated
    assert result.duration_s < 5
    ok = run_in_sandbox("python3 -c 'print(6 * 7)'", workspace)
    assert (ok.exit_code, ok.stdout, ok.reason) == (0, "42\n", "exit 0")


def test_workspace_is_readable_and_writable_and_handed_back(workspace):
    (workspace / "answer.txt").write_text("41\n")
    (workspace / "sub").mkdir()
    result = run_in_sandbox(
        "pwd; n=$(cat answer.txt); echo $((n + 1)) > out.txt; echo more >> sub/log.txt; "
        "echo edited > answer.txt; cp /bin/true suid; chmod 4755 suid", workspace)
    assert result.exit_code == 0, result
    assert result.stdout == "/workspace\n"
    assert (workspace / "out.txt").read_text() == "42\n"
    assert (workspace / "sub" / "log.txt").read_text() == "more\n"
    assert (workspace / "answer.txt").read_text() == "edited\n"
    for path in [workspace, *workspace.rglob("*")]:  # everything is the caller's again
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), path
    assert not (workspace / "suid").stat().st_mode & (stat.S_ISUID | stat.S_ISGID)


def test_no_network(workspace):
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"rs-sandbox-test-{uuid.uuid4().hex}"
    abstract.bind("\0" + abstract_name)
    abstract.listen()
    with host_listener(greeting=b"hello") as (port, accepted), contextlib.closing(abstract):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:  # the control
            assert conn.recv(5) == b"hello"
        assert len(accepted) == 1
        result = run_in_sandbox(_python(f"""
import socket
for family, address in [(socket.AF_INET, ("127.0.0.1", {port})),
                        (socket.AF_UNIX, "\\0{abstract_name}")]:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(address)
        print("connected", s.recv(5))
    except OSError as exc:
        print("failed", type(exc).__name__)
print(sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]))
"""), workspace)
    assert result.exit_code == 0, result
    lines = result.stdout.splitlines()
    assert lines[0] == "failed ConnectionRefusedError"
    assert lines[1].startswith("failed")
    assert lines[2] == "['lo']"  # only a loopback of its own
    assert len(accepted) == 1


def test_host_files_outside_the_workspace_are_invisible(base, workspace, tmp_path):
    planted = [base / "secret.txt", tmp_path / "secret.txt",
               tmp_path.parent / f"secret-{uuid.uuid4().hex}.txt"]
    for path in planted[1:]:
        path.write_text("TOP-SECRET\n")
    root_secret = None
    if os.access("/root", os.W_OK):
        fd, name = tempfile.mkstemp(dir="/root", prefix="rs-sandbox-test-")
        os.write(fd, b"TOP-SECRET\n")
        os.close(fd)
        os.chmod(name, 0o644)
        root_secret = Path(name)
        planted.append(root_secret)
    try:
        for path in planted:  # the control: the host can read them
            assert "SECRET" in path.read_text()
        probes = [*map(str, planted), "/etc/shadow", "/root", "/home", "/work", "/work/main",
                  str(Path(__file__).resolve()), str(base)]
        result = run_in_sandbox(" ; ".join(
            f"if cat '{p}' 2>/dev/null || ls '{p}' 2>/dev/null; then echo 'LEAK {p}'; fi" for p in probes),
            workspace)
    finally:
        if root_secret is not None:
            root_secret.unlink()
    assert result.exit_code == 0, result
    assert "SECRET" not in result.stdout and "LEAK" not in result.stdout, result.stdout
    listing = run_in_sandbox("ls /", workspace).stdout.split()
    assert not {"root", "home", "work"} & set(listing), listing


def test_writes_outside_the_workspace_fail_and_the_host_is_unchanged(base, workspace):
    marker = f"rs-probe-{uuid.uuid4().hex}"
    before = sorted(os.listdir(base))
    targets = [f"/usr/{marker}", f"/etc/{marker}", f"/{marker}", f"/bin/{marker}", f"/dev/{marker}",
               f"/workspace/../{marker}", f"{base}/{marker}", f"/proc/sys/kernel/{marker}"]
    result = run_in_sandbox(
        " ; ".join(f"(echo x > '{t}') 2>/dev/null && echo 'WROTE {t}'" for t in targets)
        + f" ; echo x > /tmp/{marker} && echo tmp-ok ; echo x > /dev/shm/{marker} && echo shm-ok",
        workspace)
    assert "WROTE" not in result.stdout, result.stdout
    assert "tmp-ok" in result.stdout and "shm-ok" in result.stdout  # private scratch space works
    assert sorted(os.listdir(base)) == before
    for path in [f"/usr/{marker}", f"/etc/{marker}", f"/{marker}", f"/tmp/{marker}", f"/dev/shm/{marker}"]:
        assert not os.path.exists(path)


def test_infinite_loop_is_killed_by_the_wall_clock_with_all_its_processes(workspace):
    marker = f"4{uuid.uuid4().int % 10**6}.25"
    started = time.monotonic()
    result = run_in_sandbox(f"sleep {marker} & (sleep {marker}; echo never) & while :; do :; done",
                            workspace, SandboxLimits(wall_time_s=1))
    assert time.monotonic() - started < 5
    assert result.timed_out and result.exit_code is None
    assert result.reason == "killed: wall-clock limit 1s"
    assert 1 <= result.duration_s < 5
    assert _processes_with(marker.encode()) == []  # no sandboxed process survived


def test_background_processes_die_with_the_command(workspace):
    marker = f"5{uuid.uuid4().int % 10**6}.25"
    result = run_in_sandbox(f"sleep {marker} & echo started", workspace)
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "started\n", False)
    assert result.duration_s < 5
    assert _processes_with(marker.encode()) == []


def test_memory_bomb_fails_and_the_host_is_fine(workspace):
    at_once = run_in_sandbox("python3 -c 'x = bytearray(4 * 1024**3)'", workspace,
                             SandboxLimits(memory_mb=256))
    assert at_once.exit_code not in (0, None) and "MemoryError" in at_once.stderr
    growing = run_in_sandbox(_python("chunks = []\nwhile True:\n    chunks.append(b'x' * 2**24)"),
                             workspace, SandboxLimits(memory_mb=256))
    assert growing.exit_code not in (0, None) and not growing.timed_out
    assert "MemoryError" in growing.stderr or "SIG" in growing.reason
    assert subprocess.run(["true"]).returncode == 0


def test_address_space_reserved_beyond_the_memory_limit_is_no_memory(workspace):
    # Runtimes reserve far more than they write: node reserves 10 GiB for each WebAssembly memory (its
    # fetch's HTTP parser has one), which an address-space limit refused, so no node agent could reach
    # its gateway session. The limit is on memory a process may write.
    reserve = _python("import mmap\n"
                      "reserved = mmap.mmap(-1, 16 * 1024**3, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,"
                      " prot=0)\n"
                      "print('reserved')")
    result = run_in_sandbox(reserve, workspace, SandboxLimits(memory_mb=256))
    assert (result.exit_code, result.stdout) == (0, "reserved\n"), result.stderr
    writable = run_in_sandbox(_python("import mmap\n"
                                      "mmap.mmap(-1, 1024**3, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)"),
                              workspace, SandboxLimits(memory_mb=256))
    assert writable.exit_code not in (0, None) and "Cannot allocate memory" in writable.stderr


def test_fork_bomb_is_contained(workspace):
    started = time.monotonic()
    result = run_in_sandbox("bomb() { bomb | bomb & }; bomb; sleep 1; echo still-here", workspace,
                            SandboxLimits(wall_time_s=4))
    assert time.monotonic() - started < 8
    assert result.duration_s < 6
    assert "Cannot fork" in result.stderr or result.timed_out  # it hit the process limit
    assert subprocess.run(["true"], timeout=5).returncode == 0  # the host can still fork


def test_process_limit_is_exact(workspace):
    script = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        children += 1
except OSError as exc:
    print(children, type(exc).__name__)
"""
    result = run_in_sandbox(_python(script), workspace, SandboxLimits(max_processes=12))
    assert result.exit_code == 0, result
    children, error = result.stdout.split()
    assert error == "BlockingIOError" and 1 <= int(children) <= 12  # EAGAIN well before runaway
    assert result.duration_s < 5


def test_concurrent_sandboxes_do_not_share_the_process_limit(base):
    script = """
import os, time
children = 0
try:
    while children < 8:
        if os.fork() == 0:
            time.sleep(1)
            os._exit(0)
        children += 1
except OSError:
    pass
print(children)
"""
    workspaces = []
    for index in range(3):
        workspaces.append(base / f"ws{index}")
        workspaces[-1].mkdir()
    with ThreadPoolExecutor(len(workspaces)) as pool:
        results = list(pool.map(
            lambda ws: run_in_sandbox(_python(script), ws, SandboxLimits(max_processes=12)), workspaces))
    assert [result.stdout for result in results] == ["8\n"] * 3, results


def test_huge_output_is_capped_and_drained(workspace):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    limits = SandboxLimits(max_output_bytes=1000)
    finite = run_in_sandbox("head -c 300000000 /dev/zero | tr '\\0' y; echo done >&2", workspace, limits)
    assert finite.exit_code == 0 and finite.output_truncated and not finite.timed_out
    assert finite.stdout == "y" * 1000 and finite.stderr == "done\n"
    endless = run_in_sandbox("yes & yes >&2", workspace,
                             SandboxLimits(wall_time_s=1.5, max_output_bytes=1000))
    assert endless.timed_out and endless.output_truncated
    assert len(endless.stdout) == len(endless.stderr) == 1000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100 * 1024  # KiB


def test_environment_is_clean(workspace, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    result = run_in_sandbox("env", workspace, env={"TASK_ID": "t-1"})
    variables = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert "SECRET_TOKEN" not in variables and "hunter2" not in result.stdout
    assert variables["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert variables["HOME"] == "/workspace" and variables["LANG"] == "C.UTF-8"
    assert variables["TASK_ID"] == "t-1"


def test_no_privileges_inside(workspace):
    result = run_in_sandbox(
        "id -u; grep CapEff /proc/self/status; unshare -U true 2>/dev/null && echo userns-ok; "
        "ls /proc | grep -c '^[0-9]'", workspace)
    uid, caps, *rest = result.stdout.split("\n")
    assert uid == str(bubblewrap.SANDBOX_UID)
    assert caps.split()[1] == "0000000000000000"
    assert "userns-ok" not in rest
    assert int(rest[0]) <= 5  # its own pid namespace: only its own few processes


def test_cpu_time_limit(workspace):
    result = run_in_sandbox("python3 -c 'while True: pass'", workspace,
                            SandboxLimits(cpu_time_s=1, wall_time_s=10))
    assert not result.timed_out and result.duration_s < 5
    assert result.reason.startswith("killed by signal SIGXCPU"), result.reason


def test_file_size_limit(workspace):
    result = run_in_sandbox("head -c 3000000 /dev/zero > big", workspace, SandboxLimits(max_file_size_mb=1))
    assert result.exit_code != 0 and "SIGXFSZ" in result.reason, result
    assert (workspace / "big").stat().st_size <= 1024 * 1024


@pytest.mark.skipif(not AS_ROOT, reason=DOES_NOT_APPLY + "only root runs the sandbox as another host uid")
def test_workspace_out_of_reach_is_a_clear_error(tmp_path):
    hidden = tmp_path.parent.parent  # pytest's basetemp parent is 0700
    if hidden.stat().st_mode & stat.S_IXOTH:
        skip_does_not_apply(f"{hidden} is searchable by others here")
    with pytest.raises(WorkspaceError, match="not reachable"):
        run_in_sandbox("true", tmp_path)


def test_the_workspace_can_sit_at_a_tasks_workdir(base, workspace):
    (workspace / "data.txt").write_text("in the workspace\n")
    (base / "tests").mkdir()
    (base / "tests" / "check.sh").write_text("cat /app/data.txt\n")
    result = run_in_sandbox("pwd; echo $HOME; sh /tests/check.sh; echo new > /app/new.txt; "
                            "ls /workspace 2>/dev/null || echo no-workspace", workspace,
                            extra_binds=[(base / "tests", "/tests", True)], workdir="/app")
    assert result.exit_code == 0, result
    assert result.stdout == "/app\n/app\nin the workspace\nno-workspace\n"
    assert (workspace / "new.txt").read_text() == "new\n"
    nested = run_in_sandbox("pwd", workspace, workdir="//srv/task//app/")
    assert (nested.exit_code, nested.stdout) == (0, "/srv/task/app\n")


@pytest.mark.parametrize("workdir, message", [
    ("app", "must be an absolute path"),
    ("/app/../etc", "must be an absolute path without . or .."),
    ("/srv/./app", "must be an absolute path without . or .."),
    ("/", "is \\(under\\) the sandbox's /"),
    ("/usr/src/app", "is \\(under\\) the sandbox's /usr"),
    ("/etc", "is \\(under\\) the sandbox's /etc"),
    ("/proc/app", "is \\(under\\) the sandbox's /proc"),
    ("/tmp/app", "is \\(under\\) the sandbox's /tmp"),
    ("/dev/shm", "is \\(under\\) the sandbox's /dev"),
    ("/lib64", "is \\(under\\) the sandbox's /lib64"),
])
def test_a_bad_workdir_is_refused(workspace, workdir, message):
    with pytest.raises(SandboxError, match=f"workdir .*{message}"):
        run_in_sandbox("touch /tmp/ran", workspace, workdir=workdir)
    with pytest.raises(SandboxError, match=f"workdir .*{message}"):
        bubblewrap.BubblewrapBackend(python_tools=False).run(
            "true", workspace, limits=SandboxLimits(), workdir=workdir)


def test_binds_may_not_overlap_the_workspace(base, workspace):
    (base / "other").mkdir()
    for target, workdir in [("/workspace", "/workspace"), ("/workspace/tests", "/workspace"),
                            ("/app", "/app"), ("/app/tests", "/app"), ("/srv", "/srv/app")]:
        with pytest.raises(SandboxError, match=f"bind target '{target}' overlaps the workspace"):
            run_in_sandbox("true", workspace, extra_binds=[(base / "other", target, True)],
                           workdir=workdir)
    with pytest.raises(SandboxError, match="bind target '/usr/x' is \\(under\\) the sandbox's /usr"):
        run_in_sandbox("true", workspace, extra_binds=[(base / "other", "/usr/x", True)])
    with pytest.raises(SandboxError, match="given twice"):
        run_in_sandbox("true", workspace, extra_binds=[(base / "other", "/o", True),
                                                      (base / "other", "/o/", False)])
    # /workspace is only reserved while the workspace is there
    (base / "other" / "marker").write_text("other\n")
    (base / "other" / "marker").chmod(0o644)
    moved = run_in_sandbox("cat /workspace/marker", workspace, workdir="/app",
                           extra_binds=[(base / "other", "/workspace", True)])
    assert (moved.exit_code, moved.stdout) == (0, "other\n"), moved


def test_missing_bwrap_is_a_clear_error(workspace, monkeypatch):
    monkeypatch.setattr(bubblewrap.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run_in_sandbox("true", workspace)


def test_workspaces_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    from rollstream.shared.sandbox.workspace import remove_orphaned_workspaces, workspace_prefix

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"rs-grade-{dead.pid}-abc"
    live = tmp_path / (workspace_prefix("grade") + "def")
    other = tmp_path / "rs-grade-pytools-xyz"
    for path in (orphan, live, other):
        (path / "repo").mkdir(parents=True)
    assert remove_orphaned_workspaces("grade", tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and other.exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to start processes in pid namespaces of their own")
def test_processes_of_two_containers_get_different_sandbox_uids():
    """Containers share the host's uids but each numbers its processes from 1: the main processes of two
    (pid 1 in each) must not share a sandbox uid, or one's sandboxes use up the other's process limit."""
    show = ("import os; from rollstream.shared.sandbox import host_uids; "
            "print(os.getpid(), host_uids.this_process_uids().start,"
            " host_uids.sees_every_process_of_its_uid())")
    seen = []
    for _ in range(2):
        out = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", show], capture_output=True,
                             text=True, check=True).stdout.split()
        seen.append((int(out[0]), int(out[1])))
        # nor can such a process count its uid's processes: its sandboxes get no RLIMIT_NPROC of their own
        assert out[2] == "False"
    assert [pid for pid, _ in seen] == [1, 1]
    assert seen[0][1] != seen[1][1]
