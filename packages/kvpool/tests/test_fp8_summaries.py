"""fp8 (e4m3) key summaries: `KVPool(summary_dtype=torch.float8_e4m3fn)`.

The contract (storage.py): kmin is rounded down and kmax up to e4m3 codes, the NaN codes 0xFF /
0x7F are the open ends (-inf / +inf) of the code order, and folding happens in that order, so the
codes equal the outward rounding of the exact (compute-dtype) summaries and bound every key.
The oracle of the rounding here is independent of storage.py's: a search over the 254 sorted
ordinary e4m3 values.
"""

import kvpool
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.storage import FP8_DTYPE, fp8_round_outward
from tilehal import ArgumentError

_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_VALUES = _CODES.view(FP8_DTYPE).float()
_ORDINARY = ~torch.isnan(_VALUES)
_SORTED_VALUES, _perm = _VALUES[_ORDINARY].double().sort()  # -0 and +0 both present
_SORTED_CODES = _CODES[_ORDINARY][_perm]


def _oracle(x: float, up: bool) -> float:
    """The value of the tightest e4m3 bound of x (+-inf beyond the finite range, NaN -> open end)."""
    if x != x:
        return float("inf") if up else float("-inf")
    vals = _SORTED_VALUES
    if up:
        ok = vals >= x
        return float(vals[ok][0]) if bool(ok.any()) else float("inf")
    ok = vals <= x
    return float(vals[ok][-1]) if bool(ok.any()) else float("-inf")


def _decode(codes: torch.Tensor, up: bool) -> torch.Tensor:
    """Codes -> float64 values with the open ends as infinities."""
    v = codes.view(FP8_DTYPE).double()
    end = torch.full_like(v, float("inf") if up else float("-inf"))
    other = -end
    raw = codes.view(torch.uint8)
    v = torch.where(raw == (0x7F if up else 0xFF), end, v)
    return torch.where(raw == (0xFF if up else 0x7F), other, v)


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_round_outward_is_the_tightest_bound(x):
    t = torch.tensor([x], dtype=torch.float32)
    for up in (True, False):
        got = float(_decode(fp8_round_outward(t, up), up)[0])
        want = _oracle(x, up)
        assert got == want, (x, up, got, want)
        if x == x:
            assert (got >= x) if up else (got <= x)


def _written_pool(summary_dtype, device="cpu", seed=0, scale=3.0, in_dtype=torch.float32):
    pool = kvpool.KVPool(2, 4, 64, 40, block_size=16, dtype=torch.bfloat16, device=device, prefix_caching=False,
                         summary_dtype=summary_dtype)
    g = torch.Generator().manual_seed(seed)
    keys = {}
    for s in range(3):
        pool.add_sequence(s, [0])
        keys[s] = []
    for step in range(5):
        for s in range(3):
            n = 37 if step < 2 else 1
            k = scale * torch.randn(n, 4, 64, generator=g)
            if step == 1 and s == 0:
                k[0, 0, :4] = torch.tensor([600.0, -700.0, float("inf"), 1e-4])  # beyond e4m3, and tiny
            slots = pool.append(s, n)
            pool.write(step % 2, slots.to(device), k.to(device, in_dtype),
                       torch.randn(n, 4, 64, generator=g).to(device, in_dtype))
            keys[s].append((step % 2, slots, k))
    return pool, keys


def test_fp8_summaries_equal_outward_rounding_of_exact_summaries():
    exact, _ = _written_pool(None)
    fp8, keys = _written_pool(FP8_DTYPE)
    assert fp8.storage.kmin.dtype == FP8_DTYPE and fp8.storage.kmin.shape == exact.storage.kmin.shape
    emin, emax = exact.storage.kmin.float(), exact.storage.kmax.float()
    # nothing written (exact +inf / -inf) is the open end; everything else the outward rounding
    want_min = torch.where(emin == float("inf"), 0x7F, fp8_round_outward(emin, up=False).int()).to(torch.uint8)
    want_max = torch.where(emax == float("-inf"), 0xFF, fp8_round_outward(emax, up=True).int()).to(torch.uint8)
    assert torch.equal(fp8.storage.kmin.view(torch.uint8), want_min)
    assert torch.equal(fp8.storage.kmax.view(torch.uint8), want_max)
    # every written key (as stored, bf16) lies inside its block's decoded bounds
    for layer in range(2):
        kmin, kmax = fp8.key_summary(layer)
        lo, hi = _decode(kmin, False), _decode(kmax, True)
        for parts in keys.values():
            for lyr, slots, k in parts:
                if lyr != layer:
                    continue
                blk = slots // 16
                kb = k.to(torch.bfloat16).double()
                assert bool((lo[blk] <= kb).all()) and bool((hi[blk] >= kb).all())
    # unwritten blocks: the open ends (nothing written)
    assert int(fp8.storage.kmin.view(torch.uint8)[0, -1].unique()) == 0x7F
    assert int(fp8.storage.kmax.view(torch.uint8)[0, -1].unique()) == 0xFF


