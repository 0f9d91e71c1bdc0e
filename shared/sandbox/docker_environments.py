"""The docker backend's environment of a SWE row: the image its tests run in, had once and kept.

A row's image is, in this order (row_image):

1. its `dockerfile`'s, built by DockerBackend.image_for (a row that brings its own environment);
2. when the row has an EnvironmentSpec (shared/tasks/environment_spec.py; none: the default image, as
   before environments existed), prepare_image's:
   - a published image the engine has: the one the row names (`image_name`, as SWE-smith rows do), else
     SWE-bench's image of the instance (`swebench/sweb.eval.x86_64.<instance_id, "__" as "_1776_">:latest`,
     lower-case), which is never pulled on a guess: most rows have none;
   - the image built from the spec before, `rollstream-env/<spec.key>`;
   - the named image pulled; where that fails (no registry answers), built from the spec when it has
     install commands, else an EnvironmentImageError naming the image and saying to build the
     environment instead;
   - built from the spec: FROM the backend's default image (`python:<spec.python>-slim` when the spec names
     a Python and the engine has it), the tree at the spec's commit copied to /workspace, its pre_install
     commands, a virtual environment at ENV_VENV first on the image's PATH (the backend honours it), the
     install commands run in the tree (pip reaches the package index as `docker build` does, trusting this
     machine's CA bundle), pytest when they did not bring it; labelled with the spec.

Grading mounts the graded tree over /workspace, so an editable install (`pip install -e .`) in the image
imports the graded tree, never the image's copy; a plain `pip install .` would test the image's copy.
A published SWE-bench image keeps its repository at /testbed and its conda environment: such a row is
graded with workdir /testbed (docs/tasks/datasets.md).

`prepare_image` is what `rollstream environments prepare --backend docker` runs per row, and grading reaches
it through DockerBackend.image_for_task; a failed build raises EnvironmentImageError (a SandboxError) with the
tail of the build log, which the grader reports as an infrastructure error, never as a score.

    python -m pytest tests/unit/shared/sandbox/test_docker_environments.py -q
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollstream.shared.errors import SandboxError

log = logging.getLogger(__name__)

ENV_REPOSITORY = "rollstream-env"
"""Images built from a spec are `rollstream-env/<spec.key>`."""
ENV_VENV = "/opt/rollstream-env"
"""The built image's virtual environment (first on its PATH, which the docker backend honours)."""
ENV_WORKDIR = "/workspace"
"""Where the built image holds the tree: the sandbox workspace, which grading mounts over it."""
LABEL_PREFIX = "rollstream.env."
"""Labels of a built image: the spec it was built from (key, repo, commit, python, install)."""
SWEBENCH_IMAGE_PREFIX = "swebench/sweb.eval.x86_64."
"""SWE-bench's published evaluation images of its instances start so."""
SWEBENCH_WORKDIR = "/testbed"
"""Where SWE-bench's published images keep the repository."""
BUILD_LOG_TAIL_LINES = 40
"""Lines of a failed build's log that its error carries."""

Progress = Callable[[str], None]
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""The engine colours a build step's stderr; the log a reader gets is plain text."""
_build_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)


class EnvironmentImageError(SandboxError):
    """A row's image cannot be had: its build failed (the message ends with the build log's tail), or the
    published image it names is not on this machine and cannot be pulled."""


@dataclass(frozen=True)
class PreparedImage:
    key: str
    """The spec's key."""
    image: str
    """The image's tag, as containers are made from it."""
    action: Literal["built", "reused", "pulled"]
    """"reused" (the engine had it), "pulled" (a published image) or "built" (from the spec)."""
    seconds: float
    """How long having it took."""
    size_mb: float
    """The image's size, in MB (10^6 bytes), as `docker images` counts it."""
    notes: tuple[str, ...] = ()
    """What a reader should know of it: why it is not the image the row names (its pull failed)."""


def swebench_image_name(instance_id: str) -> str:
    """SWE-bench's published evaluation image of an instance (its harness's naming: `__` becomes
    `_1776_`, all lower-case)."""
    return f"{SWEBENCH_IMAGE_PREFIX}{instance_id.replace('__', '_1776_')}:latest".lower()


def image_workdir(image: str | None) -> str:
    """Where a row's workspace belongs in `image`: /testbed in SWE-bench's published images (their repository
    and its conda environment are there), else the sandbox's /workspace."""
    if image is not None and image.lower().startswith(SWEBENCH_IMAGE_PREFIX):
        return SWEBENCH_WORKDIR
    return ENV_WORKDIR


