"""Launched by test_mpi.py as `mpiexec -n 2 python mpi_worker.py`: init_from_mpi, then a dispatch."""

import importlib.util
import os
import sys

import deepep
import torch

rank, world, local_rank = deepep.init_from_mpi(backend="gloo", timeout_s=60)
spec = importlib.util.spec_from_file_location("workers", os.path.join(os.path.dirname(__file__), "workers.py"))
workers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(workers)
torch.set_num_threads(1)
cases = [{"tokens": [13 + 4 * r for r in range(world)], "experts": 4 * world, "k": 2, "hidden": 32}]
workers.dispatch_combine(rank, world, cases)
print(f"deepep-mpi-ok rank={rank} world={world} local_rank={local_rank}", flush=True)
sys.stdout.flush()
os._exit(0)
