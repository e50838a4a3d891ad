"""Functions run on every rank of a Gloo group by tests (via deepep.testing.run_on_ranks).

Each rank can rebuild every other rank's inputs from the seed, so the expected result of a
collective is computed locally, in plain Python/torch, independent of deepep.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from deepep import Buffer, CommTimeoutError, per_token_cast_back, per_token_cast_to_fp8

# ----------------------------------------------------------------------------- inputs


def make_routing(seed: int, num_tokens: int, num_experts: int, k: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if num_tokens == 0:
        return torch.empty(0, k, dtype=torch.int64)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    idx = scores.topk(k, dim=1).indices
    if kind == "hot":  # one expert everyone wants
        idx[:, 0] = 0
    if kind in ("random", "hot"):
        drop = torch.rand(num_tokens, k, generator=g) < 0.2
        idx[drop] = -1
    if kind == "silent":  # this rank sends nothing
        idx[:] = -1
    return idx


def rank_inputs(seed: int, rank: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = cfg["tokens"][rank]
    kind = cfg.get("kinds", {}).get(rank, cfg.get("kind", "random"))
    idx = make_routing(seed * 100 + rank, t, cfg["experts"], cfg["k"], kind)
    g = torch.Generator().manual_seed(seed * 100 + rank + 7)
    x = torch.randn(t, cfg["hidden"], generator=g).to(cfg.get("dtype", torch.float32))
    w = torch.rand(t, cfg["k"], generator=g)
    return x, idx, w


def reference_dispatch(seed: int, me: int, world: int, cfg: dict):
    """Rows this rank must receive, in DeepEP's order (source rank, then token)."""
    epr = cfg["experts"] // world
    lo, hi = me * epr, (me + 1) * epr
    rows, idxs, ws, per_expert = [], [], [], [0] * epr
    for src in range(world):
        x, idx, w = rank_inputs(seed, src, cfg)
        for t in range(x.shape[0]):
            experts = [int(e) for e in idx[t]]
            if not any(lo <= e < hi for e in experts):
                continue
            rows.append(x[t])
            idxs.append([e - lo if lo <= e < hi else -1 for e in experts])
            ws.append([float(w[t, j]) if lo <= experts[j] < hi else 0.0 for j in range(len(experts))])
            for e in experts:
                if lo <= e < hi:
                    per_expert[e - lo] += 1
    h, k = cfg["hidden"], cfg["k"]
    x_ref = torch.stack(rows) if rows else torch.empty(0, h, dtype=cfg.get("dtype", torch.float32))
    return x_ref, torch.tensor(idxs, dtype=torch.int64).view(-1, k), torch.tensor(ws).view(-1, k), per_expert


# ----------------------------------------------------------------------------- normal mode


