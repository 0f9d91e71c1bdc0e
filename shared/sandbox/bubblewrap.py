"""Run a shell command on a workspace directory inside a bubblewrap sandbox (`run_in_sandbox`), and
the grader's backend over it (`BubblewrapBackend`).

The command was written by a model under training, so it is treated as hostile. It runs as
`/bin/sh -c COMMAND` under `bwrap` and sees only:

* read-only system directories, enough for `sh` and Debian's /usr/bin/python3: /usr, the
  /bin, /sbin, /lib, /lib64 links (or binds where the host has real directories),
  /etc/alternatives and a few /etc files, plus a made-up /etc/passwd, /etc/group and /etc/hosts;
  the host's /, /root, /home, /work and every other path are not there at all;
* a fresh /proc and /dev, and size-capped tmpfs mounts at /tmp and /dev/shm;
* the workspace, read-write at `workdir` (/workspace unless the caller names another place, e.g.
  a Harbor task's WORKDIR /app), which is also its working directory;
* what the caller adds with `extra_binds`: (host path, sandbox path, read_only) triples, e.g. a
  task's tests read-only at /tests and a log directory read-write at /logs. The workdir and the
  binds' sandbox paths are absolute, without `..`, and may not be or lie under a system path
  (/usr, /proc, /etc, /tmp, ...); a bind may not overlap the workdir (base.place_mounts). When we
  are root, a read-write bind is chowned to the sandbox uid for the run and back afterwards like
  the workspace (shared/sandbox/host_uids.py); a read-only one must be readable by others (o+r,
  parents o+x);
* what the caller adds with `kept_binds`: (host path, sandbox path) pairs mounted read-write but
  left with their owner, so when we are root the sandbox's uid can only do there what their modes
  let any user do (a grader's reward files: writable, never chmod-ed, deleted or replaced by it).

It gets its own user, pid, network (only a loopback: no network), ipc, uts and cgroup
namespaces, a clean environment (PATH, HOME=the workdir, LANG, plus what the caller passes), no
capabilities, no way to make further user namespaces, and the root of its file system is
remounted read-only (only the workdir, read-write binds, /tmp and /dev/shm are writable).

Limits. The wall clock kills the whole sandbox: SIGKILL to the sandbox's pid 1 (the kernel then
kills every process in its pid namespace) and to bwrap's process group (bwrap runs with
--die-with-parent, so that alone would do too); a last sweep kills anything still running as the
sandbox's host uid, so nothing outlives the call. rlimits are set on bwrap in
`preexec_fn` and inherited by the command: CPU time, memory, file size, open files and
processes. Memory is RLIMIT_DATA, what a process may map writable (heap, anonymous and private
mappings), not RLIMIT_AS: runtimes reserve far more address space than they use (node reserves
10 GiB for each WebAssembly memory, its fetch's HTTP parser among them, so under an 8 GiB RLIMIT_AS
every fetch of a node agent failed), and a reservation is no memory. stdout and stderr are read
concurrently; each keeps at most `max_output_bytes` and the rest is read and thrown away, so the
child never blocks and the host never buffers it. When we are
root, bwrap runs as a fresh unprivileged host uid, so RLIMIT_NPROC holds (see host_uids.py). When
not, RLIMIT_NPROC counts the caller's processes too, and in a container, whose uid other containers'
processes share unseen, none is set (they would use it up: "Creating new namespace failed: Resource
temporarily unavailable"): the container's pids limit bounds the sandbox there (docker-compose.yml).

Not bounded here: total memory across processes (RLIMIT_DATA is per process; shared mappings,
memfd and SysV shm pages are not in it), disk use in the workspace (RLIMIT_FSIZE is per file) and
the number of files. A memory and pids cgroup around bwrap is the next layer where the host lets us
create one.

`BubblewrapBackend` adapts it to the backend protocol (shared/sandbox/base.py): mounts become
binds, `image` is ignored (the host's /usr is the environment), and with python_tools (the default)
pytest is importable in the sandbox (shared/sandbox/python_tools.py), except in a run that brings a
virtual environment of its own (VIRTUAL_ENV set): a SWE row's environment, built on the host and mounted
read-only (`environment_for`, shared/sandbox/venv_environments.py), has its own pytest.

    from rollstream.shared.sandbox.bubblewrap import run_in_sandbox
    result = run_in_sandbox("python3 check.py", Path(workspace), SandboxLimits(wall_time_s=5))
    print(result.exit_code, result.reason, result.stdout)

    python -m pytest tests/unit/shared/sandbox -q   (needs `bwrap`: apt-get install bubblewrap)
"""

from __future__ import annotations

