"""tilehal: the hardware abstraction every TileStack package stands on.

Devices, the dtype table, tensor checks, the C and CUDA JITs with their disk cache, timing,
and the exception hierarchy.
"""

from .__about__ import __version__
from .bench import BenchResult, bench, bench_graph, bench_host, calc_diff, capture_graph
from .cache import cache_dir
from .devices import CPUDevice, CUDADevice, cpu, cuda_devices, cuda_unavailable_reason, devices
from .dtypes import DType, get_dtype, to_numpy_dtype, to_torch_dtype
from .errors import (
    ArgumentError,
    CacheError,
    CommTimeoutError,
    CompileError,
    DeviceError,
    LaunchError,
    ShapeError,
    TileStackError,
    check_choice,
    check_int,
    expect,
)
from .jit.c import CLibrary, c_compiler, c_compiler_version, compile_c
from .jit.cuda import compile_cuda, compiler_versions, cuda_include_dirs, include_dir
from .jit.launch import Arg, CudaModule, Kernel, ensure_context, pdl_requested
from .progress import progress
from .tensors import (
    as_numpy,
    check_tensor,
    data_ptr,
    device_of,
    dtype_of,
    from_numpy_like,
    is_contiguous,
    is_torch,
    stream_buffer,
)

__all__ = [
    "__version__", "Arg", "ArgumentError", "BenchResult", "CacheError", "CLibrary", "CPUDevice", "CUDADevice", "CommTimeoutError", "CompileError",
    "CudaModule", "DType", "DeviceError", "Kernel", "LaunchError", "ShapeError", "TileStackError", "as_numpy",
    "bench", "bench_graph", "bench_host", "c_compiler", "c_compiler_version", "cache_dir", "calc_diff", "capture_graph", "progress", "check_choice", "check_int", "check_tensor", "compile_c",
    "compile_cuda", "compiler_versions", "cpu", "cuda_devices", "cuda_include_dirs", "cuda_unavailable_reason",
    "data_ptr", "device_of", "devices", "dtype_of", "ensure_context", "expect", "pdl_requested", "from_numpy_like", "get_dtype", "include_dir",
    "is_contiguous", "is_torch", "stream_buffer", "to_numpy_dtype", "to_torch_dtype",
]
