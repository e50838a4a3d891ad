"""The torch engine: any torch.distributed group (Gloo on CPU, NCCL on GPU, several nodes).

normal.py: dispatch/combine (counts all-to-all, then one row all-to-all); low_latency.py: the
low-latency mode over the same transport (every rank's fallback for low-latency calls).
"""

from .low_latency import LowLatencyBuffers, LowLatencyHandle, ll_combine, ll_dispatch
from .normal import TorchDispatcher, TorchHandle, reduce_back

__all__ = ["LowLatencyBuffers", "LowLatencyHandle", "TorchDispatcher", "TorchHandle", "ll_combine", "ll_dispatch",
           "reduce_back"]