def _check_case(buf: Buffer, seed: int, cfg: dict, rank: int, world: int, device: str = "cpu") -> dict:
    x, idx, w = (t.to(device) for t in rank_inputs(seed, rank, cfg))
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, cfg["experts"])
    align = cfg.get("align", 1)
    worst = cfg.get("worst", 0)
    recv_x, recv_idx, recv_w, recv_per_expert, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=align,
        num_worst_tokens=worst)
    event.current_stream_wait()
    x_ref, idx_ref, w_ref, per_expert_ref = reference_dispatch(seed, rank, world, cfg)
    x, idx, w, in_rank, recv_x, recv_idx, recv_w = (t.cpu() for t in (x, idx, w, in_rank, recv_x, recv_idx, recv_w))
    n = x_ref.shape[0]
    if worst:
        assert recv_x.shape[0] == worst and recv_per_expert == []
        assert (recv_idx[n:] == -1).all()
    else:
        assert recv_x.shape[0] == n, (recv_x.shape, n)
        assert recv_per_expert == [(c + align - 1) // align * align for c in per_expert_ref], \
            (recv_per_expert, per_expert_ref)
    assert torch.equal(recv_x[:n], x_ref)
    assert torch.equal(recv_idx[:n], idx_ref), (recv_idx[:n], idx_ref)
    assert torch.equal(recv_w[:n], w_ref)

    # combine: every token comes back as x times the number of ranks it went to
    combined, combined_w, _ = buf.combine(recv_x.to(device), handle, topk_weights=recv_w.to(device))
    combined, combined_w = combined.cpu(), combined_w.cpu()
    mult = in_rank.sum(1, keepdim=True).to(torch.float32)
    assert torch.equal(combined, (x.float() * mult).to(x.dtype))
    assert torch.equal(combined_w, torch.where(idx >= 0, w, torch.zeros_like(w)))

    # handle reuse: new values, same routing, no counts exchange
    x2 = x * 2 + 1
    recv2, idx2, w2, per2, handle2, _ = buf.dispatch(x2.to(device), handle=handle)
    recv2 = recv2.cpu()
    assert torch.equal(recv2[:n], (x_ref * 2 + 1).to(x.dtype))
    assert idx2 is None and w2 is None and per2 is None and handle2 is None  # DeepEP's cached return
    return {"received": n}


def dispatch_combine(rank: int, world: int, cases: list[dict], transport: str = "torch",
                     ranks_per_node: int | None = None, device: str = "cpu") -> list[dict]:
    buf = Buffer(None, transport=transport, num_ranks_per_node=ranks_per_node, timeout_s=20,
                 num_max_tokens_per_rank=256)
    assert buf.transport == transport, (buf.transport, transport)
    out = [_check_case(buf, seed, cfg, rank, world, device) for seed, cfg in enumerate(cases, start=1)]
    if device != "cpu":
        torch.cuda.synchronize()
        if hasattr(buf._backend, "check"):
            buf._backend.check()
    return out


def fp8_dispatch(rank: int, world: int, hidden: int = 256, transport: str = "torch", device: str = "cpu") -> None:
    cfg = {"tokens": [24 + r * 5 for r in range(world)], "experts": 8 * world, "k": 4, "hidden": hidden,
           "dtype": torch.bfloat16}
    buf = Buffer(transport=transport, timeout_s=20, num_max_tokens_per_rank=256)
    x, idx, w = rank_inputs(3, rank, cfg)
    xq, sq = per_token_cast_to_fp8(x)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx.to(device), cfg["experts"])
    (rx, rs), ridx, rw, _, handle, _ = buf.dispatch((xq.to(device), sq.to(device)), is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=per_expert, topk_idx=idx.to(device),
                                                    topk_weights=w.to(device))
    rx, rs, ridx = rx.cpu(), rs.cpu(), ridx.cpu()
    x_ref, idx_ref, _, _ = reference_dispatch(3, rank, world, cfg)
    assert rx.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    assert rs.shape == (x_ref.shape[0], hidden // 128)
    # The transport moves bytes, so the fp8 payload is bit-exact; the dequantized value is within
    # fp8 e4m3's relative step (2^-3 with round-to-nearest: 1/16) of the bf16 source.
    ref_q, ref_s = per_token_cast_to_fp8(x_ref)
    assert torch.equal(rx.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(rs, ref_s)
    deq = per_token_cast_back(rx, rs)
    err = (deq - x_ref.float()).abs()
    bound = x_ref.float().abs() / 16 + rs.repeat_interleave(128, dim=1) * 2 ** -9
    assert (err <= bound + 1e-6).all(), float((err - bound).max())
    assert torch.equal(ridx, idx_ref)


def async_overlap(rank: int, world: int) -> None:
    cfg = {"tokens": [16] * world, "experts": 4 * world, "k": 2, "hidden": 128}
    buf = Buffer(transport="torch", timeout_s=20)
    x, idx, w = rank_inputs(5, rank, cfg)
    per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, cfg["experts"], async_finish=True)
    recv_x, _, _, _, handle, ev2 = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                topk_idx=idx, previous_event=ev, async_finish=True)
    with ev2:
        pass
    assert ev2.query()
    out, _, ev3 = buf.combine(recv_x, handle, async_finish=True, previous_event=ev2)
    ev3.current_stream_wait()
    assert torch.equal(out, x * in_rank.sum(1, keepdim=True))


def bad_inputs(rank: int, world: int) -> list[str]:
    from tilehal import ShapeError

    buf = Buffer(transport="torch", timeout_s=20)
    msgs = []
    idx = torch.zeros(4, 2, dtype=torch.int64)
    for call in (
        lambda: buf.get_dispatch_layout(idx.int(), 4 * world),
        lambda: buf.get_dispatch_layout(idx + 99, 4 * world),
        lambda: buf.dispatch(torch.zeros(4, 8, dtype=torch.int32), topk_idx=idx,
                             num_tokens_per_expert=torch.zeros(4 * world, dtype=torch.int32)),
        lambda: buf.dispatch((torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.zeros(4, 3)), topk_idx=idx,
                             num_tokens_per_expert=torch.zeros(4 * world, dtype=torch.int32)),
        lambda: buf.dispatch(torch.zeros(4, 8), topk_idx=idx[:3],
                             num_tokens_per_expert=torch.zeros(4 * world, dtype=torch.int32)),
        lambda: buf.combine(torch.zeros(4, 8), handle=object()),
    ):
        try:
            call()
        except ShapeError as e:
            msgs.append(str(e))
        else:
            raise AssertionError("bad input was accepted")
    return msgs


