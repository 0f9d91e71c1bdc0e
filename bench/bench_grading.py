"""Gradings per minute per sandbox backend (bubblewrap, docker) against the number of sandbox-grader replicas.

Publishes N finished rollouts of the Harbor fixture task `fix-add` (each graded on the task's reference diff)
on a run's `trajectories`, starts W `rollstream-sandbox-grader` processes with grader.backend B (the local
run's supervisor, an embedded Redis; each replica enqueues and runs grading jobs, as in a deployment), and
times them until N grades are on `grades`; prints gradings/minute for each B and W, with the ratio to the
first W of the same backend and, for docker, to bubblewrap at the same W, all measured in the same run. The
time includes the replicas' start (about two seconds), as a scale-up's would. A backend that cannot make a
sandbox here (no Docker engine answering: DOCKER_HOST) is reported as not measured, with the reason.

    python bench/bench_grading.py [--jobs 24] [--workers 1 2 4] [--backends bubblewrap docker]
                                  [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from results import Figure, parse_args, write_result

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.events import GradeReported, TrajectoryFinished
from rollstream.shared.errors import BackendUnavailable
from rollstream.shared.grading.validation import reference_diff
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.backends import get_backend, probe_sandbox
from rollstream.shared.tasks.harbor import load_harbor_task

TASK = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tasks" / "harbor" / "fix-add"
GRADES_TIMEOUT_S = 600
BACKENDS = ("bubblewrap", "docker")


def gradings_per_minute(root: Path, diff: str, jobs: int, backend: str, replicas: int) -> float:
    settings = Settings(run_id=f"bench-grading-{uuid.uuid4().hex[:6]}", storage_uri=str(root / "runs"),
                        grader={"backend": backend, "wall_time_s": 60}, recorder={"enabled": False})
    local = LocalRun(settings, services=("sandbox-grader",), replicas={"sandbox-grader": replicas})
    local.start()
    try:
        diff_uri = Storage(settings.storage_uri).write_bytes(diff.encode(), settings.run_id, "reference.diff")
        started = time.perf_counter()
        for index in range(jobs):
            rollout = f"r{index}"
            local.bus.publish("trajectories", TrajectoryFinished(
                status="completed", attempt="a1", segment_count=1, group_size=1, sample_index=index,
                grader={"kind": "harbor", "task_dir": str(TASK)}, artifacts={"diff": diff_uri}),
                rollout_id=rollout, group_id=rollout, trajectory_id=rollout, session_id=rollout)
        while len(grades := [d.event for d in local.bus.read_all("grades")]) < jobs:
            if time.perf_counter() - started > GRADES_TIMEOUT_S:
                raise TimeoutError(f"{backend}, {replicas} replicas: {len(grades)} grades of {jobs} after "
                                   f"{GRADES_TIMEOUT_S}s")
            time.sleep(0.1)
        elapsed = time.perf_counter() - started
        if not all(isinstance(grade, GradeReported) and grade.score == 1.0 for grade in grades):
            raise RuntimeError(f"{backend}, {replicas} replicas: the reference diff was not graded 1.0 every "
                               f"time: {grades}")
        return jobs / elapsed * 60
    finally:
        local.stop()


def usable(backend: str) -> str | None:
    """Why `backend` cannot make a sandbox here, or None."""
    try:
        probe_sandbox(backend)
    except BackendUnavailable as exc:
        return str(exc)
    return None


def replicas(count: int) -> str:
    return f"{count} replica{'s' if count > 1 else ''}"


def figures_of(rates: dict[str, dict[int, float]]) -> list[Figure]:
    """Each backend's replica counts against its first; docker against bubblewrap at the same count."""
    figures = []
    for backend, by_replicas in rates.items():
        first, *more = by_replicas
        figures += [Figure(f"{backend}, {replicas(w)}", by_replicas[w], f"{backend}, {replicas(first)}",
                           by_replicas[first], "gradings/min") for w in more]
    if "bubblewrap" in rates and "docker" in rates:
        figures += [Figure(f"docker, {replicas(w)}", rate, f"bubblewrap, {replicas(w)}",
                           rates["bubblewrap"][w], "gradings/min") for w, rate in rates["docker"].items()]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="sandbox-grader replicas")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    args = parse_args(parser, smoke={"jobs": 2, "workers": [1, 2]})
    task = load_harbor_task(TASK)
    diff = reference_diff(task, get_backend("bubblewrap"))
    notes = [f"{args.jobs} gradings of {task.name} (reference diff) per setting"]
    rates: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rs-bench-grading-") as tmp:
        for backend in args.backends:
            if (why := usable(backend)) is not None:
                notes.append(f"{backend}: NOT MEASURED: {why}")
                continue
            rates[backend] = {w: gradings_per_minute(Path(tmp) / f"{backend}-w{w}", diff, args.jobs, backend,
                                                     w) for w in args.workers}
    print(notes[0])
    print(f"{'backend':<12}{'replicas':>9}{'gradings/min':>14}{'vs first':>10}")
    for backend, by_replicas in rates.items():
        base = by_replicas[args.workers[0]]
        for count, rate in by_replicas.items():
            print(f"{backend:<12}{count:>9}{rate:>14.1f}{rate / base:>10.2f}")
    print("\n".join(notes[1:]))
    if not rates:
        raise SystemExit("no sandbox backend could make a sandbox here")
    write_result(args.json, figures_of(rates), notes)


if __name__ == "__main__":
    main()
