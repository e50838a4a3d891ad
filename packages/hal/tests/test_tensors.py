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


def test_stream_buffer_checks_its_sizes():
    pytest.importorskip("torch")
    from tilehal import ArgumentError, stream_buffer

    for bad in ({"numel": -1}, {"numel": 2.5}, {"min_numel": 0}, {"numel": True}):
        kw = {"numel": 8, **bad}
        with pytest.raises(ArgumentError, match=next(iter(bad))):
            stream_buffer({}, None, **kw)


@pytest.mark.gpu
def test_stream_buffer_is_per_stream_zeroed_and_grows():
    import torch
    from tilehal import stream_buffer

    cache: dict = {}
    dev = torch.device("cuda", torch.cuda.current_device())
    a = stream_buffer(cache, dev, 10)
    assert a.dtype == torch.int32 and a.numel() == 256 and int(a.abs().sum()) == 0
    assert stream_buffer(cache, dev, 200) is a  # big enough: the same buffer
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = stream_buffer(cache, dev, 10)
    assert b is not a and len(cache) == 2  # another stream: its own buffer
    c = stream_buffer(cache, dev, 1000, dtype=torch.int64)
    assert c is not a and c.numel() == 1000 and c.dtype == torch.int64 and int(c.abs().sum()) == 0
