"""Run a shell command on a workspace directory inside a bubblewrap sandbox.

The command was written by a model under training, so it is treated as hostile. It runs as
`/bin/sh -c COMMAND` under `bwrap` and sees only:

* read-only system directories, enough for `sh` and Debian's /usr/bin/python3: /usr, the
  /bin, /sbin, /lib, /lib64 links (or binds where the host has real directories),
  /etc/alternatives and a few /etc files, plus a made-up /etc/passwd, /etc/group and /etc/hosts;
  the host's /, /root, /home, /work and every other path are not there at all;
* a fresh /proc and /dev, and size-capped tmpfs mounts at /tmp and /dev/shm;
* the workspace, read-write at /workspace, which is also its working directory;
* what the caller adds with `extra_binds`: (host path, sandbox path, read_only) triples, e.g. a
  task's tests read-only at /tests and a log directory read-write at /logs. Sandbox paths are
  absolute, without `..`, and may not be or lie under a system path (/usr, /proc, /etc, ...) or
  /workspace. When we are root, a read-write bind is chowned to the sandbox uid for the run and
  back afterwards like the workspace; a read-only one must be readable by others (o+r, parents
  o+x).

It gets its own user, pid, network (only a loopback: no network), ipc, uts and cgroup
namespaces, a clean environment (PATH, HOME=/workspace, LANG, plus what the caller passes), no
capabilities, no way to make further user namespaces, and the root of its file system is
remounted read-only (only /workspace, /tmp and /dev/shm are writable).

Limits. The wall clock kills the whole sandbox: SIGKILL to the sandbox's pid 1 (the kernel then
kills every process in its pid namespace) and to bwrap's process group (bwrap runs with
--die-with-parent, so that alone would do too); a last sweep kills anything still running as the
sandbox's host uid, so nothing outlives the call. rlimits are set on bwrap in
`preexec_fn` and inherited by the command: CPU time, address space, file size, open files and
processes. stdout and stderr are read concurrently; each keeps at most `max_output_bytes` and the
rest is read and thrown away, so the child never blocks and the host never buffers it.

The process limit when the caller is root: the kernel never enforces RLIMIT_NPROC for processes
whose host uid is 0, and `bwrap --unshare-user --uid N` run by root still runs the command as host
uid 0 (the uid is only renamed inside the namespace). So when we are root, bwrap itself is
started as a fresh unprivileged host uid (one per concurrent run, never a real user; see
`_sandbox_host_uid`), and RLIMIT_NPROC then holds for everything in the sandbox. That uid must
be able to write the workspace, so the workspace tree is chowned to it for the run (files with
several hard links are left alone) and chowned back afterwards (set-uid/set-gid bits that the
command set are cleared). The workspace's parent directories must be searchable by other users
(a directory made by `tempfile` under /tmp is fine; pytest's `tmp_path` is not). When we are not
root, bwrap runs as the caller, nothing is chowned, and RLIMIT_NPROC counts the caller's own
processes too, so it is raised by how many the caller already has.

Not bounded here: total memory across processes (RLIMIT_AS is per process; memfd/SysV shm pages
are not in it), disk use in the workspace (RLIMIT_FSIZE is per file) and the number of files. A
memory and pids cgroup around bwrap is the next layer where the host lets us create one.

    from shared.sandbox import SandboxLimits, run_in_sandbox
    result = run_in_sandbox("python3 check.py", Path(workspace), SandboxLimits(wall_time_s=5))
    print(result.exit_code, result.reason, result.stdout)

Tests: python -m pytest tests/unit/test_sandbox.py -q   (needs `bwrap`: apt-get install bubblewrap)
"""

from __future__ import annotations

import glob
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SANDBOX_UID = 1000
"""uid and gid the command has inside the sandbox (named `sandbox` in its /etc/passwd)."""

_HOST_UID_BASE = 0x2000_0000
"""Sandbox host uids are _HOST_UID_BASE + pid * _SLOTS + slot: unique per live process and run."""
_SLOTS = 256
_MAX_DEPTH = 128
"""Directories deeper than this below the workspace are not chowned (the walk stays bounded)."""
_KILL_GRACE_S = 5.0

