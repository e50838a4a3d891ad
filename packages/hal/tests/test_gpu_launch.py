"""Launch tests on a real GPU (run on the device machine: `pytest -m gpu`)."""

import pytest
from tilehal import Arg, calc_diff, compile_cuda

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SRC = r"""
#include <tilehal/tilehal.cuh>
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
// One warp per row: each lane sums a strided slice, then a butterfly reduction.
extern "C" __global__ void warp_row_sum(const __nv_bfloat16* x, float* out, int cols) {
  const __nv_bfloat16* row = x + (long long)blockIdx.x * cols;
  float acc = 0.f;
  for (int j = threadIdx.x; j < cols; j += 32) acc += tilehal::to_float(row[j]);
  acc = tilehal::warp_sum(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}
extern "C" __global__ void big_smem_copy(const float* a, float* c, int n) {
  extern __shared__ float buf[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = a[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) c[i] = buf[n - 1 - i];
}
// Static shared memory next to a 1 KiB-aligned dynamic array: ptxas pads the static part to 1 KiB.
extern "C" __global__ void static_and_48k_dynamic(const float* a, float* c, int n) {
  __shared__ float first;
  extern __shared__ __align__(1024) float dyn[];
  if (threadIdx.x == 0) first = a[0];
  for (int i = threadIdx.x; i < n; i += blockDim.x) dyn[i] = a[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) c[i] = dyn[n - 1 - i] + first;
}
"""


@pytest.fixture(scope="module")
def mod():
    return compile_cuda(SRC, name="launch_tests")


def test_vector_add_on_side_stream(mod):
    n = (1 << 22) + 5
    a = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    c = torch.empty_like(a)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mod.get_kernel("vector_add").launch(((n + 255) // 256,), (256,), [a, b, c, Arg.i64(n)])
    s.synchronize()
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)


def test_warp_reduce_explicit_stream(mod):
    rows, cols = 4096, 1000
    x = torch.randn(rows, cols, device="cuda").bfloat16()
    out = torch.empty(rows, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    mod.get_kernel("warp_row_sum").launch(rows, 32, [x, out, cols], stream=s)
    s.synchronize()
    ref = x.double().sum(dim=1)
    assert calc_diff(out, ref) < 1e-6
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)


def test_dynamic_smem_above_48k(mod):
    n = 150 * 1024 // 4
    a = torch.randn(n, device="cuda")
    c = torch.empty_like(a)
    mod.get_kernel("big_smem_copy").launch(1, 256, [a, c, n], smem_bytes=n * 4)
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a.flip(0))


def test_bench_hides_host_overhead_unless_asked():
    """With hide_host a call times the GPU work (one small add, a few us), not the 2 ms of host work
    before it; without, every call's figure holds that gap. Other processes on the same GPU and CPU
    (the lead's `-n 12` GPU pass) stretch single calls: the host work outlasts the spin that covers
    it, or another context's time slice lands between the events (03:05 pass, 5 calls: 3.9 us,
    2.9 us, 26.6 ms, 1.87 ms, 1.89 ms). So 20 calls each, and the claim is made on the fastest fifth
    of the hidden calls against the typical shown one, measured in the same run."""
    import time

    from tilehal import bench

    x = torch.zeros(1024, device="cuda")

    def slow_host_fast_gpu():
        time.sleep(0.002)  # 2 ms of host work before a tiny kernel
        x.add_(1)

    hidden = bench(slow_host_fast_gpu, warmup=3, iters=20)
    shown = bench(slow_host_fast_gpu, warmup=3, iters=20, hide_host=False)
    assert hidden.iters >= 20 and shown.iters >= 20
    assert hidden.host_s >= 0.002 and shown.host_s >= 0.002
    assert shown.median_s >= 0.002  # the host gap sits between the events
    # a fifth of the hidden calls time the add alone: far below any call that holds the gap
    assert hidden.p20_s < 0.0005, hidden
    assert hidden.p20_s < shown.median_s / 4, (hidden, shown)


def test_preload_then_launch(mod):
    """A preloaded kernel reports its attributes and launches as before."""
    k = mod.get_kernel("vector_add")
    k.preload()
    assert k.attribute("NUM_REGS") > 0
    a = torch.ones(1000, device="cuda")
    c = torch.empty_like(a)
    k.launch(4, 256, [a, a, c, Arg.i64(1000)])
    torch.testing.assert_close(c, 2 * a)


def test_bench_host_gap_sleep_stays_bounded_for_a_synchronizing_fn():
    """A fn that synchronizes waits out the sleep queued before it; the sleep must not grow."""
    import time

    from tilehal import bench

    x = torch.randn(1024, device="cuda")

    def syncing():
        (x * 2).sum().item()

    t0 = time.perf_counter()
    r = bench(syncing, warmup=3, iters=40)
    assert time.perf_counter() - t0 < 5.0, "the host-gap sleep grew call after call"
    assert r.median_s < 0.01


def test_launch_plan_is_built_once_and_reused(mod):
    """The second launch of a signature runs its LaunchPlan; results stay exact, new buffers and
    values are honoured, and a bad argument after the plan exists still raises LaunchError."""
    from tilehal import LaunchError

    k = mod.get_kernel("vector_add")
    k._plans.clear()
    for n in (1000, 777, 1000):
        a = torch.randn(n, device="cuda")
        b = torch.randn(n, device="cuda")
        c = torch.empty_like(a)
        k.launch(4, 256, [a, b, c, Arg.i64(n)])
        torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    assert len(k._plans[(4, 256, 0, None, torch.cuda.current_device())]) == 1
    with pytest.raises(LaunchError, match="args\\[0\\]"):
        k.launch(4, 256, [a.cpu(), b, c, Arg.i64(1000)])
    w = mod.get_kernel("warp_row_sum")
    x = torch.randn(8, 64, device="cuda").bfloat16()
    out = torch.empty(8, device="cuda")
    w.launch(8, 32, [x, out, 64])
    with pytest.raises(LaunchError, match="int32"):
        w.launch(8, 32, [x, out, 2**31])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the plan reads the current stream on every call
        w.launch(8, 32, [x, out, 64])
    s.synchronize()
    torch.testing.assert_close(out.double(), x.double().sum(1), rtol=1e-4, atol=1e-3)


def test_launch_plan_under_cuda_graph_capture(mod):
    k = mod.get_kernel("vector_add")
    a = torch.randn(4096, device="cuda")
    c = torch.empty_like(a)
    k.launch(16, 256, [a, a, c, Arg.i64(4096)])  # builds the plan
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        k.launch(16, 256, [a, a, c, Arg.i64(4096)])
    c.zero_()
    a.copy_(torch.arange(4096, device="cuda", dtype=torch.float32))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(c, 2 * a)


def test_static_smem_plus_48k_dynamic(mod):
    """48 KiB of dynamic shared memory in a kernel that also has static shared memory needs the opt-in (the
    default limit covers static + dynamic): tilelang's TMA gemms with 48 KiB of stages failed to launch."""
    k = mod.get_kernel("static_and_48k_dynamic")
    assert k.attribute("SHARED_SIZE_BYTES") > 0
    n = 48 * 1024 // 4
    a = torch.randn(n, device="cuda")
    c = torch.empty_like(a)
    k.launch(1, 256, [a, c, n], smem_bytes=n * 4)
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a.flip(0) + a[0])
