# requires: multi_gpu
"""What the GPU-to-GPU link of this host can carry: the ceiling every dispatch/combine figure lives under.

    source scripts/device_env.sh
    python3 packages/deepep/benchmarks/bench_link.py --record

One process, GPUs 0 and 1, peer access on. Times (CUDA events, median of 20 after warm-up):
- copy engine: `dst1.copy_(src0)` (cudaMemcpyPeer), one way and both ways at once;
- SM stores: a kernel on GPU 0 writes 16-byte words into GPU 1's memory, with 8..132 blocks;
- SM loads: a kernel on GPU 0 reads GPU 1's memory into its own;
- both ways at once with SM stores (what dispatch and combine do: every rank sends and receives).
Prints GB/s per direction; writes deepep_link_2xGPU.json. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(512) copy16(int4* dst, const int4* src, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long s = (long long)gridDim.x * blockDim.x;
  for (; i + 3 * s < n; i += 4 * s) {
    const int4 a = __ldcg(src + i), b = __ldcg(src + i + s), c = __ldcg(src + i + 2 * s), d = __ldcg(src + i + 3 * s);
    dst[i] = a;
    dst[i + s] = b;
    dst[i + 2 * s] = c;
    dst[i + 3 * s] = d;
  }
  for (; i < n; i += s) dst[i] = __ldcg(src + i);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per timed call, MiB")
    ap.add_argument("--record", action="store_true", help="write the results into docs/benchmarks/ (default: print only)")
    ap.add_argument("--out", type=Path, default=None, help="folder for deepep_link_2xGPU.json")
    args = ap.parse_args()

    import tilehal
    import torch
    from cuda.bindings import runtime

    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_link.py needs two GPUs")
    n_bytes = args.mib * 2**20
    mods = []
    for i in range(2):
        tilehal.ensure_context(i)
        torch.cuda.set_device(i)
        mods.append(tilehal.compile_cuda(SOURCE, arch="sm_90a", name="deepep_link").get_kernel("copy16"))
    bufs = [(torch.empty(n_bytes, dtype=torch.uint8, device=f"cuda:{i}"),
             torch.empty(n_bytes, dtype=torch.uint8, device=f"cuda:{i}")) for i in range(2)]
    for i in range(2):  # kernels may touch the other GPU's memory only with peer access enabled
        runtime.cudaSetDevice(i)
        err = runtime.cudaDeviceEnablePeerAccess(1 - i, 0)[0]
        if int(err) not in (0, int(runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled)):
            raise SystemExit(f"cudaDeviceEnablePeerAccess({i} -> {1 - i}) failed: {err}")
    streams = [torch.cuda.Stream(device=i) for i in range(2)]

    def kernel_copy(dev: int, dst: torch.Tensor, src: torch.Tensor, blocks: int) -> None:
        torch.cuda.set_device(dev)
        tilehal.ensure_context(dev)
        with torch.cuda.stream(streams[dev]):
            mods[dev].launch(blocks, 512, [tilehal.Arg.u64(dst.data_ptr()), tilehal.Arg.u64(src.data_ptr()),
                                           tilehal.Arg.i64(n_bytes // 16)])

    def ce_copy(dev: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        torch.cuda.set_device(dev)
        with torch.cuda.stream(streams[dev]):
            dst.copy_(src, non_blocking=True)

    def timed(fn, devices: list[int], iters: int = 20) -> float:
        """Median seconds of fn() from the first device's start to the last device's end."""
        for _ in range(3):
            fn()
        for d in devices:
            torch.cuda.synchronize(d)
        times = []
        for _ in range(iters):
            starts = [torch.cuda.Event(enable_timing=True) for _ in devices]
            ends = [torch.cuda.Event(enable_timing=True) for _ in devices]
            for d, ev in zip(devices, starts):
                ev.record(streams[d])
            fn()
            for d, ev in zip(devices, ends):
                ev.record(streams[d])
            for d in devices:
                torch.cuda.synchronize(d)
            # Events of different devices cannot be compared: take the slowest device's span.
            times.append(max(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3)
        times.sort()
        return times[len(times) // 2]

    results: dict = {}

    def record(name: str, seconds: float) -> None:
        results[name] = {"us": seconds * 1e6, "GBps_per_direction": n_bytes / seconds / 1e9}
        print(f"{name:<40} {seconds * 1e6:10.1f} us {n_bytes / seconds / 1e9:8.1f} GB/s per direction", flush=True)

    (a0, b0), (a1, b1) = bufs
    record("local/copy_engine (GPU0)", timed(lambda: ce_copy(0, b0, a0), [0]))
    record("local/sm_copy 132 blocks (GPU0)", timed(lambda: kernel_copy(0, b0, a0, 132), [0]))
    record("ce/one_way 0->1", timed(lambda: ce_copy(0, a1, a0), [0]))
    record("ce/both_ways", timed(lambda: (ce_copy(0, a1, a0), ce_copy(1, b0, b1)), [0, 1]))
    for blocks in (8, 16, 24, 32, 48, 64, 96, 132):
        record(f"sm_store/one_way/{blocks} blocks", timed(lambda b=blocks: kernel_copy(0, a1, a0, b), [0]))
    for blocks in (16, 32, 64, 132):
        record(f"sm_load/one_way/{blocks} blocks", timed(lambda b=blocks: kernel_copy(0, b0, b1, b), [0]))
    for blocks in (16, 32, 64, 132):
        record(f"sm_store/both_ways/{blocks} blocks",
               timed(lambda b=blocks: (kernel_copy(0, a1, a0, b), kernel_copy(1, b0, b1, b)), [0, 1]))
    for blocks in (32, 132):
        record(f"sm_load/both_ways/{blocks} blocks",
               timed(lambda b=blocks: (kernel_copy(0, b0, b1, b), kernel_copy(1, a1, a0, b)), [0, 1]))

    if args.record and args.out is None:
        args.out = Path(__file__).resolve().parents[3] / "docs" / "benchmarks"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
                "host": platform.node(), "bytes_per_call": n_bytes, "torch": torch.__version__}
        (args.out / "deepep_link_2xGPU.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
