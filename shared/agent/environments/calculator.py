"""The calculator environment's tool, registered as "calculator".

Evaluates + - * / // % ** and parentheses on integers and decimals by walking the expression's
syntax tree (the `ast` module parses, nothing is ever `eval`ed): names, calls, attributes and
anything else are refused. Integers stay exact; results that would have more than a million digits
are refused before they are computed, so no expression can take the process down.
"""

from __future__ import annotations

import ast
import math
import operator

from rollstream.shared.agent.tools import ToolError, register_tool, tool

MAX_EXPRESSION_CHARS = 2000
MAX_RESULT_DIGITS = 1_000_000
_MAX_RESULT_BITS = int(MAX_RESULT_DIGITS * math.log2(10))

Number = int | float

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; ToolError says why when there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"cannot parse {expression!r} as arithmetic: {getattr(e, 'msg', e)}") from None
    try:
        value = _value(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("the result is too large") from None
    except RecursionError:
        raise ToolError("the expression is nested too deeply") from None
    if isinstance(value, complex):
        raise ToolError("the result is not a real number (a negative number to a fractional power)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is too large (not a finite number)")
    return value


def format_number(value: Number) -> str:
    """Integers without '.0'; decimals to 15 significant digits, which hides float noise (0.1+0.2)."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return format(value, ".15g")
    try:
        return str(value)
    except ValueError:  # beyond Python's limit on int-to-text conversion (sys.get_int_max_str_digits)
        raise ToolError(f"the result has about {int(value.bit_length() / math.log2(10)):,} digits, "
                        "too many to show") from None


def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass, and True + 1 is not arithmetic
            raise ToolError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        _refuse_huge(node.op, left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Name):
        raise ToolError(f"unknown name {node.id!r}: only numbers and + - * / // % ** ( ) are allowed")
    if isinstance(node, ast.Call):
        raise ToolError("function calls are not supported: only numbers and + - * / // % ** ( ) are allowed")
    raise ToolError(f"unsupported syntax {ast.unparse(node)!r}: "
                    "only numbers and + - * / // % ** ( ) are allowed")


def _refuse_huge(op: ast.operator, left: Number, right: Number) -> None:
    """Refuse, before computing it, an integer result beyond MAX_RESULT_DIGITS (floats overflow by
    themselves)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        bits = right * math.log2(abs(left))
    elif isinstance(op, ast.Mult):
        bits = left.bit_length() + right.bit_length()
    else:
        return
    if bits > _MAX_RESULT_BITS:
        raise ToolError(f"the result would have more than {MAX_RESULT_DIGITS:,} digits")


@register_tool("calculator")
@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    return format_number(evaluate(expression))
