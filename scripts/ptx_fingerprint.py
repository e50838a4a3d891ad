"""Fingerprint the stack's CUDA kernels (PTX and SASS) to prove a refactor changed no generated code.

Runs on a machine without a GPU. Each package's own compile function is called with
`tilehal.compile_cuda` swapped for a recorder, so the exact source, options, include
directories and template instantiations that production would build are replayed through
NVRTC to get the PTX (`nvrtcGetPTX`) and the cubin. Written per case:

  <case>.ptx   the PTX, symbol names and debug lines taken out (see normalize_ptx), so renamed
               kernels and moved helpers compare equal;
  <case>.sass  one line per code section of the cubin, sorted: its number of bytes and SHA-256
               (the machine code itself; symbol names live in other sections).

  <case>.cubin the cubin itself, for `compare --nvdisasm`.

Usage:
  python scripts/ptx_fingerprint.py dump DIR [--only SUBSTR]   # compile every case into DIR
  python scripts/ptx_fingerprint.py compare DIR_BEFORE DIR_AFTER  # exit 1 on any difference
      [--nvdisasm PATH]   # where SASS differs: do the two hold the same instructions up to register numbers?

Typical check: dump on the old commit, dump on the new one, compare.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import struct
import sys
from pathlib import Path

import tilehal
from tilehal.jit import cuda as tcuda

_SYM = re.compile(r"\b_Z\w+")
# kvpool decode kernels fingerprinted: case label -> KVPOOL_DECODE_KERNEL text.
DECODE_CONFIGS = {"simt": "simt", "mma2": "mma:64:2", "mma3": "mma"}


def normalize_ptx(ptx: str) -> str:
    """PTX with symbol names and debug lines taken out, its top-level blocks sorted.

    Each block (a kernel, a function, a module-level variable) numbers the mangled symbols it
    names S0, S1, ... in order of first appearance, so renaming a kernel, moving a helper to
    another header or defining kernels in another order leaves the text unchanged. Dropped: the
    banner (compiler build) and the line tables (.file/.loc and .debug_* sections, which
    -lineinfo builds change with every edit or move of a header; the code they annotate is
    what is compared).
    """
    blocks: list[list[str]] = [[]]
    depth = 0
    for ln in ptx.splitlines():
        s = ln.strip()
        if not s or s.startswith("//") or s.startswith((".loc", ".file")):
            continue
        blocks[-1].append(ln)
        depth += s.count("{") - s.count("}")
        if depth == 0 and (s.endswith(";") or s == "}" or s.startswith((".version", ".target", ".address_size"))):
            blocks.append([])

    def norm(block: list[str]) -> str:
        names: dict[str, str] = {}
        return _SYM.sub(lambda m: names.setdefault(m.group(0), f"S{len(names)}"), "\n".join(block))

    # .section .debug_*: -lineinfo's tables, which also spell inlined functions' mangled names
    # as bytes (a helper moved to another namespace changes them, not the code).
    kept = [b for b in blocks if b and not b[0].strip().startswith(".section\t.debug")
            and not b[0].strip().startswith(".section .debug")]
    return "\n\n".join(sorted(norm(b) for b in kept)) + "\n"


def text_sections(cubin: bytes) -> list[tuple[int, str]]:
    """(size, sha256) of every .text.* section of an ELF64 cubin, in section order."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = header(shstrndx)
    out = []
    for i in range(shnum):
        name_off, off, size = header(i)
        end = cubin.index(b"\0", stroff + name_off)
        if cubin[stroff + name_off:end].startswith(b".text."):
            out.append((size, hashlib.sha256(cubin[off:off + size]).hexdigest()))
    return out


