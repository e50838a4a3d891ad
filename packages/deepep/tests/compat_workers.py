"""Rank-side checks of DeepEP's API on deepep (issue 18); run by test_compat.py through run_on_ranks on Gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepep import Buffer, Config
from deepep import fp8 as deepep_fp8
from deepep.utils.math import per_token_cast_back


def _routing(seed: int, t: int, experts: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, experts, generator=g).topk(k, dim=1).indices
    idx[torch.rand(t, k, generator=g) < 0.15] = -1
    return idx


def normal_mode(rank: int, world: int) -> dict:
    """Handles as DeepEP's tuples, cached-dispatch return shape, combine(bias=), Config, explicitly_destroy."""
    experts, k, hidden = 4 * world, 2, 64
    t = 10 + 3 * rank
    # DeepEP's positional order: group, nvl bytes, rdma bytes, low_latency_mode, qps, allow_nvlink_for_ll,
    # allow_mnnvl, explicitly_destroy, enable_shrink, comm
    buf = Buffer(None, 1 << 20, 0, False, 1, True, False, True, False, None, transport="torch", timeout_s=20)
    assert buf.explicitly_destroy and not buf.enable_shrink
    idx = _routing(rank, t, experts, k)
    x = torch.full((t, hidden), float(rank), dtype=torch.bfloat16)
    x[:, -1] = torch.arange(t, dtype=torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    cfg = Config(24, 8, 256)  # DeepEP's positional fields; the torch engine logs and ignores it
    assert cfg.num_max_rdma_chunked_send_tokens == 6 and cfg.chunk_tokens == 8
    recv_x, _, _, per_list, handle, ev = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=idx, config=cfg)
    ev.current_stream_wait()
    rank_prefix, chan, recv_chan, recv_src_idx, is_in, send_head = handle  # six members, like DeepEP
    assert len(handle) == 6 and handle[0] is not None
    all_counts = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(all_counts, in_rank.sum(0).to(torch.int64))
    expect_prefix = torch.cumsum(torch.stack(all_counts), 0).to(torch.int32)
    assert torch.equal(rank_prefix, expect_prefix), (rank_prefix, expect_prefix)
    # rows from source i are recv_x[prefix[i-1][rank] : prefix[i][rank]] and carry x = i
    start = 0
    for i in range(world):
        end = int(rank_prefix[i][rank])
        assert torch.all(recv_x[start:end, :-1] == i)
        start = end
    assert torch.equal(recv_x[:, -1].long(), recv_src_idx)
    assert torch.equal(is_in, in_rank) and chan.view(-1).tolist() == in_rank.sum(0).tolist()
    assert recv_chan.view(-1).sum().item() == recv_x.shape[0]
    for r in range(world):
        rows = in_rank[:, r].nonzero().flatten()
        assert send_head[rows, r].tolist() == list(range(rows.numel())) and torch.all(send_head[~in_rank[:, r], r] == -1)
    # cached dispatch: only the data and the event, as DeepEP
    cached = buf.dispatch(x * 2, handle=handle, config=cfg)
    assert len(cached) == 6 and all(v is None for v in cached[1:5])
    assert torch.equal(cached[0], recv_x * 2)
    # combine with one and with two biases
    b0 = torch.full((t, hidden), 0.5, dtype=torch.bfloat16)
    b1 = torch.full((t, hidden), 0.25, dtype=torch.bfloat16)
    plain, _, _ = buf.combine(recv_x, handle)
    one, _, _ = buf.combine(recv_x, handle, None, b0, cfg)  # DeepEP's positional order: topk_weights, bias, config
    two, _, _ = buf.combine(recv_x, handle, bias=(b0, b1))
    assert torch.equal(one, (plain.float() + 0.5).bfloat16()) and torch.equal(two, (plain.float() + 0.75).bfloat16())
    buf.destroy()
    try:
        buf.dispatch(x, handle=handle)
    except RuntimeError as e:
        assert "destroy" in str(e)
    else:
        raise AssertionError("a destroyed Buffer accepted a dispatch")
    return {"recv": int(recv_x.shape[0])}


def _ll_reference(rank: int, world: int, seed: int, t: int, hidden: int, experts: int, k: int, masked=()):
    """Per local expert of this rank: the (source rank, token) pairs it receives, in arrival order."""
    epr = experts // world
    out: list[list[tuple[int, int]]] = [[] for _ in range(epr)]
    for src in range(world):
        if src in masked:
            continue
        idx = _routing(seed * 10 + src, t, experts, k)
        for tok in range(t):
            for e in idx[tok].tolist():
                if rank * epr <= e < (rank + 1) * epr:
                    out[e - rank * epr].append((src, tok))
    return out