_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
              "/etc/localtime", "/etc/nsswitch.conf")
"""Bound read-only where the host has them, with /etc/python3* (Debian's python3 config)."""
_PID_1 = '/bin/sh -c "$1"; exit "$?"'
"""The sandbox's pid 1 (bwrap --as-pid-1): a shell that runs the command in a child shell (so the
command has ordinary signal handling, not init's), reaps orphans while it waits, and passes on the
exit status (128+N for signal N). bwrap's own reaper is not used: bwrap returns as soon as the
command ends without reaping it, leaving one zombie per run to the host's init; counted against
the sandbox uid's RLIMIT_NPROC until init reaps it (and forever where init never does)."""
_TOP_LEVEL_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class SandboxError(RuntimeError):
    """The sandbox could not be set up for this call."""


class SandboxUnavailable(SandboxError):
    """bubblewrap (`bwrap`) is not installed on this host."""


class WorkspaceError(SandboxError):
    """The workspace is missing, not a directory, or out of the sandbox user's reach."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10
    """Wall-clock limit; then every process in the sandbox is killed."""
    cpu_time_s: float = 10
    """CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS), in MiB."""
    max_processes: int = 64
    """Processes and threads the sandbox may have at once (RLIMIT_NPROC on a per-run uid)."""
    max_file_size_mb: int = 64
    """Largest file the command may write (RLIMIT_FSIZE), in MiB."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 64 * 1024
    """stdout and stderr are each kept up to this many bytes; the rest is drained and dropped."""
    tmp_size_mb: int = 64
    """Size of the tmpfs at /tmp (and of the one at /dev/shm), in MiB."""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None
    """The command's exit status (128+N when it died of signal N); None when the wall clock killed it."""
    stdout: str
    """Captured stdout, at most max_output_bytes of it (decoded as UTF-8, bad bytes replaced)."""
    stderr: str
    """Captured stderr, likewise capped."""
    timed_out: bool
    """The wall-clock limit killed the sandbox."""
    output_truncated: bool
    """stdout or stderr had more than max_output_bytes; the rest was dropped."""
    duration_s: float
    """Wall time from starting bwrap to its end."""
    reason: str
    """What happened, in words: "exit 0", "killed: wall-clock limit 10s", ..."""


