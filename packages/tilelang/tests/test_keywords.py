"""Every keyword the front end accepts is kept in the IR (printed with the op, loop, kernel or
allocation it belongs to), and a target that does not act on one says so at DEBUG level."""

import logging

import pytest
import tilelang
import tilelang.language as T
from tilelang.ir.visit import walk_stmts
from tilelang.layout import make_swizzled_layout

# keyword -> how it prints in the IR text
KEPT = {
    "coalesced_width": "coalesced_width=4",
    "disable_tma": "disable_tma=True",
    "eviction_policy": "eviction_policy='evict_first'",
    "k_pack": "k_pack=2",
    "wg_wait": "wg_wait=-1",
    "use_wgmma": "use_wgmma=False",
    "num_stages": "num_stages=2",
    "order": "order=[0, 1, 2]",
    "stage": "stage=[0, 0, 1]",
    "group": "group=[[0], [1], [2]]",
    "memory_order": "memory_order='relaxed'",
    "swizzle": "swizzle = (4, 'row', True)",
    "scope": "scope='shared.dyn'",
    "layout": None,  # T.annotate_layout: the buffer's layout (not in the text)
}


@T.prim_func
def _program(A: T.Tensor((32, 32), "float16"), B: T.Tensor((32, 32), "float16"), C: T.Tensor((32, 32), "float32")):
    with T.Kernel(1, threads=128) as bx:
        A_s = T.alloc_shared((32, 32), "float16", scope="shared.dyn")
        B_s = T.alloc_shared((32, 32), "float16")
        acc = T.alloc_fragment((32, 32), "float32")
        T.use_swizzle(4)
        T.annotate_layout({B_s: make_swizzled_layout(B_s)})
        T.clear(acc)
        for k in T.Pipelined(1, num_stages=2, order=[0, 1, 2], stage=[0, 0, 1], group=[[0], [1], [2]]):
            T.copy(A[0, 0], A_s, coalesced_width=4, disable_tma=True, eviction_policy="evict_first")
            T.copy(B[0, 0], B_s)
            T.gemm(A_s, B_s, acc, k_pack=2, wg_wait=-1, use_wgmma=False)
        for i, j in T.Parallel(32, 32, coalesced_width=4):
            acc[i, j] = acc[i, j] * 2
        T.copy(acc, C[0, 0])
        T.atomic_add(C[0, 0], 1.0, memory_order="relaxed")


def test_every_keyword_is_kept_in_the_ir():
    text = _program.script()
    for kw, printed in KEPT.items():
        assert printed is None or printed in text, f"{kw} is not kept: {text}"
    opts = {}
    for s in walk_stmts(_program.body):
        opts |= s.user_options()
    assert set(opts) >= set(KEPT), set(KEPT) - set(opts)


@pytest.mark.parametrize("target", ["interp", "cpu", "cuda"])
def test_a_target_that_ignores_a_keyword_says_so(caplog, target):
    from tilelang.passes.pipeline import USED_OPTIONS, report_ignored_options

    acts_on = USED_OPTIONS[target]  # what the target's passes read (the oracle and the C backend: none)
    assert acts_on <= set(KEPT) and (target == "cuda" or not acts_on)
    with caplog.at_level(logging.DEBUG, logger="tilelang.passes"):
        report_ignored_options(_program, target)
    lines = [r.getMessage() for r in caplog.records if "have no effect on target " + target in r.getMessage()]
    said = " ".join(lines)
    for kw in KEPT:
        if kw in acts_on:
            assert f"'{kw}'" not in said, f"{target} acts on {kw} but reports it ignored"
        else:
            assert f"'{kw}'" in said, f"{target} ignores {kw} silently"


def test_the_program_still_runs(target):
    import numpy as np

    a = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float16)
    b = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float16)
    c = np.zeros((32, 32), np.float32)
    tilelang.compile(_program, target=target)(a, b, c)
    want = 2 * (a.astype(np.float32) @ b.astype(np.float32))
    want[0, 0] += 1
    np.testing.assert_allclose(c, want, rtol=2e-3, atol=2e-3)
