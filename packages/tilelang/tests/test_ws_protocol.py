"""The mbarrier protocol of the warp-specialized kernels, checked on the CPU (tests/ws_protocol.py: the generated
source's producer loop and consumer warps run under random schedules, TMA loads landing late): no deadlock, no
stage read before its load landed, no stage overwritten while a wgmma reads it, every wgmma group waited for.
Covers the default warp-specialized flash attention and GEMM and the opt-in forms (split stages, gemm/softmax
overlap, pingpong, combined); mutations of a correct kernel (a wait removed, a release moved early, a wrong
parity, a wrong arrival count) must be caught."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ws_protocol as wp  # noqa: E402
from cuda_snapshot import generate  # noqa: E402


def _kernels():
    spec = importlib.util.spec_from_file_location("tl_bench_cuda_kernels", HERE.parent / "benchmarks" / "cuda_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CK = _kernels()
SPLIT = {"cuda_ws_split_stages": True}
OV = {"cuda_ws_overlap": True}
PP = {"cuda_ws_pingpong": True}
SPROD = {"cuda_ws_split_producers": True}  # a producer thread per split group (session 29)
FA_FORMS = {"ws": {}, "split": SPLIT, "ov": OV, "ov_split": {**OV, **SPLIT}, "pp": PP, "pp_split": {**PP, **SPLIT},
            "ovpp": {**OV, **PP}, "ovpp_split": {**OV, **PP, **SPLIT}, "ovpp_split_prod": {**OV, **PP, **SPLIT, **SPROD},
            "split_prod": {**SPLIT, **SPROD}}


def _fa(causal: bool, form: str, stages: int = 2) -> str:
    # 1 x 2 heads x 1024: 8 KV blocks; at bx = 5 causal attention runs 6 of them
    return generate(CK.flashattn_bhsd(1, 2, 1024, 128, causal, num_stages=stages), FA_FORMS[form])


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("form", sorted(FA_FORMS))
@pytest.mark.parametrize("causal", [False, True])
def test_fa_protocol(causal, form, stages):
    src = _fa(causal, form, stages)
    m = wp.check(src, {"bx": 5, "by": 1, "bz": 0}, seeds=range(3))
    iters = 6 if causal else 8
    waits = [t for t in m.trace if t[0] != "producer" and t[1] == "wait"]
    groups = 2 if "split" in form else 1  # K and V waited for apart
    assert len(waits) == 8 * iters * groups, (form, len(waits))
    releases = [t for t in m.trace if t[0] != "producer" and t[1] == "arrive"]
    assert len(releases) == 8 * iters * groups


@pytest.mark.parametrize("two", [False, True])  # cuda_ws_two_ctas: a producer warp (applies to 128 x 128 only)
@pytest.mark.parametrize("cfg", [(128, 256, 64, 4, 256), (128, 256, 64, 4, 256, "c_shared"), (128, 128, 64, 3, 256)])
def test_gemm_protocol(cfg, two):
    src = generate(CK.gemm_nt(1024, 1024, 1024, *cfg[:5], "bfloat16", c_shared="c_shared" in cfg[5:]),
                   {"cuda_ws_two_ctas": True} if two else {})
    assert ("__launch_bounds__(288, 2)" in src) == (two and cfg[1] == 128)
    m = wp.check(src, {"bx": 1, "by": 2, "bz": 0}, seeds=range(3))
    assert sum(t[1] == "wait" and t[0] != "producer" for t in m.trace) == (256 // 32) * 1024 // 64


PERSISTENT = {"cuda_persistent": True}


@pytest.mark.parametrize("form", ["ws", "split", "pp", "pp_split", "ov", "ovpp_split", "ovpp_split_prod"])
@pytest.mark.parametrize("causal", [False, True])
def test_fa_persistent_protocol(causal, form):
    """Persistent flash attention (one CTA runs tiles 1, 6, 11 of the 16: 2 heads x 8 query blocks); the stage
    phases run on across the tiles, a consumer barrier ends each tile."""
    src = generate(CK.flashattn_bhsd(1, 2, 1024, 128, causal), {**FA_FORMS[form], **PERSISTENT})
    assert "_tile += gridDim.x" in src
    m = wp.check(src, {"blockIdx": wp.Dim3(1), "gridDim": wp.Dim3(5)}, seeds=range(2))
    tiles = [1, 6, 11]  # bx = tile % 8 (longest first when causal: 7 - bx), by = tile / 8
    iters = sum((8 - t % 8) if causal else 8 for t in tiles)
    waits = [t for t in m.trace if t[0] != "producer" and t[1] == "wait"]
    assert len(waits) == 8 * iters * (2 if "split" in form else 1), (form, len(waits), iters)


@pytest.mark.parametrize("cfg", [(128, 256, 64, 4, 256), (128, 256, 64, 3, 256, "c_shared")])
def test_gemm_persistent_protocol(cfg):
    """A persistent GEMM (the wgmma in flight across iterations; the tile's last stage released after its final
    wait, while the producer loads the next tile): one CTA of 3 runs tiles 2, 5, ... of 4 x 8."""
    src = generate(CK.gemm_nt(1024, 1024, 1024, *cfg[:5], "bfloat16", c_shared="c_shared" in cfg[5:]), PERSISTENT)
    assert "_tile += gridDim.x" in src
    m = wp.check(src, {"blockIdx": wp.Dim3(2), "gridDim": wp.Dim3(3)}, seeds=range(2))
    ntiles = len(range(2, 32, 3))
    assert sum(t[1] == "wait" and t[0] != "producer" for t in m.trace) == 8 * ntiles * (1024 // 64)


def _mutate(src: str, old: str, new: str, count: int = 1) -> str:
    assert src.count(old) >= count, old
    return src.replace(old, new, count)


def test_catches_a_missing_wait():
    src = _fa(False, "split")
    fv = re.findall(r"tilehal::u64\* (_\w+) = _tl_mbar", src)[2]
    line = next(ln for ln in src.splitlines() if f"mbarrier_wait(&{fv}[_stage" in ln)
    with pytest.raises(wp.ProtocolError, match=r"reads \('V_shared'"):
        wp.check(_mutate(src, line + "\n", ""), {"bx": 0, "by": 0, "bz": 0}, seeds=range(2))


def test_split_producers_run_apart_and_a_missing_empty_wait_is_caught():
    """cuda_ws_split_producers: K's and V's loads come from two producer threads (the model runs both); without the
    V thread's wait for a free stage it overwrites V while P V still reads it."""
    src = _fa(False, "ovpp_split_prod")
    assert "if (_tx == 256) {" in src and "if (_tx == 288) {" in src
    m = wp.check(src, {"bx": 5, "by": 1, "bz": 0}, seeds=range(2))
    assert sum(t[0] == "producer" and t[1] == "wait" for t in m.trace) == 2 * (8 - 2)  # K and V, from round 2 on
    ev = re.findall(r"tilehal::u64\* (_\w+) = _tl_mbar", src)[3]
    line = next(ln for ln in src.splitlines() if f"mbarrier_wait(&{ev}[_s]" in ln)
    with pytest.raises(wp.ProtocolError, match="overwrites|reads"):
        wp.check(_mutate(src, line + "\n", ""), {"bx": 5, "by": 1, "bz": 0}, seeds=range(4))


