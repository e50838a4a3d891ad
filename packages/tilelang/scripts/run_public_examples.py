#!/usr/bin/env python3
"""Run examples written for the public TileLang on our CPU targets, and report pass/fail per file.

    python packages/tilelang/scripts/run_public_examples.py /path/to/tilelang/examples --target cpu
    python packages/tilelang/scripts/run_public_examples.py /path/to/tilelang/examples --target interp -k gemm

Nothing is fetched: point it at the `examples/` folder of a checkout of the public TileLang
(the list below was made against tile-ai/tilelang at commit a35008a). Each file is copied
with its folder into a temporary directory and adapted as a GPU-less user would: CUDA
devices become the CPU, problem sizes shrink (the per-file edits below, each of which must
match or the file is reported "stale"), and the target is chosen with the public
TileLang's TILELANG_DEFAULT_TARGET variable. The file then runs as `__main__` in a fresh
process; it passes when it exits 0 (every example checks itself against its reference).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# (pattern, replacement) applied to every file: device edits only.
DEVICE_EDITS = [
    (r"\.cuda\(\)", ""),
    (r"""device\s*=\s*["']cuda(:\d+)?["']""", 'device="cpu"'),
    (r"""torch\.device\(["']cuda(:\d+)?["']\)""", 'torch.device("cpu")'),
    (r"""\.to\(["']cuda(:\d+)?["']\)""", '.to("cpu")'),
    (r"""\.to\(device=["']cuda(:\d+)?["']""", '.to(device="cpu"'),
    (r"torch\.cuda\.synchronize\(\)", "None"),
    (r"torch\.cuda\.manual_seed(_all)?\(", "torch.manual_seed("),
    (r"torch\.cuda\.Stream\(\)|torch\.cuda\.default_stream\(\)|torch\.cuda\.current_stream\(\)", "None"),
]


@dataclass
class Example:
    path: str  # relative to the examples folder
    kind: str  # what the list calls it
    sizes: list[tuple[str, str]] = field(default_factory=list)  # exact text edits: problem sizes, or a
    # device query a GPU-less machine cannot answer (each is commented where it is not a size)
    argv: list[str] = field(default_factory=list)
    expect: str = ""  # for examples that print their check instead of asserting: text a pass must print
    timeout: int = 600


EXAMPLES: list[Example] = [
    Example("gemm/example_gemm.py", "gemm",
            [("M=1024, N=1024, K=1024, block_M=128", "M=256, N=192, K=160, block_M=128"),
             ("torch.randn(1024, 1024).half()\n    b = torch.randn(1024, 1024)",
              "torch.randn(256, 160).half()\n    b = torch.randn(160, 192)")]),
    Example("gemm_splitk/example_tilelang_gemm_splitk.py", "split-K gemm",
            [("    M = 1024\n    N = 1024\n    K = 1024\n", "    M = 256\n    N = 256\n    K = 512\n")]),
    Example("elementwise/example_elementwise_add.py", "elementwise", argv=["--m", "200", "--n", "300"]),
    Example("online_softmax/online_softmax.py", "softmax", [("M = 8192\nN = 8192\n", "M = 16\nN = 8192\n")]),
    Example("norm/rms_norm.py", "RMSNorm", [("M, N, blk_m, blk_k = 8192, 8192, 1, 512", "M, N, blk_m, blk_k = 64, 1024, 1, 512")]),
    Example("norm/layernorm.py", "LayerNorm", [("N, D = 4096, 8192", "N, D = 64, 512")]),
    Example("topk/example_topk.py", "top-k"),
    Example("cast/example_group_per_split_token_cast_to_fp8.py", "per-token fp8 cast (grouped)",
            [("def main(M=8192, N=8192, BG=2, blk_m=8, batch_sizes=None)",
              "def main(M=160, N=512, BG=2, blk_m=8, batch_sizes=[40, 120])")]),
    Example("dynamic_shape/example_dynamic.py", "dynamic shapes",
            [("def main(M=16384, N=16384, K=16384)", "def main(M=200, N=136, K=96)")]),
    Example("gemm_fp8/example_tilelang_gemm_fp8.py", "fp8 gemm",
            [("test_gemm_fp8(1024, 1024, 1024, determine_fp8_type())\n    test_gemm_fp8(1024, 1024, 1024,",
              "test_gemm_fp8(256, 256, 256, determine_fp8_type())\n    test_gemm_fp8(256, 256, 256,")]),
    Example("flash_attention/example_mha_fwd_bhsd.py", "flash attention MHA (bhsd)",
            argv=["--batch", "1", "--heads", "2", "--seq_q", "128", "--seq_kv", "192", "--dim", "64"]),
    Example("flash_attention/example_mha_fwd_bshd.py", "flash attention MHA (bshd, causal)",
            argv=["--batch", "1", "--heads", "2", "--seq_len", "256", "--dim", "64", "--is_causal"]),
    Example("flash_attention/example_gqa_fwd_bshd.py", "flash attention GQA",
            argv=["--batch", "1", "--heads", "4", "--seq_len", "256", "--dim", "64", "--groups", "2"]),
    Example("flash_decoding/example_mha_inference.py", "MHA inference (split-KV + combine)",
            [("def main(BATCH=1, H=32, Q_CTX=128, KV_CTX=8192, D_HEAD=128, causal=False)",
              "def main(BATCH=1, H=2, Q_CTX=128, KV_CTX=1024, D_HEAD=64, causal=False)")]),
    Example("attention_sink/example_mha_sink_fwd_bhsd.py", "attention with sinks (sliding window)",
            argv=["--batch", "1", "--heads", "2", "--seq_q", "128", "--seq_kv", "256", "--dim", "64",
                  "--window_size", "128"]),
    Example("convolution/example_convolution.py", "convolution",
            argv=["--n", "2", "--c", "32", "--h", "12", "--w", "12", "--f", "64", "--k", "3", "--s", "1", "--d", "1",
                  "--p", "1"]),
    Example("fusedmoe/example_fusedmoe_tilelang.py", "fused MoE",
            [("def main(d_hidden=7168, d_expert=2048, n_routed_experts=8, n_shared_experts=1, n_experts_per_token=4, "
              "batch_size=1, seq_len=8192)",
              "def main(d_hidden=256, d_expert=128, n_routed_experts=4, n_shared_experts=1, n_experts_per_token=2, "
              "batch_size=1, seq_len=64)")]),
    Example("gemm/example_gemm_persistent.py", "persistent gemm", argv=["--M", "320", "--N", "512", "--K", "128"]),
    Example("gemm_streamk/example_tilelang_gemm_streamk.py", "stream-K gemm",
            [("total_sm = 108", "total_sm = 12  # device edit: the SM count (programs of the stream-K split)")]),
    Example("quickstart.py", "gemm + ReLU (quickstart)", [("M = 1024\nN = 1024\nK = 1024\n", "M = 256\nN = 256\nK = 128\n")]),
    Example("blocksparse_gemm/example_blocksparse_gemm.py", "block-sparse gemm",
            argv=["--m", "256", "--n", "256", "--k", "256"]),
    Example("grouped_gemm/example_grouped_gemm_fwd.py", "grouped gemm",
            argv=["--batch_sizes", "64, 100", "--K", "256", "--M", "256"], expect="Tilelang and Torch match"),
    Example("flash_decoding/example_gqa_decode.py", "flash decoding GQA (split-KV + combine)",
            [("    if not torch.cuda.is_available():\n        raise RuntimeError(\"CUDA is not available\")\n"
              "    device = torch.cuda.current_device()\n"
              "    sm_major, sm_minor = torch.cuda.get_device_capability(device)\n",
              "    sm_major, sm_minor = 9, 0  # device edit: no GPU to ask; take the sm_90 config\n")],
            argv=["--batch", "1", "--heads", "8", "--groups", "2", "--kv_seqlen", "2048", "--dim", "64"]),
    Example("gemv/example_gemv.py", "gemv", argv=["--n", "256", "--k", "256"]),
    Example("dequantize_gemm/example_dequant_gemm_w4a8.py", "dequantized w4a8 gemm",
            argv=["--m", "64", "--n", "128", "--k", "128"]),
]


