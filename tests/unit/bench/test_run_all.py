"""bench/run_all.py: the report it writes (machine, each benchmark's command and figures), a benchmark that
fails or runs past the timeout written down as such with the end of its output and a non-zero exit, and how it
reads gateway_latency.py's table.

    python -m pytest tests/unit/bench/test_run_all.py -q
"""

from __future__ import annotations

import platform
import re
import sys

from bench.gateway_latency_report import TABLE_HEADER, Measured, format_table, table_row
from bench.run_all import BENCHMARKS, Outcome, gateway_figures, report
from rollstream.cli.vllm_server import free_port
from tests.support import REPO
from tests.unit.bench.smoke import run_command


def run_all(tmp_path, *args: str) -> tuple[int, str, str]:
    """(exit code, output, report) of bench/run_all.py --smoke with these arguments."""
    report = tmp_path / "BENCHMARKS.md"
    code, output = run_command([sys.executable, "bench/run_all.py", "--smoke", "--out", str(report), *args])
    return code, output, report.read_text() if report.exists() else ""


def section(report: str, name: str) -> str:
    return report.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]


def test_the_report_has_the_machine_and_each_benchmarks_command_and_figures(machine_redis_url, tmp_path):
    code, output, report = run_all(tmp_path, "--only", "encoding,bus", "--redis", machine_redis_url)
    assert code == 0, output
    assert f"| Python | {platform.python_version()} |" in report and "| cores | " in report
    assert "| [encoding](#encoding) | ok |" in report and "| [bus](#bus) | ok |" in report
    encoding, bus = section(report, "encoding"), section(report, "bus")
    assert "bench/bench_encoding.py --smoke\n" in encoding
    assert f"bench/bench_bus.py --smoke --redis {machine_redis_url}\n" in bus
    rows = [line for line in bus.splitlines() if line.startswith("| PromptIssued: Bus.publish (hiredis) |")]
    # the bus runs each case twice in its smoke mode: the ratio's median, then the runs' range
    ratio = rows[0].split(" | ")[-1].rstrip(" |") if len(rows) == 1 else ""
    assert re.fullmatch(r"[0-9.]+ \([0-9.]+ - [0-9.]+\)", ratio), rows


def test_a_failed_benchmark_is_reported_with_its_output_and_fails_the_command(tmp_path):
    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    code, output, report = run_all(tmp_path, "--only", "encoding,bus", "--redis", nothing_listens)
    assert code != 0
    assert "1 of 2 benchmarks did not finish: bus" in output
    assert "| [encoding](#encoding) | ok |" in report and "| [bus](#bus) | failed |" in report
    bus = section(report, "bus")
    assert "**FAILED**" in bus and "exit code 1" in bus and "ConnectionError" in bus


def test_a_benchmark_past_the_timeout_is_stopped_and_reported(tmp_path):
    # the data path benchmark imports torch and loads a model before its first figure: far past 0.1 s
    code, output, report = run_all(tmp_path, "--only", "data-path", "--timeout", "0.1")
    assert code != 0 and "did not finish: data-path" in output
    assert "| [data-path](#data-path) | timed out |" in report
    assert "**TIMED OUT**" in section(report, "data-path")


def test_an_unknown_benchmark_is_refused_with_the_known_names(tmp_path):
    code, output, report = run_all(tmp_path, "--only", "encoding,nonsense")
    assert code != 0 and not report
    assert "unknown benchmark nonsense" in output and all(b.name in output for b in BENCHMARKS)


def test_a_note_of_several_lines_keeps_them_as_printed():
    figure = {"what": "w", "value": 1.0, "baseline_what": "b", "baseline": 2.0, "unit": "s", "ratio": 0.5}
    command = [sys.executable, str(REPO / "bench" / "bench_encoding.py")]
    outcome = Outcome(BENCHMARKS[0], command, figures=[figure],
                      notes=["one line", "litellm: not measured:\n    Traceback\n      ImportError"])
    written = section(report([outcome], smoke=True, host={"CPU": "x"}), "encoding").splitlines()
    at = written.index("litellm: not measured:")
    assert "one line" in written
    assert written[at + 1:at + 5] == ["```", "    Traceback", "      ImportError", "```"]