def test_catches_an_early_release():
    src = _fa(False, "split")
    ek = re.findall(r"tilehal::u64\* (_\w+) = _tl_mbar", src)[1]
    rel = next(ln for ln in src.splitlines() if f"mbarrier_arrive(&{ek}[" in ln and "split stages" in ln)
    src = _mutate(src, rel + "\n", "")
    # released right after its full wait, before S = Q K^T reads it
    fk = re.findall(r"tilehal::u64\* (_\w+) = _tl_mbar", src)[0]
    wait = next(ln for ln in src.splitlines() if f"mbarrier_wait(&{fk}[_stage" in ln)
    with pytest.raises(wp.ProtocolError, match="overwrites|reads"):
        wp.check(_mutate(src, wait + "\n", wait + "\n" + rel + "\n"), {"bx": 0, "by": 0, "bz": 0}, seeds=range(4))


def test_catches_a_wrong_parity():
    src = _fa(False, "ws")
    with pytest.raises(wp.ProtocolError, match="reads|deadlock"):
        wp.check(_mutate(src, "], ((k - (0)) / 2) & 1);", "], (((k - (0)) / 2) + 1) & 1);"), {"bx": 0, "by": 0, "bz": 0},
                 seeds=range(2))


def test_catches_a_wrong_arrival_count():
    src = generate(CK.gemm_nt(1024, 1024, 1024, 128, 256, 64, 4, 256, "bfloat16"), {})
    with pytest.raises(wp.ProtocolError, match="deadlock"):
        wp.check(_mutate(src, "[_s], 8);", "[_s], 9);"), {"bx": 0, "by": 0, "bz": 0}, seeds=range(1))


def test_catches_a_missing_wgmma_wait():
    src = _fa(False, "ov_split")
    loop = src.index("for (int k = 0 + 1;")
    w = src.index("tilehal::wgmma_wait<0>();", loop)
    src = src[:w] + src[w:].replace("tilehal::wgmma_wait<0>();", "", 1)
    with pytest.raises(wp.ProtocolError):
        wp.check(src, {"bx": 0, "by": 0, "bz": 0}, seeds=range(3))


def test_catches_a_missing_tile_end_release():
    """Persistent GEMM without the release of each tile's last stage after its final wgmma wait: the producer
    waits for it forever on the next tile."""
    src = generate(CK.gemm_nt(1024, 1024, 1024, 128, 256, 64, 4, 256, "bfloat16"), PERSISTENT)
    line = next(ln for ln in src.splitlines() if "(_tx & 31) == 0) tilehal::mbarrier_arrive(&_empty" in ln
                and "_kb +" in ln and "- 1) %" in ln)
    with pytest.raises(wp.ProtocolError, match="deadlock"):
        wp.check(_mutate(src, line + "\n", ""), {"blockIdx": wp.Dim3(0), "gridDim": wp.Dim3(8)}, seeds=range(1))