# ----------------------------------------------------------------------------- low latency


def low_latency(rank: int, world: int, use_fp8: bool, tokens: list[int], hidden: int = 256, experts: int = 16,
                k: int = 4, max_tokens: int = 32, transport: str = "torch", rounds: int = 2, device: str = "cpu",
                exact: bool = True) -> None:
    cfg = {"tokens": tokens, "experts": experts, "k": k, "hidden": hidden, "dtype": torch.bfloat16}
    buf = Buffer(transport=transport, timeout_s=20, low_latency_mode=True)
    assert buf.transport == transport
    epr = experts // world
    stats = torch.zeros(epr, dtype=torch.int32, device=device)
    expect_stats = torch.zeros(epr, dtype=torch.int32)
    for seed in range(11, 11 + rounds):
        x, idx, w = rank_inputs(seed, rank, cfg)
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x.to(device), idx.to(device), max_tokens, experts, use_fp8=use_fp8, return_recv_hook=(seed % 2 == 0),
            cumulative_local_expert_recv_stats=stats)
        if hook is not None:
            hook()
        event.current_stream_wait()
        recv_x = tuple(t.cpu() for t in recv_x) if isinstance(recv_x, tuple) else recv_x.cpu()
        recv_count = recv_count.cpu()
        # reference: per local expert, rows ordered by source rank then token
        expect: list[list[torch.Tensor]] = [[] for _ in range(epr)]
        for src in range(world):
            xs, ids, _ = rank_inputs(seed, src, cfg)
            for t in range(xs.shape[0]):
                for e in ids[t].tolist():
                    if rank * epr <= e < (rank + 1) * epr:
                        expect[e - rank * epr].append(xs[t])
        assert recv_count.tolist() == [len(v) for v in expect]
        expect_stats += recv_count.to(torch.int32)
        assert torch.equal(stats.cpu(), expect_stats)
        if use_fp8:
            rx, rs = recv_x
            assert rx.shape == (epr, world * max_tokens, hidden) and rs.shape == (epr, world * max_tokens, hidden // 128)
            got = per_token_cast_back(rx, rs)
        else:
            got = recv_x.float()
        for e in range(epr):
            if expect[e]:
                ref = torch.stack(expect[e]).float()
                if use_fp8:
                    ref = per_token_cast_back(*per_token_cast_to_fp8(ref))
                if exact:
                    assert torch.equal(got[e, : len(expect[e])], ref), e
                else:  # the GPU's own fp8 cast: within one e4m3 step of the CPU's
                    torch.testing.assert_close(got[e, : len(expect[e])], ref, rtol=2 ** -3, atol=1e-3)
        # expert e's output: its input times (global expert id + 1), in bf16
        scale = torch.arange(rank * epr + 1, (rank + 1) * epr + 1, dtype=torch.float32).view(epr, 1, 1)
        y = (got * scale).to(torch.bfloat16)
        out, ev, hook2 = buf.low_latency_combine(y.to(device), idx.to(device), w.to(device), handle,
                                                 return_recv_hook=(seed % 2 == 1))
        if hook2 is not None:
            hook2()
        ev.current_stream_wait()
        out = out.cpu()
        xin = x.float()
        if use_fp8:
            xin = per_token_cast_back(*per_token_cast_to_fp8(x)) if x.shape[0] else xin
        ref = torch.zeros(x.shape[0], hidden)
        for t in range(x.shape[0]):
            for j, e in enumerate(idx[t].tolist()):
                if e >= 0:
                    ref[t] += w[t, j] * (xin[t] * (e + 1)).to(torch.bfloat16).float()
        assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], hidden)
        # bf16 output: relative 2^-8 per element of the sum, plus an absolute floor
        rtol, atol = (2 ** -7, 1e-2) if exact else (2 ** -3, 5e-2)
        torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- faults


