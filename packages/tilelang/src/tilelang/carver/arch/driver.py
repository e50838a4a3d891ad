"""How many blocks run at once on the device a persistent kernel targets.

On a CUDA GPU (torch sees one): its streaming-multiprocessor count. Otherwise the CPU targets run
one thread block per OpenMP thread, so a "wave" is the number of CPU cores OpenMP uses.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tilelang.carver")


def _cuda_props(device_id: int):
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(device_id)
    except ImportError:
        pass
    return None


def get_num_sms(device_id: int = 0) -> int:
    props = _cuda_props(device_id)
    if props is not None:
        return int(props.multi_processor_count)
    n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1)
    log.debug("get_num_sms: no CUDA device; %d CPU threads", n)
    return n


def get_max_dynamic_shared_size_bytes(device_id: int = 0) -> int:
    props = _cuda_props(device_id)
    if props is not None:
        return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)
    return 1 << 30  # on-chip buffers of the CPU targets live in ordinary memory


__all__ = ["get_max_dynamic_shared_size_bytes", "get_num_sms"]
