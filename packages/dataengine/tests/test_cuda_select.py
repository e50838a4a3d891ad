"""GPU block selection (cuda_select.py): compile-only checks in CI, exact agreement with the
torch reference (select.py's *_reference, run on the CPU) on a GPU.

Exactness: on inputs whose products and sums are exact in float32 (small integers in bf16), the
kernel's and the reference's bounds are bit-identical whatever the summation order, so the
chosen blocks must be identical too, ties included (forced first, higher score, lower position).
Integer inputs are also the adversarial case: they tie constantly. On Gaussian inputs the bounds
agree to float32 rounding and the chosen sets may differ only where the reference's scores tie
to that rounding.
"""

import pytest
import tilehal
import torch
from dataengine import cuda_select, select


def _have_compiler() -> bool:
    v = tilehal.compiler_versions()
    return v["nvrtc"] is not None or v["nvcc"] is not None


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("q_dtype,s_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (128, 8), (256, 2)])
@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_score_kernels_compile(q_dtype, s_dtype, head_dim, group, reduce):
    m = cuda_select.compile_score(q_dtype, s_dtype, head_dim, group, reduce)
    assert len(m.cubin) > 1000
    assert cuda_select.score_kernel_name(q_dtype, s_dtype, head_dim, group, reduce) in m.lowered_names


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
def test_topk_kernels_compile():
    m = cuda_select.compile_topk()
    assert set(cuda_select.TOPK_KERNELS.values()) <= set(m.lowered_names) and len(m.cubin) > 1000


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
def test_pdl_builds_compile():
    """TILESTACK_PDL=1's builds (-DDATAENGINE_PDL: griddepcontrol at the entry of the heads / records score
    kernels and the top-k kernels) compile with the same kernels and differ from the default builds."""
    u8 = torch.uint8
    pairs = [(cuda_select.compile_topk(), cuda_select.compile_topk(pdl=True)),
             (cuda_select.compile_records(u8, 128, 4, "max", 8, pairs=True),
              cuda_select.compile_records(u8, 128, 4, "max", 8, pairs=True, pdl=True)),
             (cuda_select.compile_heads(FP8, 128, 4, "max", 8, pairs=cuda_select._pairs(FP8, 4)),
              cuda_select.compile_heads(FP8, 128, 4, "max", 8, pairs=cuda_select._pairs(FP8, 4), pdl=True))]
    for plain, pdl in pairs:
        assert set(pdl.lowered_names) == set(plain.lowered_names) and len(pdl.cubin) > 1000
        assert pdl.cubin != plain.cubin and pdl.name == plain.name + "_pdl"


def test_topk_variant_env(monkeypatch):
    monkeypatch.setenv("DATAENGINE_TOPK_KERNEL", "staged")
    assert cuda_select.topk_variant() == "staged"
    monkeypatch.setenv("DATAENGINE_TOPK_KERNEL", "fastest")
    with pytest.raises(ValueError, match="DATAENGINE_TOPK_KERNEL"):
        cuda_select.topk_variant()
    monkeypatch.delenv("DATAENGINE_TOPK_KERNEL")
    assert cuda_select.topk_variant() == cuda_select.DEFAULT_TOPK


def test_reference_tie_rule():
    # equal scores: lower position first; forced blocks outrank +inf; -0 ties with +0
    s = torch.tensor([[1.0, 3.0, 3.0, 1.0, 3.0, float("inf"), -0.0, 0.0]])
    assert select.topk_blocks_reference(s, 3).tolist() == [[1, 2, 5]]
    assert select.topk_blocks_reference(s, 2, sink_blocks=1).tolist() == [[0, 5]]
    s0 = torch.tensor([[0.0, -0.0, -0.0, 0.0]])
    assert select.topk_blocks_reference(s0, 2).tolist() == [[0, 1]]
    # more forced blocks than fit: the first ones by position, whatever their scores
    s1 = torch.tensor([[1.0, 5.0, 3.0, 9.0]])
    assert select.topk_blocks_reference(s1, 1, sink_blocks=2).tolist() == [[0]]
    assert select.topk_blocks_reference(s1, 2, sink_blocks=1, local_blocks=2).tolist() == [[0, 2]]


def test_cpu_dispatch_is_the_reference():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(-3, 3, (3, 2, 40), generator=g).float()
    assert torch.equal(select.topk_blocks(s, 5, sink_blocks=1, local_blocks=2),
                       select.topk_blocks_reference(s, 5, sink_blocks=1, local_blocks=2))


def _top(keys, width, neg_inf=0x007FFFFF):
    """Positions of the `width` largest keys (key desc, position asc), keys > -inf's only, ascending
    (topk_select_kernel's answer for one row of keys: 0 invalid, 0xFFFFFFFF forced)."""
    order = sorted(range(len(keys)), key=lambda i: (-keys[i][0], keys[i][1]))[:width]
    return sorted(keys[i][1] for i in order if keys[i][0] > neg_inf)


def test_chunked_selection_algorithm_is_exact():
    """quest_select_chunk_kernel's two levels (each chunk's top-min(width, chunk) as candidates in
    position order, then the top-width of all candidates), emulated on the host, equal the one-level
    top-k on random and tie-heavy rows with -inf, forced and invalid keys, for any chunk size."""
    neg_inf = 0x007FFFFF
    g = torch.Generator().manual_seed(0)
    for trial in range(80):
        n = int(torch.randint(1, 900, (1,), generator=g))
        chunk = (128, 256, 384, 2048)[trial % 4]
        width = int(torch.randint(1, 300, (1,), generator=g))
        hi = (3, 50, 1 << 32)[trial % 3]
        raw = [int(x) % (1 << 32) for x in torch.randint(0, hi, (n,), generator=g).tolist()]
        keys = [(neg_inf if x == 1 else 0xFFFFFFFF if x == 2 else x, p) for p, x in enumerate(raw)]
        want = _top(keys, width)
        cand = []
        for c in range(0, n, chunk):
            won = set(_top(keys[c:c + chunk], min(width, chunk), neg_inf))
            cand += [(k, p) for k, p in keys[c:c + chunk] if p in won]
        assert [p for k, p in cand] == sorted(p for k, p in cand)  # the merge's input: position order
        assert _top(cand, width) == want, (trial, n, chunk, width)


def _cta_topk_model(keys, width, early, bins_bits=12):
    """cta_topk's algorithm on the host (keys in position order: 0 invalid, 0xFFFFFFFF forced): counts,
    the bits every free key shares skipped, 12-bit digit passes (early: stop once the chosen bin holds
    exactly the keys still needed, T = the prefix so far), then the walk. Returns (positions, passes)."""
    forced, free = [k == 0xFFFFFFFF for k in keys], [k != 0 and k != 0xFFFFFFFF for k in keys]
    n_forced, n_free = sum(forced), sum(free)
    need_free = max(width - n_forced, 0)
    T, need, passes = 0, 0, 0
    if 0 < need_free < n_free:
        a, o = 0xFFFFFFFF, 0
        for k, f in zip(keys, free):
            if f:
                a, o = a & k, o | k
        diff = a ^ o
        prefix, mask, need = a & o, ~diff & 0xFFFFFFFF, need_free
        top = diff.bit_length() - 1
        while top >= 0:
            w = min(bins_bits, top + 1)
            shift, dmask = top + 1 - w, (1 << w) - 1
            hist = [0] * (1 << w)
            for k, f in zip(keys, free):
                if f and (k & mask) == prefix:
                    hist[(k >> shift) & dmask] += 1
            passes += 1
            cum = 0
            for d in range((1 << w) - 1, -1, -1):  # descending digits
                if cum + hist[d] >= need:
                    digit, need, count = d, need - cum, hist[d]
                    break
                cum += hist[d]
            prefix, mask, top = prefix | (digit << shift), mask | (dmask << shift), shift - 1
            if early and count == need:
                break
        T = prefix
    all_free = need_free >= n_free
    taken, f_rank, e_rank = [], 0, 0
    for p, k in enumerate(keys):
        if k == 0xFFFFFFFF:
            tk = f_rank < width
            f_rank += 1
        elif k != 0 and need_free > 0:
            tk = all_free or k > T
            if not tk and k == T:
                tk = e_rank < need
                e_rank += 1
            tk = tk and k > 0x007FFFFF
        else:
            tk = False
        if tk:
            taken.append(p)
    return taken, passes


def test_topk_early_exit_algorithm_is_exact():
    """cta_topk's EARLY exit (the fastx / fast512 / fast256 variants), emulated on the host: the same
    positions as the full radix select and as the one-level reference on spread-out, tie-heavy and
    shared-prefix rows with -inf, forced and invalid keys; on spread-out float keys it takes fewer passes."""
    g = torch.Generator().manual_seed(1)
    saved = 0
    for trial in range(120):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        width = int(torch.randint(1, 200, (1,), generator=g))
        kind = trial % 4
        if kind == 0:  # order keys of positive float scores (the benchmark's Quest bounds)
            raw = [(u | 0x80000000) for u in (torch.rand(n, generator=g) * 40 + 1).view(torch.int32).tolist()]
        elif kind == 1:  # ties everywhere
            raw = [0x80000000 + x for x in torch.randint(0, 5, (n,), generator=g).tolist()]
        elif kind == 2:  # arbitrary 32-bit keys
            raw = [int(x) % (1 << 32) for x in torch.randint(0, 1 << 32, (n,), generator=g).tolist()]
        else:  # a shared prefix, differing low bits
            raw = [0xC0000000 | x for x in torch.randint(0, 1 << 13, (n,), generator=g).tolist()]
        mark = torch.rand(n, generator=g).tolist()
        keys = [0 if m < 0.05 else 0x007FFFFF if m < 0.15 else 0xFFFFFFFF if m < 0.17 else k for k, m in zip(raw, mark)]
        want = _top(list(zip(keys, range(n))), width)
        full, p_full = _cta_topk_model(keys, width, early=False)
        got, p_early = _cta_topk_model(keys, width, early=True)
        assert full == want and got == want, (trial, n, width, kind)
        assert p_early <= p_full
        saved += p_full - p_early
    assert saved > 0


# ----------------------------------------------------------------------------- GPU
def _problem(seed, B=6, Hq=32, Hkv=8, D=128, max_blocks=300, num_blocks=2000, dtype=torch.bfloat16,
             sdtype=None, integer=True, holes=False, unwritten=0.0):
    """q, kmin, kmax, block_table, seq_lens on the GPU (block size 16); integer values tie often."""
    sdtype = sdtype or dtype
    g = torch.Generator().manual_seed(seed)
    if integer:
        q = torch.randint(-3, 4, (B, Hq, D), generator=g).float()
        kmin = torch.randint(-4, 4, (num_blocks, Hkv, D), generator=g).float()
        kmax = kmin + torch.randint(0, 3, (num_blocks, Hkv, D), generator=g).float()
    else:
        q = torch.randn(B, Hq, D, generator=g)
        kmin = torch.randn(num_blocks, Hkv, D, generator=g) - 1
        kmax = kmin + 2 * torch.rand(num_blocks, Hkv, D, generator=g)
    if unwritten:
        dead = torch.rand(num_blocks, generator=g) < unwritten
        kmin[dead], kmax[dead] = float("inf"), float("-inf")
    lens = torch.randint(0, max_blocks * 16 + 1, (B,), generator=g)
    lens[0], lens[-1] = 0, max_blocks * 16  # an empty and a full sequence
    lens[1] = 5  # shorter than any budget
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)
    used = 0
    for b in range(B):
        n = -(-int(lens[b]) // 16)
        take = min(n, num_blocks - used)
        table[b, :take] = perm[used:used + take].to(torch.int32)
        used = (used + take) % (num_blocks - max_blocks)
    if holes:
        hole = torch.rand(B, max_blocks, generator=g) < 0.05
        table[hole & (table >= 0)] = -1
    dev = "cuda"
    return (q.to(dev, dtype), kmin.to(dev, sdtype), kmax.to(dev, sdtype), table.to(dev),
            lens.to(dev, torch.int32))


def _problem_cpu(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (2, 8, 128), generator=g).to(torch.bfloat16)
    kmin = torch.randint(-4, 4, (40, 2, 128), generator=g).float()
    kmax = kmin + torch.randint(0, 3, (40, 2, 128), generator=g).float()
    table = torch.randperm(40, generator=g)[:20].to(torch.int32).reshape(2, 10)
    return q, kmin, kmax, table, torch.tensor([160, 77], dtype=torch.int32)


def _cpu(*ts):
    return [t.cpu() for t in ts]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,sdtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                          (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("D,Hq,Hkv", [(128, 32, 8), (64, 8, 8), (256, 4, 2), (128, 16, 2)])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("use_bs", [True, False])
def test_select_exact_on_integer_inputs(dtype, sdtype, D, Hq, Hkv, reduce, use_bs):
    for seed, (top_k, sink, local) in enumerate([(64, 1, 1), (7, 0, 0), (3, 2, 3), (500, 1, 1), (1, 4, 4)]):
        args = _problem(seed, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, sdtype=sdtype, holes=not use_bs, unwritten=0.05)
        bs = 16 if use_bs else None
        got = select.select_blocks(*args, top_k, sink, local, block_size=bs, reduce=reduce)
        want = select.select_blocks_reference(*_cpu(*args), top_k, sink, local, block_size=bs, reduce=reduce)
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got.cpu(), want), (seed, top_k, sink, local)
        sc = select.quest_scores(*args, block_size=bs, reduce=reduce)
        assert torch.equal(sc.cpu(), select.quest_scores_reference(*_cpu(*args), block_size=bs, reduce=reduce))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", cuda_select.TOPK_VARIANTS)
def test_select_all_ties_and_all_unwritten(variant, monkeypatch):
    monkeypatch.setenv("DATAENGINE_TOPK_KERNEL", variant)
    q, kmin, kmax, table, lens = _problem(1)
    kmin.fill_(1.0)
    kmax.fill_(1.0)  # every block scores the same: positions decide
    for top_k in (1, 5, 64):
        got = select.select_blocks(q, kmin, kmax, table, lens, top_k, 1, 1)
        want = select.select_blocks_reference(*_cpu(q, kmin, kmax, table, lens), top_k, 1, 1)
        assert torch.equal(got.cpu(), want)
    kmin.fill_(float("inf"))
    kmax.fill_(float("-inf"))  # nothing written: only the forced blocks come back
    got = select.select_blocks(q, kmin, kmax, table, lens, 16, 1, 2)
    want = select.select_blocks_reference(*_cpu(q, kmin, kmax, table, lens), 16, 1, 2)
    assert torch.equal(got.cpu(), want)
    assert int((got >= 0).sum(-1).max()) <= 3


@pytest.mark.gpu
def test_select_gaussian_differs_only_at_rounding_ties():
    for seed in range(4):
        args = _problem(seed, integer=False, max_blocks=2048, num_blocks=8192)
        got = select.select_blocks(*args, 64, 1, 1).cpu()
        want = select.select_blocks_reference(*_cpu(*args), 64, 1, 1)
        ref_scores = select.quest_scores_reference(*_cpu(*args))
        gpu_scores = select.quest_scores(*args).cpu()
        finite = torch.isfinite(ref_scores)
        assert torch.equal(finite, torch.isfinite(gpu_scores))
        torch.testing.assert_close(gpu_scores[finite], ref_scores[finite], rtol=1e-5, atol=1e-3)
        _, _, _, table, lens = _cpu(*args)
        for b in range(got.shape[0]):
            nv = int((table[b] >= 0).sum()) if int(lens[b]) > 0 else 0
            for h in range(got.shape[1]):
                a = set(got[b, h].tolist()) - {-1}
                r = set(want[b, h].tolist()) - {-1}
                if a != r:
                    s = ref_scores[b, h]
                    free = [p for p in r if p not in (0, nv - 1)]
                    edge = float(s[free].min())
                    assert all(abs(float(s[p]) - edge) < 1e-3 * (1 + abs(edge)) for p in a ^ r), (b, h)
        # the kernel ranks the GPU's own scores exactly like the reference ranks them
        assert torch.equal(select.topk_blocks(gpu_scores.cuda(), 64).cpu(), select.topk_blocks_reference(gpu_scores, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 3000), (4, 2, 777), (2, 3, 2, 129), (1, 1), (3, 8192), (2, 20000), (2, 40000)])