def killed_rank(rank: int, world: int, victim: int, comm_timeout_s: float) -> dict:
    cfg = {"tokens": [8] * world, "experts": 2 * world, "k": 2, "hidden": 64}
    buf = Buffer(transport="torch", timeout_s=comm_timeout_s)
    x, idx, _ = rank_inputs(9, rank, cfg)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, cfg["experts"])
    buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)  # all alive
    if rank == victim:
        import os

        os._exit(1)
    time.sleep(0.5)  # let the victim die first
    t0 = time.monotonic()
    try:
        buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    except CommTimeoutError as e:
        elapsed = time.monotonic() - t0
        err = {"elapsed": elapsed, "rank": e.rank, "stage": e.stage, "msg": str(e), "peer": e.peer}
    else:
        raise AssertionError("dispatch with a dead peer returned")
    # The survivors form a new group and carry on with the same Buffer.
    survivors = [r for r in range(world) if r != victim]
    g = dist.new_group(survivors, use_local_synchronization=True)
    buf.reset(g)
    me = survivors.index(rank)
    n = len(survivors)
    cfg2 = {"tokens": [5 + r for r in range(n)], "experts": 2 * n, "k": 2, "hidden": 64}
    x2, idx2, _ = rank_inputs(4, me, cfg2)
    _, _, pe2, ir2, _ = buf.get_dispatch_layout(idx2, cfg2["experts"])
    recv, _, _, _, h2, _ = buf.dispatch(x2, is_token_in_rank=ir2, num_tokens_per_expert=pe2, topk_idx=idx2)
    assert torch.equal(recv, reference_dispatch(4, me, n, cfg2)[0])
    return err


def stalled_rank(rank: int, world: int, comm_timeout_s: float) -> dict | None:
    buf = Buffer(transport="torch", timeout_s=comm_timeout_s)
    cfg = {"tokens": [8] * world, "experts": 2 * world, "k": 2, "hidden": 64}
    x, idx, _ = rank_inputs(9, rank, cfg)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, cfg["experts"])
    if rank == world - 1:
        time.sleep(comm_timeout_s + 3)  # alive, but never joins
        return None
    return _dispatch_until_timeout(buf, x, in_rank, per_expert, idx, "dispatch")


def _dispatch_until_timeout(buf, x, in_rank, per_expert, idx, what: str) -> dict:
    """A dispatch that a stalled peer must end with CommTimeoutError: how long it took and what the error names."""
    t0 = time.monotonic()
    try:
        buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    except CommTimeoutError as e:
        return {"elapsed": time.monotonic() - t0, "rank": e.rank, "stage": e.stage, "msg": str(e), "peer": e.peer}
    raise AssertionError(f"{what} with a stalled peer returned")


# ----------------------------------------------------------------------------- DDP hooks


def ddp_training(rank: int, world: int, steps: int = 150) -> dict:
    from deepep.comm_hooks import (
        Int8ErrorFeedbackState,
        TopKErrorFeedbackState,
        int8_error_feedback_hook,
        topk_error_feedback_hook,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(32, 8, generator=g)
    data = torch.randn(world, 256, 32, generator=g)
    target = torch.tanh(data @ w_true) + 0.01 * torch.randn(world, 256, 8, generator=g)

    def train(hook, state) -> float:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        ddp = DDP(model)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(data[rank]), target[rank])
            loss.backward()
            opt.step()
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(data.view(-1, 32)), target.view(-1, 8)))

    base = train(None, None)
    s8 = Int8ErrorFeedbackState()
    int8 = train(int8_error_feedback_hook, s8)
    sk = TopKErrorFeedbackState(ratio=0.1)
    topk = train(topk_error_feedback_hook, sk)
    # state survives a checkpoint round trip
    for st, cls, kw in ((s8, Int8ErrorFeedbackState, {}), (sk, TopKErrorFeedbackState, {"ratio": 0.5})):
        sd = st.state_dict()
        again = cls(**kw)
        again.load_state_dict(sd)
        assert again.step == st.step and again.residuals.keys() == st.residuals.keys()
        assert all(torch.equal(again.residuals[k], st.residuals[k]) for k in st.residuals)
        assert any(v.abs().sum() > 0 for v in again.residuals.values())
    assert sk.ratio == 0.1
    return {"base": base, "int8": int8, "topk": topk}


# ----------------------------------------------------------------------------- hierarchical


