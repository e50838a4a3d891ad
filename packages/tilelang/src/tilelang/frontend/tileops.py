"""Tile-op statements (`T.copy`, `T.gemm`, `T.reduce_*`, ...): binding their arguments into IR nodes.

Each `op_<name>` maps a call's positional/keyword arguments onto the op's parameters, resolves
its buffer regions (whole buffers, start-index tiles, slices) and checks shapes, citing the
user's file:line on every error.
"""

from __future__ import annotations

import ast
from typing import Any

from ..ir.nodes import (
    AtomicAdd,
    Buffer,
    Copy,
    CumSum,
    Expr,
    Fill,
    For,
    Gemm,
    Load,
    Reduce,
    Region,
    Select,
    Stmt,
    Store,
    Var,
    binop,
    const,
)
from .affine import constant_difference
from .meta import MetaEvaluator, fmt_shape


class TileOpBinder(MetaEvaluator):
    def _args(self, call: ast.Call, names: list[str], defaults: dict[str, Any], what: str) -> dict[str, ast.AST | Any]:
        """Map positional/keyword AST args onto `names`; values for defaults stay Python values."""
        if len(call.args) > len(names):
            self.fail(call, f"T.{what} takes at most {len(names)} positional arguments, got {len(call.args)}")
        out: dict[str, Any] = dict(zip(names, call.args))
        for k in call.keywords:
            if k.arg not in names:
                self.fail(call, f"T.{what}: unknown keyword {k.arg!r}")
            out[k.arg] = k.value
        for n in names:
            if n not in out:
                if n not in defaults:
                    self.fail(call, f"T.{what}: missing argument {n!r}")
                out[n] = defaults[n]
        return out

    def _meta_arg(self, v: Any) -> Any:
        return self.value(v) if isinstance(v, ast.AST) else v

    def region_spec(self, node: ast.AST) -> tuple[Buffer, list[Expr], list[int | None]]:
        """(buffer, starts, extents) with None extents where only a start index was given."""
        if isinstance(node, ast.Subscript):
            buf = self.value(node.value)
            if not isinstance(buf, Buffer):
                self.fail(node, f"{ast.unparse(node.value)} is not a buffer")
            sl = node.slice
            elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
            if len(elts) != buf.ndim:
                self.fail(node, f"buffer {buf.name} has rank {buf.ndim} (shape {fmt_shape(buf)}) but the tile "
                                f"{ast.unparse(node)} gives {len(elts)} index(es)")
            starts: list[Expr] = []
            extents: list[int | None] = []
            any_slice = any(isinstance(e, ast.Slice) for e in elts)
            for d, e in enumerate(elts):
                if isinstance(e, ast.Slice):
                    if e.step is not None:
                        self.fail(node, "strided slices are not supported in tile ops")
                    lo = self.to_expr(self.value(e.lower), e) if e.lower is not None else const(0)
                    hi = self.to_expr(self.value(e.upper), e) if e.upper is not None else buf.shape[d]
                    n = constant_difference(hi, lo)
                    if n is None:
                        self.fail(node, f"slice {ast.unparse(e)} of {buf.name}: extent must be a compile-time "
                                        f"constant")
                    if n <= 0:
                        self.fail(node, f"slice {ast.unparse(e)} of {buf.name} is empty (extent {n})")
                    starts.append(lo)
                    extents.append(n)
                else:
                    starts.append(self.to_expr(self.value(e), e))
                    extents.append(1 if any_slice else None)
            return buf, starts, extents
        v = self.value(node)
        if isinstance(v, Load):
            return v.buffer, list(v.indices), [None] * len(v.indices)
        if not isinstance(v, Buffer):
            self.fail(node, f"expected a buffer or a tile of one, got {ast.unparse(node)}")
        if v.static_shape() is None:
            self.fail(node, f"buffer {v.name} has a symbolic shape; pass a tile of it, e.g. {v.name}[i, j]")
        return v, [const(0)] * v.ndim, list(v.static_shape())

    def full_region(self, node: ast.AST, what: str) -> Region:
        buf, starts, ext = self.region_spec(node)
        if any(e is None for e in ext):
            # a start-only tile for gemm/fill: the rest of the buffer from that start
            shape = buf.static_shape()
            if shape is None:
                self.fail(node, f"T.{what}: give explicit slices for the symbolic-shaped buffer {buf.name}")
            ext = [1 if e is None and i < len(ext) - 2 else (e if e is not None else shape[i]) for i, e in
                   enumerate(ext)]
        return Region(buf, starts, [int(e) for e in ext], self.loc(node))

    def op_copy(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.copy")
        a = self._args(call, ["src", "dst", "coalesced_width", "disable_tma", "eviction_policy"],
                       {"coalesced_width": None, "disable_tma": False, "eviction_policy": None}, "copy")
        sb, ss, se = self.region_spec(a["src"])
        db, ds, de = self.region_spec(a["dst"])
        if any(e is None for e in se) and any(e is None for e in de):
            self.fail(call, "T.copy: at least one side must be a whole buffer or a sliced tile, so the tile shape is "
                            "known")
        if any(e is None for e in se):
            se = self._infer_extents(call, sb, se, de, "source")
        if any(e is None for e in de):
            de = self._infer_extents(call, db, de, se, "destination")
        src, dst = Region(sb, ss, se, self.loc(call)), Region(db, ds, de, self.loc(call))
        if src.squeezed() != dst.squeezed():
            self.fail(call, f"T.copy: shape mismatch: source {sb.name} tile {tuple(se)} vs destination {db.name} "
                            f"tile {tuple(de)}")
        opts = {k: self._meta_arg(a[k]) for k in ("coalesced_width", "disable_tma", "eviction_policy")}
        opts = {k: v for k, v in opts.items() if v not in (None, False)}  # keep what the user set
        return Copy(src, dst, opts, loc=self.loc(call))

    def _infer_extents(self, call: ast.Call, buf: Buffer, ext: list[int | None], other: list[int], side: str) -> list[int]:
        r = len(ext)
        if r >= len(other):
            return [1] * (r - len(other)) + list(other)
        sq = [e for e in other if e != 1]
        if r >= len(sq):
            return [1] * (r - len(sq)) + sq
        self.fail(call, f"T.copy: wrong rank: {side} {buf.name} has rank {r} but the other side's tile has shape "
                        f"{tuple(other)}")

    def op_gemm(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.gemm")
        a = self._args(call, ["A", "B", "C", "transpose_A", "transpose_B", "policy", "clear_accum", "k_pack",
                              "wg_wait", "use_wgmma"],
                       {"transpose_A": False, "transpose_B": False, "policy": "Square", "clear_accum": False,
                        "k_pack": 1, "wg_wait": 0, "use_wgmma": None}, "gemm")
        A, B, C = (self.full_region(a[n], "gemm") for n in "ABC")
        ta, tb = bool(self._meta_arg(a["transpose_A"])), bool(self._meta_arg(a["transpose_B"]))
        clear = bool(self._meta_arg(a["clear_accum"]))
        policy = str(self._meta_arg(a["policy"]))
        sa, sb, sc = A.squeezed(), B.squeezed(), C.squeezed()
        for r, nm in ((sa, "A"), (sb, "B"), (sc, "C")):
            if len(r) > 2:
                self.fail(call, f"T.gemm: {nm} tile must be 2-D, got extents {tuple(r)}")
        sa, sb, sc = A.as_2d(), B.as_2d(), C.as_2d()
        M, K = (sa[1], sa[0]) if ta else (sa[0], sa[1])
        K2, N = (sb[1], sb[0]) if tb else (sb[0], sb[1])
        if K != K2 or tuple(sc) != (M, N):
            self.fail(call, f"T.gemm: shape mismatch: A {A.buffer.name}{tuple(sa)}{' (transposed)' if ta else ''} is "
                            f"{M}x{K}, B {B.buffer.name}{tuple(sb)}{' (transposed)' if tb else ''} is {K2}x{N}, "
                            f"C {C.buffer.name} is {tuple(sc)}; expected C to be {M}x{N} and both K equal")
        opts = {k: self._meta_arg(a[k]) for k in ("k_pack", "wg_wait", "use_wgmma")}
        opts = {k: v for k, v in opts.items() if v not in (None, {"k_pack": 1, "wg_wait": 0}.get(k))}
        return Gemm(A, B, C, ta, tb, clear, policy, opts, loc=self.loc(call))

    def op_clear(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.clear")
        a = self._args(call, ["buffer"], {}, "clear")
        r = self.full_region(a["buffer"], "clear")
        return Fill(r, const(0), loc=self.loc(call))

    def op_fill(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.fill")
        a = self._args(call, ["buffer", "value"], {}, "fill")
        r = self.full_region(a["buffer"], "fill")
        return Fill(r, self.to_expr(self.value(a["value"]), call), loc=self.loc(call))

    def _reduce(self, call: ast.Call, kind: str) -> Stmt:
        self._need_kernel(call, f"T.reduce_{kind}")
        a = self._args(call, ["buffer", "out", "dim", "clear"], {"dim": -1, "clear": True}, f"reduce_{kind}")
        src, dst = self.value(a["buffer"]), self.value(a["out"])
        for b, nm in ((src, "source"), (dst, "destination")):
            if not isinstance(b, Buffer) or b.scope == "global":
                self.fail(call, f"T.reduce_{kind}: {nm} must be a shared/fragment/local buffer")
        dim = int(self._meta_arg(a["dim"]))
        if dim < 0:
            dim += src.ndim
        if not 0 <= dim < src.ndim:
            self.fail(call, f"T.reduce_{kind}: dim {a['dim']!r} out of range for {src.name} of rank {src.ndim}")
        ss, ds = src.static_shape(), dst.static_shape()
        expect = ss[:dim] + ss[dim + 1:]
        if ds != expect and ds != ss[:dim] + (1,) + ss[dim + 1:] and not (expect == () and ds == (1,)):
            self.fail(call, f"T.reduce_{kind}: destination {dst.name} has shape {ds}, expected {expect} (source "
                            f"{src.name}{ss} reduced over dim {dim})")
        return Reduce(kind, src, dst, dim, bool(self._meta_arg(a["clear"])), loc=self.loc(call))

    def op_reduce_max(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "max")

    def op_reduce_min(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "min")

    def op_reduce_sum(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "sum")

    def op_reduce_abssum(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "abssum")

    def op_reduce_absmax(self, call: ast.Call) -> Stmt:
        return self._reduce(call, "absmax")

    def op_cumsum(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.cumsum")
        a = self._args(call, ["src", "dst", "dim", "reverse"], {"dst": None, "dim": 0, "reverse": False}, "cumsum")
        src = self.value(a["src"])
        dst = self._meta_arg(a["dst"]) if a["dst"] is not None else src
        if not isinstance(src, Buffer) or not isinstance(dst, Buffer) or src.scope == "global" or dst.scope == "global":
            self.fail(call, "T.cumsum: src and dst must be shared/fragment/local buffers")
        if src.static_shape() != dst.static_shape():
            self.fail(call, f"T.cumsum: shape mismatch: {src.name}{src.static_shape()} vs {dst.name}"
                            f"{dst.static_shape()}")
        dim = int(self._meta_arg(a["dim"]))
        dim = dim + src.ndim if dim < 0 else dim
        if not 0 <= dim < src.ndim:
            self.fail(call, f"T.cumsum: dim {dim} out of range for rank {src.ndim}")
        return CumSum(src, dst, dim, bool(self._meta_arg(a["reverse"])), loc=self.loc(call))

    def op_atomic_add(self, call: ast.Call) -> Stmt:
        self._need_kernel(call, "T.atomic_add")
        a = self._args(call, ["dst", "value", "memory_order"], {"memory_order": None}, "atomic_add")
        order = self._meta_arg(a["memory_order"])
        opts = {"memory_order": order} if order is not None else {}  # kept in the IR; backends say if ignored
        vnode = a["value"]
        v = self.value(vnode)
        db, ds, de = self.region_spec(a["dst"])
        if isinstance(v, Buffer) and v.scope != "var" or isinstance(vnode, ast.Subscript) and any(
                isinstance(e, ast.Slice) for e in (vnode.slice.elts if isinstance(vnode.slice, ast.Tuple)
                                                   else [vnode.slice])):
            sb, ss, se = self.region_spec(vnode)
            if any(e is None for e in de):
                de = self._infer_extents(call, db, de, se, "destination")
            src = Region(sb, ss, [int(e) for e in se], self.loc(call))
            dst = Region(db, ds, [int(e) for e in de], self.loc(call))
            if src.squeezed() != dst.squeezed():
                self.fail(call, f"T.atomic_add: shape mismatch: {tuple(de)} vs {tuple(se)}")
            return AtomicAdd(dst, src, opts, loc=self.loc(call))
        de = [1 if e is None else e for e in de]
        if any(e != 1 for e in de):
            self.fail(call, "T.atomic_add with a scalar value needs a single element destination, e.g. C[i, j]")
        return AtomicAdd(Region(db, ds, de, self.loc(call)), self.to_expr(v, call), opts, loc=self.loc(call))

    def op_use_swizzle(self, call: ast.Call) -> None:
        k = self._need_kernel(call, "T.use_swizzle")
        a = self._args(call, ["panel_size", "order", "enable"], {"order": "row", "enable": True}, "use_swizzle")
        k.attrs["swizzle"] = (int(self._meta_arg(a["panel_size"])), str(self._meta_arg(a["order"])),
                              bool(self._meta_arg(a["enable"])))
        return None

    def op_annotate_layout(self, call: ast.Call) -> None:
        self._need_kernel(call, "T.annotate_layout")
        a = self._args(call, ["layout_map"], {}, "annotate_layout")
        m = self.value(a["layout_map"])
        if not isinstance(m, dict) or not all(isinstance(b, Buffer) for b in m):
            self.fail(call, "T.annotate_layout expects a dict {buffer: layout}")
        for b, layout in m.items():
            b.layout = layout
        return None

    def op_im2col(self, call: ast.Call) -> Stmt:
        """`T.im2col(img, col, nhw_step, c_step, kernel, stride, dilation, pad)`: the (block_M, block_K) tile
        of the im2col matrix of an NHWC image: row r = (n, oh, ow), column k = (kh, kw, c), zero where the
        window falls in the padding or past the end. Lowered here into a T.Parallel loop over the tile."""
        self._need_kernel(call, "T.im2col")
        a = self._args(call, ["img", "col", "nhw_step", "c_step", "kernel", "stride", "dilation", "pad",
                              "eviction_policy", "annotations"],
                       {"eviction_policy": None, "annotations": None}, "im2col")
        img, col = self.value(a["img"]), self.value(a["col"])
        if not isinstance(img, Buffer) or img.scope != "global" or img.ndim != 4:
            self.fail(call, "T.im2col: img must be a global NHWC tensor of rank 4")
        if not isinstance(col, Buffer) or col.scope == "global" or col.static_shape() is None or col.ndim != 2:
            self.fail(call, "T.im2col: col must be a 2-D shared/fragment buffer")
        meta = {}
        for k in ("kernel", "stride", "dilation", "pad"):
            v = self._meta_arg(a[k])
            if isinstance(v, bool) or not isinstance(v, int):
                self.fail(call, f"T.im2col: {k} must be a Python int, got {v!r}")
            meta[k] = v
        ks, s, d, pad = meta["kernel"], meta["stride"], meta["dilation"], meta["pad"]
        nhw = self.to_expr(self._meta_arg(a["nhw_step"]), call)
        cst = self.to_expr(self._meta_arg(a["c_step"]), call)
        n_, h_, w_, c_ = img.shape
        bm, bk = col.static_shape()
        oh_n = binop("+", binop("//", binop("-", binop("+", h_, 2 * pad), d * (ks - 1) + 1), s), 1)
        ow_n = binop("+", binop("//", binop("-", binop("+", w_, 2 * pad), d * (ks - 1) + 1), s), 1)
        i, j = Var(self.shared.fresh("i")), Var(self.shared.fresh("j"))
        row = binop("+", binop("*", nhw, bm), i)
        kk = binop("+", binop("*", cst, bk), j)
        ow = binop("%", row, ow_n)
        oh = binop("%", binop("//", row, ow_n), oh_n)
        n = binop("//", row, binop("*", oh_n, ow_n))
        c = binop("%", kk, c_)
        kw = binop("%", binop("//", kk, c_), ks)
        kh = binop("//", kk, binop("*", c_, ks))
        h = binop("-", binop("+", binop("*", oh, s), binop("*", kh, d)), pad)
        w = binop("-", binop("+", binop("*", ow, s), binop("*", kw, d)), pad)
        conds = [binop("<", row, binop("*", n_, binop("*", oh_n, ow_n))), binop("<", kk, binop("*", ks * ks, c_)),
                 binop(">=", h, 0), binop("<", h, h_), binop(">=", w, 0), binop("<", w, w_)]
        cond = conds[0]
        for x in conds[1:]:
            cond = binop("and", cond, x)
        val = Load(img, [n, h, w, c])
        zero = const(0.0, val.dtype) if val.dtype.startswith(("float", "bfloat")) else const(0, val.dtype)
        body: Stmt = Store(col, [i, j], Select(cond, val, zero, val.dtype), loc=self.loc(call))
        body = For(j, const(0), const(bk), "parallel", body, {}, loc=self.loc(call))
        return For(i, const(0), const(bm), "parallel", body, {}, loc=self.loc(call))

    op_c2d_im2col = op_im2col