@pytest.mark.parametrize("k", [1, 16, 64, 200])
@pytest.mark.parametrize("variant", cuda_select.TOPK_VARIANTS)
def test_topk_blocks_exact(shape, k, variant, monkeypatch):
    monkeypatch.setenv("DATAENGINE_TOPK_KERNEL", variant)
    g = torch.Generator().manual_seed(k + shape[-1])
    s = torch.randint(-5, 5, shape, generator=g).float()
    s[torch.rand(shape, generator=g) < 0.1] = float("-inf")
    s[torch.rand(shape, generator=g) < 0.01] = float("inf")
    s[torch.rand(shape, generator=g) < 0.1] = -0.0
    nv = torch.randint(0, shape[-1] + 3, (shape[0],), generator=g)  # counts >= 0 (the contract); 0 and past the end
    if shape[0] > 1:
        nv[1] = 0  # a row with no valid block
    for kw in ({}, {"num_valid": nv}, {"num_valid": nv, "sink_blocks": 2, "local_blocks": 3},
               {"sink_blocks": 1, "local_blocks": 1}):
        got = select.topk_blocks(s.cuda(), k, **{n: (v.cuda() if isinstance(v, torch.Tensor) else v)
                                                for n, v in kw.items()})
        want = select.topk_blocks_reference(s, k, **kw)
        assert torch.equal(got.cpu(), want), kw
    # negative counts break the contract; on the host they are an ArgumentError, on CUDA (no sync to
    # check them) they select nothing, like 0, and never read outside the row
    neg = -1 - nv
    got = select.topk_blocks(s.cuda(), k, num_valid=neg.cuda(), sink_blocks=2, local_blocks=3)
    assert torch.equal(got.cpu(), select.topk_blocks_reference(s, k, num_valid=torch.zeros_like(nv),
                                                               sink_blocks=2, local_blocks=3))
    with pytest.raises(tilehal.ArgumentError, match="num_valid: expected counts >= 0"):
        select.topk_blocks(s.cuda(), k, num_valid=neg.cuda(), validate=True)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(select.topk_blocks(s.to(dt).cuda(), k).cpu(), select.topk_blocks_reference(s.to(dt), k))
    one = s.reshape(-1)[:100]
    assert torch.equal(select.topk_blocks(one.cuda(), k).cpu(), select.topk_blocks_reference(one, k))


