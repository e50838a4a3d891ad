import numpy as np
import pytest
from tilehal import ShapeError, as_numpy, check_tensor, from_numpy_like


def test_check_tensor_accepts_matching_numpy():
    x = np.zeros((4, 8), np.float32)
    assert check_tensor(x, "x", dtype="float32", shape=(4, None), contiguous=True, device="cpu") is x


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"dtype": "float16"}, r"x: expected dtype float16, got float32"),
        ({"shape": (4, 9)}, r"x: expected shape \(4, 9\), got \(4, 8\)"),
        ({"ndim": 3}, r"x: expected 3 dimensions, got 2"),
        ({"device": "cuda"}, r"x: expected device cuda, got cpu"),
    ],
)
def test_check_tensor_messages_name_argument_expected_actual(kwargs, pattern):
    with pytest.raises(ShapeError, match=pattern):
        check_tensor(np.zeros((4, 8), np.float32), "x", **kwargs)


def test_non_contiguous_and_alignment():
    x = np.zeros((4, 8), np.float32)[:, ::2]
    with pytest.raises(ShapeError, match="contiguous"):
        check_tensor(x, "x", contiguous=True)
    y = np.zeros(64, np.uint8)[1:]
    with pytest.raises(ShapeError, match="aligned to 16 bytes"):
        check_tensor(y, "y", alignment=16)


def test_shape_error_is_a_value_error():
    with pytest.raises(ValueError):
        check_tensor([1, 2], "lst")


def test_torch_views_share_memory():
    torch = pytest.importorskip("torch")
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32):
        t = torch.zeros(6, dtype=dt)
        a = as_numpy(t)
        assert a.shape == (6,)
        a[2] = 1
        assert float(t[2].float()) == 1.0  # zero-copy: the write shows through
        back = from_numpy_like(a, t)
        assert back.dtype == dt and back.data_ptr() == t.data_ptr()
