"""On the device: compile deepgemm fp8_gemm_nt (bench_fp4's peer) and the fp8 casts for one (M, N, K) of the
bench by running it once (the job starts one process per row in parallel while the GPU tests run)."""
import sys

import deepgemm
import torch

m, n, k = (int(v) for v in sys.argv[1:4])
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
x8, sx = deepgemm.per_token_cast_to_fp8(x)
deepgemm.per_token_cast_to_fp8(x, tma_aligned_sf=True)  # bench_fp4's cast_fp8 contender
w8, sw = deepgemm.per_block_cast_to_fp8(w)
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
deepgemm.fp8_gemm_nt((x8, deepgemm.get_mn_major_tma_aligned_tensor(sx)), (w8, sw), out)
torch.cuda.synchronize()