@pytest.mark.gpu
def test_select_captures_in_a_cuda_graph():
    q, kmin, kmax, table, lens = _problem(3, integer=True)
    static_q = q.clone()
    select.select_blocks(static_q, kmin, kmax, table, lens, 32, 1, 1)  # compile + load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select.select_blocks(static_q, kmin, kmax, table, lens, 32, 1, 1)
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        static_q.copy_(torch.randint(-3, 4, q.shape, generator=g).to(q.dtype))
        graph.replay()
        want = select.select_blocks_reference(*_cpu(static_q, kmin, kmax, table, lens), 32, 1, 1)
        assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
def test_out_of_range_ids_score_minus_inf_without_validation():
    q, kmin, kmax, table, lens = _problem(4)
    bad = table.clone()
    bad[2, 0] = kmin.shape[0] + 5
    sc = select.quest_scores(q, kmin, kmax, bad, lens)
    assert bool(torch.isneginf(sc[2, :, 0]).all())
    with pytest.raises(ValueError, match="block_table: expected physical ids < num_blocks"):
        select.select_blocks(q, kmin, kmax, bad, lens, 4, validate=True)


# ----------------------------------------------------------------------------- fp8 summaries, tensor cores
FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("s_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (128, 8), (64, 2)])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_mma_and_fp8_score_kernels_compile(s_dtype, head_dim, group, reduce):
    m = cuda_select.compile_score(torch.bfloat16, s_dtype, head_dim, group, reduce, variant="mma")
    assert cuda_select.score_kernel_name(torch.bfloat16, s_dtype, head_dim, group, reduce, "mma") in m.lowered_names
    if s_dtype == FP8:
        m = cuda_select.compile_score(torch.float32, FP8, head_dim, group, reduce)
        assert cuda_select.score_kernel_name(torch.float32, FP8, head_dim, group, reduce) in m.lowered_names


def test_score_variant_env_and_reasons(monkeypatch):
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", "tensor")
    with pytest.raises(ValueError, match="DATAENGINE_SCORE_KERNEL"):
        cuda_select.score_variant()
    monkeypatch.delenv("DATAENGINE_SCORE_KERNEL")
    assert cuda_select.score_variant() == cuda_select.DEFAULT_SCORE
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    assert cuda_select.mma_reason(q, torch.zeros(4, 8, 128, dtype=FP8)) is None
    assert "bf16" in cuda_select.mma_reason(q.float(), torch.zeros(4, 8, 128, dtype=FP8))
    assert "head_dim" in cuda_select.mma_reason(q[..., :64].repeat(1, 1, 4), torch.zeros(4, 8, 256, dtype=FP8))
    assert "q heads" in cuda_select.mma_reason(q, torch.zeros(4, 2, 128, dtype=torch.bfloat16))


def _to_fp8_summaries(kmin: torch.Tensor, kmax: torch.Tensor):
    """Exact e4m3 codes of integer-valued summaries (|x| <= 448), unwritten rows as the open ends."""
    out = []  # on the inputs' device (integers <= 448 convert exactly on the CPU and the GPU alike)
    for t, dead, code in ((kmin, torch.isposinf(kmin), 0x7F), (kmax, torch.isneginf(kmax), 0xFF)):
        c = t.float().masked_fill(dead, 0.0).to(FP8).view(torch.uint8)
        c[dead] = code
        out.append(c.view(FP8))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["simt", "mma", "mma-ring"])
