"""deepep: expert-parallel MoE dispatch/combine in the style of DeepEP, on torch.distributed.

Transports: any torch.distributed group (Gloo on CPU, NCCL on GPU and across nodes), a
hierarchical two-level exchange for multi-node groups, and an NVLink fast path of our own kernels
for the GPUs of one host. Every wait on a peer is bounded (CommTimeoutError names rank and stage).
"""

import torch
from tilehal import CommTimeoutError

from . import utils  # noqa: E402  (DeepEP's deep_ep.utils.{math,testing,envs})
from .__about__ import __version__
from .buffer import Buffer
from .config import Config
from .event import EventOverlap
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from .mpi import init_from_mpi

topk_idx_t = torch.int64  # DeepEP's expert-index dtype

__all__ = [
    "__version__", "Buffer", "CommTimeoutError", "Config", "EventOverlap", "init_from_mpi",
    "per_token_cast_back", "per_token_cast_to_fp8", "topk_idx_t", "utils",
]
