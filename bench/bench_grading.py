"""Gradings per minute against the number of sandbox-grader replicas, on real bubblewrap sandboxes.

Publishes N finished rollouts of the Harbor fixture task `fix-add` (each graded on the task's reference diff)
on a run's `trajectories`, starts W `rollstream-sandbox-grader` processes (the local run's supervisor, an
embedded Redis; each replica enqueues and runs grading jobs, as in a deployment), and times them until N grades
are on `grades`; prints gradings/minute for each W with the ratio to the first W, measured in the same run. The
time includes the replicas' start (about two seconds), as a scale-up's would.

    python bench/bench_grading.py [--jobs 24] [--workers 1 2 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.events import GradeReported, TrajectoryFinished
from rollstream.shared.grading.validation import reference_diff
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.tasks.harbor import load_harbor_task

TASK = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tasks" / "harbor" / "fix-add"
GRADES_TIMEOUT_S = 600


def gradings_per_minute(root: Path, diff: str, jobs: int, replicas: int) -> float:
    settings = Settings(run_id=f"bench-grading-{uuid.uuid4().hex[:6]}", storage_uri=str(root / "runs"),
                        grader={"backend": "bubblewrap", "wall_time_s": 60}, recorder={"enabled": False})
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
                raise TimeoutError(f"{replicas} replicas: {len(grades)} grades of {jobs} after {GRADES_TIMEOUT_S}s")
            time.sleep(0.1)
        elapsed = time.perf_counter() - started
        if not all(isinstance(grade, GradeReported) and grade.score == 1.0 for grade in grades):
            raise RuntimeError(f"{replicas} replicas: the reference diff was not graded 1.0 every time: {grades}")
        return jobs / elapsed * 60
    finally:
        local.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="sandbox-grader replicas")
    args = parser.parse_args()
    task = load_harbor_task(TASK)
    diff = reference_diff(task, get_backend("bubblewrap"))
    with tempfile.TemporaryDirectory(prefix="rs-bench-grading-") as tmp:
        rates = {replicas: gradings_per_minute(Path(tmp) / f"w{replicas}", diff, args.jobs, replicas)
                 for replicas in args.workers}
    print(f"{args.jobs} gradings of {task.name} (reference diff) per setting, bubblewrap sandbox")
    print(f"{'replicas':>9}{'gradings/min':>14}{'vs first':>10}")
    base = rates[args.workers[0]]
    for replicas, rate in rates.items():
        print(f"{replicas:>9}{rate:>14.1f}{rate / base:>10.2f}")


if __name__ == "__main__":
    main()