def _ll_x(src: int, t: int, hidden: int) -> torch.Tensor:
    x = torch.full((t, hidden), float(src - 8), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(t, dtype=torch.bfloat16).view(-1, 1)
    return x


def low_latency_mode(rank: int, world: int) -> dict:
    """DeepEP's positional LL signatures, two live results, round_scale/use_ue8m0, column-major scales,
    handle tuple, zero_copy, wait-cost stats."""
    t, hidden, experts, k = 12, 512, 8, 3
    epr, cap = experts // world, world * t
    buf = Buffer(None, 0, 0, True, epr, transport="torch", timeout_s=20)
    seed = 1
    idx = _routing(seed * 10 + rank, t, experts, k)
    x = _ll_x(rank, t, hidden)
    stats = torch.zeros(epr, dtype=torch.int32)
    wait = torch.zeros(world, dtype=torch.int64)
    # x, topk_idx, max_tokens, num_experts, cumulative stats, wait stats, use_fp8, round_scale, use_ue8m0
    r1 = buf.low_latency_dispatch(x, idx, t, experts, stats, wait, True, False, False)
    (rx1, rs1), cnt1, h1, _, _ = r1
    snapshot = (rx1.view(torch.uint8).clone(), rs1.clone(), cnt1.clone())
    assert rs1.shape == (epr, cap, hidden // 128) and rs1.stride()[-2:] == (1, (cap + 3) // 4 * 4)  # column-major
    assert torch.all(wait >= 0) and wait[rank] == 0
    ref = _ll_reference(rank, world, seed, t, hidden, experts, k)
    assert cnt1.tolist() == [len(v) for v in ref] and stats.tolist() == cnt1.tolist()
    src_info, layout_range, m_, h_, e_ = h1
    assert (m_, h_, e_) == (t, hidden, experts)
    for e in range(epr):
        n = len(ref[e])
        assert src_info[e, :n].tolist() == [tok for _, tok in ref[e]]
        got = per_token_cast_back(rx1[e, :n], rs1[e, :n])
        assert got.dtype == torch.bfloat16
        for j in range(world):
            begin, count = int(layout_range[e, j]) >> 32, int(layout_range[e, j]) & 0xFFFFFFFF
            assert count == sum(1 for s, _ in ref[e] if s == j)
            assert torch.all(got[begin:begin + count, :-128] == j - 8)
    # a second live result (round_scale + UE8M0) must not overwrite the first
    x2 = x * 3
    (rx2, rs2), cnt2, h2, _, hook = buf.low_latency_dispatch(x2, idx, t, experts, use_fp8=True, round_scale=True,
                                                             use_ue8m0=True, return_recv_hook=True)
    hook()
    assert rs2.dtype == torch.int32 and rs2.shape == (epr, cap, hidden // 512) and rs2.stride(-2) == 1
    assert torch.equal(rx1.view(torch.uint8), snapshot[0]) and torch.equal(rs1, snapshot[1])
    unpacked = deepep_fp8.unpack_ue8m0(rs2)
    for e in range(epr):
        n = len(ref[e])
        s = unpacked[e, :n]
        assert torch.all((s.view(torch.int32) & 0x7FFFFF) == 0)  # powers of two
        # rounded up from amax / 448 of 3x (amax is clamped to 1e-4 for all-zero groups)
        live = rs1[e, :n] > 1e-4 / 448 * 1.01
        assert torch.all(s[live] >= rs1[e, :n][live] * 3 * (1 - 1e-6)), (s, rs1[e, :n])
        back = per_token_cast_back(rx2[e, :n], rs2[e, :n]).float()
        want = 3 * (torch.tensor([src for src, _ in ref[e]], dtype=torch.float32).view(-1, 1) - 8)
        assert torch.all((back[:, :-128] - want).abs() <= want.abs() * 2**-4)  # one e4m3 step
    # a third call reuses the first's storage (two buffer sets, as DeepEP)
    (rx3, _), _, _, _, _ = buf.low_latency_dispatch(x, idx, t, experts)
    assert rx3.data_ptr() == rx1.data_ptr() and rx3.data_ptr() != rx2.data_ptr()
    # combine: DeepEP's positional order, zero_copy through get_next_low_latency_combine_buffer, wait stats
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(rank))
    y = per_token_cast_back(rx1.view(-1, hidden), rs1.reshape(-1, hidden // 128)).view(epr, cap, hidden)
    out = torch.empty(t, hidden, dtype=torch.bfloat16)
    cw = torch.zeros(world, dtype=torch.int64)
    # x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out, wait stats
    combined, ev, _ = buf.low_latency_combine(y, idx, w, h1, False, False, False, False, out, cw)
    ev.current_stream_wait(release_handle=True)
    assert combined is out
    xq = per_token_cast_back(*_cast(x))
    expect = (xq.float() * w.masked_fill(idx < 0, 0).sum(1, keepdim=True))
    assert (combined.float() - expect).abs().max() <= 1e-2 * expect.abs().max() + 1e-3
    buf.get_next_low_latency_combine_buffer(h1)[:] = y
    zc, _, _ = buf.low_latency_combine(torch.zeros_like(y), idx, w, h1, zero_copy=True)
    assert torch.equal(zc, combined)
    return {"counts": cnt1.tolist()}


def _cast(x):
    from deepep.fp8 import per_token_cast_to_fp8

    return per_token_cast_to_fp8(x)


def masked_rank(rank: int, world: int) -> dict:
    """Shrink mode: the last rank stops taking part; the others mask it and go on."""
    t, hidden, experts, k = 8, 256, 3 * world, 2
    epr = experts // world
    buf = Buffer(None, 0, 0, True, epr, enable_shrink=True, transport="torch", timeout_s=20)
    dead = world - 1
    if rank == dead:
        return {"left": True}
    buf.low_latency_update_mask_buffer(dead, True)
    status = torch.zeros(world, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r == dead else 0 for r in range(world)]
    seed = 2
    idx = _routing(seed * 10 + rank, t, experts, k)
    x = _ll_x(rank, t, hidden)
    recv, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False)
    ref = _ll_reference(rank, world, seed, t, hidden, experts, k, masked=(dead,))
    assert cnt.tolist() == [len(v) for v in ref]
    w = torch.ones(t, k)
    combined, _, _ = buf.low_latency_combine(recv, idx, w, h)
    alive = idx.masked_fill(idx // epr == dead, -1)
    expect = x.float() * (alive >= 0).sum(1, keepdim=True)
    assert torch.equal(combined.float(), expect)
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    assert status.sum() == 0
    return {"left": False}


def nvlink_compat(rank: int, world: int) -> dict:
    """On GPUs (NCCL group): a per-call Config on the NVLink engine, its handle tuple, and low-latency
    round_scale/use_ue8m0 (served by the torch engine over NCCL) next to the NVLink kernels' fp8."""
    experts, k, hidden, t = 4 * world, 2, 512, 64
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(None, 0, 0, True, 4, transport="nvlink", timeout_s=60, num_max_tokens_per_rank=t, hidden=hidden)
    idx = _routing(rank, t, experts, k).to(dev)
    x = torch.full((t, hidden), float(rank), dtype=torch.bfloat16, device=dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=idx, config=Config(8, 4, 256))
    prefix = handle[0]
    start = 0
    for i in range(world):
        end = int(prefix[i][rank])
        assert torch.all(recv[start:end] == i)
        start = end
    combined, _, _ = buf.combine(recv, handle, config=Config(8, 4, 256))
    assert torch.equal(combined.float(), x.float() * in_rank.sum(1, keepdim=True).float())
    (rx, rs), cnt, h, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=True, round_scale=True,
                                                      use_ue8m0=True)
    assert rs.dtype == torch.int32 and rs.shape[-1] == hidden // 512
    src_info, layout_range, *_ = h
    assert int((layout_range & 0xFFFFFFFF).sum()) == int(cnt.sum())
    y = per_token_cast_back(rx.view(-1, hidden), rs.reshape(-1, 1)).view(rx.shape)
    out, _, _ = buf.low_latency_combine(y, idx, torch.ones(t, k, device=dev), h)
    expect = x.float() * (idx >= 0).sum(1, keepdim=True)
    assert torch.allclose(out.float(), expect, rtol=2**-6, atol=1e-2)
    buf.destroy()
    return {"recv": int(recv.shape[0])}


def _ll_round(buf: Buffer, rank: int, world: int, seed: int, dead_set: set[int], t: int, hidden: int, experts: int,
              k: int) -> None:
    """One low-latency dispatch + combine (identity experts) checked against a reference that drops the
    ranks in dead_set: their tokens are not received, their experts' outputs count as zeros."""
    epr = experts // world
    idx = _routing(seed * 10 + rank, t, experts, k)
    x = _ll_x(rank, t, hidden)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(seed * 100 + rank))
    recv, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False)
    ref = _ll_reference(rank, world, seed, t, hidden, experts, k, masked=tuple(dead_set))
    assert cnt.tolist() == [len(v) for v in ref], (seed, cnt.tolist(), [len(v) for v in ref])
    for le in range(epr):
        got = sorted(zip(recv[le, : len(ref[le]), 0].tolist(), recv[le, : len(ref[le]), -1].tolist()))
        assert got == sorted((float(s - 8), float(tok)) for s, tok in ref[le]), (seed, le)
    combined, _, _ = buf.low_latency_combine(recv, idx, w, h)
    owner = torch.where(idx >= 0, idx // epr, -1)
    alive = (idx >= 0) & ~torch.isin(owner, torch.tensor(sorted(dead_set) or [-2]))
    expect = x.float() * (w * alive).sum(1, keepdim=True)
    torch.testing.assert_close(combined.float(), expect, rtol=1e-2, atol=1e-2)


def shrink_auto(rank: int, world: int, mode: str, ll_timeout_s: float = 2.0) -> dict:
    """Shrink mode without an explicit mask: the last rank takes part in a first round, then fails (mode
    'die': the process exits before its second dispatch; 'die_at_combine': after its second dispatch,
    before the combine; 'stall': it sleeps past everyone's deadline, then calls again). The others must
    finish the second round with it masked (results as if its contributions were dropped) and a third
    round without waiting on it; the stalled one, back, finds everyone else masked."""
    import os
    import time

    t, hidden, experts, k = 8, 256, 3 * world, 2
    dead = world - 1
    buf = Buffer(None, 0, 0, True, experts // world, enable_shrink=True, transport="torch", timeout_s=ll_timeout_s)
    status = torch.zeros(world, dtype=torch.int32)
    _ll_round(buf, rank, world, 1, set(), t, hidden, experts, k)  # everyone alive
    if rank == dead:
        if mode == "die":
            os._exit(3)
        if mode == "die_at_combine":
            idx = _routing(20 + rank, t, experts, k)
            buf.low_latency_dispatch(_ll_x(rank, t, hidden), idx, t, experts, use_fp8=False)
            os._exit(3)
        time.sleep(3 * ll_timeout_s)
        t0 = time.monotonic()
        x = _ll_x(rank, t, hidden)
        buf.low_latency_dispatch(x, _routing(20 + rank, t, experts, k), t, experts, use_fp8=False)
        buf.low_latency_query_mask_buffer(status)
        return {"masked": status.tolist(), "seconds": time.monotonic() - t0}
    t0 = time.monotonic()
    if mode == "die_at_combine":
        # The dead rank sent its dispatch: its tokens arrive; only the combine misses it.
        epr = experts // world
        idx = _routing(20 + rank, t, experts, k)
        x = _ll_x(rank, t, hidden)
        w = torch.ones(t, k)
        recv, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False)
        assert cnt.tolist() == [len(v) for v in _ll_reference(rank, world, 2, t, hidden, experts, k)]
        combined, _, _ = buf.low_latency_combine(recv, idx, w, h)
        alive = (idx >= 0) & (idx // epr != dead)
        assert torch.equal(combined.float(), x.float() * alive.sum(1, keepdim=True))
    else:
        _ll_round(buf, rank, world, 2, {dead}, t, hidden, experts, k)
    second = time.monotonic() - t0
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r == dead else 0 for r in range(world)], status
    t0 = time.monotonic()
    _ll_round(buf, rank, world, 3, {dead}, t, hidden, experts, k)
    third = time.monotonic() - t0
    if world >= 4:  # DeepEP's clean_low_latency_buffer is a barrier that masks who does not come
        late = world - 2
        if rank == late:
            return {"masked": status.tolist(), "second_s": second, "third_s": third, "late": True}
        buf.clean_low_latency_buffer(t, hidden, experts)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [1 if r in (dead, late) else 0 for r in range(world)], status
        _ll_round(buf, rank, world, 4, {dead, late}, t, hidden, experts, k)
    return {"masked": status.tolist(), "second_s": second, "third_s": third}


def shrink_off_timeout(rank: int, world: int, timeout_s: float = 2.0) -> dict:
    """Without enable_shrink a silent rank is an error: CommTimeoutError naming it, nothing masked."""
    import time

    from tilehal import CommTimeoutError

    t, hidden, experts, k = 8, 256, 2 * world, 2
    dead = world - 1
    buf = Buffer(None, 0, 0, True, experts // world, transport="torch", timeout_s=timeout_s)
    if rank == dead:
        time.sleep(3 * timeout_s)
        return {"dead": True}
    try:
        buf.low_latency_dispatch(_ll_x(rank, t, hidden), _routing(rank, t, experts, k), t, experts, use_fp8=False)
    except CommTimeoutError as e:
        return {"peer": e.peer, "stage": e.stage}
    raise AssertionError("a silent rank without enable_shrink did not raise")