@pytest.mark.parametrize("sdtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("D,Hq,Hkv", [(128, 32, 8), (64, 8, 8), (128, 16, 2), (64, 12, 2)])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
def test_select_exact_fp8_and_mma(variant, sdtype, D, Hq, Hkv, reduce, monkeypatch):
    if variant == "mma-ring" and sdtype != FP8:
        pytest.skip("the ring path is for fp8 summaries (and int4 rows)")
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", variant[:4].rstrip("-"))
    monkeypatch.setenv("DATAENGINE_RING_SCORES", "on" if variant == "mma-ring" else "off")
    for seed, (top_k, sink, local) in enumerate([(64, 1, 1), (7, 0, 0), (3, 2, 3), (500, 1, 1)]):
        q, kmin, kmax, table, lens = _problem(seed, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16,
                                              sdtype=torch.float32, holes=seed % 2 == 1, unwritten=0.05)
        if sdtype == FP8:
            kmin, kmax = _to_fp8_summaries(kmin, kmax)
            big = torch.rand(kmax.shape[0], device="cuda") < 0.02  # some blocks with a key above 448
            kmax.view(torch.uint8)[big, :, 0] = 0x7F
        else:
            kmin, kmax = kmin.to(sdtype), kmax.to(sdtype)
        args = (q, kmin, kmax, table, lens)
        got = select.select_blocks(*args, top_k, sink, local, reduce=reduce)
        want = select.select_blocks_reference(*_cpu(*args), top_k, sink, local, reduce=reduce)
        assert torch.equal(got.cpu(), want), (seed, top_k, sink, local)
        sc = select.quest_scores(*args, reduce=reduce)
        assert torch.equal(sc.cpu(), select.quest_scores_reference(*_cpu(*args), reduce=reduce))


@pytest.mark.gpu
@pytest.mark.parametrize("sdtype", [torch.bfloat16, FP8])
def test_mma_gaussian_scores_within_rounding(sdtype, monkeypatch):
    args = list(_problem(0, integer=False, max_blocks=2048, num_blocks=8192, dtype=torch.bfloat16,
                         sdtype=torch.float32))
    if sdtype == FP8:
        # outward rounding is the writer's job; here: nearest, then the bounds are what they are
        args[1] = args[1].to(FP8)
        args[2] = args[2].to(FP8)
    else:
        args[1], args[2] = args[1].to(sdtype), args[2].to(sdtype)
    ref = select.quest_scores_reference(*_cpu(*args))
    for variant, ring in (("simt", "off"), ("mma", "off"), ("mma", "on")):
        monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", variant)
        monkeypatch.setenv("DATAENGINE_RING_SCORES", ring)
        got = select.quest_scores(*args).cpu()
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(got)), (variant, ring)
        torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-3)


# ----------------------------------------------------------------------------- one-launch selection
CHUNK_CONFIGS = [(FP8, 128, 4, True, True), (FP8, 64, 8, True, True), (FP8, 128, 1, False, True),
                 (FP8, 64, 2, False, True), (FP8, 128, 4, True, False), (torch.bfloat16, 128, 4, True, False),
                 (torch.bfloat16, 64, 8, True, False), (torch.uint8, 128, 4, True, False),
                 (torch.uint8, 128, 4, True, True), (torch.uint8, 128, 8, False, True)]


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("s_dtype,head_dim,group,fused,ring", CHUNK_CONFIGS)
def test_chunk_select_kernels_compile(s_dtype, head_dim, group, fused, ring):
    m = cuda_select.compile_chunk(s_dtype, head_dim, group, "max", fused, ring)
    assert cuda_select.chunk_kernel_name(s_dtype, head_dim, group, "max", fused, ring) in m.lowered_names
    # two CTAs per H200 SM (228 KB of shared memory, 1 KB reserved per CTA): the rings, the block
    # table entries, the scores (fused) and the top-k scratch
    static = 4 * cuda_select.CHUNK_MAX * (2 if fused else 1) + 1024
    assert 2 * (cuda_select.chunk_smem_bytes(s_dtype, head_dim, fused, ring) + static + 1024) <= 228 * 1024


def test_fused_and_ring_reasons(monkeypatch):
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", "auto")
    monkeypatch.setattr(cuda_select, "fused_chunk", lambda device, rows, nb: min(nb, cuda_select.CHUNK_MAX))
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    s = torch.zeros(4, 8, 128, dtype=FP8)
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "0")
    assert "FUSED=0" in cuda_select.fused_reason(q, s, 64, 8192)
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "auto")
    assert cuda_select.fused_reason(q, s, 64, cuda_select.FUSED_AUTO_MAX) is None
    assert "two launches" in cuda_select.fused_reason(q, s, 64, cuda_select.FUSED_AUTO_MAX + 1)
    b16 = s.to(torch.bfloat16)  # no ring scores: one launch up to CHUNK_MAX (two launches not measured there)
    assert cuda_select.fused_reason(q, b16, 64, cuda_select.CHUNK_MAX) is None
    assert "two launches" in cuda_select.fused_reason(q, b16, 64, cuda_select.CHUNK_MAX + 1)
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "1")
    assert cuda_select.fused_reason(q, s, 64, 8192) is None
    assert cuda_select.fused_reason(q, s, 512, 8192) is None  # 4 chunks x 512 candidates
    assert "merge candidates" in cuda_select.fused_reason(q, s, 600, 8192)
    assert "bf16" in cuda_select.fused_reason(q.half(), s, 64, 8192)
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", "simt")
    assert "simt" in cuda_select.fused_reason(q, s, 64, 8192)
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "yes")
    with pytest.raises(ValueError, match="DATAENGINE_SELECT_FUSED"):
        cuda_select.fused_reason(q, s, 64, 8192)
    monkeypatch.setenv("DATAENGINE_RING_SCORES", "yes")
    with pytest.raises(ValueError, match="DATAENGINE_RING_SCORES"):
        cuda_select.ring_variant()
    monkeypatch.delenv("DATAENGINE_RING_SCORES")
    assert cuda_select.ring_variant() == cuda_select.DEFAULT_RING
    monkeypatch.setenv("DATAENGINE_RING_SCORES", "on")
    assert cuda_select._ring(FP8, 64) and cuda_select._ring(torch.uint8, 128)
    assert not cuda_select._ring(torch.uint8, 64) and not cuda_select._ring(torch.bfloat16, 128)
    monkeypatch.setenv("DATAENGINE_RING_SCORES", "off")
    assert not cuda_select._ring(FP8, 128)