import glob
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rollstream.shared.errors import (
    BackendUnavailable,
    SandboxError,
    SandboxUnavailable,
    WorkspaceError,
)
from rollstream.shared.sandbox.base import (
    DEFAULT_WORKDIR,
    SandboxEnvironment,
    SandboxLimits,
    SandboxResult,
    place_mounts,
)
from rollstream.shared.sandbox.host_uids import (
    check_reachable,
    count_tasks,
    kill_leftovers,
    lent_to,
    sandbox_host_uid,
    sees_every_process_of_its_uid,
)
from rollstream.shared.sandbox.python_tools import (
    PYTHON_TOOLS_MOUNT,
    stage_python_tools,
)
from rollstream.shared.sandbox.venv_environments import VenvEnvironments

SANDBOX_UID = 1000
"""uid and gid the command has inside the sandbox (named `sandbox` in its /etc/passwd)."""

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


def run_in_sandbox(command: str, workspace: Path, limits: SandboxLimits = SandboxLimits(),
                   env: dict[str, str] | None = None,
                   extra_binds: list[tuple[Path, str, bool]] | None = None,
                   workdir: str = DEFAULT_WORKDIR,
                   kept_binds: list[tuple[Path, str]] | None = None) -> SandboxResult:
    """Run `/bin/sh -c command` in `workdir` (= `workspace` on the host) inside the sandbox.
    extra_binds: (host path, sandbox path, read_only) mounted in addition to the workspace;
    kept_binds: (host path, sandbox path) mounted read-write without lending them to the sandbox."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap is not installed (`bwrap` not on PATH); "
                                 "on Debian: apt-get install bubblewrap")
    workspace = Path(workspace).resolve()
    if not workspace.is_dir():
        raise WorkspaceError(f"workspace {workspace} is not a directory")
    lendable = list(extra_binds or [])
    workdir, binds = _check_binds(lendable + [(host, target, False) for host, target in kept_binds or []],
                                  workdir)
    if os.geteuid() != 0:
        return _run(bwrap, command, workspace, limits, env or {}, None, binds, workdir)
    check_reachable(workspace)
    for host, _, _ in binds:
        check_reachable(host)
    writable = [workspace] + [host for host, _, read_only in binds[:len(lendable)] if not read_only]
    kept = [host for host, _, _ in binds[len(lendable):]]
    with sandbox_host_uid() as host_uid:
        try:
            with lent_to(host_uid, writable, kept):
                return _run(bwrap, command, workspace, limits, env or {}, host_uid, binds, workdir)
        finally:
            kill_leftovers(host_uid)


def _check_binds(binds: list[tuple[Path, str, bool]],
                 workdir: str) -> tuple[str, list[tuple[Path, str, bool]]]:
    """The workdir and the extra binds, checked: existing host paths, sandbox paths a caller may
    use (base.place_mounts), normalized."""
    hosts = []
    for host, _, _ in binds:
        host = Path(host).resolve()
        if not host.exists():
            raise SandboxError(f"bind source {host} does not exist")
        hosts.append(host)
    workdir, targets = place_mounts(workdir, [target for _, target, _ in binds])
    return workdir, [(host, target, bool(read_only))
                     for host, target, (_, _, read_only) in zip(hosts, targets, binds)]


def _run(bwrap: str, command: str, workspace: Path, limits: SandboxLimits, env: dict[str, str],
         host_uid: int | None, binds: list[tuple[Path, str, bool]],
         workdir: str) -> SandboxResult:
    data_fds: list[int] = []
    try:
        args = _bwrap_args(bwrap, command, workspace, limits, env, data_fds, binds, workdir)
        nproc = _process_limit(limits, host_uid)
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


def _process_limit(limits: SandboxLimits, host_uid: int | None) -> int | None:
    """RLIMIT_NPROC for bwrap: the sandbox's own uid's limit when we are root; else the caller's processes
    plus the sandbox's, where we can count the caller's; None (the inherited limit) in a container that
    shares its uid with processes it cannot see, whose pids limit is then what bounds a fork bomb."""
    if host_uid is not None:
        return limits.max_processes
    if sees_every_process_of_its_uid():
        return limits.max_processes + count_tasks(os.getuid())
    return None


def _bwrap_args(bwrap: str, command: str, workspace: Path, limits: SandboxLimits,
                env: dict[str, str], data_fds: list[int], binds: list[tuple[Path, str, bool]],
                workdir: str) -> list[str]:
    """The bwrap command line; files made up for the sandbox are passed as pipe fds in data_fds."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--clearenv"]
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
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
                       f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{workdir}:/bin/sh\n"
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
             "--bind", str(workspace), workdir]
    for host, target, read_only in binds:
        args += ["--ro-bind" if read_only else "--bind", str(host), target]
    args += ["--remount-ro", "/", "--remount-ro", "/dev",
             "--chdir", workdir, "--as-pid-1", "--", "/bin/sh", "-c", _PID_1, "sandbox", command]
    return args