def test_fp8_summaries_reset_on_reuse_and_copy_on_write():
    pool, _ = _written_pool(FP8_DTYPE)
    blocks = pool.block_table([0])[0]
    pool.free(0)
    pool.add_sequence(7, [1])
    slots = pool.append(7, 16 * 20)  # reuses freed blocks: their summaries start over
    pool.write(0, slots, torch.zeros(len(slots), 4, 64), torch.zeros(len(slots), 4, 64))
    b = int(slots[0]) // 16
    assert int(blocks.max()) >= 0
    assert pool.storage.kmin.view(torch.uint8)[0, b].unique().tolist() == [0x00]  # round_down(0) = +0
    assert pool.storage.kmax.view(torch.uint8)[0, b].unique().tolist() == [0x00]
    pool.fork(7, 8)
    before = pool.storage.kmax.view(torch.uint8).clone()
    s8 = pool.append(8, 1)  # the shared partial block is copied (summaries too), then widened
    pool.write(0, s8, torch.full((1, 4, 64), 5.0), torch.zeros(1, 4, 64))
    nb = int(s8[0]) // 16
    assert pool.storage.kmax.view(torch.uint8)[0, nb].unique().tolist() == [int(fp8_round_outward(torch.tensor(5.0), True))]
    assert torch.equal(pool.storage.kmax.view(torch.uint8)[0, b], before[0, b])


