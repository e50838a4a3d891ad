import numpy as np
import pytest
from tilehal import ArgumentError, ShapeError, bench, bench_host, calc_diff


def test_calc_diff_identical_is_zero_and_scale_sensitive():
    x = np.random.default_rng(0).standard_normal((64, 64))
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert calc_diff(x, 1.01 * x) == pytest.approx(1 - 2 * 1.01 / (1 + 1.01**2), rel=1e-9)
    assert calc_diff(x, -x) == pytest.approx(2.0)


def test_calc_diff_shape_mismatch():
    with pytest.raises(ShapeError, match=r"\(2,\) and \(3,\)"):
        calc_diff(np.zeros(2), np.zeros(3))


def test_bench_times_the_function_on_cpu():
    calls = []

    def work():
        calls.append(1)
        np.linalg.norm(np.ones(10000))

    r = bench(work, warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and r.iters == 5
    assert 0 < r.min_s <= r.median_s <= r.max_s
    assert r.timer == "perf_counter"


@pytest.mark.parametrize("bad", ["clean", "memset", 2, None])
def test_bench_flush_mode_is_checked(bad):
    import tilehal

    calls = []
    with pytest.raises(tilehal.ArgumentError, match="flush_l2: expected one of"):
        bench(lambda: calls.append(1), flush_l2=bad, device="cpu")
    assert calls == []  # refused before running anything


def test_bench_flush_modes_accepted_on_cpu():
    for mode in (False, True, "write", "read"):  # on the CPU no L2 flush runs: the figure is perf_counter's
        assert bench(lambda: None, warmup=0, iters=2, device="cpu", flush_l2=mode).iters == 2


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("name", ["bench_graph", "capture_graph"])
def test_graph_helpers_need_a_gpu(name):
    import tilehal

    calls = []
    with pytest.raises(tilehal.DeviceError, match=name):
        getattr(tilehal, name)(lambda: calls.append(1))
    assert calls == []  # refused before running anything


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_graph_helpers_capture_after_warming_up_and_time_the_replay():
    import torch
    from tilehal import ArgumentError, bench_graph, capture_graph

    x = torch.zeros(1 << 20, device="cuda")
    calls = []

    def step():
        calls.append(1)  # Python side effects run at the eager calls and at the capture only
        x.add_(1)
        return x * 2

    graph, out = capture_graph(step, warmup=2, reps=3)
    assert len(calls) == 2 + 3                      # the warm-up calls, then the captured ones (Python runs once)
    torch.cuda.synchronize()
    assert x[0].item() == 2                         # capturing ran nothing on the GPU
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 5 and out[0].item() == 10  # three adds per replay; out is the last captured call's
    with pytest.raises(ArgumentError, match="reps"):
        capture_graph(step, reps=0)
    x.zero_()
    calls.clear()
    r = bench_graph(step, warmup=2, iters=5)
    assert r.timer == "cuda_events" and r.median_s > 0 and len(calls) == 2
    torch.cuda.synchronize()
    assert x[0].item() == 1 + 2 + r.iters  # the eager call, then every replay (capturing runs nothing)


def test_bench_host_times_batches_of_back_to_back_calls():
    calls = []

    def work():
        calls.append(1)
        np.linalg.norm(np.ones(1000))

    r = bench_host(work, warmup=3, batches=4, per=5)
    assert len(calls) == 3 + 4 * 5 and r.iters == 4 and len(r.times_s) == 4
    assert 0 < r.min_s <= r.median_s <= r.max_s and r.host_s == r.median_s
    assert r.timer == "host"
    for bad in ({"per": 0}, {"batches": 0}, {"warmup": -1}, {"per": 1.5}):
        with pytest.raises(ArgumentError, match=next(iter(bad))):
            bench_host(work, **bad)


def test_calc_diff_of_torch_tensors_matches_the_numpy_path():
    """Torch tensors are compared on their device in float64 (DeepGEMM's helper does so on the GPU): the same
    value as the numpy path, bf16 inputs included; shapes still checked."""
    torch = pytest.importorskip("torch")  # tilehal's isolation session has no torch

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g)
    y = x + 0.01 * torch.randn(64, 48, generator=g)
    assert calc_diff(x, y) == pytest.approx(calc_diff(x.numpy(), y.numpy()), rel=1e-12)
    xb, yb = x.bfloat16(), y.bfloat16()
    assert calc_diff(xb, yb) == pytest.approx(calc_diff(xb.float().numpy(), yb.float().numpy()), rel=1e-12)
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ShapeError, match="calc_diff"):
        calc_diff(torch.zeros(2), torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_bench_flush_modes_on_a_gpu():
    """Each flush mode times the call alone (the flush runs before the start event): a 64 MiB copy reads
    from DRAM after either flush, and is faster warm (the L2 holds part of it)."""
    import torch

    x = torch.ones(16 * 2**20, device="cuda")
    y = torch.empty_like(x)
    t = {m: bench(lambda: y.copy_(x), warmup=2, iters=10, flush_l2=m).median_s for m in (False, "write", "read")}
    assert all(v > 0 for v in t.values()) and t["read"] < 1e-3 and t["write"] < 1e-3, t
