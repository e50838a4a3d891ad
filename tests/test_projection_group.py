"""ProjectionGroup (register_optimizations(fuse_qkv=True)): an attention block's q/k/v projections as one GEMM
(its GPU test: tests/test_fusions_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from tilehal import ArgumentError, calc_diff

from tilestack import register_optimizations
from tilestack.layers import GemmLinear, ProjectionGroup, projection_group_skip_reason


@pytest.mark.parametrize("fp8, bias", [(False, False), (True, False), (False, True)])
def test_grouped_projections_give_the_separate_ones(make_llama, fp8, bias):
    model = make_llama(attention_bias=bias)
    sep, grp = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        register_optimizations(sep, backend="cpu", fp8=fp8)
        rep = register_optimizations(grp, backend="cpu", fp8=fp8, fuse_qkv=True)
        want, got = sep(ids).logits, grp(ids).logits
    groups = [d for d in rep.swapped if d.kind == "qkv"]
    assert [d.name for d in groups] == [f"model.layers.{i}.self_attn.{{q_proj,k_proj,v_proj}}" for i in range(2)]
    # The same per-row reductions over K: equal up to the fp32 reference's summation order.
    assert calc_diff(got, want) < 1e-9
    attn = grp.model.layers[0].self_attn
    assert attn.q_proj._group is attn.k_proj._group is attn.v_proj._group
    assert attn.q_proj._group._pending is None               # every member served: nothing kept past the forward
    assert sorted(grp.state_dict()) == sorted(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(grp.state_dict()[k], v)


def test_members_return_slices_of_one_output_and_fall_back_on_another_input():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(128, n, bias=False) for n in (256, 128, 128)]
    refs = [GemmLinear.from_linear(copy.deepcopy(lin)) for lin in lins]   # the same bf16 roundings, ungrouped
    members = [GemmLinear.from_linear(lin) for lin in lins]
    group = ProjectionGroup(members)
    x = torch.randn(3, 5, 128)
    with torch.no_grad():
        q, k, v = (m(x) for m in members)
        assert q.shape == (3, 5, 256) and k.shape == v.shape == (3, 5, 128)
        assert k.data_ptr() == q.data_ptr() + 256 * 4          # views of the one [15, 512] output
        for ref, y in zip(refs, (q, k, v)):
            assert calc_diff(y, ref(x)) < 1e-9
        y = torch.randn(3, 5, 128)
        assert group._pending is None
        members[0](x)
        kk = members[1](y)                                        # another input: k computes alone
        assert calc_diff(kk, refs[1](y)) < 1e-9 and group._pending is not None
        x.add_(1.0)                                               # written since: not reused either
        assert calc_diff(members[2](x), refs[2](x)) < 1e-9


def test_a_replaced_weight_is_concatenated_again():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(128, 128, bias=False) for _ in range(3)]
    members = [GemmLinear.from_linear(lin) for lin in lins]
    ProjectionGroup(members)
    new = torch.randn(128, 128)
    members[1].weight = torch.nn.Parameter(new, requires_grad=False)
    ref = GemmLinear.from_linear(torch.nn.Linear(128, 128, bias=False))
    ref.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
    x = torch.randn(4, 128)
    with torch.no_grad():
        members[0](x)
        assert calc_diff(members[1](x), ref(x)) < 1e-9


def test_skip_reasons():
    a, b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128, bias=False)
    assert "bias" in projection_group_skip_reason([GemmLinear.from_linear(a), GemmLinear.from_linear(b)])
    assert "GemmLinear" in projection_group_skip_reason([a, b])
    odd = [GemmLinear.from_linear(torch.nn.Linear(128, n, bias=False), fp8=True) for n in (192, 128)]
    assert "multiple of 128" in projection_group_skip_reason(odd)
    with pytest.raises(ArgumentError, match="members"):
        ProjectionGroup(odd)


def test_compiled_members_run_on_their_own(make_llama):
    model = make_llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        register_optimizations(model, backend="cpu", fuse_qkv=True)
        torch._dynamo.reset()
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
        want = ref(ids).logits
    assert calc_diff(got, want) < 1e-4
