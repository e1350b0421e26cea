"""A calculator by safe AST evaluation: the expression is parsed with `ast.parse(mode="eval")` and
only numeric literals, + - * / // % **, unary signs, parentheses and a few named functions are
evaluated; anything else (names, attributes, calls of other functions, comprehensions, strings) is
refused with a message the model can read. No `eval`, no `exec`.

Bounds keep it from being used as a denial of service: expression length, AST node count, the
exponent of `**`, and the size of integer results (digits).
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 100
MAX_DIGITS = 60


class CalcError(ValueError):
    """The expression is not allowed or cannot be computed; the message is the tool's output."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor, "ceil": math.ceil}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression ('347 * 86', '2**10 - 1', 'sqrt(2)'); raises CalcError."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {text!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    value = _eval(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise CalcError(str(e)) from None
        return _check_size(value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        args = [_eval(a) for a in node.args]
        try:
            return _check_size(_FUNCS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as e:
            raise CalcError(f"{node.func.id}: {e}") from None
    raise CalcError(f"not allowed in the calculator: {type(node).__name__} "
                    f"(numbers, + - * / // % **, parentheses and {', '.join(_FUNCS)} only)")


def _check_size(value):
    if isinstance(value, complex):
        raise CalcError("complex result")
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
        raise CalcError(f"result has more than {MAX_DIGITS} digits")
    return value


def format_value(value: int | float) -> str:
    """Integers as they are; floats with up to 10 significant digits, integral floats without '.0'."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)
