"""The thread-level IR (ir/thread.py; issue 14 item 2, step 1): hand-built thread programs are printed,
verified and run by the thread interpreter (threads as numpy lanes), and compared with numpy and
with the tile interpreter on the equivalent tile program."""

import numpy as np
import pytest
import tilehal
from tilelang.backends.interp import Interpreter
from tilelang.backends.thread_interp import ThreadInterpreter, fragment_indices, run_thread, tile_of_registers
from tilelang.errors import CompileError
from tilelang.ir.layout import default_fragment, mma_accumulator, replicated
from tilelang.ir.nodes import (
    Alloc,
    Buffer,
    Copy,
    For,
    If,
    Kernel,
    Let,
    Load,
    PrimFunc,
    Reduce,
    Region,
    Seq,
    Store,
    Var,
    binop,
    const,
)
from tilelang.ir.thread import (
    THREAD_NODES,
    AsyncCommit,
    AsyncCopy,
    AsyncWait,
    Barrier,
    Intrinsic,
    RegBuffer,
    Shuffle,
    ThreadFor,
    ThreadIdx,
    Uniform,
    reg_buffer,
)
from tilelang.ir.verifier import verify, verify_thread
from tilelang.ir.visit import buffers_read, buffers_written, map_stmt, walk_stmts

c = const


def gbuf(name, shape, dtype="float32"):
    return Buffer(name, tuple(c(n) for n in shape), dtype, "global")


def sbuf(name, shape, dtype="float32"):
    return Buffer(name, tuple(c(n) for n in shape), dtype, "shared")


def kernel(grid, threads, body, bx):
    return Kernel([c(grid)], [bx], (threads,), Seq(body))


# ---------------------------------------------------------------- programs


def copy_program(n=256, threads=32, vec=4):
    """B[block] = A[block], reversed in vec-chunks through shared memory: each thread loads vec
    contiguous elements per j (ThreadFor), a barrier, then each thread stores a chunk another wrote."""
    A, B = gbuf("A", (2 * n,)), gbuf("B", (2 * n,))
    bx, j, k, e = Var("bx"), Var("j"), Var("k"), Var("e")
    s = sbuf("s", (n,))
    trips = n // (threads * vec)
    r = reg_buffer("r", trips * vec, "float32", default_fragment((n,), threads, vec))  # register j*vec + k
    tx = ThreadIdx()
    reg = binop("+", binop("*", j, vec), k)
    base = binop("*", bx, n)
    load = ThreadFor(j, trips, Seq([
        Let(e, binop("*", binop("+", tx, binop("*", j, threads)), vec)),
        For(k, c(0), c(vec), "unroll", Store(r.buffer, [reg], Load(A, [binop("+", base, binop("+", e, k))]))),
        For(k, c(0), c(vec), "unroll", Store(s, [binop("+", e, k)], Load(r.buffer, [reg]))),
    ]))
    e2 = Var("e2")
    store = ThreadFor(j, trips, Seq([
        Let(e2, binop("*", binop("+", tx, binop("*", j, threads)), vec)),
        For(k, c(0), c(vec), "unroll",
            Store(B, [binop("+", base, binop("+", e2, k))], Load(s, [binop("-", c(n - vec), binop("-", e2, k))]))),
    ]))
    body = [Alloc(s), r, load, Barrier(), store]
    return PrimFunc("vcopy", [A, B], kernel(2, threads, body, bx), [])


def tile_copy_program(n=256, threads=32):
    """The same copy at the tile level (no reversal: B = A block by block)."""
    A, B = gbuf("A", (2 * n,)), gbuf("B", (2 * n,))
    bx = Var("bx")
    s = sbuf("s", (n,))
    body = [Alloc(s), Copy(Region(A, [binop("*", bx, n)], [n]), Region(s, [c(0)], [n])),
            Copy(Region(s, [c(0)], [n]), Region(B, [binop("*", bx, n)], [n]))]
    return PrimFunc("tcopy", [A, B], kernel(2, threads, body, bx), [])