def adapt(text: str, ex: Example) -> tuple[str, list[str]]:
    for pat, rep in DEVICE_EDITS:  # first, so the size edits below read as device-free code
        text = re.sub(pat, rep, text)
    stale = []
    for old, new in ex.sizes:
        if old not in text:
            stale.append(old)
        text = text.replace(old, new)
    return text, stale


def run_one(root: Path, ex: Example, target: str, workdir: Path) -> dict:
    src = root / ex.path
    if not src.exists():
        return {"file": ex.path, "kind": ex.kind, "status": "missing"}
    dst_dir = workdir / Path(ex.path).parent.name
    if not dst_dir.exists():
        shutil.copytree(src.parent, dst_dir)
        for sib in dst_dir.glob("*.py"):  # helpers next to the example (references, inputs) get the device edits too
            sib.write_text(adapt(sib.read_text(), Example(sib.name, ""))[0])
    text, stale = adapt(src.read_text(), ex)
    if stale:
        return {"file": ex.path, "kind": ex.kind, "status": "stale", "detail": f"edits no longer match: {stale}"}
    dst = dst_dir / f"_adapted_{src.name}"
    dst.write_text(text)
    env = dict(os.environ, TILELANG_DEFAULT_TARGET=target, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(dst_dir), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, dst.name, *ex.argv], cwd=dst_dir, env=env, capture_output=True, text=True,
                           timeout=ex.timeout)
        rc, out = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timeout after {ex.timeout}s\n{(e.stdout or b'')[-2000:]!r}"
    secs = time.perf_counter() - t0
    tail = out.strip().splitlines()[-6:]
    status = "pass" if rc == 0 and ex.expect in out else "fail"
    if rc == 0 and ex.expect not in out:
        tail.append(f"(exit 0, but {ex.expect!r} was not printed)")
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", out)
    if rc != 0 and missing and not missing.group(1).startswith("tilelang"):
        status = f"needs {missing.group(1)}"  # a third-party module the example imports (not ours)
    return {"file": ex.path, "kind": ex.kind, "status": status, "seconds": round(secs, 1), "detail": "\n".join(tail)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("examples", type=Path, help="the examples/ folder of a public TileLang checkout")
    ap.add_argument("--target", choices=["cpu", "interp"], default="cpu")
    ap.add_argument("-k", dest="select", default="", help="only files whose path contains this")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the output tail of failures")
    args = ap.parse_args(argv)
    root = args.examples.resolve()
    chosen = [e for e in EXAMPLES if args.select in e.path]
    results = []
    with tempfile.TemporaryDirectory(prefix="tl_public_") as tmp:
        for ex in chosen:
            r = run_one(root, ex, args.target, Path(tmp))
            results.append(r)
            print(f"{r['status']:6s} {r.get('seconds', ''):>6} {ex.path}", flush=True)
            if args.verbose and r["status"] != "pass":
                print("       " + r.get("detail", "").replace("\n", "\n       "), flush=True)
    n = sum(r["status"] == "pass" for r in results)
    print(f"{n}/{len(results)} passed on target {args.target}")
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "results": results}, indent=1))
    return 0 if n == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
