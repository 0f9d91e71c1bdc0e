"""Gradings per minute against the number of RQ workers, on real bubblewrap sandboxes.

Enqueues N grading jobs (the Harbor fixture task `fix-add`, graded on its reference diff, as the
sandbox-grader enqueues them), runs W burst workers (`rq worker --burst`, each its own process, as
sandbox-grader replicas would be) until the queue is empty, and prints gradings/minute for each W
with the ratio to one worker, in the same run.

    python bench/bench_grading.py [--jobs 24] [--workers 1 2 4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rq import Queue

from rollstream.cli.embedded_redis import EmbeddedRedis
from rollstream.services.sandbox_grader.jobs import GradeRequest, grade_rollout
from rollstream.shared.contract.bus import Bus
from rollstream.shared.grading.validation import reference_diff
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.sandbox.backends import get_backend
from rollstream.shared.tasks.harbor import load_harbor_task

TASK = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tasks" / "harbor" / "fix-add"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    task = load_harbor_task(TASK)
    with tempfile.TemporaryDirectory(prefix="rs-bench-grading-") as tmp:
        redis_server = EmbeddedRedis(Path(tmp) / "redis")
        redis_server.start()
        try:
            storage = Storage(str(Path(tmp) / "runs"))
            diff_uri = storage.write_bytes(reference_diff(task, get_backend("bubblewrap")).encode(), "bench", "ref.diff")
            rates = {}
            for workers in args.workers:
                run_id = f"bench-{uuid.uuid4().hex[:6]}"
                bus = Bus.connect(redis_server.url, run_id)
                queue = Queue(bus.keys.job_queue("sandbox"), connection=bus.redis)
                for index in range(args.jobs):
                    rollout = f"{run_id}-r{index}"
                    request = GradeRequest(run_id=run_id, storage_uri=storage.uri,
                                           ids={"rollout_id": rollout, "group_id": "g", "trajectory_id": rollout,
                                                "session_id": rollout},
                                           backend="bubblewrap", wall_time_s=60, memory_mb=512,
                                           grader={"kind": "harbor", "task_dir": str(TASK)}, diff_uri=diff_uri)
                    queue.enqueue(grade_rollout, request.as_job_arg(), job_timeout=120)
                start = time.perf_counter()
                procs = [subprocess.Popen([str(Path(sys.executable).with_name("rq")), "worker", "--burst", "-q",
                                           "-u", redis_server.url, queue.name], stdout=subprocess.DEVNULL)
                         for _ in range(workers)]
                for proc in procs:
                    proc.wait()
                elapsed = time.perf_counter() - start
                grades = [d.event for d in bus.read_all("grades")]
                if len(grades) != args.jobs or not all(g.score == 1.0 for g in grades):
                    raise RuntimeError(f"{workers} workers: {len(grades)} grades of {args.jobs}, not all 1.0")
                rates[workers] = args.jobs / elapsed * 60
        finally:
            redis_server.stop()
    print(f"{args.jobs} gradings of {task.name} (reference diff) per setting, bubblewrap sandbox")
    print(f"{'workers':>8}{'gradings/min':>14}{'vs 1 worker':>13}")
    base = rates[args.workers[0]]
    for workers, rate in rates.items():
        print(f"{workers:>8}{rate:>14.1f}{rate / base:>13.2f}")


if __name__ == "__main__":
    main()
