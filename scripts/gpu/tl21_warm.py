"""Build (or with --check: verify that the cache holds) the flash-attention kernels of the tl21 GPU job (issue 21,
session 29) that bench_cuda.py --build-only does not: every form of test_fa_pipelined_ws_gpu. Run by
scripts/gpu/warm.sh from /tmp/tl21_tree (after `bench_cuda.py --build-only --ab 1 --set s29c --only fa`)."""
import importlib.util
import sys
from pathlib import Path

import tilelang

ROOT = Path.cwd() / "packages" / "tilelang"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("test_cuda", ROOT / "tests" / "test_cuda.py")
tc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tc)
import bench_cuda as bc  # noqa: E402
import cuda_kernels as ck  # noqa: E402

from conftest import load_example  # noqa: E402

check = "--check" in sys.argv
built = []
m = load_example("flash_attention")
# every form test_fa_pipelined_ws_gpu runs (its "cfg" parameters)
FORMS = next(m.args[1] for m in tc.test_fa_pipelined_ws_gpu.pytestmark if m.name == "parametrize" and m.args[0] == "cfg")
for causal in (False, True):
    for cfg in FORMS:
        func = m.flash_attention_fwd(2, 8, 1536, 128, causal, 128, 128, 2, 256, "float16", groups=4, layout="bhsd")
        built.append(tilelang.JITKernel(func, out_idx=[3], target="cuda", pass_configs=tc._WS_CFG.get(cfg)))
if check:  # the bench's and ncu's contenders too (same caches)
    for impl, stages in bc.AB_FA_S29C:
        for causal in (False, True):
            func = ck.flashattn_bhsd(4, 32, 4096, 128, causal, num_stages=stages)
            built.append(tilelang.JITKernel(func, out_idx=[3], target="cuda", **bc._compile_kw(impl)))
    miss = [k for k in built if not (k._impl.from_kernel_cache and k.cache_hit)]
    print(f"check: {len(built) - len(miss)} of {len(built)} kernels found in the cache", flush=True)
    sys.exit(1 if miss else 0)
print(f"built {len(built)} GPU-test kernels", flush=True)