def hierarchical(rank: int, world: int, ranks_per_node: int) -> dict:
    cfg = {"tokens": ([40, 0, 33, 17] * 2)[:world], "experts": 4 * world, "k": 4, "hidden": 128}
    h = Buffer(transport="hierarchical", num_ranks_per_node=ranks_per_node, timeout_s=20)
    assert h.transport == "hierarchical"
    stats = _check_case(h, 21, cfg, rank, world)
    x, idx, w = rank_inputs(21, rank, cfg)
    _, per_rdma, per_expert, in_rank, _ = h.get_dispatch_layout(idx, cfg["experts"])
    _, _, _, _, handle, _ = h.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    # each token crosses to a remote node once, however many ranks there want it
    nodes = in_rank.view(x.shape[0], world // ranks_per_node, ranks_per_node).any(dim=2)
    my_node = rank // ranks_per_node
    remote = int(nodes.sum()) - int(nodes[:, my_node].sum())
    assert handle.inter_node_rows_sent == remote, (handle.inter_node_rows_sent, remote)
    assert torch.equal(per_rdma, nodes.sum(0, dtype=torch.int32))
    stats["remote_rows"] = remote
    return stats


# ----------------------------------------------------------------------------- GPU only


def nvlink_stalled_peer(rank: int, world: int, comm_timeout_s: float) -> dict | None:
    """Rank 1 never joins: rank 0's NVLink kernel gives up at its deadline, the host raises."""
    buf = Buffer(transport="nvlink", timeout_s=comm_timeout_s, num_max_tokens_per_rank=64)
    cfg = {"tokens": [8] * world, "experts": 2 * world, "k": 2, "hidden": 64}
    x, idx, _ = (t.cuda() for t in rank_inputs(9, rank, cfg))
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, cfg["experts"])
    # One call with everyone present: sets up the shared buffers (a collective).
    buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    torch.cuda.synchronize()
    if rank != 0:
        time.sleep(comm_timeout_s + 4)
        return None
    return _dispatch_until_timeout(buf, x, in_rank, per_expert, idx, "NVLink dispatch")


def nvlink_layout(rank: int, world: int) -> int:
    """The NVLink layout kernel against compute_layout (torch ops) on several routings, more tokens
    than one 1024-thread tile; a bad expert id raises ShapeError at the next call, once."""
    from deepep.layout import compute_layout
    from tilehal import ShapeError

    buf = Buffer(transport="nvlink", timeout_s=20, num_max_tokens_per_rank=3000)
    checked = 0
    for seed, (tokens, experts, k, kind) in enumerate([(2500, 8 * world, 4, "random"), (700, 64 * world, 8, "hot"),
                                                       (0, 4 * world, 2, "random"), (33, 2 * world, 2, "silent")]):
        idx = make_routing(seed, tokens, experts, k, kind).cuda()
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        ref = compute_layout(idx.cpu(), experts, world, world)
        assert torch.equal(per_rank.cpu(), ref.num_tokens_per_rank), seed
        assert torch.equal(per_expert.cpu(), ref.num_tokens_per_expert), seed
        assert torch.equal(in_rank.cpu(), ref.is_token_in_rank), seed
        send_pos = buf._backend._layout_cache[2].cpu()
        pos_ref = torch.cumsum(ref.is_token_in_rank.int(), 0) - 1
        assert torch.equal(send_pos, torch.where(ref.is_token_in_rank, pos_ref, -1).int()), seed
        checked += 1
    bad = torch.tensor([[0, 5 * world]], dtype=torch.int64, device="cuda")
    buf.get_dispatch_layout(bad, 4 * world)
    torch.cuda.synchronize()
    try:
        buf.get_dispatch_layout(bad[:, :1], 4 * world)
    except ShapeError as e:
        assert "topk_idx" in str(e) and str(5 * world) in str(e), e
    else:
        raise AssertionError("a bad expert id was not reported")
    buf.get_dispatch_layout(bad[:, :1], 4 * world)  # reported once; valid input runs again
    torch.cuda.synchronize()
    buf.destroy()
    return checked


# ----------------------------------------------------------------------------- cross-rank consistency


def disagreeing_dispatch(rank: int, world: int, vary: str, odd_rank: int = 1, transport: str = "torch",
                         ranks_per_node: int | None = None) -> str:
    """Every rank dispatches, `odd_rank` with one thing different: every rank must raise ShapeError naming it."""
    from tilehal import ShapeError

    rank_is_odd = rank == odd_rank

    experts = 8 * world if not (vary == "experts" and rank_is_odd) else 4 * world
    hidden = 64 if not (vary == "hidden" and rank_is_odd) else 96
    k = 2 if not (vary == "topk" and rank_is_odd) else 3
    dtype = torch.bfloat16 if (vary == "dtype" and rank_is_odd) else torch.float32
    buf = Buffer(None, transport=transport, num_ranks_per_node=ranks_per_node, timeout_s=20)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(10, experts, generator=g).topk(k, dim=1).indices
    x = torch.randn(10, hidden, generator=g).to(dtype)
    w = torch.rand(10, k, generator=g)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    try:
        buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    except ShapeError as e:
        return str(e)
    return "no error"