def _summaries(sdtype, kmin, kmax, open_ends=False):
    """Integer-valued float32 summaries as `sdtype` (FP8: exact codes, unwritten rows and, with
    open_ends, some keys above 448 as the NaN codes; uint8: dyadic int4 rows)."""
    if sdtype == FP8:
        lo, hi = _to_fp8_summaries(kmin, kmax)
        if open_ends:
            big = torch.rand(hi.shape[0], device=hi.device) < 0.02  # some blocks with a key above 448
            hi.view(torch.uint8)[big, :, 0] = 0x7F
        return lo, hi
    if sdtype == torch.uint8:
        return _int4_rows(kmin, False).cuda(), _int4_rows(kmax, True).cuda()
    return kmin.to(sdtype), kmax.to(sdtype)


SELECT_CASES = [(64, 1, 1), (7, 0, 0), (3, 2, 3), (256, 1, 1), (1, 4, 4), (100, 0, 5), (512, 1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("sdtype,ring", [(torch.bfloat16, "off"), (FP8, "on"), (FP8, "off"), (torch.uint8, "on"),
                                        (torch.uint8, "off")], ids=["bf16", "fp8-ring", "fp8", "int4-ring", "int4"])
@pytest.mark.parametrize("D,Hq,Hkv,max_blocks", [(128, 32, 8, 300), (64, 8, 8, 1000), (128, 16, 2, 97), (64, 12, 2, 512),
                                                 (128, 32, 8, 2100)])
@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_fused_select_equals_reference(sdtype, ring, D, Hq, Hkv, max_blocks, reduce, monkeypatch):
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "1")
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", "auto")
    monkeypatch.setenv("DATAENGINE_RING_SCORES", ring)
    for seed, (top_k, sink, local) in enumerate(SELECT_CASES):
        q, kmin, kmax, table, lens = _problem(seed, Hq=Hq, Hkv=Hkv, D=D, max_blocks=max_blocks,
                                              num_blocks=max(2000, 3 * max_blocks), dtype=torch.bfloat16,
                                              sdtype=torch.float32, unwritten=0.05, holes=seed == 4)
        kmin, kmax = _summaries(sdtype, kmin, kmax, open_ends=seed % 2 == 1)
        if seed == 2:
            kmin.view(torch.uint8)[:] = kmin.view(torch.uint8)[:1]  # every block alike: positions decide
            kmax.view(torch.uint8)[:] = kmax.view(torch.uint8)[:1]
        args = (q, kmin, kmax, table, lens)
        width = min(max(top_k, sink + local), max_blocks)
        fused = cuda_select.fused_reason(q, kmin, width, max_blocks) is None
        assert fused or top_k == 512, cuda_select.fused_reason(q, kmin, width, max_blocks)
        got = select.select_blocks(*args, top_k, sink, local, block_size=16, reduce=reduce)
        want = select.select_blocks_reference(*_cpu(*args), top_k, sink, local, block_size=16, reduce=reduce)
        assert torch.equal(got.cpu(), want), (seed, top_k, sink, local, fused)
        for _ in range(2):  # the row tickets are back at zero after every launch
            assert torch.equal(select.select_blocks(*args, top_k, sink, local, block_size=16, reduce=reduce).cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("D,Hq,Hkv", [(128, 32, 8), (64, 8, 8), (128, 16, 2), (64, 12, 2)])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("grid", ["chunk", "heads", "heads_occ3", "records", "chunk_h1", "heads_h1", "records_h1"])
def test_fp8_ring_scores_exact(D, Hq, Hkv, reduce, grid, monkeypatch):
    """The f16 path of fp8 summaries: exact bounds on integer inputs (q scaled up and down by
    powers of two too), with unwritten blocks, open ends (0x7F), holes, ids out of range; and a q
    head with an element too small for f16 (the bf16 path) within float32 rounding. heads_occ3: the
    heads grid at 3 CTAs per SM (two ring stages); _h1: DATAENGINE_RING_FP8=h1 (one launch and two)."""
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", "mma")
    monkeypatch.setenv("DATAENGINE_RING_SCORES", "on")
    monkeypatch.setenv("DATAENGINE_RING_GRID", grid.removesuffix("_occ3").removesuffix("_h1"))
    monkeypatch.setenv("DATAENGINE_RING_FP8", "h1" if grid.endswith("_h1") else "cvt")
    monkeypatch.setenv("DATAENGINE_RING_OCC", "3" if grid.endswith("occ3") else "2")
    for seed, qscale in enumerate([1.0, 2.0 ** 20, 2.0 ** -30, 1.0]):
        q, kmin, kmax, table, lens = _problem(seed, Hq=Hq, Hkv=Hkv, D=D, max_blocks=700, num_blocks=3000,
                                              dtype=torch.float32, sdtype=torch.float32, unwritten=0.05,
                                              holes=seed % 2 == 1)
        q = (q * qscale).to(torch.bfloat16)
        kmin, kmax = _summaries(FP8, kmin, kmax, open_ends=True)
        args = (q, kmin, kmax, table, lens)
        got = select.quest_scores(*args, reduce=reduce).cpu()
        want = select.quest_scores_reference(*_cpu(*args), reduce=reduce)
        assert torch.equal(got, want), (seed, qscale)
        if seed == 3:  # ids >= num_blocks score -inf (zero rows in the ring, never read)
            bad = table.clone()
            bad[2, :5] = kmin.shape[0] + 5
            assert bool(torch.isneginf(select.quest_scores(q, kmin, kmax, bad, lens, reduce=reduce)[2, :, :5]).all())
        assert torch.equal(select.select_blocks(*args, 64, 1, 1, reduce=reduce).cpu(),
                           select.select_blocks_reference(*_cpu(*args), 64, 1, 1, reduce=reduce))
    q2 = q.clone()
    q2[:, ::3, 5] = 2.0 ** -40  # some groups hold an element f16 cannot: those CTAs take the bf16 path
    args = (q2, kmin, kmax, table, lens)
    got = select.quest_scores(*args, reduce=reduce).cpu()
    want = select.quest_scores_reference(*_cpu(*args), reduce=reduce)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-6)


GRAPH_PATHS = {"fused": {"DATAENGINE_SELECT_FUSED": "1", "DATAENGINE_RING_SCORES": "off"},
               "fused-ring": {"DATAENGINE_SELECT_FUSED": "1", "DATAENGINE_RING_SCORES": "on"}}


@pytest.mark.gpu
@pytest.mark.parametrize("path,sdtype", [("fused", torch.bfloat16), ("fused-ring", FP8), ("fused-ring", torch.uint8)])
def test_one_launch_selection_in_a_cuda_graph(path, sdtype, monkeypatch):
    """The one-launch selections replay in a CUDA graph (row tickets re-armed), on new q each time."""
    monkeypatch.setenv("DATAENGINE_SCORE_KERNEL", "auto")
    for k, v in GRAPH_PATHS[path].items():
        monkeypatch.setenv(k, v)
    q, kmin, kmax, table, lens = _problem(5, max_blocks=600, num_blocks=4000, sdtype=torch.float32)
    kmin, kmax = _summaries(sdtype, kmin, kmax)
    static_q = q.clone()
    select.select_blocks(static_q, kmin, kmax, table, lens, 32, 1, 1, block_size=16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select.select_blocks(static_q, kmin, kmax, table, lens, 32, 1, 1, block_size=16)
    for seed in range(3):
        g = torch.Generator().manual_seed(200 + seed)
        static_q.copy_(torch.randint(-3, 4, q.shape, generator=g).to(q.dtype))
        graph.replay()
        want = select.select_blocks_reference(*_cpu(static_q, kmin, kmax, table, lens), 32, 1, 1, block_size=16)
        assert torch.equal(out.cpu(), want)


# ----------------------------------------------------------------------------- int4 rows
def _int4_rows(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Dyadic int4 rows of x [N, H, D] (lo = floor(min), step a multiple of 1/8, codes outward):
    every decoded value and every partial sum is exact in float32 on integer inputs. Computed on
    x's device (float64 floor / ceil / division are exact IEEE operations on both)."""
    D = x.shape[-1]
    x = x.double()
    g = x.reshape(*x.shape[:-1], D // 32, 32)
    dead = torch.isinf(g).all(-1)
    gg = torch.where(torch.isinf(g), 0.0, g)
    lo = torch.floor(gg.amin(-1))
    step = torch.ceil((gg.amax(-1) - lo) / 15 * 8) / 8
    c = (gg - lo[..., None]) / torch.where(step > 0, step, 1.0)[..., None]
    c = torch.where(dead[..., None], 0.0, (torch.ceil(c) if up else torch.floor(c)).clamp(0, 15))
    lo, step = torch.where(dead, g[..., 0], lo), torch.where(dead, 0.0, step)
    codes = c.to(torch.uint8).reshape(*x.shape[:-1], D // 2, 2)
    params = torch.stack((lo, step), -1).to(torch.bfloat16).reshape(*x.shape[:-1], D // 16).view(torch.uint8)
    return torch.cat((codes[..., 0] | (codes[..., 1] << 4), params), -1)


@pytest.mark.gpu
@pytest.mark.parametrize("D,Hq,Hkv", [(128, 32, 8), (64, 8, 8), (128, 16, 2), (64, 12, 2)])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("ring", ["on", "off", "on_pairs"])
def test_int4_select_equals_reference(D, Hq, Hkv, reduce, fused, ring, monkeypatch):
    if ring != "off" and D != 128:
        pytest.skip("int4 rings: head_dim 128")
    monkeypatch.setenv("DATAENGINE_RING_Q4", "pairs" if ring == "on_pairs" else "groups")
    ring = ring[:2]
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "1" if fused else "0")
    monkeypatch.setenv("DATAENGINE_RING_SCORES", ring)
    for seed, (top_k, sink, local) in enumerate([(64, 1, 1), (7, 0, 0), (3, 2, 3), (200, 1, 1)]):
        q, kmin, kmax, table, lens = _problem(seed, Hq=Hq, Hkv=Hkv, D=D, dtype=torch.bfloat16, sdtype=torch.float32,
                                              unwritten=0.05)
        lo, hi = _int4_rows(kmin, False).cuda(), _int4_rows(kmax, True).cuda()
        args = (q, lo, hi, table, lens)
        assert select.is_int4_summary(lo, D)
        got = select.select_blocks(*args, top_k, sink, local, block_size=16, reduce=reduce)
        want = select.select_blocks_reference(*_cpu(*args), top_k, sink, local, block_size=16, reduce=reduce)
        assert torch.equal(got.cpu(), want), (seed, top_k, sink, local)
        sc = select.quest_scores(*args, reduce=reduce)
        assert torch.equal(sc.cpu(), select.quest_scores_reference(*_cpu(*args), reduce=reduce))


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("s_dtype,head_dim,group,kv_heads", [(FP8, 128, 4, 8), (FP8, 64, 6, 2), (torch.uint8, 128, 4, 8),
                                                            (torch.uint8, 128, 8, 1)])
def test_heads_kernels_compile(s_dtype, head_dim, group, kv_heads):
    m = cuda_select.compile_heads(s_dtype, head_dim, group, "max", kv_heads)
    assert cuda_select.heads_kernel_name(s_dtype, head_dim, group, "max", kv_heads) in m.lowered_names


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
def test_paired_int4_and_x_topk_kernels_compile_without_spills():
    """The paired-groups int4 ring kernels (heads grid; chunk grid, scores and one launch) and the X
    fast top-k kernels (fastx, fast512, fast256), sm_90a: every kernel present and, when this run
    compiled it (a cache hit has no ptxas report), 0 bytes of spill stores."""
    u8 = torch.uint8
    exprs = [cuda_select.heads_kernel_name(u8, 128, 4, "max", 8, True), cuda_select.heads_kernel_name(u8, 128, 2, "mean", 1, True),
             cuda_select.heads_kernel_name(u8, 128, 4, "max", 8, True, 3), cuda_select.heads_kernel_name(FP8, 128, 4, "max", 8, False, 3),
             cuda_select.heads_kernel_name(FP8, 128, 4, "mean", 8, False, 3),
             cuda_select.records_kernel_name(u8, 128, 4, "max", 8, True), cuda_select.records_kernel_name(u8, 128, 4, "max", 8),
             cuda_select.records_kernel_name(u8, 128, 4, "max", 8, True, 3),
             cuda_select.records_kernel_name(u8, 128, 8, "mean", 1), cuda_select.records_kernel_name(FP8, 128, 4, "max", 8),
             cuda_select.records_kernel_name(FP8, 64, 6, "sum", 2),
             cuda_select.heads_kernel_name(FP8, 128, 4, "max", 8, True), cuda_select.records_kernel_name(FP8, 128, 4, "max", 8, True),
             cuda_select.chunk_kernel_name(FP8, 128, 4, "max", True, True, True),
             cuda_select.chunk_kernel_name(u8, 128, 4, "max", False, True, True),
             cuda_select.chunk_kernel_name(u8, 128, 4, "sum", True, True, True),
             *[cuda_select.TOPK_KERNELS[f"fast{i}_{t}"] for t, its in cuda_select.FEW_THREADS_ITEMS.items() for i in its],
             *[cuda_select.TOPK_KERNELS[f"fastx{i}"] for i in cuda_select.FAST_ITEMS]]
    m = tilehal.compile_cuda('#include "select.cuh"\n' + cuda_select._CHECKS + cuda_select._CHUNK_CHECKS, arch="sm_90a",
                             name="select_pairs_probe", include_dirs=[str(cuda_select.KERNEL_DIR)], name_expressions=exprs,
                             options=["--ptxas-options=-v"])
    assert all(e in m.lowered_names for e in exprs)
    if not m.cache_hit:
        # one line per kernel, and one per __noinline__ device function (the fp8 kernels' bf16 tile path)
        spills = [line for line in m.log.splitlines() if "spill stores" in line]
        assert m.log.count("Compiling entry") == len(exprs) and len(spills) >= len(exprs), m.log
        assert all("0 bytes spill stores" in line for line in spills), m.log


def test_ring_occ_env_and_shared_memory(monkeypatch):
    monkeypatch.delenv("DATAENGINE_RING_OCC", raising=False)
    assert cuda_select.ring_occ() == 2
    monkeypatch.setenv("DATAENGINE_RING_OCC", "3")
    assert cuda_select.ring_occ() == 3
    monkeypatch.setenv("DATAENGINE_RING_OCC", "4")
    with pytest.raises(ValueError, match="DATAENGINE_RING_OCC"):
        cuda_select.ring_occ()
    # the default keeps its rings; three CTAs of OCC = 3 (static block table 8 KB, 1 KB reserved each)
    # fit an H200 SM's 228 KB of shared memory, the records grid's (int4) too; two of OCC = 2
    static = 4 * cuda_select.CHUNK_MAX + 1024
    for s in (FP8, torch.uint8):
        assert cuda_select.heads_smem_bytes(s, 128, 8) == cuda_select.chunk_smem_bytes(s, 128, False, True)
        assert 3 * (cuda_select.heads_smem_bytes(s, 128, 8, 3) + static) <= 228 * 1024
        assert 2 * (cuda_select.records_smem_bytes(s, 128, 8) + static) <= 228 * 1024
    assert 3 * (cuda_select.records_smem_bytes(torch.uint8, 128, 8, 3) + static) <= 228 * 1024
    assert cuda_select.records_smem_bytes(torch.uint8, 128, 8) == 4 * 2 * 16 * (8 * 80 + 16)  # padded records
    assert cuda_select.heads_kernel_name(FP8, 128, 4, "max", 8, False, 3).endswith(", 8, false, 3>")


def test_ring_q4_env(monkeypatch):
    monkeypatch.delenv("DATAENGINE_RING_Q4", raising=False)
    monkeypatch.delenv("DATAENGINE_RING_FP8", raising=False)
    assert cuda_select.ring_q4() == cuda_select.DEFAULT_RING_Q4 == "pairs" and cuda_select._pairs(torch.uint8, 4)
    assert cuda_select.ring_fp8() == cuda_select.DEFAULT_RING_FP8 == "h1" and cuda_select._pairs(FP8, 4)
    monkeypatch.setenv("DATAENGINE_RING_Q4", "groups")
    monkeypatch.setenv("DATAENGINE_RING_FP8", "cvt")
    assert not cuda_select._pairs(torch.uint8, 4) and not cuda_select._pairs(FP8, 4)
    monkeypatch.setenv("DATAENGINE_RING_Q4", "pairs")
    assert cuda_select._pairs(torch.uint8, 4) and cuda_select._pairs(torch.uint8, 1)
    assert not cuda_select._pairs(torch.uint8, 8) and not cuda_select._pairs(FP8, 4)  # > 4 heads; fp8: its own variable
    monkeypatch.setenv("DATAENGINE_RING_FP8", "h1")
    assert cuda_select.ring_fp8() == "h1" and cuda_select._pairs(FP8, 8)
    monkeypatch.setenv("DATAENGINE_RING_FP8", "shift")
    with pytest.raises(ValueError, match="DATAENGINE_RING_FP8"):
        cuda_select.ring_fp8()
    assert cuda_select.heads_kernel_name(torch.uint8, 128, 4, "max", 8, True).endswith(", 8, true>")
    monkeypatch.setenv("DATAENGINE_RING_Q4", "quads")
    with pytest.raises(ValueError, match="DATAENGINE_RING_Q4"):
        cuda_select.ring_q4()


def test_ring_grid_env(monkeypatch):
    monkeypatch.delenv("DATAENGINE_RING_GRID", raising=False)
    assert cuda_select.ring_grid() == cuda_select.DEFAULT_RING_GRID == "auto"
    assert cuda_select.ring_grid(torch.uint8) == "records" and cuda_select.ring_grid(FP8) == "heads"
    monkeypatch.setenv("DATAENGINE_RING_GRID", "heads")
    assert cuda_select.ring_grid(torch.uint8) == "heads"
    monkeypatch.setenv("DATAENGINE_RING_GRID", "rows")
    with pytest.raises(ValueError, match="DATAENGINE_RING_GRID"):
        cuda_select.ring_grid()


@pytest.mark.gpu
@pytest.mark.parametrize("D,Hq,Hkv", [(128, 32, 8), (128, 16, 2), (128, 8, 1)])
@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize("q4", ["groups", "pairs", "pairs_occ3", "records_groups", "records_pairs", "records_pairs_occ3"])
def test_int4_heads_grid_scores_exact(D, Hq, Hkv, reduce, q4, monkeypatch):
    """int4 rows through quest_score_heads_kernel (per-group or paired-groups epilogue, 2 or 3 CTAs per
    SM) and quest_score_records_kernel (DATAENGINE_RING_GRID=records): the reference's bounds exactly
    (dyadic grids), then the reference's blocks."""
    monkeypatch.setenv("DATAENGINE_RING_Q4", "pairs" if "pairs" in q4 else "groups")
    monkeypatch.setenv("DATAENGINE_RING_OCC", "3" if q4.endswith("occ3") else "2")
    monkeypatch.setenv("DATAENGINE_RING_SCORES", "on")
    monkeypatch.setenv("DATAENGINE_RING_GRID", "records" if q4.startswith("records") else "heads")
    monkeypatch.setenv("DATAENGINE_SELECT_FUSED", "0")
    for seed in range(3):
        q, kmin, kmax, table, lens = _problem(seed, Hq=Hq, Hkv=Hkv, D=D, max_blocks=900, num_blocks=3000,
                                              sdtype=torch.float32, unwritten=0.05, holes=seed == 1)
        lo, hi = _summaries(torch.uint8, kmin, kmax)
        args = (q, lo, hi, table, lens)
        assert torch.equal(select.quest_scores(*args, reduce=reduce).cpu(),
                           select.quest_scores_reference(*_cpu(*args), reduce=reduce))
        assert torch.equal(select.select_blocks(*args, 64, 1, 1, block_size=16, reduce=reduce).cpu(),
                           select.select_blocks_reference(*_cpu(*args), 64, 1, 1, block_size=16, reduce=reduce))


def test_int4_rows_need_tensor_cores():
    rows = torch.zeros(4, 8, 80, dtype=torch.uint8)
    assert cuda_select.mma_reason(torch.zeros(2, 8, 128, dtype=torch.bfloat16), rows) is None
    assert "bf16" in cuda_select.mma_reason(torch.zeros(2, 8, 128, dtype=torch.float16), rows)
    # on the CPU, int4 rows go to the reference (select.py dispatches on the device first)
    q, kmin, kmax, table, lens = (t.cpu() for t in _problem_cpu(0))
    lo, hi = _int4_rows(kmin, False), _int4_rows(kmax, True)
    assert torch.equal(select.select_blocks(q, lo, hi, table, lens, 5, block_size=16),
                       select.select_blocks_reference(q, lo, hi, table, lens, 5, block_size=16))


# ----------------------------------------------------------------------------- the defaults, adversarial
SELECT_ENV = ("DATAENGINE_SELECT_FUSED", "DATAENGINE_SCORE_KERNEL", "DATAENGINE_RING_SCORES", "DATAENGINE_RING_GRID",
              "DATAENGINE_TOPK_KERNEL", "DATAENGINE_RING_Q4", "DATAENGINE_RING_OCC", "DATAENGINE_RING_FP8",
              "TILESTACK_PDL")
# (top_k, sink, local, what the seed's input is): budgets below, at and above the rows' block counts
ADVERSARIAL = [(64, 1, 1, "integer ties"), (7, 0, 0, "integer ties, holes"), (3, 2, 3, "every block alike"),
               (256, 1, 1, "nothing written"), (1, 4, 4, "forced > budget"), (100, 0, 5, "-inf on half the blocks"),
               (512, 1, 1, "integer ties")]


_ADVERSARIAL_PROBLEMS: dict = {}


def _adversarial_problem(seed: int, max_blocks: int):
    """The float32 problem of one ADVERSARIAL seed, built once per process and shared by the three
    summary dtypes (building it is most of this test's host time)."""
    key = (seed, max_blocks)
    if key not in _ADVERSARIAL_PROBLEMS:
        _ADVERSARIAL_PROBLEMS[key] = _problem(seed, B=4, Hq=32, Hkv=8, D=128, max_blocks=max_blocks,
                                              num_blocks=3 * max_blocks, dtype=torch.bfloat16, sdtype=torch.float32,
                                              unwritten={3: 1.0, 5: 0.5}.get(seed, 0.05), holes=seed == 1)
    return _ADVERSARIAL_PROBLEMS[key]


# the other variants held to the same adversarial inputs (env, test id); "s27_defaults": the defaults
# before session 28's figures
ADVERSARIAL_VARIANTS = [({}, "default"),
                        ({"DATAENGINE_RING_Q4": "groups", "DATAENGINE_RING_FP8": "cvt", "DATAENGINE_RING_GRID": "heads",
                          "DATAENGINE_TOPK_KERNEL": "fast"}, "s27_defaults"),
                        ({"DATAENGINE_RING_Q4": "pairs", "DATAENGINE_RING_FP8": "h1", "DATAENGINE_TOPK_KERNEL": "fastx"},
                         "pairsx"),
                        ({"DATAENGINE_RING_Q4": "pairs", "DATAENGINE_RING_OCC": "3", "DATAENGINE_TOPK_KERNEL": "fastx"},
                         "pairs_occ3_x"),
                        ({"DATAENGINE_RING_Q4": "pairs", "DATAENGINE_RING_FP8": "h1", "DATAENGINE_RING_GRID": "records",
                          "DATAENGINE_TOPK_KERNEL": "fastx"}, "records_pairs_x"),
                        ({"DATAENGINE_RING_Q4": "pairs", "DATAENGINE_RING_GRID": "records", "DATAENGINE_RING_OCC": "3",
                          "DATAENGINE_TOPK_KERNEL": "fastx"}, "records_pairs_occ3_x"),
                        ({"DATAENGINE_RING_Q4": "pairs", "DATAENGINE_TOPK_KERNEL": "fast512"}, "pairs512"),
                        ({"DATAENGINE_RING_Q4": "pairs", "DATAENGINE_TOPK_KERNEL": "fast256"}, "pairs256"),
                        ({"TILESTACK_PDL": "1"}, "pdl")]  # the defaults' kernels launched with PDL


@pytest.mark.gpu
@pytest.mark.parametrize("variant_env", [v for v, _ in ADVERSARIAL_VARIANTS], ids=[i for _, i in ADVERSARIAL_VARIANTS])
@pytest.mark.parametrize("sdtype", [torch.bfloat16, FP8, torch.uint8], ids=["bf16", "fp8", "int4"])
@pytest.mark.parametrize("max_blocks", [300, 2100], ids=["one-launch", "two-launch"])
def test_default_selection_adversarial(sdtype, max_blocks, variant_env, monkeypatch):
    """Issue 15's must-hold on the paths select_blocks takes by default (no variant in the
    environment; GQA 32/8, d128, bf16 q as in the 128K benchmark): rows of <= 1024 blocks (bf16
    summaries: 2048) in one launch, longer rows in two (ring scores: fp8 on the heads grid, int4 on the records grid; the
    fastx top-k), and the same under the opt-in / opt-out combinations of ADVERSARIAL_VARIANTS (the
    H200 round of session 28 ran these with the then defaults, the session-27 ones). Integer inputs (bounds
    exact in float32, so ties everywhere), an empty sequence, a 5-token one (1 block: shorter than
    every budget), a full one, a random length, unwritten (-inf) blocks, every block alike, nothing written, holes in
    the table, more forced blocks than the budget: the reference's blocks exactly, and the same again
    on a second launch (the one-launch path's row tickets re-armed)."""
    for name in SELECT_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in variant_env.items():  # an opt-in variant on top of the defaults
        monkeypatch.setenv(name, value)
    for seed, (top_k, sink, local, what) in enumerate(ADVERSARIAL):
        q, kmin, kmax, table, lens = _adversarial_problem(seed, max_blocks)
        kmin, kmax = _summaries(sdtype, kmin, kmax, open_ends=seed % 2 == 1)  # new tensors: the cache stays intact
        if seed == 2:
            kmin.view(torch.uint8)[:] = kmin.view(torch.uint8)[:1]
            kmax.view(torch.uint8)[:] = kmax.view(torch.uint8)[:1]
        args = (q, kmin, kmax, table, lens)
        width = min(max(top_k, sink + local), max_blocks)
        one_launch = cuda_select.fused_reason(q, kmin, width, max_blocks) is None
        limit = cuda_select.CHUNK_MAX if sdtype == torch.bfloat16 else cuda_select.FUSED_AUTO_MAX
        assert one_launch == (max_blocks <= limit), (what, one_launch)
        # valid blocks counted from seq_lens (the one-launch path needs block_size), or from the table
        bs = None if seed == 1 else 16
        # the torch reference on the GPU too (its float32 sums are exact in any order on these
        # inputs; stable sorts): the CPU reference of 2100-block rows cost more than a short GPU round
        want = select.select_blocks_reference(*args, top_k, sink, local, block_size=bs).cpu()
        for _ in range(2):
            got = select.select_blocks(*args, top_k, sink, local, block_size=bs)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), (seed, what, bs)
        if seed == 3:  # nothing written: only the forced blocks of the non-empty rows come back
            assert int((want >= 0).sum(-1).max()) <= sink + local
    assert cuda_select.ring_grid(sdtype) == variant_env.get("DATAENGINE_RING_GRID",
                                                            "records" if sdtype == torch.uint8 else "heads")
    assert cuda_select._ring(sdtype, 128) == (sdtype != torch.bfloat16)