def run_in_sandbox(command: str, workspace: Path, limits: SandboxLimits = SandboxLimits(),
                   env: dict[str, str] | None = None,
                   extra_binds: list[tuple[Path, str, bool]] | None = None) -> SandboxResult:
    """Run `/bin/sh -c command` in /workspace (= `workspace` on the host) inside the sandbox.
    extra_binds: (host path, sandbox path, read_only) mounted in addition to the workspace."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap is not installed (`bwrap` not on PATH); "
                                 "on Debian: apt-get install bubblewrap")
    workspace = Path(workspace).resolve()
    if not workspace.is_dir():
        raise WorkspaceError(f"workspace {workspace} is not a directory")
    binds = _check_binds(extra_binds or [])
    if os.geteuid() != 0:
        return _run(bwrap, command, workspace, limits, env or {}, None, binds)
    _check_reachable(workspace)
    for host, _, _ in binds:
        _check_reachable(host)
    writable = [workspace] + [host for host, _, read_only in binds if not read_only]
    with _sandbox_host_uid() as host_uid:
        try:
            with lent_to(host_uid, writable):
                return _run(bwrap, command, workspace, limits, env or {}, host_uid, binds)
        finally:
            _kill_leftovers(host_uid)


@contextmanager
def lent_to(uid: int, trees: list[Path]):
    """chown the trees to `uid` for the duration (a sandbox user must write them), then give every
    entry back to its previous owner."""
    handed: list[tuple[Path, dict[int, tuple[int, int]]]] = []
    try:
        for top in trees:
            owners: dict[int, tuple[int, int]] = {}
            handed.append((top, owners))
            _hand_over(top, uid, owners)
        yield
    finally:
        for top, owners in handed:
            _take_back(top, uid, owners)


_RESERVED_SANDBOX_PATHS = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                           "/etc", "/proc", "/dev", "/tmp", "/workspace")


def _check_binds(binds: list[tuple[Path, str, bool]]) -> list[tuple[Path, str, bool]]:
    """Validate extra binds: existing host paths, absolute sandbox paths outside system paths."""
    checked: list[tuple[Path, str, bool]] = []
    seen: set[str] = set()
    for host, target, read_only in binds:
        host = Path(host).resolve()
        if not host.exists():
            raise SandboxError(f"bind source {host} does not exist")
        if not isinstance(target, str) or not target.startswith("/") or "\0" in target \
                or any(part in ("..", ".") for part in target.split("/")):
            raise SandboxError(f"bind target {target!r} must be an absolute path without . or ..")
        target = "/" + "/".join(part for part in target.split("/") if part)
        for reserved in _RESERVED_SANDBOX_PATHS:
            if target == reserved or (reserved != "/" and target.startswith(reserved + "/")):
                raise SandboxError(f"bind target {target!r} is (under) the sandbox's {reserved}")
        if target in seen:
            raise SandboxError(f"bind target {target!r} given twice")
        seen.add(target)
        checked.append((host, target, bool(read_only)))
    return checked


def _run(bwrap: str, command: str, workspace: Path, limits: SandboxLimits, env: dict[str, str],
         host_uid: int | None, binds: list[tuple[Path, str, bool]] = ()) -> SandboxResult:
    data_fds: list[int] = []
    try:
        args = _bwrap_args(bwrap, command, workspace, limits, env, data_fds, binds)
        nproc = limits.max_processes if host_uid is not None else \
            limits.max_processes + _count_tasks(os.getuid())
        started = time.monotonic()
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=data_fds, start_new_session=True,
            user=host_uid, group=host_uid, extra_groups=[] if host_uid is not None else None,
            preexec_fn=_limit_child(limits, nproc))
    finally:
        for fd in data_fds:
            os.close(fd)
    with proc:
        stdout, stderr, truncated, timed_out = _collect_output(proc, limits, started)
        exit_code = None if timed_out else proc.returncode
        duration = time.monotonic() - started
    text_out = stdout.decode("utf-8", errors="replace")
    text_err = stderr.decode("utf-8", errors="replace")
    return SandboxResult(exit_code=exit_code, stdout=text_out, stderr=text_err, timed_out=timed_out,
                         output_truncated=truncated, duration_s=duration,
                         reason=_describe(exit_code, timed_out, limits, text_err))


def _bwrap_args(bwrap: str, command: str, workspace: Path, limits: SandboxLimits,
                env: dict[str, str], data_fds: list[int],
                binds: list[tuple[Path, str, bool]] = ()) -> list[str]:
    """The bwrap command line; files made up for the sandbox are passed as pipe fds in data_fds."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--clearenv"]
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8"}
    full_env.update(env)
    for key, value in full_env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise SandboxError(f"bad environment variable {key!r}")
        args += ["--setenv", key, value]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in _TOP_LEVEL_SYSTEM_DIRS:
        host = Path("/", name)
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    for path in [*_ETC_FILES, *sorted(glob.glob("/etc/python3*"))]:
        args += ["--ro-bind-try", path, path]
    made_up = {
        "/etc/passwd": f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
                       f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/workspace:/bin/sh\n"
                       f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "/etc/group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n",
    }
    for path, content in made_up.items():
        read_end, write_end = os.pipe()
        data_fds.append(read_end)
        with open(write_end, "wb") as pipe:  # far below a pipe's buffer, so this never blocks
            pipe.write(content.encode())
        args += ["--perms", "0444", "--ro-bind-data", str(read_end), path]
    tmp_bytes = str(limits.tmp_size_mb * 1024 * 1024)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", tmp_bytes, "--tmpfs", "/tmp",
             "--perms", "1777", "--size", tmp_bytes, "--tmpfs", "/dev/shm",
             "--bind", str(workspace), "/workspace"]
    for host, target, read_only in binds:
        args += ["--ro-bind" if read_only else "--bind", str(host), target]
    args += ["--remount-ro", "/", "--remount-ro", "/dev",
             "--chdir", "/workspace", "--as-pid-1", "--", "/bin/sh", "-c", _PID_1, "sandbox", command]
    return args