def disagreeing_combine(rank: int, world: int, transport: str = "torch", ranks_per_node: int | None = None) -> str:
    """The same dispatch everywhere, then rank 1 combines bf16 rows where the others combine fp32: every rank
    must raise ShapeError naming x_dtype before a row moves."""
    from tilehal import ShapeError

    buf = Buffer(None, transport=transport, num_ranks_per_node=ranks_per_node, timeout_s=20)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(10, 4 * world, generator=g).topk(2, dim=1).indices
    x = torch.randn(10, 64, generator=g)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4 * world)
    recv, _, _, _, handle, _ = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                            topk_idx=idx)
    try:
        buf.combine(recv.to(torch.bfloat16) if rank == 1 else recv, handle)
    except ShapeError as e:
        return str(e)
    return "no error"


def handle_reuse_checks(rank: int, world: int) -> list[str]:
    """A handle reused with a new hidden size by every rank works (DeepEP replays handles with new x); one
    rank alone changing it, or a new topk_idx, is refused on every rank before any row moves."""
    from tilehal import ShapeError

    buf = Buffer(None, transport="torch", timeout_s=20)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(12, 16, generator=g).topk(2, dim=1).indices
    x = torch.randn(12, 64, generator=g)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 16)
    *_, handle, _ = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
    errors = []
    for bad in ({"x": torch.randn(12, 32)}, {"x": x, "topk_idx": idx.roll(1, 0)},
                {"x": torch.randn(12, 32 if rank == 1 else 64)}):
        try:
            buf.dispatch(bad["x"], handle=handle, topk_idx=bad.get("topk_idx"))
            errors.append("no error")
        except ShapeError as e:
            errors.append(str(e))
    wrong = per_expert.clone()
    wrong[0] += 1
    try:
        buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=wrong, topk_idx=idx)
        errors.append("no error")
    except ShapeError as e:
        errors.append(str(e))
    bad_in = in_rank.clone()
    bad_in[0] = ~bad_in[0]
    try:
        buf.dispatch(x, is_token_in_rank=bad_in, num_tokens_per_expert=per_expert, topk_idx=idx)
        errors.append("no error")
    except ShapeError as e:
        errors.append(str(e))
    # The buffer still works for everyone afterwards: nothing half-sent.
    again = buf.dispatch(x, handle=handle)[0]  # a cached dispatch returns the data (DeepEP's shape)
    again = again[0] if isinstance(again, tuple) else again
    errors.append(f"ok {again.shape[0] == handle.num_recv_tokens}")
    return errors


# ----------------------------------------------------------------------------- fuzzing (one rank)


