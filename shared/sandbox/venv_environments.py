"""A SWE row's test environment for the bubblewrap sandbox: a virtual environment of the sandbox's own Python
(/usr/bin/python3) with the row's repository installed into it, built once per EnvironmentSpec key
(shared/tasks/environment_spec.py) under the environments directory and reused by every grading after.

Building (`VenvEnvironments.prepare`), under a file lock per key (a second grader building the same key waits
and reuses the first one's):

1. `/usr/bin/python3 -m venv` in a staging directory beside the final one; a spec that asks for another
   Python is refused (EnvironmentUnsupported: the docker backend builds an image of any Python);
2. the spec's source tree copied to a build path of its own, and its install commands run there on the host,
   with the environment's bin/ first on PATH and VIRTUAL_ENV set: the dataset's repository at its environment
   commit is the user's trusted data, installed as they would install it (network as the host has it); the
   spec's `pre_install` (system packages) is not run: it needs an image (the manifest notes it);
3. pytest installed when the commands did not bring it;
4. the paths rewritten: an editable install records the build path (in a `*.pth` file, a setuptools
   `__editable__*finder*.py`, an `*.egg-link`), which becomes the sandbox's workdir, where grading mounts the
   graded tree: the tests import the graded tree, never the build copy (which is deleted); and the staging
   path in bin/'s scripts and pyvenv.cfg becomes the final one;
5. a manifest (`rollstream-environment.json`: the spec, when it was built, in how many seconds, its size on
   disk, the Python version, `pip freeze`) and the install log written into it, then the staging directory
   renamed into place: an environment is there whole or not at all.

A failed build raises EnvironmentBuildFailed with the tail of the install log (a SandboxError: the grader
reports it as an infrastructure error, never a score) and leaves nothing behind.

At grading the sandbox mounts the environment read-only at its own host path (so every absolute path in it
holds) with its bin/ first on PATH and VIRTUAL_ENV set (the backend's pytest copy is then left out). The
environments directory must therefore be a place the sandbox may mount (not under /tmp, /usr, /etc, ...)
and, when the grader runs as root, one the sandbox's user can reach: the default is
~/.cache/rollstream/environments, or /var/cache/rollstream/environments for root (whose home the sandbox's
user cannot enter).

    python -m pytest tests/unit/shared/sandbox/test_venv_environments.py -q   (needs bwrap and PyPI)
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollstream.shared.errors import SandboxError
from rollstream.shared.sandbox.base import DEFAULT_WORKDIR, SandboxEnvironment, sandbox_path

ENVIRONMENTS_DIR_VARIABLE = "RS_GRADER__ENVIRONMENTS_DIR"
"""The setting grader.environments_dir as a variable: read where no Settings are at hand (validate)."""
SANDBOX_PYTHON = "/usr/bin/python3"
MANIFEST = "rollstream-environment.json"
INSTALL_LOG = "install.log"
INSTALL_TIMEOUT_S = 1800.0
"""Longest one install command may take."""
LOG_TAIL_CHARS = 3000
"""How much of the install log a failed build's error carries."""

Progress = Callable[[str], None]
_NOT_FOR_INSTALLS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PIP_USER", "PIP_TARGET", "PIP_PREFIX")
"""Variables of the host's that would install elsewhere than into the environment, or import from there."""


class EnvironmentBuildFailed(SandboxError):
    """An environment's install failed; the message ends with the install log's tail."""


class EnvironmentUnsupported(SandboxError):
    """The spec asks for what the bubblewrap sandbox cannot give (another Python), or the environments
    directory cannot be mounted in the sandbox."""


@dataclass(frozen=True)
class PreparedEnvironment:
    key: str
    path: Path
    """The virtual environment (also its path in the sandbox)."""
    built: bool
    """Built now; False: it was there and is reused."""
    seconds: float
    """How long having it took (building, or finding it)."""
    size_mb: float
    """Its size on disk, in MB (10^6 bytes)."""
    notes: tuple[str, ...] = ()
    """What of the spec was not done here (pre_install commands)."""

    @property
    def action(self) -> str:
        return "built" if self.built else "reused"


def default_environments_dir() -> Path:
    """RS_GRADER__ENVIRONMENTS_DIR if set; else ~/.cache/rollstream/environments, or for root (whose home
    the sandbox's user cannot enter) /var/cache/rollstream/environments."""
    configured = os.environ.get(ENVIRONMENTS_DIR_VARIABLE)
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/cache/rollstream/environments")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "rollstream" / "environments"


