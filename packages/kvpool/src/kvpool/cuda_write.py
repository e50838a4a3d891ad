"""CUDA write path (kernels/kv_write.cuh): K/V stores and key-summary update in one launch."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import tilehal
import torch

log = logging.getLogger("kvpool.cuda_write")

KERNEL_DIR = Path(__file__).with_name("kernels")
_CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}
POOL_DTYPES = (torch.bfloat16, torch.float16)


def kernel_name(in_dtype: torch.dtype, pool_dtype: torch.dtype, fp8_summaries: bool = False) -> str:
    return f"kvpool::kv_write_kernel<{_CTYPES[in_dtype]}, {_CTYPES[pool_dtype]}, {str(fp8_summaries).lower()}>"


def encode_kernel_name(pool_dtype: torch.dtype) -> str:
    return f"kvpool::int4_encode_kernel<{_CTYPES[pool_dtype]}>"


@functools.cache
def compile_write(arch: str = "sm_90a") -> tilehal.CudaModule:
    names = [kernel_name(i, p, f) for i in _CTYPES for p in POOL_DTYPES for f in (False, True)]
    names += [encode_kernel_name(p) for p in POOL_DTYPES]
    return tilehal.compile_cuda('#include "kv_write.cuh"\n', arch=arch, name="kv_write",
                                include_dirs=[str(KERNEL_DIR)], name_expressions=names)


def unsupported_reason(storage, k: torch.Tensor) -> str | None:
    if storage.device.type != "cuda":
        return f"storage on {storage.device}"
    if storage.is_fp8:
        return "fp8 pool (requantizing writes run in torch)"
    if storage.dtype not in POOL_DTYPES:
        return f"pool dtype {storage.dtype} (kernel: bf16/fp16)"
    if k.dtype not in _CTYPES:
        return f"input dtype {k.dtype} (kernel: fp32/bf16/fp16)"
    if storage.head_dim % 2:
        return f"odd head_dim {storage.head_dim}"
    if storage.fp8_summaries and (storage.num_blocks * storage.num_kv_heads * storage.head_dim) % 4:
        return "fp8 summaries of a layer not 4-byte aligned (num_blocks * kv_heads * head_dim % 4 != 0)"
    return None


def write_kv(storage, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K/V `[T, H, D]` at `slots` (int64 on the device) and widen kmin/kmax: one launch."""
    T = slots.shape[0]
    if T == 0:
        return
    k = k.to(storage.device).contiguous()
    v = v.to(device=storage.device, dtype=k.dtype).contiguous()
    kern = compile_write().get_kernel(kernel_name(k.dtype, storage.dtype, storage.fp8_summaries))
    kern.launch(T, 256, [k, v, slots.contiguous(), storage.num_kv_heads, storage.head_dim, storage.block_size,
                         storage.k[layer], storage.v[layer], storage.kmin[layer], storage.kmax[layer]])


def encode_int4(storage, layer: int, slots: torch.Tensor) -> None:
    """Re-encode the int4 summary rows of the blocks `slots` wrote (after write_kv): one launch."""
    T = slots.shape[0]
    if T == 0:
        return
    kern = compile_write().get_kernel(encode_kernel_name(storage.dtype))
    kern.launch(T, 256, [slots.contiguous(), storage.num_kv_heads, storage.head_dim, storage.block_size,
                         storage.kmin[layer], storage.kmax[layer], storage.kmin_q4[layer], storage.kmax_q4[layer]])