def fuzz_dispatch_args(rank: int, world: int, max_examples: int = 120, transport: str = "torch") -> dict:
    """Hypothesis over dispatch/combine arguments on a 1-rank group: every call either matches the
    reference (world 1: each token with a valid expert comes back to itself, combine sums its copy)
    or raises a TileStackError naming an argument. Runs inside the rank so the group is set up once."""
    import math

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from tilehal import TileStackError

    buf = Buffer(None, transport=transport, timeout_s=20)
    assert buf.transport == transport
    outcome = {"ok": 0, "refused": 0}
    names = ("x", "topk_idx", "topk_weights", "num_tokens_per_expert", "is_token_in_rank", "expert_alignment",
             "num_worst_tokens", "handle", "dispatch")

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(t=st.integers(0, 5), hidden=st.sampled_from([1, 16, 33]),
           dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.float64]),
           k=st.integers(1, 3), experts=st.sampled_from([1, 4, 6]), strided=st.booleans(),
           special=st.sampled_from([0.0, math.nan, math.inf, -math.inf]),
           idx_mode=st.sampled_from(["ok", "ok", "neg", "big", "int32", "1d"]),
           counts_mode=st.sampled_from(["ok", "ok", "wrong", "float", "none"]),
           align=st.sampled_from([1, 4, 0]), worst=st.sampled_from([0, 0, 64, 1]))
    def run(t, hidden, dtype, k, experts, strided, special, idx_mode, counts_mode, align, worst):
        g = torch.Generator().manual_seed(t * 31 + hidden)
        x = torch.randn(t, hidden * (2 if strided else 1), generator=g)
        if t:
            x[0, 0] = special
        x = (x[:, ::2] if strided else x).to(dtype)
        kk = min(k, experts)
        idx = torch.rand(t, experts, generator=g).topk(kk, dim=1).indices if t else torch.empty(0, kk, dtype=torch.long)
        if idx_mode == "neg" and t:
            idx[0, 0] = -1
        elif idx_mode == "big" and t:
            idx[0, 0] = experts + 3
        elif idx_mode == "int32":
            idx = idx.to(torch.int32)
        elif idx_mode == "1d":
            idx = idx[:, 0]
        w = torch.rand(t, kk, generator=g)
        per_expert = torch.zeros(experts, dtype=torch.int32)
        in_rank = torch.zeros(t, 1, dtype=torch.bool)
        if idx_mode in ("ok", "neg"):
            _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        if counts_mode == "wrong":
            per_expert = per_expert.clone()
            per_expert[0] += 1
        elif counts_mode == "float":
            per_expert = per_expert.float()
        try:
            recv_x, recv_idx, recv_w, per_list, handle, _ = buf.dispatch(
                x, is_token_in_rank=in_rank, num_tokens_per_expert=None if counts_mode == "none" else per_expert,
                topk_idx=idx, topk_weights=w if idx.dim() == 2 else None, expert_alignment=align,
                num_worst_tokens=worst)
            combined, _, _ = buf.combine(recv_x, handle)
        except TileStackError as e:
            head = str(e).split(":")[0]
            assert any(n in head for n in names), str(e)
            outcome["refused"] += 1
            return
        except Exception as e:  # the failure this test exists to catch
            raise AssertionError(f"raw {type(e).__name__} from dispatch/combine: {e}") from e
        sent = [i for i in range(t) if any(int(e) >= 0 for e in idx[i])]
        n = len(sent)
        assert torch.equal(recv_x[:n].float(), x[sent].float()) or torch.allclose(
            recv_x[:n].float(), x[sent].float(), equal_nan=True), "received rows differ"
        if worst:
            assert recv_x.shape[0] == worst and per_list == []
        want = torch.zeros_like(x, dtype=torch.float32)
        want[sent] = x[sent].float()
        assert torch.allclose(combined.float(), want.to(combined.dtype).float(), equal_nan=True), "combine differs"
        outcome["ok"] += 1

    run()
    return outcome


# ----------------------------------------------------------------------------- the local engine


def _same(a, b, what: str) -> None:
    """Exact equality of two results (tensors, pairs, lists, None), NaN-free inputs."""
    if isinstance(a, (tuple, list)) and not isinstance(a, torch.Tensor):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), (what, type(a), type(b))
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (what, a, b)
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), what
    else:
        assert a == b, (what, a, b)


