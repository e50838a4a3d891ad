"""The CUDA write path (K/V stores + key summaries in one kernel) and the fp8 decode kernel.

The write kernel is exact: it stores the same rounded values as torch's `.to(dtype)` and widens
the summaries with exact min/max, so a GPU pool must equal a CPU pool fed the same writes bit
for bit. fp8 decode is checked against the torch reference on the same fp8 pool (float32 math
on the dequantized values): calc_diff < 1e-5.
"""

import kvpool
import pytest
import tilehal
import torch
from kvpool import cuda_decode, cuda_write


def _have_compiler() -> bool:
    v = tilehal.compiler_versions()
    return v["nvrtc"] is not None or v["nvcc"] is not None


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
def test_write_kernels_compile():
    m = cuda_write.compile_write()
    for i in (torch.float32, torch.bfloat16, torch.float16):
        for p in cuda_write.POOL_DTYPES:
            assert cuda_write.kernel_name(i, p) in m.lowered_names


@pytest.mark.skipif(not _have_compiler(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (128, 8), (256, 2)])
def test_fp8_decode_kernels_compile(q_dtype, head_dim, group):
    m = cuda_decode.compile_decode_fp8(q_dtype, head_dim, group)
    assert set(cuda_decode.fp8_kernel_names(q_dtype, head_dim, group)) <= set(m.lowered_names)


def test_write_reasons():
    pool = kvpool.KVPool(1, 2, 64, 4, dtype=torch.bfloat16)
    assert "cpu" in cuda_write.unsupported_reason(pool.storage, torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_write_kernel_equals_torch_path(dtype, in_dtype):
    pools = [kvpool.KVPool(2, 4, 64, 40, block_size=16, dtype=dtype, device=d, prefix_caching=False)
             for d in ("cuda", "cpu")]
    g = torch.Generator().manual_seed(0)
    for p in pools:
        for s in range(3):
            p.add_sequence(s, [0])
    for step in range(6):  # prompt chunks then single tokens, sequences interleaved
        for s in range(3):
            n = 37 if step < 2 else 1
            k = (3 * torch.randn(n, 4, 64, generator=g)).to(in_dtype)
            v = torch.randn(n, 4, 64, generator=g).to(in_dtype)
            for p in pools:
                slots = p.append(s, n)
                p.write(step % 2, slots.to(p.device), k.to(p.device), v.to(p.device))
    gpu, cpu = pools
    for t in ("k", "v", "kmin", "kmax"):
        assert torch.equal(getattr(gpu.storage, t).cpu(), getattr(cpu.storage, t)), t
    # a rewrite of a written position keeps widening (never narrows) the bounds
    kmin0 = gpu.storage.kmin.clone()
    gpu.write(0, torch.tensor([0], device="cuda"), torch.zeros(1, 4, 64, device="cuda"),
              torch.zeros(1, 4, 64, device="cuda"))
    assert bool((gpu.storage.kmin <= kmin0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(128, 32, 8), (64, 8, 8), (256, 4, 2), (128, 8, 1)])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("sparse", [False, True])
def test_fp8_decode_matches_reference(q_dtype, head_dim, q_heads, kv_heads, splits, sparse):
    lens = [1, 15, 16, 17, 300, 1000, 0]
    blocks = sum(-(-L // 16) for L in lens) + 4
    pool = kvpool.KVPool(1, kv_heads, head_dim, blocks, block_size=16, dtype=torch.float8_e4m3fn, device="cuda",
                         prefix_caching=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    for i, L in enumerate(lens):
        pool.add_sequence(i, [0])
        for start in range(0, L, 100):  # several writes per block: scales rise, earlier tokens requantize
            n = min(100, L - start)
            k = torch.randn(n, kv_heads, head_dim, device="cuda", generator=g) * (1 + start / 100)
            pool.write(0, pool.append(i, n).cuda(), k, torch.randn(n, kv_heads, head_dim, device="cuda", generator=g))
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(len(lens), q_heads, head_dim, device="cuda").to(q_dtype)
    bi = None
    if sparse:
        bi = torch.full((len(lens), kv_heads, 6), -1, dtype=torch.int32, device="cuda")
        for i, L in enumerate(lens):
            nb = -(-L // 16)
            for h in range(kv_heads):
                bi[i, h, :min(nb, 6)] = torch.randperm(nb, device="cuda", generator=g)[:6].sort().values.int()
    out = cuda_decode.paged_decode_fp8_cuda(q, pool, 0, bt, sl, None, bi, num_splits=splits)
    ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl, block_indices=bi)
    assert out.dtype == q_dtype
    assert tilehal.calc_diff(out, ref) < 1e-5
    assert torch.all(out[-1] == 0)  # empty sequence
    # dispatch: paged_decode on an fp8 CUDA pool runs this kernel
    torch.testing.assert_close(kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi).float(), out.float(),
                               atol=1e-2, rtol=1e-2)
