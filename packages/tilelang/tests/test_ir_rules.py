"""Tile ops are objects with per-table rules: every op has a rule in each backend's table, and a new
op works through the generic walkers (verify, dce, printer, interpreter) with no walker edited.
The math-function table is written once: every T.<function> folds, interprets, and compiles on
cpu and cuda (run on CPU threads) to the same values."""

from dataclasses import dataclass

import numpy as np
import pytest
import tilelang
import tilelang.language as T
from tilelang.backends import interp  # noqa: F401 - registers the "interp" table
from tilelang.backends.c import codegen as c_codegen  # noqa: F401 - registers the "cpu" table
from tilelang.backends.c import lower_tile_ops  # noqa: F401 - registers the "cpu.lower" table
from tilelang.backends.cexpr import C_MATH
from tilelang.backends.cuda import codegen as cuda_codegen  # noqa: F401 - registers the "cuda" tables
from tilelang.ir.nodes import (
    FUNCTIONS,
    AtomicAdd,
    Copy,
    CumSum,
    Fill,
    Gemm,
    PrimFunc,
    Reduce,
    Region,
    Stmt,
    TileOp,
    register_rules,
)
from tilelang.ir.verifier import verify
from tilelang.ir.visit import buffers_read, buffers_written, map_stmt, walk_stmts
from tilelang.passes.dce import dce

OPS = [Copy, Gemm, Fill, Reduce, CumSum, AtomicAdd]


def test_every_tile_op_has_a_rule_in_every_table():
    assert set(OPS) == set(TileOp.__subclasses__()) - {_Scale}
    for op in OPS:
        for table in ("interp", "cuda", "print", "verify"):
            assert op.rule_for(table) is not None, f"{op.__name__} has no {table!r} rule"
        # the cpu target lowers each op to loops, or its C codegen emits the op itself
        assert op.rule_for("cpu.lower") is not None or op.rule_for("cpu") is not None, op.__name__
    assert AtomicAdd.rule_for("cuda.parallel") is not None


def test_register_rules_refuses_a_non_statement():
    with pytest.raises(TypeError, match="not a statement or expression class"):
        register_rules("interp", {int: print})


@dataclass(eq=False)
class _Scale(TileOp):
    """dst[region] *= factor: a tile op the walkers have never heard of."""

    dst: Region
    factor: float

    def regions(self):
        return [self.dst]

    def reads(self):
        return {self.dst.buffer}

    def writes(self):
        return {self.dst.buffer}

    def rebuild(self, tr):
        return _Scale(tr.region(self.dst), self.factor, loc=self.loc)

    def text(self, expr, region):
        return f"scale({region(self.dst)}, {self.factor!r})"


def _scale_interp(it, s: _Scale) -> None:
    it.write_region(s.dst, it.read_region(s.dst) * np.float32(s.factor))


register_rules("interp", {_Scale: _scale_interp})


def _program() -> PrimFunc:
    @T.prim_func
    def prog(X: T.Tensor((8, 16), "float32"), Y: T.Tensor((8, 16), "float32")):
        with T.Kernel(1) as bx:
            t = T.alloc_fragment((8, 16), "float32")
            dead = T.alloc_fragment((8, 16), "float32")
            T.copy(X[0, 0], t)
            T.fill(dead, 1.0)
            T.fill(t[0:4, 0:16], 0.0)  # becomes scale(t[0:4, :], 3.0) below
            T.copy(t, Y[0, 0])

    def swap(s: Stmt) -> Stmt:
        if isinstance(s, Fill) and s.dst.extents == [4, 16]:
            return _Scale(s.dst, 3.0, loc=s.loc)
        return s

    return PrimFunc(prog.name, prog.params, map_stmt(prog.body, swap), prog.dynamic_vars, prog.loc, prog.source)


def test_a_new_tile_op_goes_through_the_generic_walkers():
    f = verify(_program())
    ops = [s for s in walk_stmts(f.body) if isinstance(s, _Scale)]
    assert len(ops) == 1
    t = ops[0].dst.buffer
    assert t in buffers_read(f.body) and t in buffers_written(f.body)
    assert "scale(t[0:4, 0:16], 3.0)" in f.script()
    g = dce(f)  # the fill of `dead` goes, the new op (its buffer is read later) stays
    assert "dead" not in g.script() and "scale(" in g.script()
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    y = tilelang.compile(g, out_idx=[1], target="interp")(x)
    want = x.copy()
    want[:4] *= 3.0
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_a_backend_without_the_rule_says_so():
    with pytest.raises(tilelang.CompileError, match="C codegen: _Scale should have been lowered"):
        tilelang.compile(_program(), out_idx=[1], target="cpu")


# ---------------------------------------------------------------- the function table, written once

NAMES = list(FUNCTIONS)
FNS = [getattr(T, n) for n in NAMES]
ARITY = [FUNCTIONS[n].arity for n in NAMES]
KS = list(range(len(NAMES)))


@T.prim_func
def _every_function(X: T.Tensor((64,), "float32"), Y: T.Tensor((len(KS), 64), "float32")):
    with T.Kernel(1, threads=64) as bx:
        for i in T.Parallel(64):
            for k in KS:  # meta loop: one statement per T.<function>
                Y[k, i] = FNS[k](X[i]) if ARITY[k] == 1 else FNS[k](X[i], 1.5)


def test_every_function_has_a_c_spelling_and_a_language_intrinsic():
    assert set(C_MATH) == set(FUNCTIONS)
    for name, fn in FUNCTIONS.items():
        assert callable(getattr(T, name)), name
        args = [0.7] * fn.arity
        assert getattr(T, name)(*args) == pytest.approx(fn.fold(*args)), name  # meta level folds


@pytest.mark.parametrize("tgt", ["interp", "cpu", "cuda_emu"])
def test_every_function_on_every_target(tgt):
    """float32 vs numpy in float64: 4 ulp (the C backend's exp2 is its own vectorized one)."""
    x = np.linspace(0.1, 2.3, 64).astype(np.float32)
    y = tilelang.compile(_every_function, out_idx=[1], target=tgt)(x)
    x64 = x.astype(np.float64)
    for k, name in enumerate(NAMES):
        args = [x64] if ARITY[k] == 1 else [x64, np.float64(1.5)]
        want = FUNCTIONS[name].numpy(*args)
        np.testing.assert_allclose(y[k], want, rtol=5e-7, atol=5e-7, err_msg=f"T.{name} on {tgt}")


def test_every_reduce_kind_is_a_language_statement_with_a_front_end_binding():
    from tilelang.frontend.tileops import TileOpBinder
    from tilelang.ir.nodes import REDUCE_OPS

    for kind in REDUCE_OPS:
        assert getattr(T, f"reduce_{kind}").__tl_stmt__ == f"reduce_{kind}"
        assert callable(getattr(TileOpBinder, f"op_reduce_{kind}"))
    assert {n[len("reduce_"):] for n in dir(T) if n.startswith("reduce_")} == set(REDUCE_OPS)
