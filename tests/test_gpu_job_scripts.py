"""scripts/gpu/job.sh (the shared part of a GPU round's job) and scripts/gpu/warm.sh (its kernel cache warmed on
the CPU machine), run here on a small tree: the names they check, the steps' limits and logs, the cache's way
from warm.sh to job.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import tilehal

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "scripts" / "gpu").mkdir(parents=True)
    for rel in ("scripts/device_env.sh", "scripts/gpu/job.sh", "scripts/gpu/warm.sh"):
        shutil.copy(ROOT / rel, tree / rel)
    for p in ("hal", "deepgemm"):
        shutil.copytree(ROOT / "packages" / p / "src", tree / "packages" / p / "src")
    return tree


def _bash(script: str, cwd: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "JOB_OUT": str(out), **env}
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=e, capture_output=True, text=True, timeout=120)


@pytest.fixture
def name():
    n = f"t{uuid.uuid4().hex[:10]}"
    yield n
    for suffix in ("tree", "cache", "key"):
        shutil.rmtree(f"/tmp/{n}_{suffix}", ignore_errors=True)


def test_job_name_and_job_out_are_checked(tmp_path):
    tree = _tree(tmp_path)
    r = _bash("set -uo pipefail; source scripts/gpu/job.sh 'Bad Name'; echo after", tree, tmp_path)
    assert r.returncode == 2 and "expected a job name of [a-z0-9_]" in r.stderr and "after" not in r.stdout
    r = subprocess.run(["bash", "-c", "unset JOB_OUT; source scripts/gpu/job.sh ok"], cwd=tree, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "JOB_OUT is not set" in r.stderr


def test_steps_run_from_the_copied_tree_with_their_limits(tmp_path, name):
    tree, out = _tree(tmp_path), tmp_path / "out"
    out.mkdir()
    script = f"""set -uo pipefail; source scripts/device_env.sh
source scripts/gpu/job.sh {name}
pwd > "$O/where.txt"; echo "$TILESTACK_CACHE_DIR $TILESTACK_CACHE_KEY_FILE" > "$O/cache.txt"
echo "$PYTHONPATH" > "$O/pythonpath.txt"
step 5 hello.log bash -c 'echo hello; echo "Warning: noise"; exit 3'
step 2 never.log touch "$O/never"
step 3 slow.log sleep 30
echo "left=$(left 1000)"
"""
    r = _bash(script, tree, out)
    assert r.returncode == 0, r.stderr
    assert (out / "where.txt").read_text().strip() == f"/tmp/{name}_tree"
    assert (out / "cache.txt").read_text().split() == [f"/tmp/{name}_cache", f"/tmp/{name}_key/cache.key"]
    paths = (out / "pythonpath.txt").read_text().strip().split(":")  # device_env.sh's paths moved to the copy
    assert f"/tmp/{name}_tree/src" in paths and f"/tmp/{name}_tree/packages/hal/src" in paths
    assert not any(p.startswith(str(tree)) for p in paths)
    assert (out / "hello.log").read_text() == "hello\nWarning: noise\n"
    assert "hello.log rc=3" in r.stdout and "hello\n" in r.stdout and "noise" not in r.stdout  # warnings filtered
    assert "never.log skipped: 2 s left" in r.stdout and not (out / "never").exists()
    assert "slow.log rc=124 (cut at the limit)" in r.stdout
    left = int(r.stdout.split("left=")[1].split()[0])
    assert 900 < left <= 1000


@pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="needs NVRTC")
def test_a_warmed_cache_travels_with_its_key(tmp_path, name):
    tree, out = _tree(tmp_path), tmp_path / "out"
    out.mkdir()
    fake_nvrtc = tmp_path / "libnvrtc.so.13"  # stands in for the device's NVRTC: ld.so ignores it
    fake_nvrtc.write_bytes(b"")
    src = "extern \\\"C\\\" __global__ void k(int* x) { x[0] = 1; }"
    compile_k = f"python3 -c \"import tilehal; tilehal.compile_cuda('{src}', name='k')\""
    r = _bash(f"bash scripts/gpu/warm.sh {name} . {compile_k}", tree, out, DEVICE_NVRTC=str(fake_nvrtc))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warm: rc=0, 1 kernels" in r.stdout
    key = tree / f"{name}_cache.key"
    assert (tree / f"{name}_cache.tgz").is_file() and key.stat().st_mode & 0o777 == 0o600
    shutil.rmtree(f"/tmp/{name}_cache")
    shutil.rmtree(f"/tmp/{name}_key")
    # The job unpacks the cache under the carried key: the same compile is a hit (no NVRTC call).
    check = f"import tilehal; print('hit' if tilehal.compile_cuda('{src}', name='k').cache_hit else 'miss')"
    r = _bash(f'source scripts/gpu/job.sh {name}; step 60 hit.log python3 -c "{check}"', tree, out)
    assert "cache: 1 kernels" in r.stdout and "hit.log rc=0" in r.stdout, r.stdout + r.stderr
    assert (out / "hit.log").read_text().split()[-1] == "hit"


def test_warm_refuses_a_missing_device_nvrtc(tmp_path, name):
    tree = _tree(tmp_path)
    r = _bash(f"bash scripts/gpu/warm.sh {name} . true", tree, tmp_path, DEVICE_NVRTC=str(tmp_path / "none.so"))
    assert r.returncode == 2 and "DEVICE_NVRTC: expected the GPU machine's libnvrtc.so" in r.stderr
    r = _bash("bash scripts/gpu/warm.sh Bad . true", tree, tmp_path)
    assert r.returncode == 2 and "usage: scripts/gpu/warm.sh NAME TREE CMD" in r.stderr
