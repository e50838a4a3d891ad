"""The NVLink kernels on ONE GPU, with R ranks emulated in one process.

Each emulated rank gets its own regions in the same GPU's memory, its own stream, and a slice of
the SMs (so all ranks' kernels are resident at once and their spin-waits meet); normal mode runs
each rank's host code in its own thread (dispatch waits on the host for its kernel's counts).
Everything but the IPC plumbing runs as on R GPUs: the flag protocol, parities, slots, fan-out,
partial sums, the layout kernel.
Numerics are checked against a float reference built from the same inputs (fp8 within one e4m3
step, bf16 sums within 2^-7 relative).
"""

from __future__ import annotations

import threading

import pytest
import torch
from deepep.engines.nvlink.emulation import EmulatedRegions, emulated_context

pytestmark = pytest.mark.gpu


def _inputs(seed: int, rank: int, tokens: int, hidden: int, experts: int, k: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
    idx[torch.rand(tokens, k, generator=g) < 0.2] = -1
    if tokens and rank == 0:
        idx[0, :2] = 1  # one token lists an expert twice: two rows
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, k, generator=g)
    return x, idx, w


@pytest.mark.parametrize("world, tokens, use_fp8", [(2, [32, 7], True), (2, [0, 20], False), (3, [5, 31, 12], True)])
def test_low_latency_kernels_emulated_ranks(world, tokens, use_fp8):
    from deepep.engines.nvlink.low_latency import NvlinkLowLatency
    from deepep.fp8 import per_token_cast_back, per_token_cast_to_fp8

    hidden, experts, k, max_tokens = 512, 8 * world, 4, 32
    epr = experts // world
    w_ = EmulatedRegions(world)
    owners = [emulated_context(w_, r, sms=120 // world) for r in range(world)]
    lls = [NvlinkLowLatency(o) for o in owners]
    streams = [torch.cuda.Stream() for _ in range(world)]
    for seed in (1, 2, 3):  # several calls: both parities, epochs counted on the device
        ins = [_inputs(seed, r, tokens[r], hidden, experts, k) for r in range(world)]
        hooks = seed == 2  # send phases first, then every rank's receive phase from its hook
        outs = []
        for r in range(world):
            x, idx, _ = ins[r]
            with torch.cuda.stream(streams[r]):
                outs.append(lls[r].dispatch(x.cuda(), idx.cuda(), max_tokens, experts, use_fp8, hooks))
        for r in range(world):
            assert (outs[r][4] is not None) == hooks
            if hooks:
                with torch.cuda.stream(streams[r]):
                    outs[r][4]()
        torch.cuda.synchronize()
        ys = []
        for r in range(world):
            owners[r].check()
            recv_x, recv_count, handle, _, _ = outs[r]
            got = per_token_cast_back(*recv_x).cpu() if use_fp8 else recv_x.float().cpu()
            expect, srcs = _expected_ll_rows(ins, r, world, epr, with_sources=True)
            assert recv_count.cpu().tolist() == [len(v) for v in expect]
            for e in range(epr):
                n = len(expect[e])
                if n:
                    ref = torch.stack(expect[e]).float()
                    if use_fp8:
                        ref = per_token_cast_back(*per_token_cast_to_fp8(ref))
                        torch.testing.assert_close(got[e, :n], ref, rtol=2 ** -3, atol=1e-3)
                    else:
                        assert torch.equal(got[e, :n], ref)
                    assert handle.recv_src_info[e, :n].cpu().tolist() == srcs[e]
            scale = torch.arange(r * epr + 1, (r + 1) * epr + 1, dtype=torch.float32).view(epr, 1, 1)
            ys.append((got * scale).to(torch.bfloat16).cuda())
        results = []
        for r in range(world):
            _, idx, w = ins[r]
            with torch.cuda.stream(streams[r]):
                results.append(lls[r].combine(ys[r], idx.cuda(), w.cuda(), outs[r][2], hooks, None))
        if hooks:
            for r in range(world):
                with torch.cuda.stream(streams[r]):
                    results[r][2]()
        torch.cuda.synchronize()
        for r in range(world):
            owners[r].check()
            x, idx, w = ins[r]
            xin = per_token_cast_back(*per_token_cast_to_fp8(x.float())) if use_fp8 and x.shape[0] else x.float()
            ref = torch.zeros(x.shape[0], hidden)
            for t in range(x.shape[0]):
                for j, e in enumerate(idx[t].tolist()):
                    if e >= 0:
                        ref[t] += w[t, j] * (xin[t] * (e + 1)).to(torch.bfloat16).float()
            out = results[r][0].float().cpu()
            # fp8 rows: the GPU's cast may differ from the CPU's by one e4m3 step
            rtol, atol = (2 ** -3, 5e-2) if use_fp8 else (2 ** -7, 1e-2)
            torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def _expected_ll_rows(ins, r: int, world: int, epr: int, with_sources: bool = False):
    """The rows each local expert of rank r receives, packed by source rank then token; with_sources:
    also each row's token index on its source rank, as (rows, sources)."""
    expect: list[list[torch.Tensor]] = [[] for _ in range(epr)]
    srcs: list[list[int]] = [[] for _ in range(epr)]
    for s in range(world):
        xs, ids, _ = ins[s]
        for t in range(xs.shape[0]):
            for e in ids[t].tolist():
                if r * epr <= e < (r + 1) * epr:
                    expect[e - r * epr].append(xs[t])
                    srcs[e - r * epr].append(t)
    return (expect, srcs) if with_sources else expect


def test_low_latency_two_live_results_and_column_major_scales():
    """Issue 18 on the NVLink kernels: a second dispatch does not overwrite the first's outputs (two
    output sets used in turn, a third call reuses the first's storage), and fp8 scales come
    column-major with a TMA-aligned column stride (deepgemm's masked-GEMM layout)."""
    from deepep.engines.nvlink.low_latency import NvlinkLowLatency
    from deepep.fp8 import per_token_cast_back, per_token_cast_to_fp8

    world, hidden, experts, k, max_tokens = 2, 256, 8, 2, 7  # R * M = 14 rows: the column pads to 16
    epr = experts // world
    regions = EmulatedRegions(world)
    lls = [NvlinkLowLatency(emulated_context(regions, r, sms=60)) for r in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    results = []
    for seed in (11, 12, 13):
        ins = [_inputs(seed, r, 5 + r, hidden, experts, k) for r in range(world)]
        outs = []
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                outs.append(lls[r].dispatch(ins[r][0].cuda(), ins[r][1].cuda(), max_tokens, experts, True, False))
        torch.cuda.synchronize()
        results.append((ins, outs))
    for r in range(world):
        lls[r].ctx.check()
        first, second, third = (res[1][r][0] for res in results)
        assert first[0].data_ptr() != second[0].data_ptr() and third[0].data_ptr() == first[0].data_ptr()
        assert second[1].stride() == (hidden // 128 * 16, 1, 16) and second[1].shape == (epr, 14, hidden // 128)
    for ins, outs in results[1:]:  # the second result, after a third call; and the third
        for r in range(world):
            recv_x, recv_count = outs[r][0], outs[r][1]
            expect = _expected_ll_rows(ins, r, world, epr)
            assert recv_count.cpu().tolist() == [len(v) for v in expect]
            got = per_token_cast_back(*recv_x).cpu()
            for e in range(epr):
                if expect[e]:
                    ref = per_token_cast_back(*per_token_cast_to_fp8(torch.stack(expect[e]).float()))
                    torch.testing.assert_close(got[e, :len(expect[e])], ref, rtol=2 ** -3, atol=1e-3)


@pytest.mark.parametrize("T", [0, 1, 511, 513, 4096, 20001])
@pytest.mark.parametrize("R", [2, 3, 8])
def test_layout_kernel_tiles(T, R):
    """The multi-block layout kernel against a plain torch reference (exact integers)."""
    from deepep.engines.nvlink.context import compile_kernels
    from deepep.engines.nvlink.memory import HostMapped
    from deepep.engines.nvlink.normal import LayoutScratch, launch_layout

    E, k = 24 * R, 8
    g = torch.Generator().manual_seed(T * 10 + R)
    idx = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    idx[torch.rand(T, k, generator=g) < 0.3] = -1
    idx = idx.cuda()
    err = HostMapped(4)
    scratch = LayoutScratch()
    in_rank = torch.empty(T, R, dtype=torch.bool, device="cuda")
    per_rank = torch.empty(R, dtype=torch.int32, device="cuda")
    per_expert = torch.empty(E, dtype=torch.int32, device="cuda")
    send_pos, msg = launch_layout(compile_kernels(), err.device, scratch, R, T, E // R, topk_idx=idx,
                                  in_rank=in_rank, per_expert_in=None, per_rank=per_rank, per_expert=per_expert)
    torch.cuda.synchronize()
    assert list(err.view) == [0, 0, 0, 0]
    valid = idx >= 0
    owner = torch.where(valid, idx // (E // R), -1).cpu()
    ref_in = torch.stack([(owner == r).any(1) for r in range(R)], 1) if T else torch.zeros(0, R, dtype=torch.bool)
    ref_pos = torch.where(ref_in, ref_in.int().cumsum(0) - 1, -1)
    ref_expert = torch.bincount(idx[valid].cpu(), minlength=E)
    assert torch.equal(in_rank.cpu(), ref_in)
    assert torch.equal(send_pos.cpu(), ref_pos.int())
    assert per_rank.cpu().tolist() == ref_in.sum(0).tolist()
    assert per_expert.cpu().tolist() == ref_expert.tolist()
    assert msg[:, 0].cpu().tolist() == ref_in.sum(0).tolist()
    assert msg[:, 1:].reshape(-1).cpu().tolist() == ref_expert.tolist()
    # Again from is_token_in_rank and given per-expert counts (dispatch without the layout's cache).
    send_pos2, msg2 = launch_layout(compile_kernels(), err.device, scratch, R, T, E // R, topk_idx=None,
                                    in_rank=in_rank, per_expert_in=per_expert, per_rank=None, per_expert=None)
    assert torch.equal(send_pos2, send_pos) and torch.equal(msg2, msg)


def _emulated_dispatchers(world: int, cap: int, num_nvl_bytes: int = 0):
    """One NvlinkDispatcher per emulated rank, each on its own NvlinkContext (regions in one GPU)."""
    from deepep.dispatcher import EngineOptions
    from deepep.engines.nvlink import NvlinkDispatcher

    shared = EmulatedRegions(world)
    options = EngineOptions(group=None, timeout_s=10.0, num_ranks_per_node=world, num_max_tokens_per_rank=cap,
                            num_nvl_bytes=num_nvl_bytes)
    return [NvlinkDispatcher(options, context=emulated_context(shared, r, sms=2 * (60 // world)))
            for r in range(world)]


def _config(world: int):
    from deepep.config import Config

    return Config(num_sms=2 * (60 // world), num_max_nvl_chunked_send_tokens=32)


def _on_threads(world: int, fn):
    """fn(rank) on one thread per emulated rank, each on its own stream; re-raises the first error."""
    results, errors = [None] * world, []
    streams = [torch.cuda.Stream() for _ in range(world)]
    ready = threading.Barrier(world)

    def run(r):
        try:
            with torch.cuda.stream(streams[r]):
                # A device allocation (cudaMalloc) between two launches keeps the later kernel from
                # running beside the earlier one, so one rank's kernel would wait out the other's
                # spin: fill this stream's allocator cache first (large and small pools).
                warm = [torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")]
                warm += [torch.empty(64 * 2**10, dtype=torch.uint8, device="cuda") for _ in range(256)]
                del warm
                ready.wait(30)
                results[r] = fn(r)
            streams[r].synchronize()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world, fmt, worst, nvl", [(2, "bf16", 0, 0), (2, "fp8", 0, 0), (3, "bf16", 0, 0),
                                                   (2, "fp8", 700, 0), (2, "bf16", 0, 8 << 20)])
def test_normal_dispatch_combine_emulated_ranks(world, fmt, worst, nvl):
    """Layout + dispatch + combine through the NvlinkDispatcher; rows ordered by (source, token). With
    num_nvl_bytes (nvl) the regions are sized from it: a quarter per kind and parity."""
    from deepep.dispatcher import DispatchInput
    from deepep.fp8 import per_token_cast_to_fp8

    hidden, experts, k, cap = 512, 8 * world, 4, 300
    epr = experts // world
    tokens = [257, 0, 33][:world]
    ds = _emulated_dispatchers(world, cap, nvl)
    for seed in (1, 2):  # both parities
        ins = [_inputs(seed, r, tokens[r], hidden, experts, k) for r in range(world)]

        # Inputs are made here, not on the rank threads: a torch kernel's first (lazy) load there
        # could wait for the context to go idle while the other rank's kernel spins.
        gpu_in = []
        for x, idx, w in ins:
            x, idx, w = x.cuda(), idx.cuda(), w.cuda()
            gpu_in.append(DispatchInput(*per_token_cast_to_fp8(x), idx, w) if fmt == "fp8"
                          else DispatchInput(x, None, idx, w))
        torch.cuda.synchronize()

        def dispatch(r, gpu_in=gpu_in):
            lay = ds[r].layout(gpu_in[r].topk_idx, experts)
            return lay, ds[r].dispatch(gpu_in[r], None, lay.is_token_in_rank, lay.num_tokens_per_expert, epr, 1, worst,
                                       config=_config(world))

        outs = _on_threads(world, dispatch)
        for r in range(world):
            ds[r].check()
            lay, got = outs[r]
            rows, ids, ws = [], [], []
            for s_ in range(world):
                x, idx, w = ins[s_]
                sent = [t for t in range(x.shape[0]) if any(r * epr <= e < (r + 1) * epr for e in idx[t].tolist())]
                rows += [x[t] for t in sent]
                ids += [[e - r * epr if r * epr <= e < (r + 1) * epr else -1 for e in idx[t].tolist()] for t in sent]
                ws += [[float(w[t, j]) if r * epr <= idx[t, j] < (r + 1) * epr else 0.0 for j in range(k)] for t in sent]
            n = len(rows)
            assert got.recv_x.shape[0] == (worst or n)
            if rows:
                ref = torch.stack(rows)
                if fmt == "fp8":
                    rx = got.recv_x[:n].float() * got.recv_scales[:n].repeat_interleave(128, 1)
                    torch.testing.assert_close(rx.cpu(), ref.float(), rtol=2 ** -3, atol=1e-3)
                else:
                    assert torch.equal(got.recv_x.cpu(), ref)
                assert got.recv_topk_idx[:n].cpu().tolist() == ids
                torch.testing.assert_close(got.recv_topk_weights[:n].cpu(), torch.tensor(ws))
            if worst:  # padding rows route nowhere
                assert (got.recv_topk_idx[n:] == -1).all() and (got.recv_topk_weights[n:] == 0).all()
            else:
                per_expert = torch.bincount(torch.cat([i[i >= 0] for _, i, _ in ins]), minlength=experts)
                assert got.handle.num_recv_tokens_per_expert_list == per_expert[r * epr:(r + 1) * epr].tolist()

        ys = []
        for r in range(world):
            got = outs[r][1]
            y = got.recv_x.float() * got.recv_scales.repeat_interleave(128, 1) if fmt == "fp8" else got.recv_x
            ys.append(y.to(torch.bfloat16)[:got.handle.num_recv_tokens])
        torch.cuda.synchronize()

        def combine(r, outs=outs, ys=ys):
            return ds[r].combine(ys[r], outs[r][1].handle, outs[r][1].recv_topk_weights, config=_config(world))

        back = _on_threads(world, combine)
        for r in range(world):
            ds[r].check()
            x, idx, w = ins[r]
            owners = [{e // epr for e in row if e >= 0} for row in idx.tolist()]
            times = torch.tensor([float(len(o)) for o in owners]).view(-1, 1)
            xin = x.float()
            if fmt == "fp8":  # the rows as cast on the GPU (a CPU cast may round one e4m3 step apart)
                xin = (gpu_in[r].x.float() * gpu_in[r].scales.repeat_interleave(128, 1)).cpu()
            torch.testing.assert_close(back[r][0].float().cpu(), (xin.to(torch.bfloat16).float() * times),
                                       rtol=2 ** -7, atol=1e-2)
            # combined weights: each token's weights summed over the ranks it went to (own experts' only)
            torch.testing.assert_close(back[r][1].cpu(), torch.where(idx >= 0, w, torch.zeros_like(w)))
    if nvl:  # both kinds, both parities: exactly num_nvl_bytes of region memory per rank
        assert ds[0].ctx.regions.used == nvl


def test_num_worst_tokens_overflow_is_reported_at_the_next_call():
    from deepep.dispatcher import DispatchInput

    world, hidden, experts, k = 2, 256, 16, 4
    ds = _emulated_dispatchers(world, 64)
    ins = [_inputs(5, r, 64, hidden, experts, k) for r in range(world)]
    gpu_in = [DispatchInput(x.cuda(), None, idx.cuda(), w.cuda()) for x, idx, w in ins]
    torch.cuda.synchronize()

    def dispatch(r):
        lay = ds[r].layout(gpu_in[r].topk_idx, experts)
        return ds[r].dispatch(gpu_in[r], None, lay.is_token_in_rank, lay.num_tokens_per_expert, experts // world,
                              1, 5, config=_config(world))

    _on_threads(world, dispatch)  # returns without reading counts; each rank receives far more than 5 rows
    torch.cuda.synchronize()
    for d in ds:
        with pytest.raises(ValueError, match="num_worst_tokens"):
            d.check()
        d.check()  # reported once


def _masked_round(lls, streams, seed: int, world: int, dispatchers: set[int], combiners: set[int],
                  gone_at_dispatch: set[int], gone_at_combine: set[int] = frozenset(), hidden: int = 256,
                  experts_per_rank: int = 4, k: int = 3, max_tokens: int = 16) -> float:
    """One low-latency dispatch (ranks in `dispatchers`) and combine (ranks in `combiners`) on emulated ranks,
    bf16 rows, checked on the live ranks against a reference that drops the ranks gone at dispatch (their
    tokens are not received) and at either point (their experts' outputs count as zeros): DeepEP's shrink
    semantics. -> seconds spent in the two kernels (launch to synchronize)."""
    import time

    dropped = set(gone_at_dispatch) | set(gone_at_combine)
    experts = experts_per_rank * world
    epr = experts_per_rank
    ins = [_inputs(seed, r, 9 + 2 * r, hidden, experts, k) for r in range(world)]
    dev_in = [(x.cuda(), idx.cuda(), w.cuda()) for x, idx, w in ins]
    torch.cuda.synchronize()
    outs = {}
    t0 = time.monotonic()
    for r in sorted(dispatchers):
        with torch.cuda.stream(streams[r]):
            outs[r] = lls[r].dispatch(dev_in[r][0], dev_in[r][1], max_tokens, experts, False, False)
    torch.cuda.synchronize()
    spent = time.monotonic() - t0
    live = sorted(combiners)
    ys = {}
    for r in live:
        recv_x, recv_count, handle, _, _ = outs[r]
        kept = [s if s not in gone_at_dispatch else None for s in range(world)]
        expect = _expected_ll_rows([ins[s] if kept[s] is not None else (ins[s][0][:0], ins[s][1][:0], None)
                                    for s in range(world)], r, world, epr)
        assert recv_count.cpu().tolist() == [len(v) for v in expect], (r, recv_count.tolist())
        got = recv_x.float().cpu()
        for e in range(epr):
            if expect[e]:
                assert torch.equal(got[e, :len(expect[e])], torch.stack(expect[e]).float())
        scale = torch.arange(r * epr + 1, (r + 1) * epr + 1, dtype=torch.float32).view(epr, 1, 1)
        ys[r] = (got * scale).to(torch.bfloat16).cuda()
    torch.cuda.synchronize()
    results = {}
    t0 = time.monotonic()
    for r in live:
        with torch.cuda.stream(streams[r]):
            results[r] = lls[r].combine(ys[r], dev_in[r][1], dev_in[r][2], outs[r][2], False, None)
    torch.cuda.synchronize()
    spent += time.monotonic() - t0
    for r in live:
        lls[r].ctx.check()  # shrink mode: a peer past its deadline is a mask, not an error
        x, idx, w = ins[r]
        ref = torch.zeros(x.shape[0], hidden)
        for t in range(x.shape[0]):
            for j, e in enumerate(idx[t].tolist()):
                if e >= 0 and e // epr not in dropped:
                    ref[t] += w[t, j] * (x[t].float() * (e + 1)).to(torch.bfloat16).float()
        torch.testing.assert_close(results[r][0].float().cpu(), ref, rtol=2 ** -7, atol=1e-2)
    return spent


def _shrink_ranks(world: int, timeout_s: float, shrink: bool = True):
    """Emulated ranks after one all-alive round with a 10 s deadline (kernels loaded, the allocator's blocks
    cached: nothing serializes the ranks' launches later), then `timeout_s` for the calls that follow."""
    from deepep.engines.nvlink.low_latency import NvlinkLowLatency

    regions = EmulatedRegions(world)
    lls = [NvlinkLowLatency(emulated_context(regions, r, sms=120 // world, timeout_s=10.0), enable_shrink=shrink)
           for r in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    for ll in lls:  # the mask's indexing kernels load now, not while a peer's kernel spins
        ll.update_mask(0, False)
    torch.cuda.synchronize()
    _masked_round(lls, streams, 4, world, set(range(world)), set(range(world)), set())
    for ll in lls:
        ll.ctx.timeout_s = timeout_s
    return lls, streams


def test_low_latency_explicit_mask_emulated():
    """Issue 18, DeepEP's low_latency_update_mask_buffer on the NVLink kernels: the live ranks mask rank 2,
    which never launches; dispatch sends it nothing and waits for nothing from it, combine counts its
    experts as zeros, no wait times out (timeout 30 s: the round takes milliseconds)."""

    world, dead = 3, 2
    lls, streams = _shrink_ranks(world, timeout_s=30.0)
    for r in (0, 1):
        lls[r].update_mask(dead, True)
    for seed in (1, 2):  # both parities
        assert _masked_round(lls, streams, seed, world, {0, 1}, {0, 1}, {dead}) < 5.0
    status = torch.zeros(world, dtype=torch.int32, device="cuda")
    lls[0].query_mask(status)
    assert status.tolist() == [0, 0, 1]
    lls[0].clean_mask()
    lls[0].query_mask(status)
    assert status.tolist() == [0, 0, 0]


@pytest.mark.parametrize("when", ["dispatch", "combine"])
def test_low_latency_timeout_masks_the_peer_emulated(when):
    """Shrink mode: rank 2 stops (before its dispatch, or after it, before the combine); the live ranks' waits
    on it pass the 0.3 s deadline, the kernels mask it (the device mask, as DeepEP's atomicExch) and finish
    the call for the live ranks with its contributions dropped; the next round does not wait at all."""
    world, dead = 3, 2
    lls, streams = _shrink_ranks(world, timeout_s=0.3)
    _masked_round(lls, streams, 5, world, {0, 1, 2}, {0, 1, 2}, set())  # all alive, short deadline
    if when == "dispatch":
        spent = _masked_round(lls, streams, 6, world, {0, 1}, {0, 1}, {dead})
    else:
        spent = _masked_round(lls, streams, 6, world, {0, 1, 2}, {0, 1}, set(), {dead})
    assert spent >= 0.3  # the deadline was waited out once
    for r in (0, 1):
        status = torch.zeros(world, dtype=torch.int32, device="cuda")
        lls[r].query_mask(status)
        assert status.tolist() == [0, 0, 1], (r, status.tolist())
    assert _masked_round(lls, streams, 7, world, {0, 1}, {0, 1}, {dead}) < 0.2  # nothing waited out


def test_low_latency_timeout_without_shrink_names_the_peer_emulated():
    """Without enable_shrink the same silent rank is an error: the kernels record (stage, peer) and the next
    call raises CommTimeoutError naming rank 2; nothing is masked."""
    from tilehal import CommTimeoutError

    world = 3
    lls, streams = _shrink_ranks(world, timeout_s=0.3, shrink=False)
    experts, k, hidden = 12, 3, 256  # as _masked_round's defaults
    ins = [_inputs(9, r, 9 + 2 * r, hidden, experts, k) for r in range(world)]
    dev_in = [(x.cuda(), idx.cuda()) for x, idx, _ in ins]
    torch.cuda.synchronize()
    for r in (0, 1):
        with torch.cuda.stream(streams[r]):
            lls[r].dispatch(dev_in[r][0], dev_in[r][1], 16, experts, False, False)
    torch.cuda.synchronize()
    for r in (0, 1):
        with pytest.raises(CommTimeoutError) as e:
            lls[r].ctx.check()
        assert e.value.peer == 2, e.value
        assert lls[r].mask.sum().item() == 0
