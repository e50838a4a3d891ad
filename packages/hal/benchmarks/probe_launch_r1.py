"""R1 probe (issue 17 item 1): where the host time of one launch goes, before any change.

Prints per-call host time (median of batches of back-to-back calls, perf_counter) of:
  tilehal Kernel.launch of an empty 10-argument kernel; the same launch through cuda-bindings'
  cuLaunchKernel with pre-packed parameters; through ctypes straight into libcuda; torch's own
  launch of a tiny kernel; the pieces (current stream, raw stream, cuTensorMapReplaceAddress);
  deepgemm.bf16_gemm_nt 128x7168x2048 vs F.linear; and a cProfile of deepgemm's call.
Usage (GPU): python packages/hal/benchmarks/probe_launch_r1.py --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import tilehal
import torch
from tilehal.jit.launch import _driver

SRC = r"""
extern "C" __global__ void k10(float* a, float* b, float* c, float* d, int n0, int n1, int n2, int n3,
                                float s0, float s1) {
  if (n0 < 0 && threadIdx.x == 0) a[0] = b[0] + c[0] + d[0] + n1 + n2 + n3 + s0 + s1;
}
"""


def host_us(fn, batches: int = 30, per: int = 100) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        xs.append((time.perf_counter() - t0) / per)
        torch.cuda.synchronize()
    return statistics.median(xs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out = Path(args.out)
    res: dict[str, float | str] = {}
    t = [torch.zeros(256, device="cuda") for _ in range(4)]
    kern = tilehal.compile_cuda(SRC, name="probe_k10").get_kernel("k10")
    argv = [*t, 1, 2, 3, 4, 0.5, 1.5]
    res["tilehal_launch_10args"] = host_us(lambda: kern.launch(1, 32, argv))

    drv = _driver()
    fn = kern._function(torch.cuda.current_device())
    vals = [ctypes.c_void_p(x.data_ptr()) for x in t] + [ctypes.c_int32(i) for i in (1, 2, 3, 4)] + \
        [ctypes.c_float(0.5), ctypes.c_float(1.5)]
    ptrs = (ctypes.c_void_p * 10)(*[ctypes.addressof(v) for v in vals])
    sh = torch.cuda.current_stream().cuda_stream
    cs = drv.CUstream(sh)
    res["cuda_bindings_prepacked"] = host_us(lambda: drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs,
                                                                         ctypes.addressof(ptrs), 0))
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fptr = int(fn)
    pa = ctypes.addressof(ptrs)
    res["ctypes_libcuda_prepacked"] = host_us(lambda: launch(fptr, 1, 1, 1, 32, 1, 1, 0, sh, pa, None))
    x1 = torch.zeros(1, device="cuda")
    res["torch_zero_1elem"] = host_us(lambda: x1.zero_())
    res["torch_current_stream_cuda_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
    dev = torch.cuda.current_device()
    res["torch_raw_stream"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(dev))
    res["data_ptr_x4"] = host_us(lambda: (t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr()))
    a = torch.randn(128, 2048, device="cuda").bfloat16()
    w = torch.randn(7168, 2048, device="cuda").bfloat16()
    d = torch.empty(128, 7168, device="cuda", dtype=torch.bfloat16)
    desc = bytearray(tilehal.tma.encode_tiled(a.data_ptr(), a.dtype, (128, 2048), (2048, 1), (128, 64), swizzle="128B"))
    dbuf = (ctypes.c_ubyte * 128).from_buffer(desc)
    try:
        rep = libcuda.cuTensorMapReplaceAddress
        rep.restype = ctypes.c_int
        rep.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        ap_ = a.data_ptr()
        res["ctypes_cuTensorMapReplaceAddress"] = host_us(lambda: rep(ctypes.addressof(dbuf), ap_))
        res["replace_rc"] = rep(ctypes.addressof(dbuf), ap_)
    except AttributeError as e:
        res["ctypes_cuTensorMapReplaceAddress"] = f"missing: {e}"
    res["encode_tiled"] = host_us(lambda: tilehal.tma.encode_tiled(a.data_ptr(), a.dtype, (128, 2048), (2048, 1),
                                                                   (128, 64), swizzle="128B"), batches=10)
    import deepgemm

    res["F_linear_128x7168x2048"] = host_us(lambda: torch.nn.functional.linear(a, w))
    res["torch_mm_out"] = host_us(lambda: torch.mm(a, w.t(), out=d))
    res["deepgemm_bf16_gemm_nt"] = host_us(lambda: deepgemm.bf16_gemm_nt(a, w, d))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        deepgemm.bf16_gemm_nt(a, w, d)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    (out / "cprofile_deepgemm_bf16.txt").write_text(s.getvalue())
    for k, v in res.items():
        print(f"{k:40s} {v:.2f} us" if isinstance(v, float) else f"{k:40s} {v}")
    (out / "probe_launch_r1.json").write_text(json.dumps(dict(machine=torch.cuda.get_device_name(),
                                                              torch=torch.__version__, us=res), indent=1))


if __name__ == "__main__":
    main()
