"""bench/gateway_latency.py: its pure parts (percentiles, metric readings, the tables and their ratios and the
figures it writes, which bench/gateway_latency_report.py holds; how an agent extends its conversation), and
its smoke mode against the fake token server.

    python -m pytest tests/unit/bench/test_gateway_latency.py -q
"""

from __future__ import annotations

import pytest

from bench.gateway_latency import FOLLOW_UP, next_messages
from bench.gateway_latency_report import (
    COMPARE_HEADER,
    TABLE_HEADER,
    Measured,
    compare_row,
    figures_of,
    format_table,
    mean_of_histogram,
    metric_totals,
    percentile,
    table_row,
)
from tests.unit.bench.smoke import run_smoke


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_metric_totals_sum_label_sets_and_keep_sum_and_count_apart():
    text = """# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 0.6
vllm:e2e_request_latency_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="tiny"} 0.2
# TYPE rollstream_gateway_event_loop_stall_max_seconds gauge
rollstream_gateway_event_loop_stall_max_seconds 0.25
"""
    totals = metric_totals(text)
    assert totals["vllm:e2e_request_latency_seconds_count"] == 4.0
    assert totals["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(0.8)
    assert totals["rollstream_gateway_event_loop_stall_max_seconds"] == 0.25


def test_mean_of_histogram_between_two_readings():
    before = {"h_sum": 1.0, "h_count": 2.0}
    after = {"h_sum": 2.5, "h_count": 5.0}
    assert mean_of_histogram(before, after, "h") == pytest.approx(0.5)
    assert mean_of_histogram(after, after, "h") is None
    assert mean_of_histogram({}, {}, "h") is None


def test_table_row_compares_the_same_percentile_with_the_baseline():
    direct = Measured(seconds=[0.010] * 99 + [0.050], tokens=[8] * 100, wall_s=2.0)
    gateway = Measured(seconds=[0.015] * 99 + [0.100], tokens=[8] * 100, wall_s=4.0, cpu_s=0.5,
                       vllm_requests=100, vllm_request_s=0.8)
    row = dict(zip(TABLE_HEADER, table_row("gateway", 4, gateway, direct)))
    assert row["turns"] == "100"
    assert row["p50 ms"] == "15.0" and row["+p50 ms"] == "+5.0" and row["x p50"] == "1.50"
    # p99 of 100 values lies between the 99th and the 100th
    assert float(row["p99 ms"]) == pytest.approx(15 + 0.01 * 85, abs=0.1)
    assert float(row["+p99 ms"]) == pytest.approx(float(row["p99 ms"]) - (10 + 0.01 * 40), abs=0.1)
    assert row["turns/s"] == "25.0" and row["tok/turn"] == "8.0" and row["failed"] == "0"
    assert row["vLLM e2e ms"] == "8.0" and row["CPU ms/turn"] == "5.00" and row["turns/s/core"] == "200"
    baseline = dict(zip(TABLE_HEADER, table_row("direct", 4, direct, direct)))
    assert baseline["+p50 ms"] == baseline["x p99"] == "-" and baseline["CPU ms/turn"] == "-"
    assert baseline["turns/s/core"] == "-"


def test_the_comparison_sets_the_gateways_added_latency_and_cpu_beside_litellms():
    direct = Measured(seconds=[0.010] * 100)
    gateway = Measured(seconds=[0.012] * 100, cpu_s=0.2)
    litellm = Measured(seconds=[0.015] * 100, cpu_s=0.5)
    row = compare_row(64, {"direct": direct, "gateway": gateway, "litellm": litellm})
    assert row == ["64", "+2.0", "+2.0", "2.00", "+5.0", "+5.0", "5.00", "0.40"]
    assert len(row) == len(COMPARE_HEADER)
    assert compare_row(1, {"direct": direct, "gateway": gateway}) == ["1", "+2.0", "+2.0", "2.00", *["-"] * 4]


def test_the_figures_are_percentiles_against_direct_and_cpu_against_litellm():
    level = {"direct": Measured(seconds=[0.010] * 10), "gateway": Measured(seconds=[0.012] * 10, cpu_s=0.02),
             "litellm": Measured(seconds=[0.015] * 10, cpu_s=0.05)}
    figures = {f.what: f for f in figures_of({256: level, 1: {"direct": Measured()}})}
    assert list(figures) == ["gateway, 256 sessions: p50 of a turn", "gateway, 256 sessions: p99 of a turn",
                             "litellm, 256 sessions: p50 of a turn", "litellm, 256 sessions: p99 of a turn",
                             "gateway, 256 sessions: CPU time per turn"]
    assert figures["gateway, 256 sessions: p50 of a turn"].ratio == pytest.approx(1.2)
    cpu = figures["gateway, 256 sessions: CPU time per turn"]
    assert (cpu.value, cpu.baseline, cpu.unit) == (pytest.approx(2.0), pytest.approx(5.0), "ms")


def test_a_row_without_turns_says_how_many_failed():
    failed = Measured()
    failed.fail("turn: HTTP 503: no vLLM server")
    row = table_row("gateway", 256, failed, Measured(seconds=[0.01]))
    assert len(row) == len(TABLE_HEADER)
    assert row[2] == "0" and row[TABLE_HEADER.index("failed")] == "1"


def test_pooling_rounds_adds_their_turns_and_cpu():
    pooled = Measured()
    pooled.add(Measured(seconds=[0.1], tokens=[8], wall_s=1.0))
    assert pooled.cpu_s is None
    pooled.add(Measured(seconds=[0.2], tokens=[8], wall_s=2.0, cpu_s=0.3, failed=1, errors=["x"]))
    assert pooled.seconds == [0.1, 0.2] and pooled.wall_s == 3.0
    assert pooled.cpu_s == 0.3 and pooled.failed == 1


def test_format_table_aligns_columns():
    text = format_table(["name", "ms"], [["direct", "1.0"], ["gateway", "12.5"]])
    assert text.splitlines() == ["name       ms", "direct    1.0", "gateway  12.5"]


def test_an_agent_appends_the_answer_then_a_follow_up_or_the_tool_results():
    plain = next_messages({"role": "assistant", "content": "Hi", "refusal": None})
    assert plain == [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": FOLLOW_UP}]
    call = {"id": "call_1_0", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    answered = next_messages({"role": "assistant", "content": None, "tool_calls": [call]})
    assert answered[0] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert answered[1] == {"role": "tool", "tool_call_id": "call_1_0", "content": "0"}


def test_the_smoke_mode_measures_the_gateway_in_front_of_the_fake_token_server(machine_redis_url, tmp_path):
    done = run_smoke("gateway_latency.py", tmp_path, "--redis", machine_redis_url)
    assert "upstream: the fake token server" in done.output
    assert [f["what"] for f in done.figures] == [f"gateway, {n} sessions: p{q} of a turn"
                                                 for n in (1, 4) for q in (50, 99)]
    table = done.output.split("CPU ms/turn  turns/s/core\n", 1)[1]
    gateway = [line.split() for line in table.splitlines() if line.startswith("gateway ")][:2]
    assert [row[TABLE_HEADER.index("failed")] for row in gateway] == ["0", "0"]
    assert [row[TABLE_HEADER.index("tok/turn")] for row in gateway] == ["8.0", "8.0"]
