"""Expression-level intrinsics: real functions that build IR (or fold Python numbers at meta level)."""

from __future__ import annotations

from typing import Any

from ..ir import dtypes as dt
from ..ir.nodes import FUNCTIONS, Call, Const, Expr, Select, as_expr, binop
from ..ir.nodes import Cast as _CastNode


def _expr_intrinsic(fn):
    fn.__tl_expr__ = True
    return fn


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _float_type(x: Expr) -> str:
    return x.dtype if dt.is_float(x.dtype) else "float32"


def _make_unary(name: str):
    fold = FUNCTIONS[name].fold

    @_expr_intrinsic
    def op(x: Any) -> Any:
        if _is_num(x):
            return fold(x)
        e = as_expr(x)
        return Call(name, [e], e.dtype if FUNCTIONS[name].keeps_type else _float_type(e))

    op.__name__ = name
    op.__doc__ = f"Elementwise {name} (computed in float32 for 16/8-bit floats)."
    return op


exp = _make_unary("exp")
exp2 = _make_unary("exp2")
log = _make_unary("log")
log2 = _make_unary("log2")
sqrt = _make_unary("sqrt")
rsqrt = _make_unary("rsqrt")
tanh = _make_unary("tanh")
sin = _make_unary("sin")
cos = _make_unary("cos")
sigmoid = _make_unary("sigmoid")
floor = _make_unary("floor")
ceil = _make_unary("ceil")
round = _make_unary("round")  # noqa: A001
abs = _make_unary("abs")  # noqa: A001 - TileLang's name


@_expr_intrinsic
def pow(x: Any, y: Any) -> Any:  # noqa: A001
    if _is_num(x) and _is_num(y):
        return x**y
    a, b = as_expr(x), as_expr(y)
    return Call("pow", [a, b], _float_type(binop("+", a, b)))


@_expr_intrinsic
def max(a: Any, b: Any) -> Any:  # noqa: A001
    if _is_num(a) and _is_num(b):
        return a if a >= b else b
    return binop("max", a, b)


@_expr_intrinsic
def min(a: Any, b: Any) -> Any:  # noqa: A001
    if _is_num(a) and _is_num(b):
        return a if a <= b else b
    return binop("min", a, b)


@_expr_intrinsic
def ceildiv(a: Any, b: Any) -> Any:
    """ceil(a / b) for non-negative integers (a Python int when both are ints)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return binop("//", binop("-", binop("+", a, b), 1), b)


@_expr_intrinsic
def floordiv(a: Any, b: Any) -> Any:
    return a // b if isinstance(a, int) and isinstance(b, int) else binop("//", a, b)


@_expr_intrinsic
def floormod(a: Any, b: Any) -> Any:
    return a % b if isinstance(a, int) and isinstance(b, int) else binop("%", a, b)


@_expr_intrinsic
def if_then_else(cond: Any, a: Any, b: Any) -> Any:
    if isinstance(cond, bool):
        return a if cond else b
    c, x, y = as_expr(cond), as_expr(a), as_expr(b)
    ty = binop("+", x, y).dtype  # promotion rules of arithmetic
    return Select(c, x, y, ty)


@_expr_intrinsic
def cast(x: Any, dtype: Any) -> Expr:
    return _CastNode(as_expr(x), dt.canonical(dtype))


@_expr_intrinsic
def Cast(dtype: Any, x: Any) -> Expr:  # noqa: N802 - TileLang's name (note: dtype first)
    """`T.Cast(dtype, x)`: the TIR spelling of `T.cast(x, dtype)`."""
    return cast(x, dtype)


@_expr_intrinsic
def clamp(x: Any, lo: Any, hi: Any) -> Any:
    """min(max(x, lo), hi)."""
    return min(max(x, lo), hi)


def _bitwise(name: str, op: str):
    @_expr_intrinsic
    def f(a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            return {"&": a & b, "|": a | b, "^": a ^ b, "<<": a << b, ">>": a >> b}[op]
        return binop(op, a, b)

    f.__name__ = name
    f.__doc__ = f"a {op} b on integers (and, or, != on bools)"
    return f


bitwise_and, bitwise_or, bitwise_xor = _bitwise("bitwise_and", "&"), _bitwise("bitwise_or", "|"), _bitwise("bitwise_xor", "^")
shift_left, shift_right = _bitwise("shift_left", "<<"), _bitwise("shift_right", ">>")


@_expr_intrinsic
def bitwise_not(x: Any) -> Any:
    if isinstance(x, int):
        return ~x
    e = as_expr(x)
    return binop("^", e, Const(-1, e.dtype)) if e.dtype != "bool" else binop("==", e, Const(False, "bool"))


@_expr_intrinsic
def infinity(dtype: Any = "float32") -> Const:
    return Const(float("inf"), dt.canonical(dtype))


@_expr_intrinsic
def max_value(dtype: Any) -> Const:
    import numpy as np
    import tilehal

    d = tilehal.get_dtype(dt.canonical(dtype))
    info = np.finfo(d.numpy) if d.is_float else np.iinfo(d.numpy)
    return Const(info.max.item() if hasattr(info.max, "item") else info.max, d.name)


@_expr_intrinsic
def min_value(dtype: Any) -> Const:
    import numpy as np
    import tilehal

    d = tilehal.get_dtype(dt.canonical(dtype))
    info = np.finfo(d.numpy) if d.is_float else np.iinfo(d.numpy)
    return Const(info.min.item() if hasattr(info.min, "item") else info.min, d.name)


class DTypeConst(str):
    """`T.float16` & co (and `T.dtype(name)`): a dtype name that also casts when called (`T.float32(0)`)."""

    __tl_expr__ = True

    def __new__(cls, value: Any = "float32") -> DTypeConst:
        return super().__new__(cls, dt.canonical(str(value) if isinstance(value, DTypeConst) else value))

    def as_torch(self) -> Any:
        import tilehal

        return tilehal.to_torch_dtype(str(self))

    def as_numpy(self) -> Any:
        import tilehal

        return tilehal.to_numpy_dtype(str(self))

    @property
    def bits(self) -> int:
        return self.as_numpy().itemsize * 8 if str(self) != "bool" else 8

    def __call__(self, value: Any = 0) -> Expr:
        name = dt.canonical(str(self))
        if _is_num(value) or isinstance(value, bool):
            v = float(value) if dt.is_float(name) else int(value)
            return Const(v, name)
        return _CastNode(as_expr(value), name)


def dtype_constants() -> dict[str, DTypeConst]:
    names = ["float16", "float32", "float64", "bfloat16", "float8_e4m3", "float8_e5m2", "int8", "int16", "int32",
             "int64", "uint8", "bool"]
    out = {n: DTypeConst(n) for n in names}
    out["float8_e4m3fn"] = DTypeConst("float8_e4m3")
    for alias, name in (("half", "float16"), ("float", "float32"), ("double", "float64"), ("short", "int16"),
                        ("int", "int32"), ("long", "int64")):
        out[alias] = DTypeConst(name)
    return out


__all__ = ["Cast", "DTypeConst", "abs", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "shift_left",
           "shift_right", "cast", "clamp", "ceil", "ceildiv", "cos", "exp", "exp2", "floor", "floordiv",
           "floormod", "if_then_else", "infinity", "log", "log2", "max", "max_value", "min", "min_value", "pow",
           "round", "rsqrt", "sigmoid", "sin", "sqrt", "tanh"]
