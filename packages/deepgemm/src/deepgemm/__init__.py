"""deepgemm: DeepGEMM-style FP8/BF16 dense and grouped (MoE) GEMMs.

CUDA tensors run JIT-compiled, shape-specialized sm_90a kernels (TMA + wgmma + mbarrier pipeline);
CPU tensors run the exact reference, so code using deepgemm runs and is testable anywhere.
"""

from .__about__ import __version__
from .gemm import (
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_nt,
    fp8_gemm_tn,
    fp8_gemm_tt,
    gemm,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_masked,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
)
from .heuristics import GemmConfig, pick_config
from .utils import (
    ceil_div,
    get_m_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_tensor,
    get_num_sms,
    get_tma_aligned_size,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
    set_num_sms,
    transform_sf_into_required_layout,
)

__all__ = [
    "__version__", "GemmConfig", "bf16_gemm_nn", "bf16_gemm_nt", "bf16_gemm_tn", "bf16_gemm_tt", "ceil_div",
    "fp8_gemm_nn", "fp8_gemm_nt", "fp8_gemm_tn", "fp8_gemm_tt", "gemm", "get_m_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_tensor", "get_num_sms", "get_tma_aligned_size", "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
    "per_block_cast_to_fp8", "per_token_cast_to_fp8", "pick_config", "set_num_sms",
    "transform_sf_into_required_layout",
]