@functools.cache
def sandbox_python_version() -> str:
    """"3.11": the major.minor of the sandbox's /usr/bin/python3."""
    done = subprocess.run([SANDBOX_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise EnvironmentUnsupported(f"{SANDBOX_PYTHON} does not run: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def tree_size_bytes(top: Path) -> int:
    """Bytes of the files under `top` (links not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


class VenvEnvironments:
    """The virtual environments under one environments directory (see the module's docstring)."""

    def __init__(self, root: Path | None = None, workdir: str = DEFAULT_WORKDIR) -> None:
        self.root = Path(root if root is not None else default_environments_dir()).absolute()
        self.workdir = workdir

    def path(self, spec: Any) -> Path:
        return self.root / spec.key

    def find(self, spec: Any) -> Path | None:
        """The prepared environment of `spec`, if there is one."""
        path = self.path(spec)
        return path if (path / MANIFEST).is_file() else None

    def prepare(self, spec: Any, on_progress: Progress | None = None) -> PreparedEnvironment:
        """The environment of `spec`: reused when prepared, else built (see the module's docstring)."""
        started = time.monotonic()
        self._check_usable(spec)
        with self._lock(spec.key):
            built = self.find(spec) is None
            if built:
                self._remove_abandoned(spec.key)
                self._build(spec, on_progress or (lambda _message: None))
        path = self.path(spec)
        manifest = json.loads((path / MANIFEST).read_text())
        return PreparedEnvironment(key=spec.key, path=path, built=built, seconds=time.monotonic() - started,
                                   size_mb=round(manifest["disk_bytes"] / 1e6, 1),
                                   notes=tuple(manifest.get("notes", ())))

    def sandbox_environment(self, path: Path) -> SandboxEnvironment:
        """How a run uses the environment at `path`: mounted read-only at its own path, bin/ first on PATH."""
        return SandboxEnvironment(ro_mounts={str(path): path},
                                  env={"PATH": f"{path}/bin:/usr/local/bin:/usr/bin:/bin",
                                       "VIRTUAL_ENV": str(path)})

    def _check_usable(self, spec: Any) -> None:
        try:
            sandbox_path(str(self.root), "the environments directory")
        except SandboxError as exc:
            raise EnvironmentUnsupported(f"{exc}: the sandbox mounts an environment at its own path; set "
                                         f"grader.environments_dir ({ENVIRONMENTS_DIR_VARIABLE}) to another "
                                         f"place") from None
        if spec.python and spec.python.split(".")[:2] != sandbox_python_version().split("."):
            raise EnvironmentUnsupported(
                f"{spec.repo} at {spec.commit[:12]} wants Python {spec.python}; the bubblewrap sandbox runs "
                f"{SANDBOX_PYTHON} ({sandbox_python_version()}): grade it with --backend docker")

    @contextmanager
    def _lock(self, key: str):
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0 and not self.root.stat().st_mode & 0o001:
            self.root.chmod(0o755)  # the sandbox's user walks through it to the environments
        with open(locks / f"{key}.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _remove_abandoned(self, key: str) -> None:
        """What a builder of `key` killed mid-build left (we hold its lock: no builder of it is alive)."""
        for pattern in (f".building-{key}-*", f".tree-{key}-*"):
            for leftover in self.root.glob(pattern):
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)

    def _build(self, spec: Any, on_progress: Progress) -> None:
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f".building-{spec.key}-", dir=self.root))
        tree = Path(tempfile.mkdtemp(prefix=f".tree-{spec.key}-", dir=self.root)) / "tree"
        log_path = staging.parent / f"{staging.name}.log"
        try:
            with open(log_path, "w", encoding="utf-8") as log:
                on_progress(f"{spec.key}: copying {spec.source}")
                shutil.copytree(spec.source, tree, symlinks=True)
                install_env = _install_env(staging)
                _run_logged([SANDBOX_PYTHON, "-m", "venv", str(staging)], self.root, install_env, log,
                            f"creating the virtual environment of {spec.key}")
                for command in spec.install:
                    on_progress(f"{spec.key}: {command}")
                    _run_logged(["/bin/bash", "-c", command], tree, install_env, log, f"install command "
                                f"{command!r} of {spec.repo} at {spec.commit[:12]}")
                _ensure_pytest(staging, tree, install_env, log, on_progress, spec.key)
                freeze = _run_logged([str(staging / "bin" / "python"), "-m", "pip", "freeze", "--all"], tree,
                                     install_env, None, "pip freeze").replace(str(tree), self.workdir)
            _rewrite_paths(staging, {str(tree): self.workdir, str(staging): str(self.path(spec))})
            _readable_by_all(staging)
            shutil.move(log_path, staging / INSTALL_LOG)
            _write_manifest(staging, spec, started, freeze.splitlines())
            os.rename(staging, self.path(spec))
        except EnvironmentBuildFailed:
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            raise EnvironmentBuildFailed(f"building the environment {spec.key} failed: {exc}") from exc
        finally:
            shutil.rmtree(tree.parent, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
            log_path.unlink(missing_ok=True)


def _install_env(venv: Path) -> dict[str, str]:
    """The host's environment with the virtual environment first: its pip is the `pip` the commands find."""
    env = {key: value for key, value in os.environ.items() if key not in _NOT_FOR_INSTALLS}
    env["PATH"] = f"{venv}/bin:{env.get('PATH', '/usr/local/bin:/usr/bin:/bin')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run_logged(argv: list[str], cwd: Path, env: dict[str, str], log: Any, what: str) -> str:
    """Run `argv` in `cwd`; its output goes to `log` (returned when there is no log);
    EnvironmentBuildFailed with the log's tail when it fails."""
    if log is not None:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildFailed(f"{what}: still running after {INSTALL_TIMEOUT_S:g}s"
                                     + _tail(log)) from None
    if done.returncode != 0:
        output = _tail(log) if log is not None else f"\n{(done.stdout or '')[-LOG_TAIL_CHARS:]}"
        raise EnvironmentBuildFailed(f"{what} failed (exit {done.returncode}); the install log's tail:"
                                     + output)
    return done.stdout or ""


def _tail(log: Any) -> str:
    if log is None:
        return ""
    log.flush()
    return "\n" + Path(log.name).read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]


def _ensure_pytest(venv: Path, tree: Path, env: dict[str, str], log: Any, on_progress: Progress,
                   key: str) -> None:
    has_pytest = subprocess.run([str(venv / "bin" / "python"), "-c", "import pytest"], cwd=tree, env=env,
                                capture_output=True, check=False, timeout=120)
    if has_pytest.returncode != 0:
        on_progress(f"{key}: pip install pytest")
        _run_logged([str(venv / "bin" / "python"), "-m", "pip", "install", "pytest"], tree, env, log,
                    "installing pytest")


def _rewrite_paths(venv: Path, replacements: dict[str, str]) -> None:
    """Replace each host path by its new place in the files that record absolute paths: bin/'s scripts,
    pyvenv.cfg, and site-packages' *.pth, *.egg-link and __editable__ finders (their compiled copies are
    removed: they would be imported instead)."""
    files = [venv / "pyvenv.cfg", *(path for path in (venv / "bin").iterdir() if path.is_file()
                                    and not path.is_symlink())]
    for site in venv.glob("lib/python3*/site-packages"):
        files += [*site.glob("*.pth"), *site.glob("*.egg-link"), *site.glob("__editable__*.py")]
        for compiled in site.glob("__pycache__/__editable__*"):
            compiled.unlink()
    for path in files:
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # a binary: no script
            continue
        rewritten = data
        for old, new in replacements.items():
            rewritten = rewritten.replace(old.encode(), new.encode())
        if rewritten != data:
            path.write_bytes(rewritten)


def _readable_by_all(top: Path) -> None:
    """Directories 0755, files 0644 (0755 when executable): the sandbox's user reads them when we are root."""
    for path in [top, *top.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(0o755 if path.is_dir() or mode & 0o111 else 0o644)


def _write_manifest(venv: Path, spec: Any, started: float, freeze: list[str]) -> None:
    notes = [f"pre_install not run (it needs an image: use --backend docker): {command}"
             for command in spec.pre_install]
    manifest = {
        "spec": {**asdict(spec), "source": str(spec.source), "key": spec.key},
        "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1),
        "disk_bytes": tree_size_bytes(venv),
        "python": sandbox_python_version(),
        "pip_freeze": freeze,
        "notes": notes,
    }
    (venv / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (venv / MANIFEST).chmod(0o644)