def _limit_child(limits: SandboxLimits, nproc: int) -> Callable[[], None]:
    """preexec_fn for bwrap (runs after the switch to the sandbox's host uid); its rlimits are
    inherited by everything in the sandbox. Kept to plain system calls: it runs in a forked child."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    mib = 1024 * 1024
    rlimits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits.memory_mb * mib, limits.memory_mb * mib)),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_FSIZE, (limits.max_file_size_mb * mib, limits.max_file_size_mb * mib)),
        (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    def apply() -> None:
        for which, value in rlimits:
            resource.setrlimit(which, value)
        os.nice(10)

    return apply


def _collect_output(proc: subprocess.Popen, limits: SandboxLimits,
                    started: float) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, keeping max_output_bytes of each; kill the
    sandbox when the wall clock runs out. Returns (stdout, stderr, truncated, timed_out)."""
    cap = limits.max_output_bytes
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = timed_out = False
    deadline = started + limits.wall_time_s
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:
                    break  # still open after the kill and the grace period: stop reading
                timed_out = True
                _kill_group(proc)
                deadline = time.monotonic() + _KILL_GRACE_S
                continue
            for key, _ in selector.select(left):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = kept[key.fd]
                room = cap - len(buffer)
                if room > 0:
                    buffer += chunk[:room]
                if len(chunk) > room:
                    truncated = True
    if not timed_out:
        try:
            proc.wait(timeout=max(0.0, started + limits.wall_time_s - time.monotonic()))
        except subprocess.TimeoutExpired:  # its output is closed but it runs on
            timed_out = True
            _kill_group(proc)
    proc.wait()
    return (bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]),
            truncated, timed_out)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's pid 1, bwrap's child: the kernel then kills every process in the
    sandbox's pid namespace, and bwrap reaps it and exits (killing bwrap first would leave pid 1
    to the host's init to reap). Then SIGKILL bwrap's process group in any case; --die-with-parent
    would take the sandbox down with bwrap too."""
    for pid in _children_of(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children_of(parent: int) -> list[int]:
    children = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat_file:
                    fields = stat_file.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[1] == str(parent):
                children.append(int(entry.name))
    return children


_SIGNAL_HINTS = {
    signal.SIGKILL: "memory/cpu limit?",
    signal.SIGXCPU: "cpu time limit {cpu}s",
    signal.SIGXFSZ: "file size limit {fsize} MiB",
    signal.SIGSEGV: "crash, or memory limit?",
}


def _describe(exit_code: int | None, timed_out: bool, limits: SandboxLimits, stderr: str) -> str:
    if timed_out:
        return f"killed: wall-clock limit {limits.wall_time_s:g}s"
    assert exit_code is not None
    signum = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else 0
    try:
        sig = signal.Signals(signum)
    except ValueError:
        sig = None
    if sig is not None:
        hint = _SIGNAL_HINTS.get(sig, "").format(cpu=max(1, math.ceil(limits.cpu_time_s)),
                                                 fsize=limits.max_file_size_mb)
        return f"killed by signal {sig.name}" + (f" ({hint})" if hint else "")
    reason = f"exit {exit_code}"
    if exit_code == 1 and stderr.startswith("bwrap: "):
        reason += f" (sandbox setup failed? {stderr.splitlines()[0]})"
    return reason


# --- the sandbox's host uid (when we are root) ---------------------------------------------------

_slot_lock = threading.Lock()
_slots_in_use: set[int] = set()


@contextmanager
def _sandbox_host_uid():
    """A host uid that no real user and no other live run has: _HOST_UID_BASE + pid * 256 + slot."""
    with _slot_lock:
        free = [slot for slot in range(_SLOTS) if slot not in _slots_in_use]
        if not free:
            raise SandboxError(f"more than {_SLOTS} sandboxes at once in one process")
        slot = free[0]
        _slots_in_use.add(slot)
    try:
        yield _HOST_UID_BASE + (os.getpid() % (1 << 22)) * _SLOTS + slot
    finally:
        with _slot_lock:
            _slots_in_use.discard(slot)


def _check_reachable(workspace: Path) -> None:
    """bwrap runs as the sandbox's host uid and must be able to walk down to the workspace."""
    for parent in workspace.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise WorkspaceError(
                f"workspace {workspace} is not reachable by the sandbox user: {parent} has mode "
                f"{stat.filemode(mode)} (others need search permission, o+x); "
                "make workspaces under e.g. /tmp with tempfile")


