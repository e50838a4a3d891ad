"""The tile language: `import tilelang.language as T`.

Statement-level names (T.copy, T.gemm, T.Kernel, T.Parallel, ...) only mean something inside a
`@T.prim_func` body, where the front end reads them from the function's source; calling them
from plain Python raises. Expression-level names (T.exp2, T.max, T.ceildiv, ...) are ordinary
functions that build IR, and fold Python numbers at meta level.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CompileError
from ..frontend.meta import Macro, TensorType, tensor_type
from ..frontend.parser import parse_prim_func
from ..ir import dtypes as _dt
from ..ir.nodes import PrimFunc, Var
from .ops import *  # noqa: F403
from .ops import DTypeConst, dtype_constants

globals().update(dtype_constants())  # T.float, T.int, ... (builtins.int inside this module)
dtype = DTypeConst  # T.dtype("float16"), and the annotation `dtype: T.dtype = T.float16`
__tl_language__ = True  # how the front end recognizes `T` in `T.name`


class _TensorAnnotation:
    """`T.Tensor(shape, dtype)` or `T.Tensor[shape, dtype]`: a global tensor parameter (shape entries are
    ints, `T.const` or `T.dynamic` sizes)."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, shape: Sequence[Any] | int, dtype: Any = "float32", data: Any = None, *_, **__: Any
                 ) -> TensorType:
        return tensor_type(shape, dtype, data)

    def __getitem__(self, key: Any) -> TensorType:
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], (list, tuple, builtins.int, Var)):
            return tensor_type(key[0], key[1])
        return tensor_type(key, "float32")

    def __repr__(self) -> str:
        return f"T.{self.__name__}"


Tensor = _TensorAnnotation("Tensor")
StridedTensor = _TensorAnnotation("StridedTensor")  # strides are not modelled: tensors are C-contiguous
Buffer = Tensor  # older TileLang spelling


def dynamic(name: str, dtype: str = "int32") -> Var:
    """A symbolic size bound at call time from the tensors' shapes."""
    return Var(name, _dt.canonical(dtype))


symbolic = dynamic


def _eager(kind: str, doc: str) -> Callable:
    def f(*args: Any, **kwargs: Any) -> Any:
        raise CompileError(f"T.{kind}(...) can only be used in the body of an eager @tilelang.jit function")

    f.__name__ = kind
    f.__doc__ = doc
    f.__tl_eager__ = kind
    return f


def reshape(src: Any, shape: Sequence[Any]) -> TensorType:
    """`T.reshape(tensor, shape)`: a view of a global tensor with another shape (same element count)."""
    return tensor_type(shape, src.dtype, src)


def view(src: Any, shape: Sequence[Any] | None = None, dtype: Any = None) -> TensorType:
    """`T.view(tensor, shape=, dtype=)`: like T.reshape (the dtype must stay the same)."""
    return tensor_type(shape if shape is not None else src.shape, dtype or src.dtype, src)


reshape.__tl_meta__ = view.__tl_meta__ = True  # they take buffers as they are


const = _eager("const", 'M, N = T.const("M, N"): sizes specialized per call (from the tensors) or given to '
                        '.compile(M=..., N=...)')
empty = _eager("empty", "C = T.empty(shape, dtype): an output tensor of an eager @tilelang.jit function (return it)")


def prim_func(func: Callable | None = None, **_: Any) -> PrimFunc:
    """Parse a tile program into a PrimFunc (errors cite the function's file:line)."""
    if func is None:
        return prim_func  # type: ignore[return-value]  # used as @T.prim_func()
    return parse_prim_func(func)


def macro(func: Callable) -> Macro:
    return Macro(func)


class GemmWarpPolicy:
    """How a GPU gemm splits warps over the tile; recorded in the IR, ignored by CPU backends."""

    Square = "Square"
    FullRow = "FullRow"
    FullCol = "FullCol"


def _statement(name: str, doc: str) -> Callable:
    def stmt(*args: Any, **kwargs: Any) -> Any:
        raise CompileError(f"T.{name} is only valid inside a @T.prim_func body")

    stmt.__name__ = name
    stmt.__doc__ = doc
    stmt.__tl_stmt__ = name
    return stmt


def _loop(kind: str, doc: str) -> Callable:
    f = _statement(kind, doc)
    f.__tl_loop__ = kind
    return f


def _alloc(scope: str) -> Callable:
    f = _statement(f"alloc_{scope}", f"Allocate a {scope} buffer for the current thread block.")
    f.__tl_alloc__ = scope
    return f


