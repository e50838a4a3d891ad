"""register_optimizations' fusions on the GPU (fuse_mlp: GemmSwiGLU, fuse_qkv: ProjectionGroup, fuse_norm:
FusedRMSNorm and, with fp8, its fused cast) on a small transformers Llama against the unmodified model."""

from __future__ import annotations

import copy

import pytest
import torch
from tilehal import calc_diff

from tilestack import register_optimizations

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
FUSIONS = {"mlp": dict(fuse_mlp=True), "qkv": dict(fuse_qkv=True),
           "all": dict(fuse_mlp=True, fuse_qkv=True, fuse_norm=True)}
# GemmSwiGLU picks the fused path or the three GEMMs per M by measurement; "mlp_fused" / "mlp_unfused" force one
# (TILESTACK_SWIGLU), so both paths are checked whatever this GPU measures.
SWIGLU_POLICY = {"mlp_fused": "fused", "mlp_unfused": "unfused"}
FUSIONS.update({k: FUSIONS["mlp"] for k in SWIGLU_POLICY})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="deepgemm's kernels need an sm_90 GPU")
@pytest.mark.parametrize("fusion", sorted(FUSIONS))
@pytest.mark.parametrize("fp8, bound", [(False, 1e-4), (True, 3e-2)])  # the bf16 bound; fp8: e4m3 operands
def test_fused_llama_agrees_with_the_unmodified_model(make_llama, monkeypatch, fusion, fp8, bound):
    if fusion in SWIGLU_POLICY:
        monkeypatch.setenv("TILESTACK_SWIGLU", SWIGLU_POLICY[fusion])
    model = make_llama(torch.bfloat16, "cuda", hidden=1024, ffn=2816)
    ref, one_by_one = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    with torch.no_grad():
        want = ref(ids).logits
        register_optimizations(one_by_one, backend="cuda", fp8=fp8)
        base = one_by_one(ids).logits
        register_optimizations(model, backend="cuda", fp8=fp8, **FUSIONS[fusion])
        for _ in range(2):  # the second call replays the GEMMs' plans
            got = model(ids).logits
        mlp_in = torch.randn(3, 5, 1024, device="cuda").bfloat16()
        mine, theirs = model.model.layers[0].mlp(mlp_in), ref.model.layers[0].mlp(mlp_in)
    assert calc_diff(got.float(), want.float()) < bound
    # As close to the one-by-one swaps as those are to the model (the same operands up to the fused norm's ulps).
    assert calc_diff(got.float(), base.float()) < bound
    assert mine.shape == theirs.shape and calc_diff(mine.float(), theirs.float()) < bound
