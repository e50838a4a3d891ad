import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tilehal

pytest.importorskip("cffi", reason="compile_c loads libraries through cffi")
from tilehal import CompileError, compile_c

SAXPY = """
#include <stddef.h>
void saxpy(float a, const float *x, float *y, long n) {
    #pragma omp parallel for
    for (long i = 0; i < n; i++) y[i] += a * x[i];
}
"""
CDEF = "void saxpy(float a, const float *x, float *y, long n);"


def test_runs_on_numpy_arrays(cache):
    lib = compile_c(SAXPY, CDEF, openmp=True)
    x = np.arange(1000, dtype=np.float32)
    y = np.ones(1000, dtype=np.float32)
    lib.lib.saxpy(2.0, lib.ptr(x), lib.ptr(y), x.size)
    np.testing.assert_allclose(y, 1 + 2 * np.arange(1000, dtype=np.float32))


def test_runs_on_torch_cpu_tensors(cache):
    torch = pytest.importorskip("torch")
    lib = compile_c(SAXPY, CDEF)
    x = torch.arange(100, dtype=torch.float32)
    y = torch.zeros(100)
    lib.lib.saxpy(0.5, lib.ptr(x), lib.ptr(y), 100)
    torch.testing.assert_close(y, 0.5 * x)


def test_second_compile_hits_cache_without_compiler(cache, monkeypatch):
    first = compile_c(SAXPY, CDEF)
    assert not first.cache_hit

    def no_compiler(*a, **k):
        raise AssertionError("the compiler must not run on a cache hit")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    second = compile_c(SAXPY, CDEF)
    assert second.cache_hit and second.path == first.path
    assert len(list((cache / "c").iterdir())) == 1


def test_cache_dir_is_private(cache):
    compile_c(SAXPY, CDEF)
    assert oct(os.stat(cache).st_mode & 0o777) == oct(0o700)


def test_flags_change_the_key(cache):
    a = compile_c(SAXPY, CDEF)
    b = compile_c(SAXPY, CDEF, flags=["-DVARIANT=1"])
    assert a.path != b.path


CHILD = """
import json, sys
import numpy as np
from tilehal import compile_c
src, cdef = sys.argv[1], sys.argv[2]
lib = compile_c(src, cdef)
x = np.ones(8, np.float32); y = np.zeros(8, np.float32)
lib.lib.saxpy(3.0, lib.ptr(x), lib.ptr(y), 8)
print(json.dumps([float(y.sum()), lib.cache_hit]))
"""


def test_four_processes_compile_one_source(cache):
    env = {**os.environ, "TILESTACK_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, SAXPY, CDEF], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [r[0] for r in results] == [24.0] * 4
    assert sum(not hit for _, hit in results) == 1  # exactly one process ran the compiler
    entries = [p for p in (cache / "c").iterdir() if p.is_dir()]
    assert len(entries) == 1
    assert sorted(p.name for p in entries[0].iterdir() if not p.name.startswith(".")) == ["module.so", "module.so.hmac"]


def test_corrupted_entry_is_detected_and_rebuilt(cache):
    first = compile_c(SAXPY, CDEF)
    # Replace rather than overwrite in place: this process has the library mapped.
    first.path.unlink()
    first.path.write_bytes(b"not an ELF file")
    again = compile_c(SAXPY, CDEF)
    assert not again.cache_hit  # checksum mismatch forced a rebuild
    x = np.ones(4, np.float32)
    y = np.zeros(4, np.float32)
    again.lib.saxpy(1.0, again.ptr(x), again.ptr(y), 4)
    assert y.tolist() == [1.0] * 4


def test_compile_error_carries_compiler_log(cache):
    with pytest.raises(CompileError) as info:
        compile_c("int f( { return 0; }", "int f(void);", name="broken")
    assert "broken.c" in str(info.value)
    assert "error" in info.value.log


def test_devices_report_cpu():
    cpu = tilehal.devices()[0]
    assert cpu.kind == "cpu" and cpu.cores >= 1