def _limit_child(limits: SandboxLimits, nproc: int | None) -> Callable[[], None]:
    """preexec_fn for bwrap (runs after the switch to the sandbox's host uid); its rlimits are
    inherited by everything in the sandbox. Kept to plain system calls: it runs in a forked child."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    mib = 1024 * 1024
    rlimits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_DATA, (limits.memory_mb * mib, limits.memory_mb * mib)),
        (resource.RLIMIT_FSIZE, (limits.max_file_size_mb * mib, limits.max_file_size_mb * mib)),
        (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    if nproc is not None:
        rlimits.append((resource.RLIMIT_NPROC, (nproc, nproc)))

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


NAMESPACE_HINT = (
    "bwrap needs unprivileged user namespaces (and, in a container, to mount its own /proc): on Ubuntu 24.04 "
    "(AppArmor) "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile that allows "
    "userns for bwrap; elsewhere check `sysctl user.max_user_namespaces` (> 0) and, on older Debian, "
    "kernel.unprivileged_userns_clone=1; in a container, run it with "
    "security_opt seccomp=unconfined and systempaths=unconfined (as docker-compose.yml does)")
"""What to do when bwrap cannot make its namespaces: the host, or the container runtime, forbids them."""

PROCESS_LIMIT_HINT = (
    "bwrap could not start a process: the process limit (RLIMIT_NPROC) of the user it runs as is used up; "
    "the kernel counts every process and thread of that uid on the host, other containers' too: run the "
    "grader as root (each sandbox then gets a uid of its own) or as a uid no other service uses, or raise "
    "`ulimit -u`")
"""What to do when bwrap fails with EAGAIN."""


def setup_failure_hint(stderr: str) -> str:
    """What to do about a bwrap that failed to set its sandbox up, judged by its own words; "" when
    we have no advice."""
    said = stderr.lower()
    if "resource temporarily unavailable" in said:
        return PROCESS_LIMIT_HINT
    if "namespace" in said or "uid map" in said or "operation not permitted" in said:
        return NAMESPACE_HINT
    return ""


class BubblewrapBackend:
    """shared/sandbox/bubblewrap.py; mounts become bwrap binds; `image` is ignored. With python_tools (the
    default), pytest is importable in the sandbox and `python` runs /usr/bin/python3 (mounted
    read-only at /opt/rollstream; PATH and PYTHONPATH point there), unless the run's env names a
    VIRTUAL_ENV. environments_dir: where SWE rows' environments are built (default:
    venv_environments.default_environments_dir())."""

    name = "bubblewrap"

    def __init__(self, python_tools: bool = True, environments_dir: Path | None = None) -> None:
        if shutil.which("bwrap") is None:
            raise BackendUnavailable("bubblewrap is not installed (`bwrap` not on PATH); "
                                     "on Debian: apt-get install bubblewrap")
        self.tools = stage_python_tools() if python_tools else None
        self.environments = VenvEnvironments(environments_dir)

    def image_for(self, environment_dir: Path | None) -> str | None:
        return None

    def environment_for(self, spec, build: bool = True) -> SandboxEnvironment | None:
        """The virtual environment of an EnvironmentSpec, built now when it is not prepared and `build`
        (EnvironmentBuildFailed, EnvironmentUnsupported); None when it is not prepared and not `build`, or
        the spec only names a published image (which needs docker)."""
        if not spec.install and not spec.python and spec.image_name:
            return None
        if build:
            return self.environments.sandbox_environment(self.environments.prepare(spec).path)
        path = self.environments.find(spec)
        return self.environments.sandbox_environment(path) if path is not None else None

    def run(self, command: str, workspace: Path, *, limits: SandboxLimits,
            ro_mounts: dict[str, Path] | None = None, rw_mounts: dict[str, Path] | None = None,
            env: dict[str, str] | None = None, image: str | None = None,
            workdir: str = DEFAULT_WORKDIR,
            kept_mounts: dict[str, Path] | None = None) -> SandboxResult:
        binds = [(Path(host), target, True) for target, host in (ro_mounts or {}).items()]
        binds += [(Path(host), target, False) for target, host in (rw_mounts or {}).items()]
        full_env = dict(env or {})
        if self.tools is not None and "VIRTUAL_ENV" not in full_env:
            binds.append((self.tools, PYTHON_TOOLS_MOUNT, True))
            full_env.setdefault("PATH", f"{PYTHON_TOOLS_MOUNT}/bin:/usr/local/bin:/usr/bin:/bin")
            # after the caller's own entries: a caller's module path (the SWE report plugin) is kept
            full_env["PYTHONPATH"] = ":".join(filter(None, [full_env.get("PYTHONPATH"),
                                                            f"{PYTHON_TOOLS_MOUNT}/site"]))
        return run_in_sandbox(command, workspace, limits, full_env, extra_binds=binds,
                              workdir=workdir,
                              kept_binds=[(Path(host), target)
                                          for target, host in (kept_mounts or {}).items()])