Kernel = _statement("Kernel", "with T.Kernel(gx[, gy[, gz]], threads=N) as bx | (bx, by) | (bx, by, bz)")
Kernel.__tl_kernel__ = True
Parallel = _loop("Parallel", "for i, j in T.Parallel(M, N): element-parallel loop over a tile")
Pipelined = _loop("Pipelined", "for k in T.Pipelined(n, num_stages=S): software-pipelined serial loop")
serial = _loop("serial", "for i in T.serial(n) / T.serial(start, stop[, step])")
unroll = _loop("unroll", "for i in T.unroll(n): fully unrolled serial loop")
vectorized = _loop("vectorized", "for i in T.vectorized(n): vectorized loop")
Persistent = _loop("Persistent", "for bx, by in T.Persistent([m_blocks, n_blocks], wave_size, index, group_size=8): "
                                "the tiles a persistent block visits, in grouped order")
grid = _loop("grid", "for i, j in T.grid(M, N): nested serial loops")
Serial, Unroll, Vectorized, parallel = serial, unroll, vectorized, Parallel  # the public spellings
alloc_shared = _alloc("shared")
alloc_fragment = _alloc("fragment")
alloc_local = _alloc("local")
alloc_var = _alloc("var")
alloc_global = _statement("alloc_global", "buf = T.alloc_global(shape, dtype): a zero-filled global tensor for one "
                                          "call, shared by the program's T.Kernel blocks (outside them)")
alloc_global.__tl_alloc__ = "global"
copy = _statement("copy", "T.copy(src, dst): tile copy between global/shared/fragment (zero-fill past the end)")
gemm = _statement("gemm", "T.gemm(A, B, C, transpose_A=False, transpose_B=False, clear_accum=False): C += A @ B")
clear = _statement("clear", "T.clear(buf): fill with zero")
fill = _statement("fill", "T.fill(buf, value)")
reduce_max = _statement("reduce_max", "T.reduce_max(src, dst, dim=-1, clear=True)")
reduce_min = _statement("reduce_min", "T.reduce_min(src, dst, dim=-1, clear=True)")
reduce_sum = _statement("reduce_sum", "T.reduce_sum(src, dst, dim=-1, clear=True)")
reduce_abssum = _statement("reduce_abssum", "T.reduce_abssum(src, dst, dim=-1, clear=True)")
reduce_absmax = _statement("reduce_absmax", "T.reduce_absmax(src, dst, dim=-1, clear=True)")
cumsum = _statement("cumsum", "T.cumsum(src, dst=None, dim=0, reverse=False)")
atomic_add = _statement("atomic_add", "T.atomic_add(dst, value): dst += value atomically")
im2col = _statement("im2col", "T.im2col(img, col, nhw_step, c_step, kernel, stride, dilation, pad): the im2col tile of "
                              "an NHWC image into a (block_M, block_K) buffer")
c2d_im2col = _statement("c2d_im2col", "older spelling of T.im2col")
use_swizzle = _statement("use_swizzle", "T.use_swizzle(panel_size=10, order='row'): block rasterization hint")
annotate_layout = _statement("annotate_layout", "T.annotate_layout({buf: layout}): layout hint for GPU backends")

__all__ = [  # noqa: F405
    "Buffer", "GemmWarpPolicy", "Serial", "Unroll", "Vectorized", "parallel", "StridedTensor", "const", "dtype", "empty", "Kernel", "Macro", "Parallel", "Pipelined", "Tensor", "TensorType", "abs",
    "Cast", "Persistent", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "shift_left",
    "shift_right", "reshape", "view", "c2d_im2col", "im2col", "alloc_fragment", "alloc_global", "alloc_local", "alloc_shared", "alloc_var", "annotate_layout", "atomic_add", "cast", "ceil",
    "ceildiv", "clamp", "clear", "copy", "cos", "cumsum", "dynamic", "exp", "exp2", "fill", "floor", "floordiv", "floormod",
    "gemm", "grid", "if_then_else", "infinity", "log", "log2", "macro", "max", "max_value", "min", "min_value",
    "pow", "prim_func", "reduce_absmax", "reduce_abssum", "reduce_max", "reduce_min", "reduce_sum", "round",
    "rsqrt", "serial", "sigmoid", "sin", "sqrt", "symbolic", "tanh", "unroll", "use_swizzle", "vectorized",
    "DTypeConst", *dtype_constants(),
]