def nvrtc_build(source: str, name: str, opts: list[str], exprs: list[str]) -> tuple[str, bytes]:
    nvrtc = tcuda._nvrtc()
    if nvrtc is None:
        raise SystemExit("NVRTC is not available")

    def ok(res):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(nvrtc.nvrtcGetErrorString(err)[1].decode())
        return res[1:] if isinstance(res, tuple) else ()

    (prog,) = ok(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []))
    try:
        for e in exprs:
            ok(nvrtc.nvrtcAddNameExpression(prog, e.encode()))
        enc = [o.encode() for o in opts]
        res = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        if int(res[0]) != 0:
            (n,) = ok(nvrtc.nvrtcGetProgramLogSize(prog))
            buf = bytearray(n)  # never b" " * n: n == 1 would hand NVRTC the shared b" "
            ok(nvrtc.nvrtcGetProgramLog(prog, buf))
            raise RuntimeError(f"{name}: compile failed\n{bytes(buf).decode(errors='replace')}")
        (n,) = ok(nvrtc.nvrtcGetPTXSize(prog))
        ptx = bytearray(n)
        ok(nvrtc.nvrtcGetPTX(prog, ptx))
        (n,) = ok(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = bytearray(n)
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return bytes(ptx).decode().rstrip("\0"), bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class _Recorder:
    """Stands in for tilehal.compile_cuda and keeps the arguments of each call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, source, *, arch=tcuda.DEFAULT_ARCH, name="kernel", options=(), include_dirs=(),
                 name_expressions=(), compiler="auto"):
        self.calls.append(dict(source=source, arch=arch, name=name, options=list(options),
                               include_dirs=[str(d) for d in include_dirs], exprs=list(name_expressions)))
        raise _Recorded


class _Recorded(Exception):
    pass


def _options(call: dict) -> list[str]:
    incs = [str(tcuda.include_dir()), *call["include_dirs"], *tcuda.cuda_include_dirs()]
    return [f"--gpu-architecture={call['arch']}", *tcuda.DEFAULT_OPTIONS, *call["options"], *[f"-I{d}" for d in incs]]


def cases():
    """(label, thunk): each thunk calls one package compile function (which the recorder stops)."""
    import torch

    bf16, fp16 = torch.bfloat16, torch.float16
    # (dtype, head_dim, group): every head dim, the group extremes, both dtypes.
    DECODE_SHAPES = [(bf16, 64, 4), (bf16, 128, 1), (bf16, 128, 4), (bf16, 128, 8), (bf16, 256, 4), (fp16, 128, 4)]
    out = []
    try:
        from kvpool import cuda_decode as dec
    except ImportError:
        dec = None
    if dec is not None:
        for cname, text in DECODE_CONFIGS.items():
            cfg = dec.KernelConfig.parse(text)
            for dt, d, g in DECODE_SHAPES:
                out.append((f"decode_{cname}_{str(dt)[6:]}_{d}_{g}",
                            lambda dt=dt, d=d, g=g, cfg=cfg: dec.compile_decode.__wrapped__(dt, d, g, cfg=cfg)))
        for qdt, d in ((bf16, 128), (torch.float32, 64)):
            out.append((f"decode_fp8_{str(qdt)[6:]}_{d}_4",
                        lambda qdt=qdt, d=d: dec.compile_decode_fp8.__wrapped__(qdt, d, 4)))
        from kvpool import cuda_prefill as pre
        from kvpool import cuda_write as wr

        for cfg, dt, d in [*((c, bf16, 128) for c in pre.CONFIGS), (pre.CONFIGS[0], fp16, 64)]:
            out.append((f"prefill_{pre.config_name(cfg)}_{str(dt)[6:]}_{d}",
                        lambda dt=dt, d=d, cfg=cfg: pre.compile_prefill.__wrapped__(dt, d, cfg)))
        out.append(("kv_write", lambda: wr.compile_write.__wrapped__()))
    try:
        from dataengine import cuda_select as sel
    except ImportError:
        sel = None
    if sel is not None:
        for sdt, d in ((bf16, 128), (torch.float32, 64)):
            out.append((f"quest_{str(sdt)[6:]}_{d}_4",
                        lambda sdt=sdt, d=d: sel.compile_score.__wrapped__(bf16, sdt, d, 4, "max")))
        out.append(("topk", lambda: sel.compile_topk.__wrapped__()))
        # the chunked selection (fused), register and ring paths, every summary type; the per-head scores
        for sdt, label in ((bf16, "bfloat16"), (sel.FP8, "fp8"), (torch.uint8, "q4")):
            for ring in (False, True) if sdt in sel.RING_STAGES else (False,):
                out.append((f"select_chunk_{label}_128_4_ring{int(ring)}",
                            lambda sdt=sdt, ring=ring: sel.compile_chunk.__wrapped__(sdt, 128, 4, "max", True, ring)))
        out.append(("quest_heads_fp8_128_4_8", lambda: sel.compile_heads.__wrapped__(sel.FP8, 128, 4, "max", 8)))
    try:
        from deepgemm import cuda_gemm as dg
    except ImportError:
        dg = None
    if dg is not None:
        keys = {
            "fp8_128x128": dg.KernelKey(4096, 7168, 128, 128, 5, "normal", 1, True, True, False),
            "bf16_tma_store_mc2": dg.KernelKey(4096, 2048, 128, 128, 4, "normal", 1, False, True, False,
                                               tma_store=True, d_swizzle=128, multicast=2),
            # the direct (register) epilogue with C: fp32 out, a masked grouping (row base), odd N
            "fp8_128x128_c_f32": dg.KernelKey(4096, 7168, 128, 128, 5, "normal", 1, True, False, True),
            "fp8_masked_c_f32": dg.KernelKey(4096, 7168, 128, 128, 5, "masked", 4, True, False, True),
            "bf16_odd_n_c_f32": dg.KernelKey(2049, 2048, 128, 128, 4, "normal", 1, False, False, True),
            # the grouped defaults (s26 R3): contiguous fp8 on the producer-fed schedule (-DDEEPGEMM_TILE_INFO=1,
            # compile_kernel adds it) with the overlapped promotion; masked fp8 through the staged copy-out
            "fp8_contig_info_overlap": dg.KernelKey(4096, 7168, 128, 128, 5, "contiguous", 4, True, True, False,
                                                    tma_store=True, d_swizzle=128, overlap_promotion=True,
                                                    tile_info=True),
            "fp8_masked_staged": dg.KernelKey(7168, 2048, 128, 128, 5, "masked", 4, True, True, False, d_swizzle=1,
                                              overlap_promotion=True),
        }
        for label, key in keys.items():
            out.append((f"deepgemm_{label}", lambda key=key: dg.compile_kernel(key)))
        from deepgemm import cuda_cast

        out.append(("deepgemm_fp8_cast", lambda: cuda_cast.compile_module()))  # every cast / silu_mul kernel
        from deepgemm import gemm_1d1d as g1
        from deepgemm import splitk as sk

        # 1D1D: one and two math warpgroups, narrow and wide tiles, fp32 + C and bf16 without C.
        for bm, bn, out_dt, has_c in ((64, 64, torch.float32, True), (128, 128, torch.float32, True),
                                      (128, 192, bf16, False)):
            cfg = g1.Config1D1D(bm, bn, g1.max_stages(bm, bn), 132)
            key = g1.key_1d1d(cfg, 4096, out_dt, has_c)
            out.append((f"deepgemm_1d1d_{bm}x{bn}_{str(out_dt)[6:]}_{int(has_c)}",
                        lambda key=key: g1.compile_kernels([key])))
        odd = g1.key_1d1d(g1.Config1D1D(128, 128, g1.max_stages(128, 128), 132), 2049, torch.float32, True)
        out.append(("deepgemm_1d1d_odd_n_c_f32", lambda: g1.compile_kernels([odd])))
        odd_sk = sk.splitk_key(sk.SplitKConfig(64, 128, 1, sk.max_stages(64, 128), 132), 2049, 2048, bf16, bf16)
        out.append(("deepgemm_splitk_odd_n_c_bf16", lambda: sk.compile_kernels([odd_sk])))
        # split-K: bf16 out, bf16 C (bf16 accumulation), fp32 out + fp32 C, MN-major operands.
        for bm, bn, splits, out_dt, c_dt, a_mn, b_mn in ((64, 128, 8, bf16, None, False, False),
                                                          (64, 256, 4, bf16, bf16, False, False),
                                                          (128, 128, 4, torch.float32, torch.float32, False, False),
                                                          (128, 256, 1, bf16, None, True, True)):
            cfg = sk.SplitKConfig(bm, bn, splits, sk.max_stages(bm, bn), 132)
            key = sk.splitk_key(cfg, 4096, 7168, out_dt, c_dt, a_mn, b_mn)
            out.append((f"deepgemm_splitk_{bm}x{bn}_s{splits}_{str(out_dt)[6:]}_{str(c_dt)[6:]}_{int(a_mn)}{int(b_mn)}",
                        lambda key=key: sk.compile_kernels([key])))
        # split-K with A multicast over 2-CTA clusters (the consumers' remote stage release), par_reduce
        mc_sk = sk.splitk_key(sk.SplitKConfig(128, 64, 4, sk.max_stages(128, 64), 132, multicast=2, par_reduce=True),
                              4096, 7168, bf16, bf16)
        out.append(("deepgemm_splitk_mcast2_128x64_s4_bf16", lambda: sk.compile_kernels([mc_sk])))
        from deepgemm import cuda_fp4 as f4
        from deepgemm import gemv as gv

        # GEMV (M = 1): one / several warps per row, bf16 / fp32 out, fp32 / bf16 C.
        for key in (gv.GemvKey(2048, 7168, 1, True, False), gv.GemvKey(7168, 2048, 2, False, True),
                    gv.GemvKey(4096, 4096, 8, True, True, c_bf16=True)):
            out.append((f"deepgemm_gemv_{key.n}x{key.k}_w{key.warps_per_row}_{int(key.out_bf16)}{int(key.has_c)}"
                        f"{int(key.c_bf16)}", lambda key=key: gv.compile_kernels([key])))
        # FP4: the streaming kernel (whole-range and ring activations, fp32 out + C, masked) and one
        # mma.sync and one wgmma kernel, as the planners choose them.
        fp4_keys = {
            "stream_m1": f4.plan_stream(1, 4096, 7168, 1, True, False, False, num_sms=132).key,
            "stream_ring": f4.plan_stream(1, 136, 128 * 8 * 25, 1, True, False, False, num_sms=132).key,
            "stream_f32_c": f4.plan_stream(16, 2112, 7168, 1, False, True, False, num_sms=132).key,
            "stream_masked": f4.plan_stream(64, 2112, 2048, 4, True, False, True, num_sms=132, expected_m=16).key,
            "mma_fp8_m16": f4.plan(16, 4096, 7168, 1, True, True, False, False, num_sms=132).key,
            "wgmma_m128": f4.plan_wgmma(128, 4096, 7168, 1, True, False, False, num_sms=132).key,
            "mma_bf16_m128": f4.plan(128, 4096, 7168, 1, False, True, False, False, num_sms=132).key,
            "wgmma_fp8_m64": f4.plan_wgmma(64, 7168, 2048, 1, True, False, False, num_sms=132, act_fp8=True).key,
            # the decode-to-shared kernel: bf16 / e4m3, one / two warpgroups, multicast, fp32 out + C
            "dec_m128": f4._plan_dec(128, 4096, 7168, True, False, False, 132, None, None).key,
            "dec_fp8_m64": f4._plan_dec(64, 2112, 7168, True, False, True, 132, None, None).key,
            "dec_fp8_mcast4_m128": f4._plan_dec(128, 4096, 7168, True, False, True, 132, None, None, "4").key,
            "dec_f32_c": f4._plan_dec(37, 136, 1152, False, True, False, 132, None, None).key,
        }
        for label, key in fp4_keys.items():
            out.append((f"deepgemm_fp4_{label}", lambda key=key: f4.compile_kernel(key)))
    try:
        from tilestack import norm as tnorm
    except ImportError:
        tnorm = None
    if tnorm is not None:   # the bf16 RMSNorm kernels (every row width and access mode)
        out.append(("tilestack_rms_norm", lambda: tnorm.compile_module(tuple(
            tnorm.kernel_expression(c, v) for c in range(1, tnorm.MAX_CHUNKS + 1) for v in (True, False)))))
        from tilestack import moe as tmoe

        out.append(("tilestack_moe_combine", lambda: tmoe.compile_combine()))  # both access modes
    return out


def dump(directory: Path, only: str | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rec = _Recorder()
    real = tilehal.compile_cuda
    tilehal.compile_cuda = rec
    try:
        todo = []
        for label, thunk in cases():
            if only and only not in label:
                continue
            try:
                thunk()
            except _Recorded:
                todo.append((label, rec.calls[-1]))
    finally:
        tilehal.compile_cuda = real
    for label, call in todo:
        ptx, cubin = nvrtc_build(call["source"], call["name"], _options(call), call["exprs"])
        (directory / f"{label}.ptx").write_text(normalize_ptx(ptx))
        (directory / f"{label}.sass").write_text("".join(f"{n} {h}\n" for n, h in sorted(text_sections(cubin))))
        (directory / f"{label}.cubin").write_bytes(cubin)
        print(f"{label}: {len(ptx.splitlines())} PTX lines, {len(text_sections(cubin))} code sections", flush=True)


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
_REG = re.compile(r"\b(U?R|U?P)\d+\b")


def sass_instructions(cubin: Path, nvdisasm: str) -> list[str]:
    """The cubin's instructions (nvdisasm -c), addresses, encodings and comments dropped."""
    import subprocess

    out = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [m.group(1) for m in map(_SASS_LINE.match, out.splitlines()) if m]


def sass_verdict(before: list[str], after: list[str]) -> str:
    """How two instruction lists differ: in order, as a multiset, or only by register numbers."""
    if before == after:
        return "instructions identical"
    canon = [sorted(_REG.sub(lambda m: m.group(1), x) for x in side) for side in (before, after)]
    if canon[0] == canon[1]:
        same_order = [_REG.sub(lambda m: m.group(1), x) for x in before] == \
            [_REG.sub(lambda m: m.group(1), x) for x in after]
        return (f"the same {len(before)} instructions up to register numbers"
                + ("" if same_order else ", some in another order"))
    return f"{len(before)} -> {len(after)} instructions, other instructions"


def compare(before: Path, after: Path, nvdisasm: str | None = None) -> int:
    bad = 0
    labels = sorted({p.stem for p in before.glob("*.ptx")} | {p.stem for p in after.glob("*.ptx")})
    for label in labels:
        status = []
        for ext in ("ptx", "sass"):
            a, b = before / f"{label}.{ext}", after / f"{label}.{ext}"
            if not a.exists() or not b.exists():
                status.append(f"{ext} only {'after' if b.exists() else 'before'}")
            elif a.read_bytes() != b.read_bytes():
                status.append(f"{ext} DIFFERS")
                ca, cb = before / f"{label}.cubin", after / f"{label}.cubin"
                if ext == "sass" and nvdisasm and ca.exists() and cb.exists():
                    status[-1] += f" ({sass_verdict(sass_instructions(ca, nvdisasm), sass_instructions(cb, nvdisasm))})"
            else:
                status.append(f"{ext} same")
        bad += sum("same" not in x for x in status)
        print(f"{label}: {', '.join(status)}")
    print(f"{len(labels)} cases compared, {bad} differences")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("dir", type=Path)
    d.add_argument("--only")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--nvdisasm", default=None, help="nvdisasm binary: explain SASS differences")
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args.dir, args.only)
        return 0
    return compare(args.before, args.after, args.nvdisasm)


if __name__ == "__main__":
    sys.exit(main())