def env_image_tag(key: str) -> str:
    """The tag of the image built from a spec with this key (lower-case; a character a tag may not hold
    becomes `-`)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", key.lower()).strip(".-_") or "unnamed"
    return f"{ENV_REPOSITORY}/{name[:120]}:latest"


def _image_size_mb(client: Any, image: str) -> float:
    return round(float(client.images.get(image).attrs.get("Size", 0)) / 1e6, 1)


def _has_image(client: Any, image: str) -> bool:
    import requests
    from docker.errors import DockerException, ImageNotFound
    try:
        client.images.get(image)
    except ImageNotFound:
        return False
    except (DockerException, requests.exceptions.RequestException) as exc:
        raise EnvironmentImageError(f"the Docker engine could not say whether it has {image}: {exc}") from exc
    return True


def pull_published(client: Any, name: str, on_progress: Progress | None = None) -> None:
    """Pull `name` into the engine; EnvironmentImageError naming it, with the engine's words and what to
    do, when that fails (no registry answers, no such image)."""
    import requests
    from docker.errors import DockerException

    repository, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    if on_progress is not None:
        on_progress(f"pulling {name}")
    try:
        client.images.pull(repository, tag=tag)
    except (DockerException, requests.exceptions.RequestException) as exc:
        said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise EnvironmentImageError(
            f"the row's published image {name} is not on this machine and could not be pulled ({said}). "
            f"Build the row's environment from its repository instead: give the row its install commands "
            f"(install_config, install, or environments.json beside the dataset) and run `rollstream "
            f"environments prepare ROWS --backend docker`; or `docker load` a saved copy of {name}") from exc


def prepare_image(spec: Any, backend: Any, on_progress: Progress | None = None,
                  instance_id: str | None = None) -> PreparedImage:
    """The image of an EnvironmentSpec on the docker backend's engine, had once:

    - the published image when the engine has it: the one the spec names (`image_name`), else SWE-bench's
      of `instance_id` (swebench_image_name);
    - `rollstream-env/<spec.key>` when the engine has it (built before);
    - the named image pulled; when that fails, built from the spec if it has install commands, else
      EnvironmentImageError naming the image and saying to build the environment instead;
    - built from the spec (a failed build: EnvironmentImageError with the build log's tail)."""
    started = time.monotonic()
    tag = env_image_tag(spec.key)
    published = spec.image_name or (swebench_image_name(instance_id) if instance_id else None)
    with _build_locks[tag]:
        if published is not None and _has_image(backend.client, published):
            image, action, notes = published, "reused", ()
        else:
            image, action, notes = _pull_or_build(spec, backend, tag, on_progress)
    prepared = PreparedImage(key=spec.key, image=image, action=action, seconds=time.monotonic() - started,
                             size_mb=_image_size_mb(backend.client, image), notes=notes)
    if on_progress is not None:
        on_progress(f"{prepared.action} {image} in {prepared.seconds:.1f}s ({prepared.size_mb:g} MB)")
    return prepared


def _pull_or_build(spec: Any, backend: Any, tag: str,
                   on_progress: Progress | None) -> tuple[str, Any, tuple[str, ...]]:
    """(image, action, notes) of a spec whose published image the engine lacks."""
    if _has_image(backend.client, tag):
        return tag, "reused", ()
    notes: tuple[str, ...] = ()
    if spec.image_name:
        try:
            pull_published(backend.client, spec.image_name, on_progress)
            return spec.image_name, "pulled", ()
        except EnvironmentImageError as exc:
            if not spec.install:
                raise
            notes = (f"could not pull {spec.image_name} ({exc.__cause__}): built from the repository "
                     f"instead",)
            log.warning("%s: %s", spec.key, notes[0])
    build_image(spec, backend, tag, on_progress)
    return tag, "built", notes


def spec_labels(spec: Any, base_image: str) -> dict[str, str]:
    """What a built image says of its making, as labels: `docker inspect` shows which spec it holds."""
    return {f"{LABEL_PREFIX}key": spec.key, f"{LABEL_PREFIX}repo": str(spec.repo or ""),
            f"{LABEL_PREFIX}commit": str(spec.commit or ""), f"{LABEL_PREFIX}python": str(spec.python or ""),
            f"{LABEL_PREFIX}pre_install": json.dumps(list(spec.pre_install)),
            f"{LABEL_PREFIX}install": json.dumps(list(spec.install)), f"{LABEL_PREFIX}base": base_image}


def base_image_of(spec: Any, backend: Any) -> str:
    """The image a spec's image is built FROM: `python:<spec.python>-slim` when the spec names a Python
    and the engine has that image, else the backend's default sandbox image."""
    if spec.python:
        wanted = f"python:{spec.python}-slim"
        if wanted == backend.default_image or _has_image(backend.client, wanted):
            return wanted
        log.warning("no %s image on this engine: %s is built FROM %s", wanted, spec.key,
                    backend.default_image)
    return backend.default_image


def dockerfile_text(spec: Any, base_image: str, with_ca: bool) -> str:
    """The Dockerfile of a spec's image (its build context: the tree in `tree/`, the CA bundle pip
    trusts in `pip-ca.crt` when `with_ca`)."""
    shell = ["/bin/sh", "-c"]
    lines = [f"FROM {base_image}"]
    if with_ca:
        lines += ["COPY pip-ca.crt /etc/rollstream-env/pip-ca.crt",
                  "ENV PIP_CERT=/etc/rollstream-env/pip-ca.crt"]
    lines += [f"ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore "
              f"VIRTUAL_ENV={ENV_VENV} PATH={ENV_VENV}/bin:$PATH",
              f"COPY tree/ {ENV_WORKDIR}/",
              f"WORKDIR {ENV_WORKDIR}"]
    lines += [f"RUN {json.dumps([*shell, command])}" for command in spec.pre_install]
    lines += [f"RUN python3 -m venv {ENV_VENV}"]
    lines += [f"RUN {json.dumps([*shell, command])}" for command in spec.install]
    lines += ['RUN python -c "import pytest" 2>/dev/null || pip install -q pytest',
              # the sandbox's user (65534) reads the tree and the environment
              f"RUN chmod -R a+rX {ENV_WORKDIR} {ENV_VENV}"]
    return "\n".join(lines) + "\n"


def _pip_ca_bundle() -> Path | None:
    """The CA bundle pip trusts on this machine (a TLS-intercepting proxy's CA may be in it)."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def build_image(spec: Any, backend: Any, tag: str, on_progress: Progress | None = None) -> None:
    """Build the spec's image as `tag` (the legacy builder: the base is local, nothing is pulled)."""
    source = Path(spec.source)
    if not source.is_dir():
        raise EnvironmentImageError(f"cannot build {tag}: the tree to install from, {source}, is not a "
                                    f"directory")
    base_image = base_image_of(spec, backend)
    with tempfile.TemporaryDirectory(prefix="rs-env-build-") as directory:
        context = Path(directory)
        shutil.copytree(source, context / "tree", symlinks=True, ignore=shutil.ignore_patterns(".git"))
        ca_bundle = _pip_ca_bundle()
        if ca_bundle is not None:
            shutil.copyfile(ca_bundle, context / "pip-ca.crt")
        (context / "Dockerfile").write_text(dockerfile_text(spec, base_image, ca_bundle is not None))
        if on_progress is not None:
            on_progress(f"building {tag} FROM {base_image} ({spec.repo} at {spec.commit})")
        _stream_build(backend.client, context, tag, spec_labels(spec, base_image), on_progress)


def _stream_build(client: Any, context: Path, tag: str, labels: dict[str, str],
                  on_progress: Progress | None) -> None:
    """Run the build, passing its log on line by line; EnvironmentImageError with the log's tail when
    it fails."""
    import requests
    from docker.errors import DockerException

    tail: collections.deque[str] = collections.deque(maxlen=BUILD_LOG_TAIL_LINES)
    error = None
    try:
        for chunk in client.api.build(path=str(context), tag=tag, rm=True, forcerm=True, pull=False,
                                      decode=True, labels=labels):
            for line in _ANSI_ESCAPE.sub("", str(chunk.get("stream", ""))).splitlines():
                if not line.strip():
                    continue
                tail.append(line)
                if on_progress is not None:
                    on_progress(line)
            if "error" in chunk:
                error = str(chunk.get("error")).strip()
                break
    except (DockerException, requests.exceptions.RequestException) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        log_tail = "\n".join(tail)
        raise EnvironmentImageError(f"building {tag} failed: {error}\n--- the build log's last "
                                    f"{len(tail)} lines ---\n{log_tail}")


def row_image(backend: Any, task: Any, on_progress: Progress | None = None) -> str | None:
    """The image a row's tests run in under docker: its `dockerfile`'s, else its environment's
    (prepare_image; remembered by the backend while the engine keeps the image), else None: the backend's
    default image (a row with no environment, graded on the sandbox's own Python as before)."""
    dockerfile = getattr(task, "dockerfile", None)
    if dockerfile is not None and Path(dockerfile).is_file():
        return backend.image_for(Path(dockerfile).parent)
    from rollstream.shared.tasks.environment_spec import environment_spec

    spec = environment_spec(task)
    if spec is None:
        return None
    instance_id = getattr(task, "instance_id", None)
    cache_key = f"env:{spec.key}:{instance_id}"
    known = backend.image_cache.get(cache_key)
    if known is None or not _has_image(backend.client, known):  # removed since: had again
        backend.image_cache[cache_key] = prepare_image(spec, backend, on_progress, instance_id).image
    return backend.image_cache[cache_key]
