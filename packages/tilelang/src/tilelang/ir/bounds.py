"""Integer ranges of index expressions (for bounds proofs) and evaluation of host-side sizes.

`interval(e, ranges)` gives an inclusive [lo, hi] of an integer expression, either end `None` when
unbounded, from the ranges of the variables in it (block indices, loop variables, lets). It is
sound: a proof that an access is in bounds (or that it never is) holds for every execution.
`eval_int(e, env)` evaluates an integer expression of the T.dynamic sizes on the host (grid
sizes at launch), or returns None when it reads memory.
"""

from __future__ import annotations

from .nodes import BinOp, Cast, Const, Expr, Select, Var

Interval = tuple  # (lo: int | None, hi: int | None), inclusive

UNKNOWN: Interval = (None, None)

# blocks per grid dimension, as CUDA allows them (x, y, z): a larger grid is an error on every target
# (on the cpu one block of 10**12 would run for hours)
MAX_GRID = (2**31 - 1, 65535, 65535)


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def _mul(a: Interval, b: Interval) -> Interval:
    if None not in a and None not in b:
        prods = [x * y for x in a for y in b]
        return (min(prods), max(prods))
    for x, y in ((a, b), (b, a)):
        if x[0] is not None and x[0] == x[1]:  # a constant times a half-open range
            c = x[0]
            if c == 0:
                return (0, 0)
            lo, hi = (y[0] * c if y[0] is not None else None), (y[1] * c if y[1] is not None else None)
            return (lo, hi) if c > 0 else (hi, lo)
    if a[0] is not None and b[0] is not None and a[0] >= 0 and b[0] >= 0:  # both non-negative
        hi = a[1] * b[1] if a[1] is not None and b[1] is not None else None
        return (a[0] * b[0], hi)
    return UNKNOWN


def interval(e: Expr, ranges: dict[Var, Interval]) -> Interval:
    """Inclusive [lo, hi] of integer expression `e` (ends None when unbounded)."""
    if isinstance(e, Const):
        if isinstance(e.value, bool) or not isinstance(e.value, int):
            return UNKNOWN
        return (e.value, e.value)
    if isinstance(e, Var):
        return ranges.get(e, UNKNOWN)
    if isinstance(e, Cast):
        return interval(e.value, ranges) if e.dtype.startswith("int") and e.value.dtype.startswith("int") \
            else UNKNOWN
    if isinstance(e, Select):
        a, b = interval(e.a, ranges), interval(e.b, ranges)
        lo = None if a[0] is None or b[0] is None else min(a[0], b[0])
        hi = None if a[1] is None or b[1] is None else max(a[1], b[1])
        return (lo, hi)
    if not isinstance(e, BinOp):
        return UNKNOWN
    if e.op in ("+", "-", "*", "min", "max"):
        a, b = interval(e.a, ranges), interval(e.b, ranges)
        if e.op == "+":
            return (_add(a[0], b[0]), _add(a[1], b[1]))
        if e.op == "-":
            nb = (None if b[1] is None else -b[1], None if b[0] is None else -b[0])
            return (_add(a[0], nb[0]), _add(a[1], nb[1]))
        if e.op == "*":
            return _mul(a, b)
        pick = min if e.op == "min" else max
        lo = pick(a[0], b[0]) if a[0] is not None and b[0] is not None else (
            None if e.op == "min" else (a[0] if a[0] is not None else b[0]))
        hi = pick(a[1], b[1]) if a[1] is not None and b[1] is not None else (
            None if e.op == "max" else (a[1] if a[1] is not None else b[1]))
        return (lo, hi)
    if e.op in ("//", "%") and isinstance(e.b, Const) and isinstance(e.b.value, int) and e.b.value > 0:
        c = int(e.b.value)
        a = interval(e.a, ranges)
        if e.op == "//":  # floor division is monotonic
            return (None if a[0] is None else a[0] // c, None if a[1] is None else a[1] // c)
        if a[0] is not None and a[1] is not None and a[0] // c == a[1] // c:
            return (a[0] % c, a[1] % c)
        return (0, c - 1)  # floor modulo (the C backend's tl_floormod)
    return UNKNOWN


_PYOPS = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "min": min, "max": max,
}


def eval_int(e: Expr, env: dict[Var, int]) -> int | None:
    """Value of an integer expression of sizes in `env`; None if it reads memory or is not integer."""
    if isinstance(e, Const):
        return e.value if isinstance(e.value, int) and not isinstance(e.value, bool) else None
    if isinstance(e, Var):
        v = env.get(e)
        return int(v) if v is not None else None
    if isinstance(e, Cast):
        return eval_int(e.value, env) if e.dtype.startswith("int") else None
    if isinstance(e, BinOp):
        a, b = eval_int(e.a, env), eval_int(e.b, env)
        if a is None or b is None:
            return None
        if e.op in _PYOPS:
            return _PYOPS[e.op](a, b)
        if e.op in ("//", "%"):
            if b == 0:
                return None
            return a // b if e.op == "//" else a % b
    return None
