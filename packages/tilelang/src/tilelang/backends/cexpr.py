"""Expressions -> C-family source text, shared by the C and the CUDA codegens.

The walk over expression nodes and the operator forms are the same for both; a codegen gives
what differs: its constants (`const`), loads (`load`), value types (`value_ctype`), rounding
to 16/8-bit floats (`round_to`), min/max (`minmax`), integer floor division (`int_divmod`) and
its math-function spellings (`MATH`, on top of `C_MATH`).
"""

from __future__ import annotations

from ..errors import CompileError
from ..ir import dtypes as dt
from ..ir.nodes import BinOp, Call, Cast, Const, Expr, Load, Not, Select, Var, register_rules

# T.<fn> -> (float32 spelling, float64 spelling): a function name, or a template on the args ({0})
C_MATH = {
    "exp": ("expf", "exp"), "exp2": ("exp2f", "exp2"), "log": ("logf", "log"), "log2": ("log2f", "log2"),
    "sqrt": ("sqrtf", "sqrt"), "rsqrt": ("(1.0f / sqrtf({0}))", "(1.0 / sqrt({0}))"), "tanh": ("tanhf", "tanh"),
    "sin": ("sinf", "sin"), "cos": ("cosf", "cos"), "floor": ("floorf", "floor"), "ceil": ("ceilf", "ceil"),
    "round": ("rintf", "rint"), "abs": ("fabsf", "fabs"), "pow": ("powf", "pow"),
    "sigmoid": ("(1.0f / (1.0f + expf(-{0})))", "(1.0 / (1.0 + exp(-{0})))"),
}


class CExprEmitter:
    TARGET = "C"  # in error messages
    MATH = C_MATH

    # ------------------------------------------------------------ what a codegen gives

    def const(self, e: Const) -> str:
        raise NotImplementedError

    def load(self, e: Load) -> str:
        raise NotImplementedError

    def cast_to(self, e: Expr, dtype: str) -> str:
        raise NotImplementedError

    def value_ctype(self, dtype: str) -> str:
        """C type of arithmetic on a value of `dtype`."""
        raise NotImplementedError

    def round_to(self, dtype: str, code: str) -> str | None:
        """T.cast to a 16/8-bit float: the rounded value (None for the other types)."""
        raise NotImplementedError

    def minmax(self, op: str, dtype: str, a: str, b: str) -> str:
        raise NotImplementedError

    def int_divmod(self, e: BinOp, a: str, b: str) -> str:
        """Integer `//` / `%` (Python's floor semantics)."""
        raise NotImplementedError

    # ------------------------------------------------------------ the shared walk

    def expr(self, e: Expr) -> str:
        method = e.rule("cexpr")  # the emitter's method for this class (a name, so codegens override it)
        if method is None:
            raise CompileError(f"{self.TARGET} codegen: unknown expression {type(e).__name__}")
        return getattr(self, method)(e)

    def var(self, e: Var) -> str:
        return e.name

    def not_(self, e: Not) -> str:
        return f"(!({self.expr(e.a)}))"

    def cast(self, e: Cast) -> str:
        inner = self.expr(e.value)
        rounded = self.round_to(e.dtype, inner)
        if rounded is not None:
            return rounded
        if e.dtype == "bool":
            return f"(({inner}) != 0)"
        return f"(({self.value_ctype(e.dtype)})({inner}))"

    def select(self, e: Select) -> str:
        return f"(({self.expr(e.cond)}) ? {self.cast_to(e.a, e.dtype)} : {self.cast_to(e.b, e.dtype)})"

    def call(self, e: Call) -> str:
        t = dt.compute_type(e.dtype)
        args = [self.cast_to(a, e.dtype) for a in e.args]
        if dt.is_int(t):
            if e.fn == "abs":
                return f"({args[0]} < 0 ? -{args[0]} : {args[0]})"
            raise CompileError(f"T.{e.fn} on integer type {e.dtype} is not supported")
        spelling = self.MATH.get(e.fn)
        if spelling is None:
            raise CompileError(f"T.{e.fn} is not supported by the {self.TARGET} backend")
        s = spelling[1 if t == "float64" else 0]
        return s.format(*args) if "{" in s else f"{s}({', '.join(args)})"

    def binop(self, e: BinOp) -> str:
        op = e.op
        if op in ("and", "or"):
            return f"({self.expr(e.a)} {'&&' if op == 'and' else '||'} {self.expr(e.b)})"
        if op in ("<", "<=", ">", ">=", "==", "!="):
            common = dt.promote(e.a.dtype, e.b.dtype)
            return f"({self.cast_to(e.a, common)} {op} {self.cast_to(e.b, common)})"
        a, b = self.cast_to(e.a, e.dtype), self.cast_to(e.b, e.dtype)
        if op in ("max", "min"):
            return self.minmax(op, e.dtype, a, b)
        if dt.is_int(e.dtype) and op in ("//", "%"):
            return self.int_divmod(e, a, b)
        if op == "//":
            return f"floor{'f' if e.dtype == 'float32' else ''}({a} / {b})"
        if op == "%":
            f = "f" if e.dtype == "float32" else ""
            return f"({a} - floor{f}({a} / {b}) * {b})"
        return f"({a} {op} {b})"


register_rules("cexpr", {Const: "const", Var: "var", Load: "load", BinOp: "binop", Not: "not_", Cast: "cast",
                         Select: "select", Call: "call"})