def test_summary_dtype_checked():
    with pytest.raises(ArgumentError, match="summary_dtype: expected None"):
        kvpool.KVPool(1, 2, 64, 4, summary_dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fp8_summary_write_kernel_equals_torch_path(in_dtype):
    cpu, _ = _written_pool(FP8_DTYPE, in_dtype=in_dtype)
    gpu, _ = _written_pool(FP8_DTYPE, device="cuda", in_dtype=in_dtype)
    from kvpool import cuda_write

    assert cuda_write.unsupported_reason(gpu.storage, torch.zeros(1, dtype=in_dtype, device="cuda")) is None
    for t in ("k", "v", "kmin", "kmax"):
        assert torch.equal(getattr(gpu.storage, t).cpu().view(torch.uint8), getattr(cpu.storage, t).view(torch.uint8)), t


# ----------------------------------------------------------------------------- int4 rows
from kvpool.storage import int4_encode, int4_row_bytes  # noqa: E402


def _decode_int4(rows: torch.Tensor, D: int) -> torch.Tensor:
    """The decoder's float32 arithmetic (lo + code * step), written independently of dataengine."""
    codes = rows[..., :D // 2].to(torch.int32)
    c = torch.stack((codes & 15, codes >> 4), -1).reshape(*rows.shape[:-1], D).float()
    p = rows[..., D // 2:].contiguous().view(torch.bfloat16).float().reshape(*rows.shape[:-1], D // 32, 2)
    return p[..., 0].repeat_interleave(32, -1) + c * p[..., 1].repeat_interleave(32, -1)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), scale=st.sampled_from([1e-30, 1e-3, 1.0, 300.0, 1e30]),
       special=st.sampled_from([None, "inf", "-inf", "zero"]))
def test_int4_rows_bound_every_value_and_are_tight(seed, scale, special):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(5, 3, 64, generator=g) * torch.exp2(torch.randint(-3, 4, (5, 3, 64), generator=g).float())
    if special == "inf":
        x[0, 0, 3] = float("inf")
    elif special == "-inf":
        x[1, 2, 40] = float("-inf")
    elif special == "zero":
        x[2, 1, :32] = 0.0
    for up in (True, False):
        rows = int4_encode(x, up)
        assert rows.dtype == torch.uint8 and rows.shape == (5, 3, int4_row_bytes(64))
        v = _decode_int4(rows, 64)
        assert bool(((v >= x) if up else (v <= x)).all())
        fin = torch.isfinite(x).reshape(5, 3, 2, 32).all(-1)
        g32 = x.reshape(5, 3, 2, 32)
        rng = (g32.amax(-1) - g32.amin(-1))
        step = rows[..., 32:].contiguous().view(torch.bfloat16).float().reshape(5, 3, 2, 2)[..., 1]
        # tight: the step is the range / 15 rounded up (within bf16 rounding and the 2 bumps), and
        # every channel sits within one step of its value
        ok = fin & (rng > 0)
        assert bool((step[ok] <= rng[ok] / 15 * (1 + 2 ** -6) + 1e-38).all())
        gap = (v - x).abs().reshape(5, 3, 2, 32)
        assert bool((gap[ok] <= 2 * step[ok][..., None] + 1e-30 * scale).all())


def _kernel_int4_rows(x: np.ndarray, up: bool) -> np.ndarray:
    """kv_write.cuh's int4_encode_kernel, one 32-lane warp per group, emulated in numpy float32
    (each intrinsic: __fsub_rn / __fdiv_rn / __fmul_rn / __fadd_rn = float32 RN; bf16 _rd/_ru)."""
    f32, bf16, big = np.float32, ml_dtypes.bfloat16, np.float32(3.402823466e38)

    def bf16_dir(v: np.float32, toward_up: bool) -> np.float32:
        b = np.array(v, f32).astype(bf16)
        if (b.astype(f32) < v) if toward_up else (b.astype(f32) > v):
            b = np.nextafter(b, np.array(np.inf if toward_up else -np.inf, bf16))
        return f32(b.astype(f32))

    lead, D = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, D).astype(f32)
    out = np.zeros((flat.shape[0], D // 2 + 4 * (D // 32)), np.uint8)
    for r, row in enumerate(flat):
        for grp in range(D // 32):
            lanes = row[grp * 32:(grp + 1) * 32]
            all_fin = bool((np.abs(lanes) <= big).all())
            lo, hi = f32(lanes.min()), f32(lanes.max())
            lo_b = bf16_dir(lo if all_fin else f32(0), False)
            d = f32(hi - lo_b)
            fin = all_fin and abs(d) <= big
            step = bf16_dir(f32((d if fin else f32(0)) / f32(15)), True)
            for _ in range(2):
                if fin and f32(lo_b + f32(f32(15) * step)) < hi:
                    step = f32((np.array(step, f32).astype(bf16).view(np.uint16) + np.uint16(1)).view(bf16).astype(f32))
            codes = np.zeros(32, np.uint8)
            if fin and step > 0:
                for lane, v in enumerate(lanes):
                    q = f32(f32(v - lo_b) / step)
                    cf = f32(min(max(np.ceil(q) if up else np.floor(q), f32(0)), f32(15)))
                    for _ in range(2):
                        dec = f32(lo_b + f32(cf * step))
                        if up and dec < v and cf < 15:
                            cf += f32(1)
                        if not up and dec > v and cf > 0:
                            cf -= f32(1)
                    codes[lane] = int(cf)
            if not fin:
                ext = hi if up else lo
                lo_b, step = (bf16_dir(ext, up) if abs(ext) <= big else ext), f32(0)
            out[r, grp * 16:(grp + 1) * 16] = codes[0::2] | (codes[1::2] << 4)
            p = np.array([lo_b, step], f32).astype(bf16).view(np.uint8)
            out[r, D // 2 + 4 * grp:D // 2 + 4 * grp + 4] = p
    return out.reshape(*lead, -1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), scale=st.sampled_from([1e-30, 1e-3, 1.0, 300.0, 1e30]),
       special=st.sampled_from([None, "inf", "-inf", "both", "fresh", "zero", "equal"]))
def test_int4_encode_equals_the_kernels_arithmetic(seed, scale, special):
    """The torch path and the CUDA kernel (emulated) give the same bytes, including groups with a
    non-finite value (their extreme, step 0, codes 0: the CUDA pass of 2026-12-02 caught the torch
    path nudging those codes to 2) and never-written rows (+inf / -inf)."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(3, 2, 64, generator=g)
    if special in ("inf", "both"):
        x[0, 0, 3] = float("inf")
    if special in ("-inf", "both"):
        x[1, 1, 40] = float("-inf")
    if special == "fresh":
        x[2, 0] = float("inf")
        x[2, 1] = float("-inf")
    if special == "zero":
        x[2, 1, :32] = 0.0
    if special == "equal":
        x[0, 1, 32:] = x[0, 1, 33]
    for up in (True, False):
        assert np.array_equal(int4_encode(x, up).numpy(), _kernel_int4_rows(x.numpy(), up)), up


def test_int4_pool_rows_follow_the_exact_summaries():
    pool, keys = _written_pool("int4")
    kmin, kmax = pool.key_summary(0)
    assert kmin.dtype == torch.uint8 and kmin.shape == (40, 4, int4_row_bytes(64))
    assert torch.equal(kmin, int4_encode(pool.storage.kmin[0].float(), up=False))
    assert torch.equal(kmax, int4_encode(pool.storage.kmax[0].float(), up=True))
    lo, hi = _decode_int4(kmin, 64), _decode_int4(kmax, 64)
    for parts in keys.values():
        for lyr, slots, k in parts:
            if lyr == 0:
                kb = k.to(torch.bfloat16).float()
                assert bool((lo[slots // 16] <= kb).all()) and bool((hi[slots // 16] >= kb).all())
    assert bool(torch.isposinf(lo[-1]).all()) and bool(torch.isneginf(hi[-1]).all())  # unwritten
    with pytest.raises(ArgumentError, match="multiple of 32"):
        kvpool.KVPool(1, 2, 48, 4, summary_dtype="int4")


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_int4_encode_kernel_equals_torch_path(in_dtype):
    cpu, _ = _written_pool("int4", in_dtype=in_dtype)
    gpu, _ = _written_pool("int4", device="cuda", in_dtype=in_dtype)
    for t in ("kmin", "kmax", "kmin_q4", "kmax_q4"):
        assert torch.equal(getattr(gpu.storage, t).cpu(), getattr(cpu.storage, t)), t
