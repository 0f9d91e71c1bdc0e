"""The sandbox's host uid when we are root, and handing a tree to it and back.

The kernel never enforces RLIMIT_NPROC for processes whose host uid is 0, and `bwrap --unshare-user
--uid N` run by root still runs the command as host uid 0 (the uid is only renamed inside the
namespace). So when we are root, bwrap itself is started as a fresh unprivileged host uid (one per
concurrent run, never a real user: `sandbox_host_uid`), and RLIMIT_NPROC then holds for everything
in the sandbox. That uid must be able to write the workspace, so the tree is chowned to it for the
run (`lent_to`; files with several hard links are left alone) and chowned back afterwards
(set-uid/set-gid bits the command set are cleared); a tree the caller keeps (`lent_to(kept=...)`,
e.g. a grader's reward files, which the sandbox may write but must not own) is not handed over,
only what the sandbox created in it is taken back. The workspace's parent directories must be
searchable by other users (`check_reachable`: a directory made by `tempfile` under /tmp is fine;
pytest's `tmp_path` is not). After a run, anything still running as that uid is killed
(`kill_leftovers`). When we are not root, bwrap runs as the caller and nothing here is used but
`count_tasks` (RLIMIT_NPROC then counts the caller's own processes too, and where the caller cannot see all
of them, in a container, the sandbox gets no RLIMIT_NPROC of its own: `sees_every_process_of_its_uid`).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rollstream.shared.errors import SandboxError, WorkspaceError

log = logging.getLogger(__name__)

HOST_UID_BASE = 0x2000_0000
"""Sandbox host uids are HOST_UID_BASE + process key * SLOTS + slot: unique per live process and run."""

_INIT_PID_NAMESPACE = 0xEFFF_FFFC
"""The inode of the kernel's first pid namespace (the host's)."""

_PROCESS_KEYS = 1 << 22

SLOTS = 256

_MAX_DEPTH = 128
"""Directories deeper than this below the workspace are not chowned (the walk stays bounded)."""


@contextmanager
def lent_to(uid: int, trees: list[Path], kept: list[Path] | tuple[Path, ...] = ()):
    """chown the trees to `uid` for the duration (a sandbox user must write them), then give every
    entry back to its previous owner. `kept` trees stay with their owner (the sandbox may only do
    there what their modes let any user do); what `uid` created in them is taken back all the same."""
    handed: list[tuple[Path, dict[int, tuple[int, int]]]] = [(top, {}) for top in kept]
    try:
        for top in trees:
            owners: dict[int, tuple[int, int]] = {}
            handed.append((top, owners))
            _hand_over(top, uid, owners)
        yield
    finally:
        for top, owners in handed:
            _take_back(top, uid, owners)


_slot_lock = threading.Lock()


_slots_in_use: set[int] = set()


def _fresh_slots_in_child() -> None:
    # RQ forks a work-horse per job while the grader may be probing its sandbox in another thread: a child
    # must not inherit the lock held, nor the parent's slots (its uids are its own pid's anyway).
    global _slot_lock, _slots_in_use
    _slot_lock, _slots_in_use = threading.Lock(), set()


os.register_at_fork(after_in_child=_fresh_slots_in_child)


@contextmanager
def sandbox_host_uid():
    """A host uid that no real user and no other live run has: one of this_process_uids(), by slot."""
    with _slot_lock:
        free = [slot for slot in range(SLOTS) if slot not in _slots_in_use]
        if not free:
            raise SandboxError(f"more than {SLOTS} sandboxes at once in one process")
        slot = free[0]
        _slots_in_use.add(slot)
    try:
        yield this_process_uids()[slot]
    finally:
        with _slot_lock:
            _slots_in_use.discard(slot)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return _INIT_PID_NAMESPACE


def sees_every_process_of_its_uid() -> bool:
    """Whether count_tasks sees every process the kernel counts against our uid's RLIMIT_NPROC: not in a
    container (a pid namespace of its own), where the host's other processes of the same uid (the other
    containers', which often share one image's user) are invisible but counted all the same."""
    return _pid_namespace() == _INIT_PID_NAMESPACE


def _process_key(pid: int) -> int:
    """The pid of a process of our pid namespace, offset by a digest of that namespace. Containers share the
    host's uids (and RLIMIT_NPROC counts a uid's processes on the whole host) but number their processes from
    1 each: without the offset, the grader's main process and every agent-runner replica's would share one
    sandbox uid, and one's sandboxes would use up the others' process limit ("Creating new namespace
    failed: Resource temporarily unavailable"). Within a namespace keys stay distinct."""
    namespace = _pid_namespace()
    offset = 0 if namespace == _INIT_PID_NAMESPACE else zlib.crc32(namespace.to_bytes(8, "little"))
    return (pid + offset) % _PROCESS_KEYS


def process_uids(pid: int) -> range:
    """The sandbox host uids the runs of process `pid` (of our pid namespace) get, one per slot."""
    first = HOST_UID_BASE + _process_key(pid) * SLOTS
    return range(first, first + SLOTS)


def this_process_uids() -> range:
    """The sandbox host uids this process's runs get, one per slot."""
    return process_uids(os.getpid())


def processes_of_uids(uids: range) -> list[int]:
    """Processes, zombies included, whose real uid is one of `uids` (e.g. process_uids(pid): what sandboxes
    of that process left running; only ever any when it ran as root)."""
    return [pid for pid, fields in _proc_statuses() if int(fields.get("Uid", "-1").split()[0]) in uids]


def check_reachable(workspace: Path) -> None:
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


def kill_leftovers(host_uid: int) -> None:
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


def count_tasks(uid: int) -> int:
    """Processes and threads the host shows for `uid` (RLIMIT_NPROC counts them all)."""
    return sum(int(fields.get("Threads", "0")) for _, fields in _proc_statuses()
               if fields.get("Uid", "-1").split()[0] == str(uid))

