"""Programmatic dependent launch (Kernel.launch(pdl=True)): the launch config on the CPU, producer -> consumer
ordering on a GPU (eager, the cached launch plan, CUDA-graph replay)."""

import pytest
import tilehal
from tilehal.jit import launch as L

driver = pytest.importorskip("cuda.bindings.driver")


def _attr_ids(cfg):
    return [a.id for a in cfg.attrs[: cfg.numAttrs]]


def test_launch_config_attributes():
    ids = driver.CUlaunchAttributeID
    pdl = L._cluster_config(driver, (4, 1, 1), (128, 1, 1), 0, None, driver.CUstream(0), True)
    assert _attr_ids(pdl) == [ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert pdl.attrs[0].value.programmaticStreamSerializationAllowed == 1
    both = L._cluster_config(driver, (4, 1, 1), (128, 1, 1), 0, (2, 1, 1), driver.CUstream(0), True)
    assert _attr_ids(both) == [ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                               ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    cluster = L._cluster_config(driver, (4, 1, 1), (128, 1, 1), 0, (2, 1, 1), driver.CUstream(0))
    assert _attr_ids(cluster) == [ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION] and cluster.gridDimX == 4


def test_pdl_env(monkeypatch):
    monkeypatch.delenv("TILESTACK_PDL", raising=False)
    assert not tilehal.pdl_requested() and L.DEFAULT_PDL == "0"
    monkeypatch.setenv("TILESTACK_PDL", "1")
    assert tilehal.pdl_requested()
    monkeypatch.setenv("TILESTACK_PDL", "on")
    with pytest.raises(tilehal.ArgumentError, match="TILESTACK_PDL: expected one of"):
        tilehal.pdl_requested()


SRC = r"""
extern "C" __global__ void slow_fill(int* x, int n, int v, long long spin) {
  long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = v + i;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
extern "C" __global__ void waiting_copy(const int* x, int* y, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i];
}
"""


@pytest.mark.gpu
def test_pdl_consumer_sees_the_producers_writes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = tilehal.compile_cuda(SRC, arch="sm_90a", name="pdl_pair")
    fill, copy = m.get_kernel("slow_fill"), m.get_kernel("waiting_copy")
    n = 1 << 16
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    y = torch.zeros_like(x)
    want = torch.arange(n, dtype=torch.int32, device="cuda")
    for v in range(3):  # the first launch takes the checked path, the next ones the cached plan
        fill.launch(64, 256, [x, n, v, 200_000])
        copy.launch(64, 256, [x, y, n], pdl=True)
        torch.cuda.synchronize()
        assert torch.equal(y, want + v), v
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill.launch(64, 256, [x, n, 7, 200_000])
        copy.launch(64, 256, [x, y, n], pdl=True)
    y.zero_()
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want + 7)


def test_pdl_pair_compiles():
    if tilehal.compiler_versions()["nvrtc"] is None:
        pytest.skip("needs NVRTC")
    m = tilehal.compile_cuda(SRC, arch="sm_90a", name="pdl_pair")
    assert len(m.cubin) > 500