def warp_sum_program(blocks=3, threads=64, dtype="int32", kind="xor"):
    """out[block, warp] = sum of x over the warp's lanes, by a 5-step shuffle tree; bcast[block, lane]
    = lane 0's partial value handed to every lane by an idx shuffle."""
    x = gbuf("x", (blocks * threads,), dtype)
    out = gbuf("out", (blocks, threads // 32), dtype)
    bcast = gbuf("bcast", (blocks, threads), dtype)
    bx, i = Var("bx"), Var("i")
    tx = ThreadIdx()
    r = reg_buffer("acc", 1, dtype)
    off = binop(">>", c(16), i)
    body = [
        r,
        Store(r.buffer, [c(0)], Load(x, [binop("+", binop("*", bx, threads), tx)])),
        Store(bcast, [bx, tx], Shuffle("idx", Load(r.buffer, [c(0)]), c(0))),
        For(i, c(0), c(5), "unroll",
            Store(r.buffer, [c(0)], binop("+", Load(r.buffer, [c(0)]), Shuffle(kind, Load(r.buffer, [c(0)]), off)))),
        If(binop("==", binop("%", tx, 32), 0), Store(out, [bx, binop("//", tx, 32)], Load(r.buffer, [c(0)]))),
    ]
    return PrimFunc("warp_sum", [x, out, bcast], kernel(blocks, threads, body, bx), [])


def tile_warp_sum_program(blocks=3, threads=64, dtype="int32"):
    """The tile-level equivalent: copy each block's x into a (warps, 32) fragment, reduce_sum over dim 1."""
    x = gbuf("x", (blocks * (threads // 32), 32), dtype)
    out = gbuf("out", (blocks, threads // 32), dtype)
    bx = Var("bx")
    w = threads // 32
    f = Buffer("f", (c(w), c(32)), dtype, "fragment")
    s = Buffer("s", (c(w),), dtype, "fragment")
    body = [Alloc(f), Alloc(s), Copy(Region(x, [binop("*", bx, w), c(0)], [w, 32]), Region(f, [c(0), c(0)], [w, 32])),
            Reduce("sum", f, s, 1), Copy(Region(s, [c(0)], [w]), Region(out, [bx, c(0)], [1, w]))]
    return PrimFunc("tile_warp_sum", [x, out], kernel(blocks, threads, body, bx), [])


def pipeline_program(K=5, n=128, threads=32, wait=True, valid_rows=None, vec=4, dtype="float32"):
    """out[t*vec + v] = sum over k < K of A[k, t*vec + v], A's rows streamed into a 2-stage shared
    ring with cp.async (prefetch k+1 while summing k): commit every iteration, wait(1), barrier.
    `valid_rows`: rows at or past it are predicated off (the copies write zeros). `wait=False`
    drops the waits (a bug the NaN poison shows)."""
    A = gbuf("A", (K, n), dtype)
    out = gbuf("out", (n,))
    bx, k, v = Var("bx"), Var("k"), Var("v")
    tx = ThreadIdx()
    s = sbuf("s", (2, n), dtype)
    acc = reg_buffer("acc", vec, "float32")
    col = binop("*", tx, vec)

    def issue(row):
        pred = binop("<", row, valid_rows) if valid_rows is not None else None
        return AsyncCopy(s, [binop("%", row, 2), col], A, [row, col], vec, pred)

    waits = [AsyncWait(1)] if wait else []
    loop = For(k, c(0), c(K), "serial", Seq([
        If(binop("<", binop("+", k, 1), K), issue(binop("+", k, 1))),
        AsyncCommit(),
        *waits,
        Barrier(),
        For(v, c(0), c(vec), "unroll", Store(acc.buffer, [v], binop("+", Load(acc.buffer, [v]),
                                                                     Load(s, [binop("%", k, 2), binop("+", col, v)])))),
        Barrier(),
    ]))
    body = [Alloc(s), acc, issue(c(0)), AsyncCommit(), loop, *([AsyncWait(0)] if wait else []),
            For(v, c(0), c(vec), "unroll", Store(out, [binop("+", col, v)], Load(acc.buffer, [v])))]
    return PrimFunc("pipeline", [A, out], kernel(1, threads, body, bx), [])


# ---------------------------------------------------------------- runs vs numpy and the tile interpreter


def test_vector_copy_through_shared_matches_numpy_and_the_tile_interpreter():
    n = 256
    a = np.random.default_rng(0).standard_normal(2 * n).astype(np.float32)
    f = verify_thread(copy_program(n))
    b = np.zeros_like(a)
    run_thread(f, [a, b])
    want = a.reshape(2, n // 4, 4)[:, ::-1, :].reshape(-1)  # vec-chunks reversed within each block
    np.testing.assert_array_equal(b, want)
    # the tile program (plain copy) on the tile interpreter, then reversed the same way
    t = verify(tile_copy_program(n))
    bt = np.zeros_like(a)
    Interpreter(t).run({t.params[0]: a, t.params[1]: bt}, {})
    np.testing.assert_array_equal(bt.reshape(2, n // 4, 4)[:, ::-1, :].reshape(-1), b)


@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_warp_shuffle_reduction_matches_numpy_and_tile_reduce_sum(dtype):
    blocks, threads = 3, 64
    rng = np.random.default_rng(1)
    x = (rng.integers(-50, 50, blocks * threads) if dtype == "int32" else rng.standard_normal(blocks * threads))
    x = x.astype(dtype)
    out = np.zeros((blocks, threads // 32), dtype)
    bcast = np.zeros((blocks, threads), dtype)
    run_thread(verify_thread(warp_sum_program(blocks, threads, dtype)), [x, out, bcast])
    want = x.reshape(blocks, threads // 32, 32).astype(np.float64).sum(-1)
    # the tile interpreter's reduce_sum on the same data
    t = verify(tile_warp_sum_program(blocks, threads, dtype))
    tout = np.zeros_like(out)
    Interpreter(t).run({t.params[0]: x.reshape(-1, 32), t.params[1]: tout}, {})
    if dtype == "int32":
        np.testing.assert_array_equal(out, want.astype(dtype))  # integer sums: exact
        np.testing.assert_array_equal(out, tout)
    else:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)  # fp32 tree vs float64 sum of 32 values
        np.testing.assert_allclose(out, tout, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bcast, np.repeat(x.reshape(blocks, threads // 32, 32)[:, :, :1], 32, -1)
                                  .reshape(blocks, threads))


def test_shuffle_down_tree_leaves_the_sum_in_lane_zero():
    blocks, threads = 2, 32
    x = np.arange(blocks * threads, dtype=np.int32)
    out = np.zeros((blocks, 1), np.int32)
    run_thread(verify_thread(warp_sum_program(blocks, threads, "int32", kind="down")), [x, out,
                                                                                        np.zeros((blocks, threads),
                                                                                                 np.int32)])
    np.testing.assert_array_equal(out[:, 0], x.reshape(blocks, 32).sum(-1))


def test_shuffle_lane_permutations_within_width_segments():
    threads = 64
    tx = ThreadIdx()
    outs = {k: gbuf(f"o_{k}", (threads,), "int32") for k in ("xor", "down", "up", "idx")}
    bx = Var("bx")
    args = {"xor": c(3), "down": c(5), "up": c(2), "idx": binop("+", tx, 1)}
    body = [Store(o, [tx], Shuffle(k, binop("*", tx, 10), args[k], width=16)) for k, o in outs.items()]
    f = verify_thread(PrimFunc("shfl", list(outs.values()), kernel(1, threads, body, bx), []))
    arrs = [np.zeros(threads, np.int32) for _ in outs]
    run_thread(f, arrs)
    lane = np.arange(threads)
    seg, pos = lane - lane % 16, lane % 16
    want = {"xor": seg + (pos ^ 3), "down": seg + np.where(pos + 5 < 16, pos + 5, pos),
            "up": seg + np.where(pos - 2 >= 0, pos - 2, pos), "idx": seg + (lane + 1) % 16}
    for a, k in zip(arrs, outs):
        np.testing.assert_array_equal(a, want[k] * 10, err_msg=k)


@pytest.mark.parametrize("dtype, vec, threads", [("float32", 4, 32), ("float16", 8, 16), ("bfloat16", 4, 32)])
def test_cp_async_pipeline_lands_at_its_waits(dtype, vec, threads):
    K, n = 5, 128
    a = np.random.default_rng(2).standard_normal((K, n)).astype(tilehal.to_numpy_dtype(dtype))
    out = np.zeros(n, np.float32)
    run_thread(verify_thread(pipeline_program(K, n, threads, vec=vec, dtype=dtype)), [a, out])
    want = np.zeros(n, np.float32)
    for row in a.astype(np.float32):  # fp32 accumulation in k order, as the registers do
        want += row
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_missing_wait_reads_poison_in_16_bit_types(dtype):
    a = np.ones((5, 128), tilehal.to_numpy_dtype(dtype))
    out = np.zeros(128, np.float32)
    run_thread(verify_thread(pipeline_program(5, 128, 32, wait=False, dtype=dtype)), [a, out])
    assert np.isnan(out).all()


def test_cp_async_predicated_off_rows_write_zeros():
    K, n = 5, 128
    a = np.random.default_rng(3).standard_normal((K, n)).astype(np.float32)
    out = np.zeros(n, np.float32)
    run_thread(verify_thread(pipeline_program(K, n, valid_rows=3)), [a, out])
    np.testing.assert_allclose(out, a[:3].sum(0), rtol=1e-6, atol=1e-6)


def test_a_missing_cp_async_wait_reads_poison():
    K, n = 5, 128
    a = np.ones((K, n), np.float32)
    out = np.zeros(n, np.float32)
    run_thread(verify_thread(pipeline_program(K, n, wait=False)), [a, out])
    assert np.isnan(out).all()  # every stage was read while its copy was still in flight


def test_cp_async_poison_on_integers_is_all_ones_bits():
    A, out = gbuf("A", (8,), "int32"), gbuf("out", (8,), "int32")
    s = sbuf("s", (8,), "int32")
    tx, j = ThreadIdx(), Var("j")
    at = binop("+", binop("*", tx, 4), j)
    body = [Alloc(s), AsyncCopy(s, [binop("*", tx, 4)], A, [binop("*", tx, 4)], 4), AsyncCommit(), Barrier(),
            ThreadFor(j, 4, Store(out, [at], Load(s, [at])))]  # read before any wait
    f = verify_thread(PrimFunc("poison", [A, out], kernel(1, 2, body, Var("bx")), []))
    o = np.zeros(8, np.int32)
    run_thread(f, [np.arange(8, dtype=np.int32), o])
    np.testing.assert_array_equal(o, -1)


def test_misaligned_cp_async_is_a_launch_error():
    A = gbuf("A", (64,))
    bx = Var("bx")
    s = sbuf("s", (64,))
    tx = ThreadIdx()
    body = [Alloc(s), AsyncCopy(s, [binop("+", binop("*", tx, 4), 1)], A, [binop("*", tx, 4)], 4), AsyncCommit(),
            AsyncWait(0)]
    f = verify_thread(PrimFunc("misaligned", [A], kernel(1, 8, body, bx), []))
    with pytest.raises(tilehal.LaunchError, match="16-byte aligned"):
        run_thread(f, [np.zeros(64, np.float32)])


def test_intrinsics_fma_and_cvt_per_lane():
    threads = 32
    x, y = gbuf("x", (threads,)), gbuf("y", (threads,))
    bx = Var("bx")
    tx = ThreadIdx()
    r = reg_buffer("r", 2, "float32")
    body = [r,
            Intrinsic("fma", [Load(r.buffer, [c(0)])], [Load(x, [tx]), Load(x, [tx]), c(1.0)]),
            Intrinsic("cvt", [Load(r.buffer, [c(1)])], [Load(r.buffer, [c(0)])], {"dtype": "bfloat16"}),
            Store(y, [tx], Load(r.buffer, [c(1)]))]
    f = verify_thread(PrimFunc("intrin", [x, y], kernel(1, threads, body, bx), []))
    xv = np.random.default_rng(4).standard_normal(threads).astype(np.float32)
    yv = np.zeros_like(xv)
    run_thread(f, [xv, yv])
    want = (xv.astype(np.float64) ** 2 + 1).astype(np.float32).astype(tilehal.to_numpy_dtype("bfloat16"))
    np.testing.assert_array_equal(yv, want.astype(np.float32))


def test_uniform_region_runs_scalar_code_once_for_the_block():
    out = gbuf("out", (4,), "int32")
    bx, t = Var("bx"), Var("t")
    body = [Uniform(Seq([Let(t, binop("+", binop("*", bx, 10), 7)), Store(out, [bx], t)]))]
    f = verify_thread(PrimFunc("uni", [out], kernel(4, 32, body, bx), []))
    o = np.zeros(4, np.int32)
    run_thread(f, [o])
    np.testing.assert_array_equal(o, [7, 17, 27, 37])


# ---------------------------------------------------------------- printer


def test_printer_text_of_thread_programs():
    assert copy_program(n=256).script() == """\
@T.prim_func
def vcopy(A: T.Tensor((512,), 'float32'), B: T.Tensor((512,), 'float32')):
    with T.Kernel(2, threads=32) as bx:
        s = T.alloc_shared((256,), 'float32')
        r = T.alloc_reg(8, 'float32', layout=Fragment([256]: r[4]*1 + t[32@1]*4 + r[2]*128; regs=8))
        for j in T.thread_for(2):
            e = (T.get_thread_binding() + j * 32) * 4
            for k in T.unroll(4):
                r[j * 4 + k] = A[bx * 256 + (e + k)]
            for k in T.unroll(4):
                s[e + k] = r[j * 4 + k]
        T.sync_threads()
        for j in T.thread_for(2):
            e2 = (T.get_thread_binding() + j * 32) * 4
            for k in T.unroll(4):
                B[bx * 256 + (e2 + k)] = s[252 - (e2 - k)]
"""
    text = pipeline_program(K=3, n=64, threads=16, valid_rows=2).script()
    assert "    T.cp_async(s[0, T.get_thread_binding() * 4], A[0, T.get_thread_binding() * 4], 4, pred=0 < 2)\n" \
        in text
    assert "            T.cp_async_commit()\n            T.cp_async_wait(1)\n            T.sync_threads()\n" in text
    assert "acc = T.alloc_reg(4, 'float32')" in text
    w = warp_sum_program().script()
    assert "T.shfl_idx(acc[0], 0)" in w and "T.shfl_xor(acc[0], 16 >> i)" in w
    tx = ThreadIdx()
    r = reg_buffer("r", 1, "float32")
    x = gbuf("x", (4,))
    s = Seq([Intrinsic("cvt", [Load(r.buffer, [c(0)])], [Load(x, [tx])], {"dtype": "float16"}),
             Uniform(Store(x, [c(0)], c(1.0))), Store(x, [tx], Shuffle("down", Load(x, [tx]), c(1), width=8))])
    from tilelang.ir.printer import print_stmt

    assert print_stmt(s) == ("r[0] = T.intrinsic('cvt', x[T.get_thread_binding()], dtype='float16')\n"
                             "with T.uniform():\n    x[0] = 1.0\n"
                             "x[T.get_thread_binding()] = T.shfl_down(x[T.get_thread_binding()], 1, width=8)")


# ---------------------------------------------------------------- structure: walkers and rebuild


def test_every_thread_node_has_print_verify_and_interp_rules():
    from tilelang.ir.nodes import Expr

    for cls in THREAD_NODES:
        assert cls.rule_for("print") is not None, cls.__name__
        assert cls.rule_for("thread.interp") is not None, cls.__name__
        if not issubclass(cls, Expr):  # statements: verify_thread's table (expressions: checked by it too)
            assert cls.rule_for("thread.verify") is not None, cls.__name__
            assert cls.rule_for("verify") is not None or cls is AsyncCommit, cls.__name__  # nothing local to check


def test_walkers_and_rebuild_see_thread_nodes():
    f = pipeline_program(K=3, n=64, threads=16)
    A, out = f.params
    kinds = {type(s) for s in walk_stmts(f.body)}
    assert {AsyncCopy, AsyncCommit, AsyncWait, Barrier, RegBuffer} <= kinds
    assert A in buffers_read(f.body) and out in buffers_written(f.body)
    copies = [s for s in walk_stmts(f.body) if isinstance(s, AsyncCopy)]
    assert all(s.reads() == {A} and s.writes() == {copies[0].dst} for s in copies)
    same = map_stmt(f.body, lambda s: s)  # an identity rebuild keeps the program's meaning
    g = PrimFunc("again", f.params, same, [])
    assert g.script().replace("def again", "def pipeline") == f.script()
    a = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    o1, o2 = np.zeros(64, np.float32), np.zeros(64, np.float32)
    run_thread(f, [a, o1])
    run_thread(verify_thread(g), [a, o2])
    np.testing.assert_array_equal(o1, o2)
    c_ = copy_program()
    assert isinstance(map_stmt(c_.body, lambda s: s).body.body[2], ThreadFor)


# ---------------------------------------------------------------- verifier


def _one(body, params, threads=32):
    return PrimFunc("bad", params, kernel(1, threads, body, Var("bx")), [])


def test_barrier_under_a_per_thread_condition_is_rejected():
    x = gbuf("x", (32,))
    f = _one([If(binop("<", ThreadIdx(), 16), Barrier())], [x])
    with pytest.raises(CompileError, match="sync_threads.*differs between threads"):
        verify_thread(f)
    # the interpreter catches the same at run time when the verifier is skipped
    with pytest.raises(tilehal.LaunchError, match="reached by 16 of 32"):
        run_thread(f, [np.zeros(32, np.float32)])


def test_shuffle_under_a_per_thread_condition_is_rejected():
    x = gbuf("x", (32,))
    tx = ThreadIdx()
    f = _one([If(binop("<", tx, 16), Store(x, [tx], Shuffle("xor", Load(x, [tx]), c(1))))], [x])
    with pytest.raises(CompileError, match="shfl_xor under a condition"):
        verify_thread(f)


@pytest.mark.parametrize("n, msg", [(3, "12 bytes"), (8, "32 bytes")])
def test_cp_async_sizes_are_checked(n, msg):
    A, s = gbuf("A", (64,)), sbuf("s", (64,))
    with pytest.raises(CompileError, match=msg):
        verify_thread(_one([Alloc(s), AsyncCopy(s, [c(0)], A, [c(0)], n)], [A]))


def test_cp_async_direction_dtype_and_bounds_are_checked():
    A, s = gbuf("A", (64,)), sbuf("s", (64,))
    with pytest.raises(CompileError, match="global -> shared"):
        verify_thread(_one([Alloc(s), AsyncCopy(A, [c(0)], s, [c(0)], 4)], [A]))
    h = gbuf("h", (64,), "float16")
    with pytest.raises(CompileError, match="is float16 but s is float32"):
        verify_thread(_one([Alloc(s), AsyncCopy(s, [c(0)], h, [c(0)], 4)], [h]))
    with pytest.raises(CompileError, match="out of bounds"):
        verify_thread(_one([Alloc(s), AsyncCopy(s, [c(62)], A, [c(0)], 4)], [A]))
    with pytest.raises(CompileError, match="group count"):
        verify_thread(_one([AsyncWait(-1)], [A]))


def test_thread_programs_hold_no_tile_ops_or_tile_storage():
    with pytest.raises(CompileError, match="tile op Copy in a thread-level program"):
        verify_thread(tile_copy_program())
    with pytest.raises(CompileError, match="tile op Copy"):
        run_thread(tile_copy_program(), [np.zeros(512, np.float32)] * 2)
    x = gbuf("x", (4,))
    f = Buffer("f", (c(4),), "float32", "fragment")
    with pytest.raises(CompileError, match="T.alloc_reg, not alloc_fragment"):
        verify_thread(_one([Alloc(f)], [x]))
    i = Var("i")
    with pytest.raises(CompileError, match="T.parallel loop"):
        verify_thread(_one([For(i, c(0), c(4), "parallel", Store(x, [i], c(0.0)))], [x]))
    with pytest.raises(CompileError, match="loop bounds differ between threads"):
        verify_thread(_one([For(i, c(0), ThreadIdx(), "serial", Store(x, [c(0)], c(0.0)))], [x]))


def test_uniform_regions_reject_per_thread_values():
    x = gbuf("x", (32,))
    with pytest.raises(CompileError, match="uniform.*per-thread value"):
        verify_thread(_one([Uniform(Store(x, [ThreadIdx()], c(1.0)))], [x]))
    with pytest.raises(CompileError, match="Barrier inside a T.uniform"):
        verify_thread(_one([Uniform(Barrier())], [x]))
    t = Var("t")
    with pytest.raises(CompileError, match="uniform.*per-thread value"):  # through a Let-bound variable
        verify_thread(_one([Let(t, ThreadIdx()), Uniform(Store(x, [t], c(1.0)))], [x]))


def test_registers_intrinsics_and_shuffles_are_checked():
    x = gbuf("x", (32,))
    r = reg_buffer("r", 4, "float32", default_fragment((64,), 32, 1))  # that fragment has 2 registers
    with pytest.raises(CompileError, match="4 registers but its fragment"):
        verify_thread(_one([r], [x]))
    r = reg_buffer("r", 2, "float32")
    with pytest.raises(CompileError, match="unknown; expected one of"):
        verify_thread(_one([r, Intrinsic("mma_sync", [Load(r.buffer, [c(0)])], [])], [x]))
    with pytest.raises(CompileError, match="takes 3 operands"):
        verify_thread(_one([r, Intrinsic("fma", [Load(r.buffer, [c(0)])], [c(1.0)])], [x]))
    with pytest.raises(CompileError, match="missing attribute"):
        verify_thread(_one([r, Intrinsic("cvt", [Load(r.buffer, [c(0)])], [c(1.0)])], [x]))
    with pytest.raises(CompileError, match="index 0 ranges over"):
        verify_thread(_one([r, Intrinsic("fma", [Load(r.buffer, [c(2)])], [c(1.0)] * 3)], [x]))
    tx = ThreadIdx()
    with pytest.raises(CompileError, match="width=12"):
        verify_thread(_one([Store(x, [tx], Shuffle("xor", Load(x, [tx]), c(1), width=12))], [x]))
    with pytest.raises(CompileError, match="a kind in"):
        verify_thread(_one([Store(x, [tx], Shuffle("rot", Load(x, [tx]), c(1)))], [x]))
    with pytest.raises(CompileError, match="trip count"):
        verify_thread(_one([ThreadFor(Var("j"), 0, Store(x, [c(0)], c(0.0)))], [x]))


def test_register_store_out_of_bounds_is_a_launch_error():
    x = gbuf("x", (32,))
    r = reg_buffer("r", 2, "float32")
    f = _one([r, Store(r.buffer, [binop("%", ThreadIdx(), 3)], c(1.0))], [x])
    verify_thread(f)  # index range not static: the verifier lets it through
    with pytest.raises(tilehal.LaunchError, match="store to r: index 1 out of bounds"):
        ThreadInterpreter(f).run({x: np.zeros(32, np.float32)}, {})


def test_tile_interpreter_refuses_thread_nodes():
    f = warp_sum_program()
    with pytest.raises(CompileError, match="unknown statement RegBuffer"):
        Interpreter(f).run({p: np.zeros([int(d.value) for d in p.shape], np.int32) for p in f.params}, {})


# ---------------------------------------------------------------- registers under a fragment layout


def test_registers_of_the_copy_hold_the_tile_in_its_fragment_layout():
    """The copy program's registers, written with hand index arithmetic (register j*4 + k holds
    element (tx + 32 j) * 4 + k), read back through the RegBuffer's fragment give the tile."""
    n = 256
    f = verify_thread(copy_program(n))
    a = np.random.default_rng(6).standard_normal(2 * n).astype(np.float32)
    it = ThreadInterpreter(f)
    it.run({f.params[0]: a, f.params[1]: np.zeros_like(a)}, {})
    reg = next(s for s in walk_stmts(f.body) if isinstance(s, RegBuffer))
    np.testing.assert_array_equal(tile_of_registers(it.bufs[reg.buffer], reg.fragment), a[n:])  # the last block's


def test_fragment_indices_of_the_mma_accumulator():
    """m16n8 accumulator, one warp: lane l holds rows l // 4 (+8) and columns 2 (l % 4) (+1)
    (the PTX ISA's figure for mma.m16n8 C fragments)."""
    frag = mma_accumulator(16, 8, 1, 1, 32)
    idx = fragment_indices(frag)
    lane = np.arange(32)
    rows = np.stack([lane // 4, lane // 4, lane // 4 + 8, lane // 4 + 8], 1)
    cols = np.stack([2 * (lane % 4), 2 * (lane % 4) + 1] * 2, 1)
    np.testing.assert_array_equal(idx[..., 0], rows)
    np.testing.assert_array_equal(idx[..., 1], cols)
    tile = np.arange(128, dtype=np.float32).reshape(16, 8)
    np.testing.assert_array_equal(tile_of_registers(tile[rows, cols], frag), tile)


def test_tile_of_registers_checks_replicas_and_coverage():
    frag = replicated((4,), 8)
    regs = np.tile(np.arange(4, dtype=np.float32), (8, 1))
    np.testing.assert_array_equal(tile_of_registers(regs, frag), np.arange(4))
    regs[3, 1] = 7
    with pytest.raises(tilehal.LaunchError, match="replicas"):
        tile_of_registers(regs, frag)
    half = default_fragment((64,), 32, 1)  # 2 registers per thread; pretend the tile were larger
    bigger = type(half)((96,), half.dims, half.reg_order, half.threads)
    with pytest.raises(tilehal.LaunchError, match="32 tile elements held by no thread"):
        tile_of_registers(np.zeros((32, 2), np.float32), bigger)