def _each_entry(top: Path, visit: Callable[[int | None, str, os.stat_result], None]) -> None:
    """visit(dir_fd, name, lstat) for top (dir_fd None) and everything below it, never following
    symlinks, down to _MAX_DEPTH directories; an entry that vanishes or fails is skipped."""
    visit(None, str(top), os.lstat(top))
    base_depth = str(top).count(os.sep)
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(top, follow_symlinks=False):
        if dirpath.count(os.sep) - base_depth >= _MAX_DEPTH:
            dirnames[:] = []
        for name in dirnames + filenames:
            try:
                visit(dir_fd, name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            except OSError:
                continue


def _hand_over(workspace: Path, host_uid: int, owners: dict[int, tuple[int, int]]) -> None:
    """chown the workspace tree to the sandbox's host uid, noting the old owners by inode."""

    def visit(dir_fd: int | None, name: str, st: os.stat_result) -> None:
        if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
            return  # a hard link may be a file outside the workspace too
        owners[st.st_ino] = (st.st_uid, st.st_gid)
        os.chown(name, host_uid, host_uid, dir_fd=dir_fd, follow_symlinks=False)

    _each_entry(workspace, visit)


def _take_back(workspace: Path, host_uid: int, owners: dict[int, tuple[int, int]]) -> None:
    """After the run (nothing of the sandbox is alive): give everything the sandbox uid owns back
    to its old owner, new files to the workspace's owner, and clear set-uid/set-gid bits."""
    default = owners.get(os.lstat(workspace).st_ino, (os.getuid(), os.getgid()))

    def visit(dir_fd: int | None, name: str, st: os.stat_result) -> None:
        if st.st_uid != host_uid and st.st_gid != host_uid:
            return
        new_uid, new_gid = owners.get(st.st_ino, default)
        os.chown(name, new_uid, new_gid, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(name, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID), dir_fd=dir_fd)

    try:
        _each_entry(workspace, visit)
    except OSError as exc:  # the workspace itself is gone or unreadable: nothing to give back
        log.warning("could not give workspace %s back: %s", workspace, exc)


def _proc_statuses():
    """(pid, fields of /proc/PID/status) for each process the host shows."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
            except OSError:
                continue
            yield int(entry.name), fields


def _processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`."""
    return [pid for pid, fields in _proc_statuses()
            if fields.get("Uid", "-1").split()[0] == str(uid)
            and not fields.get("State", "").strip().startswith("Z")]


def _kill_leftovers(host_uid: int) -> None:
    """SIGKILL anything still running as the sandbox's host uid (there should be nothing: the pid
    namespace is gone with bwrap), and wait until it is gone."""
    for attempt in range(100):
        pids = _processes_of(host_uid)
        if not pids:
            return
        if attempt == 0:
            log.warning("sandbox uid %d still has processes %s after bwrap ended; killing them",
                        host_uid, pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    log.error("sandbox uid %d: processes %s survived SIGKILL", host_uid, _processes_of(host_uid))


def _count_tasks(uid: int) -> int:
    """Processes and threads the host shows for `uid` (RLIMIT_NPROC counts them all)."""
    return sum(int(fields.get("Threads", "0")) for _, fields in _proc_statuses()
               if fields.get("Uid", "-1").split()[0] == str(uid))


def workspace_prefix(kind: str) -> str:
    """Temp-dir prefix of a sandbox workspace, tagged with the creating process's pid, so that the
    workspaces of a process that died (a killed RQ work-horse) can be found and removed."""
    return f"rs-{kind}-{os.getpid()}-"


def remove_orphaned_workspaces(kind: str, tmp: Path | None = None) -> list[Path]:
    """Delete `kind` workspaces whose creating process no longer exists; returns what was removed."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"rs-{kind}-*-*"):
        pid_text = path.name[len(f"rs-{kind}-"):].split("-", 1)[0]
        if not pid_text.isdigit() or not path.is_dir():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # still alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
