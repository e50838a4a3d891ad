"""deepgemm: DeepGEMM-style FP8/BF16 dense and grouped (MoE) GEMMs.

CUDA tensors run JIT-compiled, shape-specialized sm_90a kernels (TMA + wgmma + mbarrier pipeline);
CPU tensors run the exact reference, so code using deepgemm runs and is testable anywhere.
DeepGEMM's names (HEAD `fp8_fp4_*`, the `fp8_*` aliases, the v1 names) and `deepgemm.testing` /
`deepgemm.utils` are provided, so `import deepgemm as deep_gemm` runs DeepGEMM users' code.
"""

from . import testing, utils
from .__about__ import __version__
from .fp4 import bf16_fp4_gemm_nt, cast_weights_to_fp4, m_grouped_bf16_fp4_gemm_nt_masked
from .gemm import (
    SWIGLU_INTERLEAVE,
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    bf16_m_grouped_gemm_nt_masked,
    cublaslt_gemm_nn,
    cublaslt_gemm_nt,
    cublaslt_gemm_tn,
    cublaslt_gemm_tt,
    fp8_fp4_gemm_nn,
    fp8_fp4_gemm_nt,
    fp8_fp4_gemm_tn,
    fp8_fp4_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_nt,
    fp8_gemm_tn,
    fp8_gemm_tt,
    fp8_m_grouped_gemm_nt_masked,
    gemm,
    gemm_fp8_fp8_bf16_nt,
    k_grouped_bf16_gemm_tn_contiguous,
    k_grouped_fp8_gemm_nt_contiguous,
    k_grouped_fp8_gemm_tn_contiguous,
    k_grouped_wgrad_gemm_fp8_fp8_fp32_nt,
    m_grouped_bf16_gemm_nn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_masked,
    m_grouped_fp8_fp4_gemm_nn_contiguous,
    m_grouped_fp8_fp4_gemm_nt_contiguous,
    m_grouped_fp8_fp4_gemm_nt_masked,
    m_grouped_fp8_gemm_nn_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_contiguous_swiglu,
    m_grouped_fp8_gemm_nt_masked,
    m_grouped_gemm_fp8_fp8_bf16_nt_contiguous,
    m_grouped_gemm_fp8_fp8_bf16_nt_masked,
    psum_to_m_indices,
    swiglu_deinterleave,
    swiglu_interleave,
    wgrad_gemm_fp8_fp8_fp32_nt,
)
from .heuristics import GemmConfig, pick_config
from .utils import (
    align,
    cast_back_from_fp4,
    ceil_div,
    ceil_to_ue8m0,
    get_k_alignment_for_contiguous_layout,
    get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_num_sms,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    pack_ue8m0_to_int,
    per_block_cast_to_fp8,
    per_channel_cast_to_fp8,
    per_custom_dims_cast_to_fp8,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    set_mk_alignment_for_contiguous_layout,
    set_num_sms,
    silu_mul,
    silu_mul_cast_to_fp8,
    transform_sf_into_required_layout,
    transpose_packed_fp4,
    unpack_ue8m0_from_int,
)
from .validate import UnsupportedError

get_col_major_tma_aligned_tensor = get_mn_major_tma_aligned_tensor  # DeepGEMM v1 name

__all__ = [
    "__version__", "GemmConfig", "UnsupportedError", "align", "bf16_fp4_gemm_nt", "bf16_gemm_nn", "bf16_gemm_nt", "bf16_gemm_tn",
    "bf16_gemm_tt", "bf16_m_grouped_gemm_nt_masked", "cast_back_from_fp4", "cast_weights_to_fp4", "ceil_div", "ceil_to_ue8m0",
    "cublaslt_gemm_nn", "cublaslt_gemm_nt", "cublaslt_gemm_tn", "cublaslt_gemm_tt", "fp8_fp4_gemm_nn",
    "fp8_fp4_gemm_nt", "fp8_fp4_gemm_tn", "fp8_fp4_gemm_tt", "fp8_gemm_nn", "fp8_gemm_nt", "fp8_gemm_tn",
    "fp8_gemm_tt", "fp8_m_grouped_gemm_nt_masked", "gemm", "gemm_fp8_fp8_bf16_nt", "get_col_major_tma_aligned_tensor",
    "get_k_alignment_for_contiguous_layout", "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_m_alignment_for_contiguous_layout", "get_mk_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor", "get_mn_major_tma_aligned_tensor", "get_num_sms",
    "get_theoretical_mk_alignment_for_contiguous_layout", "get_tma_aligned_size", "k_grouped_bf16_gemm_tn_contiguous",
    "k_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_tn_contiguous", "k_grouped_wgrad_gemm_fp8_fp8_fp32_nt", "m_grouped_bf16_fp4_gemm_nt_masked",
    "m_grouped_bf16_gemm_nn_contiguous", "m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nn_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nn_contiguous", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous_swiglu", "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "pack_ue8m0_to_int",
    "per_block_cast_to_fp8", "per_channel_cast_to_fp8", "per_custom_dims_cast_to_fp8", "per_token_cast_to_fp4",
    "per_token_cast_to_fp8", "pick_config", "psum_to_m_indices", "set_mk_alignment_for_contiguous_layout",
    "set_num_sms", "silu_mul", "silu_mul_cast_to_fp8", "SWIGLU_INTERLEAVE", "swiglu_deinterleave", "swiglu_interleave", "testing", "transform_sf_into_required_layout", "transpose_packed_fp4", "unpack_ue8m0_from_int",
    "utils", "wgrad_gemm_fp8_fp8_fp32_nt",
]