def local_matches_one_rank_group(rank: int, world: int) -> int:
    """Buffer(transport="local") against the torch engine on this one-rank Gloo group: every output of
    layout, dispatch (bf16, fp8, unrouted tokens, alignment, num_worst_tokens, a cached handle), combine
    (weights, bias) and low-latency dispatch/combine is identical."""
    assert world == 1
    ref, loc = Buffer(None, transport="torch", timeout_s=20), Buffer(None, transport="local", timeout_s=20)
    assert loc.transport == "local" and loc.group_size == 1 and loc.rank == 0
    checked = 0
    for seed, (t, unrouted, fp8, align, worst) in enumerate(
            [(37, 0.0, False, 1, 0), (37, 0.3, False, 4, 0), (40, 0.3, True, 1, 0), (25, 0.2, False, 1, 64),
             (0, 0.0, False, 1, 0), (16, 1.0, False, 1, 0)]):
        g = torch.Generator().manual_seed(seed)
        e, k, h = 8, 3, 256
        idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
        idx[torch.rand(t, k, generator=g) < 0.2] = -1
        idx[torch.rand(t, generator=g) < unrouted] = -1  # tokens routed nowhere
        w = torch.rand(t, k, generator=g)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        xin = per_token_cast_to_fp8(x.float()) if fp8 else x
        lays = [b.get_dispatch_layout(idx, e) for b in (ref, loc)]
        _same(lays[0][:4], lays[1][:4], f"layout {seed}")
        outs = [b.dispatch(xin, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                           topk_idx=idx, topk_weights=w, expert_alignment=align, num_worst_tokens=worst)
                for b, lay in zip((ref, loc), lays)]
        _same(outs[0][:4], outs[1][:4], f"dispatch {seed}")
        _same(tuple(outs[0][4]), tuple(outs[1][4]), f"handle {seed}")
        y = (outs[0][0][0].float() * outs[0][0][1].repeat_interleave(128, 1) if fp8 else outs[0][0].float()) * 3
        y = y.to(torch.bfloat16)
        bias = torch.randn(t, h, generator=g).to(torch.bfloat16)
        comb = [b.combine(y, o[4], o[2], bias=bias)[:2] for b, o in zip((ref, loc), outs)]
        _same(comb[0], comb[1], f"combine {seed}")
        x2 = (x * 2).to(torch.bfloat16)
        again = [b.dispatch(x2, handle=o[4])[0] for b, o in zip((ref, loc), outs)]
        _same(again[0], again[1], f"cached dispatch {seed}")
        checked += 1
    for seed, (t, use_fp8, round_scale, hook) in enumerate([(20, True, False, False), (20, False, False, True),
                                                              (9, True, True, False), (0, True, False, False)]):
        g = torch.Generator().manual_seed(100 + seed)
        e, k, h, m = 8, 4, 512, 32
        idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
        idx[torch.rand(t, k, generator=g) < 0.2] = -1
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        w = torch.rand(t, k, generator=g)
        res = []
        for b in (ref, loc):
            recv, count, handle, _, recv_hook = b.low_latency_dispatch(
                x, idx, m, e, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=round_scale,
                return_recv_hook=hook)
            if recv_hook is not None:
                recv_hook()
            got = per_token_cast_back(*recv) if use_fp8 and not round_scale else (recv[0] if use_fp8 else recv)
            ys = (got.float() * 2).to(torch.bfloat16) if got.dtype != torch.float8_e4m3fn else \
                torch.ones(got.shape, dtype=torch.bfloat16)
            out, _, comb_hook = b.low_latency_combine(ys, idx, w, handle, return_recv_hook=hook)
            if comb_hook is not None:
                comb_hook()
            res.append((recv, count.clone(), tuple(handle), out))
        recv0 = tuple(r.clone() for r in res[0][0]) if use_fp8 else res[0][0].clone()
        _same((recv0, *res[0][1:]), res[1], f"low latency {seed}")
        checked += 1
    return checked


# ----------------------------------------------------------------------------- NVLink layout agreement (host side)


def nvlink_agreement(rank: int, world: int) -> list[str]:
    """The NVLink engine's cross-rank layout check (engines/nvlink/context.Agreement), on its own: the same
    layout passes (and is not exchanged again), a new layout that differs across ranks raises ShapeError on
    every rank naming the field, and the kinds are checked separately."""
    from deepep.engines.nvlink.context import Agreement
    from tilehal import ShapeError

    a = Agreement(dist.group.WORLD, timeout_s=20)
    calls = []
    real = a.t.gather_counts
    a.t.gather_counts = lambda *args, **kw: (calls.append(args[1]), real(*args, **kw))[1]
    out = []
    a.ensure("dispatch", [1024, 512, 2, -1, 4, 4, 8, 4096, 32])
    a.ensure("dispatch", [1024, 512, 2, -1, 4, 4, 8, 4096, 32])  # unchanged: no exchange
    out.append(f"exchanges {len(calls)}")
    for kind, values in (("dispatch", [1024, 576 + 64 * rank, 2, -1, 4, 4, 8, 4096, 32]),  # every rank changed it
                         ("low_latency_dispatch", [7168, 1, 8, 16 + 16 * (rank == world - 1), 128]),
                         ("combine", [1152, 512, 2 if rank else 1, 4, 4096, 32])):
        try:
            a.ensure(kind, values)
            out.append("no error")
        except ShapeError as e:
            out.append(str(e))
    a.ensure("low_latency_combine", [7168, 8, 16, 128])
    out.append(f"exchanges {len(calls)}")
    return out


def hierarchical_cached_layout(rank: int, world: int) -> list[str]:
    """The hierarchical engine's cached dispatch: every rank replaying the handle with a new hidden size is
    fine; one rank alone changing it is refused on every rank (the header goes to the whole group)."""
    from tilehal import ShapeError

    buf = Buffer(None, transport="hierarchical", num_ranks_per_node=2, timeout_s=20)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(12, 4 * world, generator=g).topk(2, dim=1).indices
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4 * world)
    *_, handle, _ = buf.dispatch(torch.randn(12, 64, generator=g), is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=idx)
    out = []
    for hidden in (32, 48 if rank == 1 else 32):
        try:
            recv = buf.dispatch(torch.randn(12, hidden, generator=g), handle=handle)[0]
            out.append(f"ok {recv.shape[1]}")
        except ShapeError as e:
            out.append(str(e))
    return out
