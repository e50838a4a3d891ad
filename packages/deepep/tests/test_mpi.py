"""deepep.init_from_mpi under a real `mpiexec -n 2` launch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


@pytest.mark.timeout(90)
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
def test_init_from_mpi_two_ranks():
    worker = Path(__file__).with_name("mpi_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(worker)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=40, env=env)
    if proc.returncode != 0:
        # Seen once on the saturated 2-core CI box and not reproduced since (the free port rank 0
        # picks can be taken before it binds): one retry, and a second failure shows both logs.
        first = proc.stdout + proc.stderr
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=40, env=env)
        assert proc.returncode == 0, f"first try:\n{first}\nsecond try:\n{proc.stdout + proc.stderr}"
    for r in range(2):
        assert f"deepep-mpi-ok rank={r} world=2" in proc.stdout, proc.stdout + proc.stderr
