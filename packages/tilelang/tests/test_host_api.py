"""The host-side API the public TileLang's examples import: autotuner, PassConfigKey, do_bench,
testing, utils, T.dtype, cdiv / next_power_of_2, TensorSupplyType.Auto."""

import logging

import numpy as np
import pytest
import tilehal
import tilelang
import tilelang.language as T
import torch
from tilelang.autotuner import autotune
from tilelang.profiler import do_bench
from tilelang.utils.tensor import torch_assert_close


def test_cdiv_next_power_of_2():
    assert [tilelang.cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [tilelang.next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]
    with pytest.raises(tilehal.ArgumentError, match="b must be non-zero"):
        tilelang.cdiv(3, 0)
    with pytest.raises(tilehal.ArgumentError, match="expected a Python int"):
        tilelang.next_power_of_2(2.5)


def test_dtype_objects():
    assert T.dtype("float16").as_torch() is torch.float16
    assert T.dtype(T.float8_e4m3fn) == "float8_e4m3" and T.float == "float32" and T.float.bits == 32
    from tilelang.language.fp8 import determine_fp8_type

    assert determine_fp8_type("e5m2") == "float8_e5m2"
    assert tilelang.utils.map_torch_type("bfloat16") is torch.bfloat16


def _copy_kernel(pass_configs):
    @tilelang.jit(out_idx=[-1], target="cpu", pass_configs=pass_configs)
    def f(n):
        @T.prim_func
        def main(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32")):
            with T.Kernel(1) as _:
                for i in T.Parallel(n):
                    B[i] = A[i] * 2.0

        return main

    return f(64)


def test_pass_configs_honored_logged_or_refused(caplog):
    with caplog.at_level(logging.INFO, logger="tilelang.pass_config"):
        k = _copy_kernel({tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True, "tl.disable_tma_lower": True})
    assert "tl.disable_warp_specialized=True has no effect on target cpu" in caplog.text
    assert "#pragma omp simd" in k.get_kernel_source()
    k2 = _copy_kernel({tilelang.PassConfigKey.TIR_DISABLE_VECTORIZE: True})
    assert "#pragma omp simd" not in k2.get_kernel_source()
    np.testing.assert_array_equal(k2(np.ones(64, np.float32)), np.full(64, 2, np.float32))
    with pytest.raises(tilehal.ArgumentError, match="unknown key 'tl.disable_tma_lowr'"):
        _copy_kernel({"tl.disable_tma_lowr": True})


def test_do_bench_time_budget():
    calls = []
    ms = do_bench(lambda: calls.append(1), warmup=1, rep=2)
    assert ms > 0 and len(calls) >= 2
    q = do_bench(lambda: None, _n_warmup=0, _n_repeat=5, quantiles=[0.0, 0.5, 1.0])
    assert len(q) == 3 and q[0] <= q[1] <= q[2]
    calls.clear()
    do_bench(lambda: calls.append(1), _n_warmup=2, _n_repeat=3)
    assert len(calls) == 1 + 2 + 3  # the estimate, warm-up, timed calls
    with pytest.raises(ValueError, match="return_mode"):
        do_bench(lambda: None, return_mode="p99")


def test_tensor_supply_auto_by_dtype():
    @tilelang.jit(out_idx=[-1], target="interp")
    def f():
        @T.prim_func
        def main(A: T.Tensor((256,), "int32"), B: T.Tensor((256,), "float32"), C: T.Tensor((256,), "float32")):
            with T.Kernel(1) as _:
                for i in T.Parallel(256):
                    C[i] = A[i] + B[i]

        return main

    prof = f().get_profiler(tilelang.TensorSupplyType.Auto)
    a, b = prof.inputs()
    assert a.dtype == torch.int32 and int(a.abs().max()) <= 2
    assert b.dtype == torch.float32 and float(b.std()) > 0.5 and not torch.equal(b, b.round())
    prof.assert_allclose(lambda a, b: a + b, atol=1e-6, rtol=0)


def test_torch_assert_close_mismatch_budget():
    x = torch.zeros(1000)
    y = x.clone()
    y[0] = 1.0
    torch_assert_close(x, y, max_mismatched_ratio=0.001)
    with pytest.raises(AssertionError, match="1 of 1000"):
        torch_assert_close(x, y, max_mismatched_ratio=0.0)


def test_testing_seed_is_deterministic():
    tilelang.testing.set_random_seed(7)
    a = (np.random.rand(), torch.rand(1).item())
    tilelang.testing.set_random_seed(7)
    assert a == (np.random.rand(), torch.rand(1).item())


def _tuned_scale(configs):
    @autotune(configs=configs, warmup=1, rep=1, cache=False, progress=False)
    @tilelang.jit(target="interp")
    def scale(X, block=4):
        n = T.const("n")
        X: T.Tensor((n,), "float32")
        Y = T.empty((n,), "float32")
        with T.Kernel(T.ceildiv(n, block)) as bx:
            for i in T.Parallel(block):
                Y[bx * block + i] = X[bx * block + i] * 3.0
        return Y

    return scale


def test_autotune_explicit_tunables_mean_no_tuning():
    # block=4 is in no config: passing it explicitly must build exactly that kernel, untuned.
    scale = _tuned_scale([{"block": 8}, {"block": 16}])
    x = torch.arange(12, dtype=torch.float32)
    torch.testing.assert_close(scale(x, block=4), x * 3)
    assert scale.last_result is None  # nothing was tuned
    k = scale.compile(x, block=4)
    assert isinstance(k, tilelang.JITKernel) and "block" not in getattr(k, "config", {})
    k2 = scale.compile(n=12, block=4)  # T.const sizes by keyword are not tunables
    assert scale.last_result is None
    torch.testing.assert_close(k2(x), x * 3)
    from tilelang.utils.tensor import get_tensor_supply

    t = get_tensor_supply(tilelang.TensorSupplyType.Integer)(k2.params[0])
    assert tuple(t.shape) == (12,) and torch.equal(t, t.round())


def test_autotune_eager_tunes_and_runs():
    scale = _tuned_scale([{"block": 4}, {"block": 8}])
    x = torch.arange(16, dtype=torch.float32)
    torch.testing.assert_close(scale(x), x * 3)
    assert scale.last_result is not None and scale.last_result.config in ({"block": 4}, {"block": 8})
    assert set(scale.last_result.timings) == {'{"block": 4}', '{"block": 8}'}
