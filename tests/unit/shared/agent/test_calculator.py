"""The calculator tool: right answers, and a clear refusal for everything that is not arithmetic."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.shared.agent.environments.calculator import calculator
from rollstream.shared.agent.tools import Episode, ToolCall, ToolError, ToolSet


@pytest.mark.parametrize("expression, result", [
    ("12 + 7", "19"),
    ("2 * (3 + 4)", "14"),
    ("-3 + +5", "2"),
    ("6 / 3", "2"),  # integral results print without ".0"
    ("7 / 2", "3.5"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("2 ** 3 ** 2", "512"),
    ("0.1 + 0.2", "0.3"),
    ("1.5 * 4", "6"),
    ("10 / 3", "3.33333333333333"),
    ("123456789 * 987654321", "121932631112635269"),  # integers stay exact
    ("2 ** 100", "1267650600228229401496703205376"),
    ("1e3 + 1", "1001"),
])
def test_arithmetic(expression, result):
    assert calculator.fn(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("x + 1", "unknown name 'x'"),
    ("__import__('os').system('ls')", "function calls are not supported"),
    ("abs(-3)", "function calls are not supported"),
    ("(1).real", "unsupported syntax"),
    ("1 < 2", "unsupported syntax"),
    ("1 << 2", "unsupported syntax"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("2j", "only numbers are allowed"),
    ("9 ** 9 ** 9", "more than 1,000,000 digits"),
    ("(10 ** 600000) * (10 ** 600000)", "more than 1,000,000 digits"),
    ("10 ** 5000", "too many to show"),
    ("2.0 ** 5000", "too large"),
    ("1e308 * 10", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "cannot parse"),
    ("", "cannot parse"),
    ("1" + " + 1" * 1000, "longer than"),
])
def test_errors_are_tool_errors_with_a_clear_message(expression, message):
    with pytest.raises(ToolError, match=message):
        calculator.fn(expression)


def test_through_a_toolset_errors_reach_the_model_as_results():
    calls = [ToolCall("call_0_0", "calculator", {"expression": "(12 + 7) * 3"}),
             ToolCall("call_0_1", "calculator", {"expression": "1 / 0"})]
    ok, failed = asyncio.run(ToolSet([calculator]).execute(calls, Episode("ep")))
    assert (ok.ok, ok.content) == (True, "57")
    assert (failed.ok, failed.error_kind, failed.content) == (False, "raised", "division by zero")


def test_schema_tells_the_model_what_to_write():
    function = calculator.schema()["function"]
    assert function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    assert "parentheses" in function["parameters"]["properties"]["expression"]["description"]
