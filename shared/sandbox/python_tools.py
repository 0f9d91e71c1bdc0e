"""Python tools (pytest) for the bubblewrap sandbox, whose /usr/bin/python3 has none.

    python -m pytest tests/unit/shared/grading/test_grading.py -k swe -q   (SWE-bench tests run pytest there)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PYTHON_TOOLS_MOUNT = "/opt/rollstream"

PYTHON_TOOLS = ("pytest",)
"""Distributions (with their requirements) the bubblewrap backend makes importable in the
sandbox, for SWE test commands (`python -m pytest`): the host's /usr/bin/python3 has no pytest."""


@functools.cache
def stage_python_tools() -> Path | None:
    """A read-only tree with bin/python (-> /usr/bin/python3) and site/ holding copies of
    PYTHON_TOOLS and their requirements, taken from this interpreter's environment when
    /usr/bin/python3 has the same minor version (pure-Python packages only). None otherwise.

    Built once per machine and tools version under the temp dir (RQ work-horses are forked per job
    and exit without cleanup, so a per-process copy would be rebuilt and leaked on every job); looked
    for once per process, so that a grader probing its sandbox every few seconds says what is missing
    once."""
    if not _sandbox_python_is_ours():
        return None
    try:
        versions = ",".join(f"{name}={metadata.version(name)}" for name in PYTHON_TOOLS)
    except metadata.PackageNotFoundError as exc:
        log.warning("%s is not installed here: it is not provided in the sandbox", exc)
        return None
    key = hashlib.sha256(f"{sys.version}|{versions}".encode()).hexdigest()[:16]
    final = Path(tempfile.gettempdir()) / f"rs-pytools-{key}"
    if (final / "complete").exists():
        return final
    base = _build_tools_tree(versions)
    try:
        os.rename(base, final)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(base, ignore_errors=True)
    return final


def _sandbox_python_is_ours() -> bool:
    """Whether /usr/bin/python3 has this interpreter's minor version, so that our pure-Python packages
    run there."""
    try:
        version = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    if version != str(tuple(sys.version_info[:2])):
        log.warning("/usr/bin/python3 is %s, not %s: pytest is not provided in the sandbox",
                    version, sys.version_info[:2])
        return False
    return True


def _build_tools_tree(versions: str) -> Path:
    """The tree in a fresh temporary directory, its `complete` marker (holding `versions`) written last."""
    base = Path(tempfile.mkdtemp(prefix="rs-pytools-building-")).resolve()
    base.chmod(0o755)
    (base / "bin").mkdir(mode=0o755)
    os.symlink("/usr/bin/python3", base / "bin" / "python")
    site = base / "site"
    site.mkdir(mode=0o755)
    _copy_distributions(PYTHON_TOOLS, site)
    for path in [site, *site.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (base / "complete").write_text(versions)
    return base


def _copy_distributions(names: tuple[str, ...], site: Path) -> None:
    """Copy the files of the installed distributions `names` and of everything they require (no extras)
    into `site`, leaving out caches and compiled extensions."""
    from packaging.requirements import Requirement

    todo, done = list(names), set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in done:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for requirement in dist.requires or []:
            parsed = Requirement(requirement)
            if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
                todo.append(parsed.name)
        for file in dist.files or []:
            if file.parts[0] in ("..", "__pycache__") or "__pycache__" in file.parts \
                    or file.suffix in (".pyc", ".so"):
                continue
            source = Path(dist.locate_file(file))
            if source.is_file():
                target = site / file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
