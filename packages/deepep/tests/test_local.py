"""The local engine (issue 20): `Buffer(group=None)` without torch.distributed is a group of one rank,
with the same results as the torch engine on a one-rank Gloo group."""

import pytest
import torch
import torch.distributed as dist
from deepep import Buffer

pytestmark = pytest.mark.timeout(120)


def test_local_engine_matches_a_one_rank_gloo_group(ranks):
    assert ranks(1, "local_matches_one_rank_group", timeout_s=110) == [10]


def test_local_engine_arguments_match_the_reference_or_name_themselves(ranks):
    (out,) = ranks(1, "fuzz_dispatch_args", transport="local", max_examples=60, timeout_s=110)
    assert out["ok"] > 5 and out["refused"] > 5, out


def test_buffer_without_torch_distributed_is_one_local_rank(monkeypatch):
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()  # this test's process never starts a group (ranks run in children)
    buf = Buffer()
    assert (buf.transport, buf.rank, buf.group_size) == ("local", 0, 1)
    idx = torch.tensor([[1, -1], [-1, -1], [0, 1]])
    w = torch.tensor([[0.7, 0.3], [0.1, 0.2], [0.5, 0.5]])
    x = torch.randn(3, 128).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
    recv_x, recv_idx, recv_w, per_local, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, expert_alignment=4)
    assert torch.equal(recv_x, x[[0, 2]]) and recv_idx.tolist() == [[1, -1], [0, 1]] and per_local == [4, 4]
    assert recv_w.tolist() == [[0.699999988079071, 0.0], [0.5, 0.5]]
    out, out_w, _ = buf.combine(recv_x, handle, recv_w)
    assert torch.equal(out, torch.stack([x[0], torch.zeros(128, dtype=torch.bfloat16), x[2]]))
    assert out_w[1].tolist() == [0.0, 0.0]


def test_a_launched_process_without_a_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4"):
        Buffer()
    assert Buffer(transport="local").transport == "local"


def test_layout_checks_skip_only_the_layouts_own_unmodified_tensors(monkeypatch):
    """The consistency check of is_token_in_rank / num_tokens_per_expert against topk_idx costs nothing for
    get_dispatch_layout's own outputs, and still fires when they were edited in place since."""
    from tilehal import ShapeError

    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    buf = Buffer(transport="local")
    idx = torch.tensor([[1, -1], [0, 1]])
    x = torch.randn(2, 64)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
    calls = []
    real = buf._check_layout_agrees
    monkeypatch.setattr(buf, "_check_layout_agrees", lambda *a: (calls.append(1), real(*a))[1])
    buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    assert calls == []  # the layout's own tensors: nothing to check
    per_expert[0] += 1  # edited in place: checked again, and wrong
    with pytest.raises(ShapeError, match="num_tokens_per_expert: expected the per-expert token counts"):
        buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    assert calls == [1]
