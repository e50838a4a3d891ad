import ml_dtypes
import numpy as np
import pytest
from tilehal import get_dtype, to_numpy_dtype
from tilehal.dtypes import TABLE


@pytest.mark.parametrize("row", TABLE, ids=lambda d: d.name)
def test_itemsize_matches_numpy(row):
    assert np.dtype(row.numpy).itemsize == row.itemsize


@pytest.mark.parametrize(
    "spelling, name",
    [("float", "float32"), ("bf16", "bfloat16"), ("float8_e4m3fn", "float8_e4m3"), ("e5m2", "float8_e5m2"),
     ("torch.float16", "float16"), ("half", "float16"), ("int", "int32")],
)
def test_aliases(spelling, name):
    assert get_dtype(spelling).name == name


def test_numpy_and_ml_dtypes_round_trip():
    assert get_dtype(np.float32).name == "float32"
    assert get_dtype(ml_dtypes.bfloat16).name == "bfloat16"
    assert to_numpy_dtype("float8_e4m3") == np.dtype(ml_dtypes.float8_e4m3fn)


def test_torch_round_trip():
    torch = pytest.importorskip("torch")
    for row in TABLE:
        t = row.to_torch()
        assert get_dtype(t) is row
        assert torch.empty(0, dtype=t).element_size() == row.itemsize


def test_unknown_dtype_message_names_choices():
    with pytest.raises(TypeError, match="complex64"):
        get_dtype("complex64")
    with pytest.raises(TypeError, match="bfloat16"):
        get_dtype("nope")
