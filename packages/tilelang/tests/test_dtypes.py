"""Conversions into 16/8-bit float tensors: the C backend rounds exactly like numpy/ml_dtypes (interp)."""

import numpy as np
import pytest
import tilelang
import tilelang.language as T


def _convert_kernel(n, dtype, target):
    @T.prim_func
    def conv(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), dtype), Z: T.Tensor((n,), "float32")):
        with T.Kernel(1) as bx:
            for i in T.Parallel(n):
                Y[i] = X[i]
            for i in T.Parallel(n):
                Z[i] = Y[i]

    return tilelang.compile(conv, out_idx=[1, 2], target=target)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3", "float8_e5m2"])
def test_store_rounding_matches_interp(dtype):
    rng = np.random.default_rng(0)
    vals = np.concatenate([
        rng.standard_normal(3000) * np.exp2(rng.integers(-30, 30, 3000)),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 465.0, 480.0, 57344.0, 61440.0, 65504.0,
                  65520.0, 1e-8, -1e-8, 2.0**-10, 2.0**-17, 2.0**-9 * 1.5]),
    ]).astype(np.float32)
    n = vals.size
    y_c, z_c = _convert_kernel(n, dtype, "cpu")(vals)
    y_i, z_i = _convert_kernel(n, dtype, "interp")(vals)
    bits = np.uint16 if y_c.dtype.itemsize == 2 else np.uint8
    yc, yi = y_c.view(bits), y_i.view(bits)
    nan_c, nan_i = np.isnan(z_c), np.isnan(z_i)
    np.testing.assert_array_equal(nan_c, nan_i)
    np.testing.assert_array_equal(yc[~nan_c], yi[~nan_i])
    np.testing.assert_array_equal(z_c[~nan_c], z_i[~nan_i])
