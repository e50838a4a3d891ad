"""DeepEP's init_dist: one process per local rank, rendezvous from MASTER_ADDR / MASTER_PORT."""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

__all__ = ["init_dist", "init_seed"]


def init_seed(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """Join the default group (NCCL with a GPU per local rank, else Gloo) and return (rank, world, group).
    WORLD_SIZE / RANK give the node count and index, as in DeepEP. On a GPU the default device becomes
    cuda:local_rank and the default dtype bf16, as DeepEP's helper sets."""
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", "1"))
    node_rank = int(os.getenv("RANK", "0"))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{ip}:{port}",
                            world_size=num_nodes * num_local_ranks, rank=node_rank * num_local_ranks + local_rank)
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_nodes * num_local_ranks)))
