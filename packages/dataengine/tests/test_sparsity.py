import logging

import pytest
import torch
from dataengine import sparsity as sp
from hypothesis import given, settings
from hypothesis import strategies as st


def _reference_mask(score, n, m):
    # Independent construction: loop over groups, keep the n largest (lowest index on ties).
    rows, cols = score.shape
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        for g in range(0, cols, m):
            vals = [(-float(score[r, g + j]), j) for j in range(m)]
            for _, j in sorted(vals)[:n]:
                mask[r, g + j] = True
    return mask


@pytest.mark.parametrize("pattern", ["2:4", "4:8"])
def test_magnitude_mask_matches_reference(pattern):
    n, m = sp.parse_pattern(pattern)
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    mask = sp.nm_mask(w, pattern)
    assert torch.equal(mask, _reference_mask(w.abs(), n, m))
    assert torch.equal(mask.reshape(6, -1, m).sum(-1), torch.full((6, 32 // m), n))
    assert sp.is_nm_sparse(sp.prune(w, pattern), pattern)


def test_wanda_uses_activation_norms():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 16, generator=g)
    x = torch.randn(100, 16, generator=g)
    x[:, 3] *= 50  # channel 3 carries large activations, so Wanda keeps it even if |w| is small
    mask = sp.nm_mask(w, "2:4", "wanda", x)
    score = w.abs() * x.norm(dim=0)
    assert torch.equal(mask, _reference_mask(score, 2, 4))
    assert mask[:, 3].all()


def test_wanda_needs_activations():
    with pytest.raises(ValueError, match="activations"):
        sp.nm_mask(torch.randn(4, 8), "2:4", "wanda")
    with pytest.raises(ValueError, match="activations"):
        sp.nm_mask(torch.randn(4, 8), "2:4", "wanda", torch.randn(3, 7))


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="pattern"):
        sp.nm_mask(torch.randn(4, 8), "1:4")
    with pytest.raises(ValueError, match="in_features divisible by 4"):
        sp.nm_mask(torch.randn(4, 6), "2:4")
    with pytest.raises(ValueError, match="weight: expected 2 dimensions"):
        sp.nm_mask(torch.randn(8), "2:4")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 11), pattern=st.sampled_from(["2:4", "4:8"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_compress_round_trip_exact(rows, groups, pattern, dtype, seed):
    n, m = sp.parse_pattern(pattern)
    w = torch.randn(rows, groups * m, generator=torch.Generator().manual_seed(seed)).to(dtype)
    pruned = sp.prune(w, pattern)
    c = sp.compress(pruned, pattern)
    assert c.values.shape == (rows, groups * n)
    assert torch.equal(c.decompress(), pruned)
    # Compressing the dense weight with its own mask gives the same thing.
    c2 = sp.compress(w, pattern, mask=sp.nm_mask(w, pattern))
    assert torch.equal(c2.decompress(), pruned)


def test_2to4_metadata_hardware_encoding():
    # Row: group0 keeps positions (1, 3), group1 keeps (0, 2), groups 2-3 keep (0,1) and (2,3).
    w = torch.tensor([[0, 5, 0, 6, 7, 0, 8, 0, 1, 2, 0, 0, 0, 0, 3, 4]], dtype=torch.float32)
    c = sp.compress(w, "2:4")
    assert c.values.tolist() == [[5, 6, 7, 8, 1, 2, 3, 4]]
    nib = [1 | 3 << 2, 0 | 2 << 2, 0 | 1 << 2, 2 | 3 << 2]
    word = nib[0] | nib[1] << 4 | nib[2] << 8 | nib[3] << 12
    assert c.metadata.dtype == torch.int16 and c.metadata.shape == (1, 1)
    assert int(c.metadata[0, 0]) & 0xFFFF == word


def test_compress_rejects_wrong_mask():
    w = torch.randn(2, 8)
    bad = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask: expected exactly 2 kept of every 4"):
        sp.compress(w, "2:4", mask=bad)


@pytest.mark.parametrize("pattern,method", [("2:4", "magnitude"), ("4:8", "wanda")])
def test_sparse_linear_cpu_reference(pattern, method, caplog):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(5, 3, 64)
    with caplog.at_level(logging.DEBUG, logger="dataengine.sparsity"):
        sl = sp.SparseLinear.from_dense(lin, pattern, method, activations=x if method == "wanda" else None)
    assert sl.path == "masked_dense"
    assert "CUDA" in sl.reason or "pattern" in sl.reason
    assert any("masked dense reference because" in r.message for r in caplog.records)
    mask = sp.nm_mask(lin.weight, pattern, method, x if method == "wanda" else None)
    ref = x.double() @ (lin.weight.double() * mask).T + lin.bias.double()
    torch.testing.assert_close(sl(x).double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x: expected last dimension 64"):
        sl(torch.randn(2, 63))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_linear_gpu_semi_structured(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 256).to("cuda", dtype)
    sl = sp.SparseLinear.from_dense(lin, "2:4")
    assert sl.path.startswith("semi_structured"), sl.reason
    x = torch.randn(64, 512, device="cuda", dtype=dtype)
    w = lin.weight.float() * sp.nm_mask(lin.weight, "2:4").float()
    ref = x.double() @ w.double().T + lin.bias.double()
    torch.testing.assert_close(sl(x).double(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(sl.dense_weight(), (w).to(dtype))


@pytest.mark.gpu
def test_sparse_linear_gpu_shape_fallback_logged():
    lin = torch.nn.Linear(40, 24).to("cuda", torch.float16)  # 24 rows is not a multiple of 32
    sl = sp.SparseLinear.from_dense(lin, "2:4")
    assert sl.path == "masked_dense" and "multiple" in sl.reason
