"""Row exchange over any torch.distributed process group (Gloo on CPU, NCCL on GPU, multi-node).

Counts go first (a tiny all-to-all), then one `all_to_all_single` of packed byte rows with split
sizes. Where the backend lacks all-to-all (older Gloo), paired send/recv does the same job.
Every wait is bounded (see waits.wait_work).

Shrink mode (`enable_pair_groups`, Gloo): the low-latency exchanges run over one two-rank Gloo group
per peer, so a peer that stops answering can be dropped without breaking the others. A Gloo
`wait(timeout)` that expires closes every pair of the group it ran on ("Application timeout caused
pair closure"); on a two-rank group that is the one pair with the silent peer. The exchange then
records the peer in `lost` (a set the caller passes), zero-fills what it would have received from
it, and finishes with the live ranks.

Every work issued is tracked until it was waited for; `close()` waits (bounded) for the ones nobody
waited for and lets go of the group, so the group's threads (Gloo's workers and its TCP loop, the
TCPStore server on rank 0) end when the group is destroyed, not during interpreter shutdown (see
Buffer.destroy; the shrink mode's pair groups are freed by `release_pair_groups` at exit).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..waits import comm_error, wait_work
from .base import RowTransport

log = logging.getLogger("deepep.transport")

# Two-rank Gloo groups by (global rank, global rank): made once per process (their names are a hash of
# the ranks, so a second Buffer reuses them; a pair closed by a timeout stays closed).
_PAIR_GROUPS: dict[tuple[int, int], dist.ProcessGroup] = {}

def destroy_own_group(group: dist.ProcessGroup | None) -> None:
    """Free a Gloo group deepep made itself (dist.new_group) now, so its threads end here and not at
    interpreter exit. Groups of other backends are left to dist.destroy_process_group(): destroying
    an NCCL communicator is collective. A group already destroyed is fine."""
    if group is None or not dist.is_initialized():
        return
    try:
        if "gloo" in str(dist.get_backend(group)).lower():
            dist.destroy_process_group(group)
    except (ValueError, RuntimeError) as e:  # destroyed already (e.g. by destroy_process_group())
        log.debug("destroy_own_group: %s", e)


def release_pair_groups() -> None:
    """Destroy the shrink mode's two-rank Gloo groups (kept for the whole process, shared by Buffers):
    called at interpreter exit, after the live Buffers are destroyed, so their threads end there."""
    for key in list(_PAIR_GROUPS):
        destroy_own_group(_PAIR_GROUPS.pop(key))


class TorchDistTransport(RowTransport):
    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.global_rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.backend = str(dist.get_backend(self.group)).lower()
        # NCCL moves only CUDA tensors; Gloo only CPU ones (its CUDA support is partial).
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in self.backend else torch.device("cpu")
        self._use_p2p = False
        self.pairs: dict[int, dist.ProcessGroup] | None = None  # group rank -> two-rank group (shrink mode)
        # id(work) -> (work, stage, gloo send/recv?, abandoned?): issued and not yet waited for; a work
        # whose bounded wait failed stays here as abandoned (close() does not wait for it again).
        self._pending: dict[int, tuple[object, str, bool, bool]] = {}

    # ------------------------------------------------------------------ outstanding works

    def _track(self, works: list, stage: str, p2p: bool = False) -> None:
        for w in works:
            self._pending[id(w)] = (w, stage, p2p, False)

    def _settled(self, works: list, ok: bool) -> None:
        for w in works:
            if ok:
                self._pending.pop(id(w), None)
            elif id(w) in self._pending:
                self._pending[id(w)] = (*self._pending[id(w)][:3], True)

    def _waited(self, works: list, wait: Callable[[], None]) -> None:
        try:
            wait()
        except BaseException:
            self._settled(works, ok=False)
            raise
        self._settled(works, ok=True)

    def close(self) -> None:
        """Wait for the works this transport issued that nobody waited for (an async call whose event
        or hook was never used), all within one timeout_s, then let go of the group. Works whose wait
        already failed (a dead or stuck peer) are not waited for again: they end with the group's own
        timeout. Idempotent; the transport is unusable afterwards."""
        deadline = time.monotonic() + self.timeout_s
        for work, stage, p2p, abandoned in list(self._pending.values()):
            if abandoned:
                log.debug("rank %d: close: the '%s' transfer that timed out earlier is still pending",
                          self.global_rank, stage)
                continue
            try:
                if p2p:
                    self._wait_p2p(work, stage, deadline, None)
                else:
                    wait_work(work, rank=self.global_rank, stage=stage,
                              timeout_s=max(deadline - time.monotonic(), 1e-3))
            except Exception as e:  # closing must release the rest; the failure is the peer's
                log.warning("deepep rank %d: close: an outstanding '%s' transfer did not finish (%s)",
                            self.global_rank, stage, e)
        self._pending.clear()
        self.group = self.pairs = None

    def enable_pair_groups(self) -> bool:
        """Shrink mode on Gloo: one two-rank group per peer for the low-latency exchanges. Collective over
        the whole world (dist.new_group is: every process makes every pair's group, in one order), so it
        needs this group to be the world; False (and nothing made) otherwise, and on other backends:
        NCCL cannot drop one peer of a communicator (its timeouts abort the whole communicator); there
        the NVLink kernels mask on their own and the torch engine takes explicit masks only."""
        if "gloo" not in self.backend or self.num_ranks < 2:
            return False
        world = dist.get_world_size()
        if self.num_ranks != world:
            log.debug("shrink mode: automatic masking on Gloo needs the Buffer's group to be the world "
                      "(%d of %d ranks); explicit masks only", self.num_ranks, world)
            return False
        ranks = [dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r
                 for r in range(self.num_ranks)]
        pairs = {}
        for i in range(self.num_ranks):
            for j in range(i + 1, self.num_ranks):
                key = (ranks[i], ranks[j])
                if key not in _PAIR_GROUPS:
                    _PAIR_GROUPS[key] = dist.new_group(list(key), backend="gloo",
                                                       timeout=datetime.timedelta(seconds=max(self.timeout_s, 120.0)))
                if self.rank in (i, j):
                    pairs[j if i == self.rank else i] = _PAIR_GROUPS[key]
        self.pairs = pairs
        log.debug("rank %d: shrink mode over %d two-rank Gloo groups", self.global_rank, len(pairs))
        return True

    # ------------------------------------------------------------------ primitives

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
             stage: str) -> None:
        self._a2a_start(out, inp, out_splits, in_splits, stage)()

    def _a2a_start(self, out, inp, out_splits, in_splits, stage, masked: frozenset[int] = frozenset(),
                   wait_ns: torch.Tensor | None = None, name_peer: bool = False,
                   lost: set[int] | None = None) -> Callable[[], None]:
        """Issue the all-to-all; the returned callable waits for it (bounded).

        `masked` peers take no part (nothing is sent to or received from them: their slices of `out`
        are left as they are), so the others go on without a failed rank. `wait_ns` (int64 [R]) gets
        the nanoseconds spent waiting for each peer's data added. Both use paired send/recv, as does
        `name_peer` on Gloo (one work per peer: a timeout names the peer that did not answer)."""
        if lost is not None and self.pairs is not None:
            return self._pair_a2a(out, inp, out_splits, in_splits, stage, masked, wait_ns, lost)
        if masked or wait_ns is not None or (name_peer and "gloo" in self.backend):
            return self._p2p_a2a(out, inp, out_splits, in_splits, stage, masked, wait_ns)
        if not self._use_p2p:
            try:
                work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
            except RuntimeError as e:
                if "not supported" not in str(e).lower() and "unsupported" not in str(e).lower():
                    raise
                log.debug("all_to_all_single unsupported on backend %s (%s); using paired send/recv",
                          self.backend, e)
                self._use_p2p = True
            else:
                self._track([work], stage)
                return lambda: self._waited([work], lambda: wait_work(work, rank=self.global_rank, stage=stage,
                                                                      timeout_s=self.timeout_s))
        return self._p2p_a2a(out, inp, out_splits, in_splits, stage)

    def _p2p_a2a(self, out, inp, out_splits, in_splits, stage, masked: frozenset[int] = frozenset(),
                 wait_ns: torch.Tensor | None = None) -> Callable[[], None]:
        n = self.num_ranks
        rows_in = in_splits if in_splits is not None else [inp.shape[0] // n] * n
        rows_out = out_splits if out_splits is not None else [out.shape[0] // n] * n
        sends = torch.split(inp, rows_in)
        recvs = torch.split(out, rows_out)
        ops, owner, peer_of = [], [], []
        for peer in range(n):
            g = dist.get_global_rank(self.group, peer) if self.group is not dist.group.WORLD else peer
            if peer == self.rank:
                recvs[peer].copy_(sends[peer])
                continue
            if peer in masked:
                continue
            if rows_in[peer]:
                ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), g, group=self.group))
                owner.append(-1)
                peer_of.append(g)
            if rows_out[peer]:
                ops.append(dist.P2POp(dist.irecv, recvs[peer], g, group=self.group))
                owner.append(peer)
                peer_of.append(g)
        if "gloo" in self.backend:
            # One call per op: Gloo raises at once for a peer whose connection closed; name that peer.
            works = []
            for op, g in zip(ops, peer_of):
                try:
                    works.append(op.op(op.tensor, op.peer, group=op.group))
                except RuntimeError as e:
                    self._track(works, stage, p2p=True)
                    self._settled(works, ok=False)  # issued before the failure: left to the group's timeout
                    raise comm_error(self.global_rank, stage, f"failed: {type(e).__name__}: {e}", g) from e
        else:
            works = dist.batch_isend_irecv(ops) if ops else []
        self._track(works, stage, p2p="gloo" in self.backend)

        def waits() -> None:
            per_op = len(works) == len(owner)  # NCCL may coalesce the batch into one work
            deadline = time.monotonic() + self.timeout_s  # one deadline for all of this exchange's works
            for i, w in enumerate(works):
                peer = owner[i] if per_op else -1
                t0 = time.perf_counter_ns()
                self._wait_p2p(w, stage, deadline, peer_of[i] if per_op else None)
                if wait_ns is not None and peer >= 0:
                    wait_ns[peer] += time.perf_counter_ns() - t0
        return lambda: self._waited(works, waits)

    def _pair_a2a(self, out, inp, out_splits, in_splits, stage, masked: frozenset[int], wait_ns: torch.Tensor | None,
                  lost: set[int]) -> Callable[[], None]:
        """All-to-all over the two-rank groups (shrink mode): a peer that fails or passes the deadline goes
        into `lost` (group rank), its receive slice is zero-filled, and the exchange goes on."""
        n = self.num_ranks
        rows_in = in_splits if in_splits is not None else [inp.shape[0] // n] * n
        rows_out = out_splits if out_splits is not None else [out.shape[0] // n] * n
        sends, recvs = torch.split(inp, rows_in), torch.split(out, rows_out)
        works: list[tuple[int, object, bool]] = []  # (peer, work, is_recv)

        def drop(peer: int, why: str) -> None:
            if peer not in lost:
                log.warning("deepep rank %d: stage '%s': rank %d dropped (masked): %s", self.global_rank, stage,
                            peer, why[:200])
            lost.add(peer)
            recvs[peer].zero_()

        for peer in range(n):
            if peer == self.rank:
                recvs[peer].copy_(sends[peer])
                continue
            if peer in masked or peer in lost:
                continue
            g = self.pairs[peer]
            pg = dist.get_global_rank(g, 1 - dist.get_rank(g))  # the other member's global rank
            try:
                if rows_in[peer]:
                    works.append((peer, dist.isend(sends[peer].contiguous(), pg, group=g), False))
                if rows_out[peer]:
                    works.append((peer, dist.irecv(recvs[peer], pg, group=g), True))
            except RuntimeError as e:  # its connection closed already: a dead peer
                drop(peer, f"{type(e).__name__}: {e}")

        self._track([w for _, w, _ in works], stage, p2p=True)

        def finish() -> None:
            deadline = time.monotonic() + self.timeout_s  # one deadline for all of this exchange's works
            for peer, w, _ in works:
                if peer in lost:
                    continue
                t0 = time.perf_counter_ns()
                try:
                    w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
                except RuntimeError as e:  # passed the deadline (its pair is closed now) or the peer died
                    drop(peer, f"{type(e).__name__}: {e}")
                if wait_ns is not None:
                    wait_ns[peer] += time.perf_counter_ns() - t0
            self._settled([w for p, w, _ in works if p not in lost], ok=True)
            self._settled([w for p, w, _ in works if p in lost], ok=False)
        return finish

    def _wait_p2p(self, work: object, stage: str, deadline: float, peer: int | None) -> None:
        left = max(deadline - time.monotonic(), 1e-3)
        if "gloo" not in self.backend:
            wait_work(work, rank=self.global_rank, stage=stage, timeout_s=left, peer=peer)
            return
        # Gloo's send/recv works report completion only from wait(), which takes a deadline itself.
        try:
            work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            raise comm_error(self.global_rank, stage, f"timed out or failed after {self.timeout_s:.1f} s "
                             f"(dead or stuck peer?): {e}", peer) from e

    # ------------------------------------------------------------------ public

    def exchange_counts(self, counts: torch.Tensor, stage: str, masked: frozenset[int] = frozenset(),
                        lost: set[int] | None = None) -> torch.Tensor:
        """counts [R, C] int64 (row r = what I send to rank r) -> [R, C] on the CPU (row r = from r; zeros
        for masked peers, and for peers put into `lost` in shrink mode)."""
        send = counts.to(device=self.device, dtype=torch.int64).contiguous()
        recv = torch.zeros_like(send)
        # The first exchange of a call: where a dead or absent peer shows; name it where the backend can.
        self._a2a_start(recv, send, None, None, stage, masked, name_peer=True, lost=lost)()
        return recv.cpu()

    def gather_counts(self, counts: torch.Tensor, stage: str) -> torch.Tensor:
        """counts [R, C] int64 of every rank -> [R (source), R (destination), C] on the CPU (one all-gather)."""
        send = counts.to(device=self.device, dtype=torch.int64).contiguous()
        out = [torch.empty_like(send) for _ in range(self.num_ranks)]
        work = dist.all_gather(out, send, group=self.group, async_op=True)
        self._track([work], stage)
        self._waited([work], lambda: wait_work(work, rank=self.global_rank, stage=stage, timeout_s=self.timeout_s))
        return torch.stack(out).cpu()

    def exchange_rows_start(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                            stage: str, masked: frozenset[int] = frozenset(),
                            wait_ns: torch.Tensor | None = None, lost: set[int] | None = None
                            ) -> Callable[[], torch.Tensor]:
        """Issue the row exchange now; the returned callable waits (bounded) and yields the rows (those of a
        peer put into `lost` in shrink mode are zeros)."""
        width = rows.shape[1]
        dev = rows.device
        send = rows if rows.device == self.device else rows.to(self.device)
        alloc = torch.zeros if masked or lost is not None else torch.empty  # rows of masked peers never arrive: zeros
        out = alloc(sum(recv_counts), width, dtype=rows.dtype, device=self.device)
        if send.shape[0] == 0 and out.shape[0] == 0:
            # Still a collective: every rank must take part even when nothing moves anywhere.
            send = torch.empty(0, width, dtype=rows.dtype, device=self.device)
        finish = self._a2a_start(out.view(-1), send.reshape(-1), [c * width for c in recv_counts],
                                 [c * width for c in send_counts], stage, masked, wait_ns, lost=lost)

        def result() -> torch.Tensor:
            finish()
            return out if out.device == dev else out.to(dev)
        return result

    def barrier(self, stage: str) -> None:
        t = torch.zeros(1, device=self.device)
        work = dist.all_reduce(t, group=self.group, async_op=True)
        self._track([work], stage)
        self._waited([work], lambda: wait_work(work, rank=self.global_rank, stage=stage, timeout_s=self.timeout_s))
