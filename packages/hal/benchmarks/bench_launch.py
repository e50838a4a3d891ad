"""Host time of one kernel launch through tilehal, against the floors below it and torch's own launch.

Rows (per-call host time: median over batches of back-to-back calls, perf_counter, GPU idle-fast):
  tilehal plan       Kernel.launch of an empty 10-argument kernel (4 tensors, 4 ints, 2 floats), the
                     LaunchPlan path (every launch after the first of a signature)
  tilehal checked    the same launch through the checked slow path (what every launch cost before plans)
  cuda-bindings      cuLaunchKernel of cuda-bindings with parameters packed beforehand (its floor)
  ctypes             cuLaunchKernel of libcuda through ctypes with parameters packed beforehand (the plan's floor)
  torch x.zero_()    torch's launch of a one-element kernel (the peer: what a torch op costs)
plus the pieces: torch.cuda.current_stream().cuda_stream vs torch._C._cuda_getCurrentRawStream,
tma.encode_tiled vs tma.retarget.

Usage (GPU): python packages/hal/benchmarks/bench_launch.py [--json FILE]
"""

# requires: cuda

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
from pathlib import Path

import tilehal
import torch
from tilehal import tma
from tilehal.jit.launch import _driver

SRC = r"""
extern "C" __global__ void k10(float* a, float* b, float* c, float* d, int n0, int n1, int n2, int n3,
                                float s0, float s1) {
  if (n0 < 0 && threadIdx.x == 0) a[0] = b[0] + c[0] + d[0] + n1 + n2 + n3 + s0 + s1;
}
"""


def host_us(fn, batches: int = 30, per: int = 100) -> float:
    """Median per-call host time of `fn` over `batches` runs of `per` back-to-back calls."""
    return tilehal.bench_host(fn, warmup=20, batches=batches, per=per).median_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    res: dict[str, float | str] = {}
    t = [torch.zeros(256, device="cuda") for _ in range(4)]
    kern = tilehal.compile_cuda(SRC, name="bench_k10").get_kernel("k10")
    argv = [*t, 1, 2, 3, 4, 0.5, 1.5]
    res["tilehal plan, 10 args"] = host_us(lambda: kern.launch(1, 32, argv))
    res["tilehal checked path, 10 args"] = host_us(lambda: kern._launch_slow(1, 32, argv, 0, None, None))
    drv = _driver()
    fn = kern._function(torch.cuda.current_device())
    vals = [ctypes.c_void_p(x.data_ptr()) for x in t] + [ctypes.c_int32(i) for i in (1, 2, 3, 4)] + \
        [ctypes.c_float(0.5), ctypes.c_float(1.5)]
    ptrs = (ctypes.c_void_p * 10)(*[ctypes.addressof(v) for v in vals])
    sh = torch.cuda.current_stream().cuda_stream
    cs = drv.CUstream(sh)
    pa = ctypes.addressof(ptrs)
    res["cuda-bindings cuLaunchKernel, pre-packed"] = host_us(
        lambda: drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, cs, pa, 0))
    from tilehal.jit.fastlaunch import ctypes_cu_launch_kernel

    launch = ctypes_cu_launch_kernel()
    if launch is not None:
        fptr = int(fn)
        res["ctypes cuLaunchKernel, pre-packed"] = host_us(lambda: launch(fptr, 1, 1, 1, 32, 1, 1, 0, sh, pa, None))
    x1 = torch.zeros(1, device="cuda")
    res["torch x.zero_() (1 element)"] = host_us(lambda: x1.zero_())
    res["torch.cuda.current_stream().cuda_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
    dev = torch.cuda.current_device()
    res["torch._C._cuda_getCurrentRawStream"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(dev))
    a = torch.randn(128, 2048, device="cuda").bfloat16()
    res["tma.encode_tiled"] = host_us(lambda: tma.encode_tiled(a.data_ptr(), a.dtype, (128, 2048), (2048, 1),
                                                                       (128, 64), swizzle="128B"), batches=10)
    desc = tma.encode_tiled(a.data_ptr(), a.dtype, (128, 2048), (2048, 1), (128, 64), swizzle="128B")
    b = torch.randn(128, 2048, device="cuda").bfloat16()
    pb = b.data_ptr()
    if tma.retarget(desc, pb) is not None:
        res["tma.retarget"] = host_us(lambda: tma.retarget(desc, pb))
        fresh = tma.encode_tiled(pb, a.dtype, (128, 2048), (2048, 1), (128, 64), swizzle="128B")
        res["retarget == fresh encode"] = str(tma.retarget(desc, pb) == fresh)
    for k, v in res.items():
        print(f"{k:45s} {v:8.2f} us" if isinstance(v, float) else f"{k:45s} {v}")
    if args.json:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    machine=torch.cuda.get_device_name(), torch=torch.__version__)
        Path(args.json).write_text(json.dumps(dict(meta=meta, host_us=res), indent=1))


if __name__ == "__main__":
    main()
