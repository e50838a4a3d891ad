"""tilehal's public entry points, each argument replaced in turn by a bad value (wrong type, NaN, 0, -1,
huge, empty / NaN tensors): the call succeeds or raises a TileStackError naming the argument, never a
raw numpy/torch/Python exception or a hang (issue 16, item 7)."""

import numpy as np
import pytest
import tilehal
from tilehal import Arg
from tilehal.testing import probe_arguments

_SRC = "int add1(int x) { return x + 1; }"

CASES = {
    "check_tensor": lambda: (tilehal.check_tensor, dict(x=np.ones((2, 3), np.float32), name="x", dtype="float32",
                                                        shape=(2, 3), ndim=2, contiguous=True, device="cpu",
                                                        alignment=4)),
    "check_int": lambda: (tilehal.check_int, dict(value=3, arg="n", lo=0, hi=5)),
    "check_choice": lambda: (tilehal.check_choice, dict(value="a", arg="mode", choices=("a", "b"))),
    "calc_diff": lambda: (tilehal.calc_diff, dict(x=np.ones(4), y=np.ones(4))),
    "bench": lambda: (tilehal.bench, dict(fn=lambda: None, warmup=1, iters=2, device="cpu", flush_l2=False,
                                          min_time_s=0.0)),
    "get_dtype": lambda: (tilehal.get_dtype, dict(x="float32")),
    "to_torch_dtype": lambda: (tilehal.to_torch_dtype, dict(x="bfloat16")),
    "to_numpy_dtype": lambda: (tilehal.to_numpy_dtype, dict(x="float16")),
    "as_numpy": lambda: (tilehal.as_numpy, dict(x=np.ones(3))),
    "data_ptr": lambda: (tilehal.data_ptr, dict(x=np.ones(3))),
    "dtype_of": lambda: (tilehal.dtype_of, dict(x=np.ones(3))),
    "is_contiguous": lambda: (tilehal.is_contiguous, dict(x=np.ones(3))),
    "device_of": lambda: (tilehal.device_of, dict(x=np.ones(3))),
    "from_numpy_like": lambda: (tilehal.from_numpy_like, dict(arr=np.ones(3), like=np.ones(3))),
    "expect": lambda: (tilehal.expect, dict(condition=True, arg="x", expected=1, actual=1)),
    "compile_c": lambda: (tilehal.compile_c, dict(source=_SRC, cdef="int add1(int x);", flags=[], openmp=False,
                                                  include_dirs=[], libraries=[], name="probe_add1")),
    "Arg.i32": lambda: (Arg.i32, dict(v=7)),
    "Arg.u64": lambda: (Arg.u64, dict(v=7)),
    "Arg.f32": lambda: (Arg.f32, dict(v=1.5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name):
    if name == "to_torch_dtype":
        pytest.importorskip("torch")  # tilehal installs without torch (nox -s isolation)
    fn, kwargs = CASES[name]()
    fn(**kwargs)  # the baseline is valid
    assert probe_arguments(fn, kwargs, fresh=CASES[name]) == []


def test_environ_sets_unsets_and_restores(monkeypatch):
    import os

    from tilehal.testing import environ

    monkeypatch.setenv("TILESTACK_T_A", "old")
    monkeypatch.delenv("TILESTACK_T_B", raising=False)
    with environ({"TILESTACK_T_A": None, "TILESTACK_T_B": "new"}):
        assert "TILESTACK_T_A" not in os.environ and os.environ["TILESTACK_T_B"] == "new"
    assert os.environ["TILESTACK_T_A"] == "old" and "TILESTACK_T_B" not in os.environ
    with pytest.raises(KeyError), environ({"TILESTACK_T_B": "x"}):
        raise KeyError("inside")
    assert "TILESTACK_T_B" not in os.environ  # restored after an error too


def test_without_modules_hides_imports_in_the_block_only():
    import builtins
    import json  # noqa: F401  (loaded before the block: still refused inside it)

    from tilehal import ArgumentError
    from tilehal.testing import without_modules

    real = builtins.__import__
    with without_modules("json", "xml.dom"):
        with pytest.raises(ImportError, match="json"):
            import json  # noqa: F401, F811
        with pytest.raises(ImportError):
            import xml.dom.minidom  # noqa: F401
        import xml  # noqa: F401  (only the named prefixes)
    import json  # noqa: F401, F811
    assert builtins.__import__ is real
    with pytest.raises(ValueError), without_modules("json"):
        raise ValueError("inside")
    assert builtins.__import__ is real             # restored after an error too
    with pytest.raises(ArgumentError, match="prefixes"), without_modules():
        pass