def test_gateway_figures_compare_each_endpoint_with_direct_at_the_same_sessions():
    def measured(p50_s: float) -> Measured:
        return Measured(seconds=[p50_s] * 10, tokens=[8] * 10, wall_s=1.0)

    direct = {1: measured(0.010), 8: measured(0.020)}
    rows = [table_row("direct", 1, direct[1], direct[1]), table_row("gateway", 1, measured(0.015), direct[1]),
            table_row("direct", 8, direct[8], direct[8]), table_row("gateway", 8, measured(0.030), direct[8]),
            table_row("litellm", 8, Measured(), direct[8])]  # every turn failed: nothing to compare
    litellm = "litellm: NOT MEASURED, its proxy did not start (litellm): the proxy exited with code 1:"
    output = f"heading\n{litellm}\n    its log\n{format_table(TABLE_HEADER, rows)}\nnotes below the table"
    figures, notes = gateway_figures(output)
    assert [(f["what"], f["ratio"]) for f in figures] == [
        ("gateway, 1 sessions: p50 of a turn", 1.5), ("gateway, 1 sessions: p99 of a turn", 1.5),
        ("gateway, 8 sessions: p50 of a turn", 1.5), ("gateway, 8 sessions: p99 of a turn", 1.5)]
    assert notes == [litellm]
    assert gateway_figures("no table here") == ([], [])


def test_a_figure_over_repeated_runs_shows_its_median_and_the_runs_range():
    from bench.results import Figure

    figure = Figure.repeated("samples trained per minute", [300.0, 250.0, 100.0], "synchronous",
                             [100.0, 120.0, 110.0], "samples/min")
    assert (figure.value, figure.baseline) == (250.0, 110.0)
    assert figure.run_ratios == [3.0, 250.0 / 120.0, 100.0 / 110.0]
    command = [sys.executable, str(REPO / "bench" / "bench_encoding.py")]
    outcome = Outcome(BENCHMARKS[0], command, figures=[figure.as_dict()])
    written = section(report([outcome], smoke=False, host={"CPU": "x"}), "encoding")
    assert ("| samples trained per minute | 250 (100 - 300) | synchronous | 110 (100 - 120) | samples/min | "
            "2.273 (0.9091 - 3) |") in written
    assert "Over repeated runs: the median" in written


def test_update_replaces_only_the_benchmarks_run_again():
    from bench.run_all import updated

    def outcome(index: int, value: float) -> Outcome:
        figure = {"what": f"figure {index}", "value": value, "baseline_what": "b", "baseline": 1.0,
                  "unit": "s", "ratio": value}
        return Outcome(BENCHMARKS[index], [sys.executable, str(REPO / "bench" / BENCHMARKS[index].script)],
                       figures=[figure])

    first = report([outcome(0, 2.0), outcome(1, 3.0)], smoke=False, host={"CPU": "x"})
    again = updated(first, [outcome(1, 5.0), outcome(2, 7.0)], host={"date": "today", "commit": "abc"})
    assert section(again, BENCHMARKS[0].name) == section(first, BENCHMARKS[0].name)
    assert "| figure 1 | 5 | b | 1 | s | 5 |" in section(again, BENCHMARKS[1].name)
    assert "| figure 1 | 3 |" not in again
    assert "Run again on today at abc, alone" in section(again, BENCHMARKS[1].name)
    rows = [line for line in again.splitlines() if line.startswith("| [")]
    assert [row.split("]")[0][3:] for row in rows] == [b.name for b in BENCHMARKS[:3]]
    assert again.count(f"\n## {BENCHMARKS[2].name}\n") == 1 and "| figure 2 | 7 |" in again
    elsewhere = updated(first, [outcome(1, 5.0)], host={"date": "today", "commit": "abc", "CPU": "y"})
    assert "Run again on today at abc, on another machine (CPU y), alone" in section(elsewhere,
                                                                                   BENCHMARKS[1].name)
    assert "| CPU | x |" in elsewhere  # the table still says what the rest was measured on
