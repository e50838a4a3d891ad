"""Bootstrap torch.distributed from an `mpiexec` launch (mpi4py), no torchrun needed."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_from_mpi(backend: str | None = None, timeout_s: float = 300.0,
                  set_cuda_device: bool = True) -> tuple[int, int, int]:
    """Initialize the default process group from MPI_COMM_WORLD; returns (rank, world_size, local_rank).

    Rank 0 picks the rendezvous address and broadcasts it over MPI. `backend` defaults to NCCL
    when CUDA is available, else Gloo. With `set_cuda_device`, rank r uses GPU local_rank.
    Safe to call twice: the second call only reports the ranks.
    """
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError("init_from_mpi needs mpi4py (pip install 'tilestack-deepep[mpi]')") from e
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank).Get_rank()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local_rank
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if set_cuda_device and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    addr = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        addr = f"tcp://{host}:{os.environ.get('MASTER_PORT') or _free_port()}"
    addr = comm.bcast(addr, root=0)
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    dist.init_process_group(backend, init_method=addr, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, size, local_rank
