"""Buffer: the DeepEP-style entry point for expert-parallel dispatch and combine."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from tilehal import ArgumentError, expect

from . import checks
from .config import Config, default_combine_config, default_dispatch_config
from .dispatcher import Dispatcher, DispatchInput, EngineOptions
from .engines.torch import LowLatencyBuffers, LowLatencyHandle, TorchDispatcher, ll_combine, ll_dispatch
from .event import EventOverlap
from .layout import check_topk_idx, compute_layout
from .transport.torch_dist import TorchDistTransport, release_pair_groups

log = logging.getLogger("deepep")

TRANSPORTS = ("auto", "torch", "hierarchical", "nvlink", "local")
# Set by launchers (torchrun, mpiexec, srun) in each process of a multi-process job.
LAUNCHER_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
DEFAULT_TIMEOUT_S = float(os.environ.get("DEEPEP_TIMEOUT_S", "60"))

XTensor = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# Buffers not destroyed yet: at interpreter exit (atexit, while Python is still whole) each is
# destroyed, so no process group stays alive through deepep into interpreter finalization, where
# its threads (Gloo's pt_gloo_runloop workers and gloo_tcp_loop, the TCPStore server's
# pt_tcpstore_uv on rank 0) would be torn down with the interpreter half gone.
_LIVE: weakref.WeakSet = weakref.WeakSet()
# torch.distributed's thread names (Gloo workers, Gloo's TCP loop, the TCPStore server) and how long the
# exit hook waits for them once every group is destroyed: Gloo's TCP loop and rank 0's TCPStore thread
# were each seen (1 process in ~80 three-rank jobs) still running just after destroy_process_group().
DIST_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")
EXIT_WAIT_S = 2.0


def _dist_threads() -> list[str]:
    """Names of this process's torch.distributed threads (Linux: /proc/self/task; elsewhere none)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        if name in DIST_THREADS:
            names.append(name)
    return names


def _destroy_live_buffers() -> None:
    for buf in list(_LIVE):
        try:
            buf.destroy()
        except Exception as e:  # exiting: release what can be released, say why not at debug
            log.debug("atexit: Buffer.destroy failed: %s: %s", type(e).__name__, e)
    release_pair_groups()  # the shrink mode's two-rank groups, shared by Buffers for the process's life
    gc.collect()  # engine objects in reference cycles still hold groups: free them now
    if dist.is_available() and not dist.is_initialized():
        # every group is destroyed: let the threads torch is still tearing down end before the interpreter does
        deadline = time.monotonic() + EXIT_WAIT_S
        while _dist_threads() and time.monotonic() < deadline:
            time.sleep(0.005)
        left = _dist_threads()
        if left:
            log.debug("atexit: torch.distributed threads still running after %.1f s: %s", EXIT_WAIT_S, left)


atexit.register(_destroy_live_buffers)


def _shape(t: Any) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


class Buffer:
    """Expert-parallel communication buffer over a torch.distributed group.

    `transport` is "auto" (NVLink kernels when every rank is a CUDA GPU of one host with peer
    access, hierarchical when the group spans several nodes, else plain torch.distributed),
    or one of "torch", "hierarchical", "nvlink" to force it. `Buffer()` in a process that never
    initialized torch.distributed (and was not started as one of several by a launcher), or
    `transport="local"`, is a group of one rank (the local engine: nothing moves, same results as a
    one-rank group). `num_nvl_bytes` sizes the NVLink
    receive buffers (0: derived from `num_max_tokens_per_rank` and `hidden`); `num_rdma_bytes`
    is accepted for DeepEP compatibility (the torch.distributed engine owns its own buffers).
    `timeout_s` bounds every wait on a peer; past it, CommTimeoutError names the rank and stage.
    """

    num_sms: int = 64

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Any = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, transport: str = "auto", num_ranks_per_node: int | None = None,
                 num_max_tokens_per_rank: int = 4096, hidden: int = 7168) -> None:
        if not isinstance(transport, str) or transport not in TRANSPORTS:
            raise ArgumentError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ArgumentError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        num_nvl_bytes = checks.check_int(num_nvl_bytes, "num_nvl_bytes", lo=0)
        num_rdma_bytes = checks.check_int(num_rdma_bytes, "num_rdma_bytes", lo=0)
        num_qps_per_rank = checks.check_int(num_qps_per_rank, "num_qps_per_rank", lo=0)
        num_max_tokens_per_rank = checks.check_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", lo=1)
        hidden = checks.check_int(hidden, "hidden", lo=1)
        if num_ranks_per_node is not None:
            num_ranks_per_node = checks.check_int(num_ranks_per_node, "num_ranks_per_node", lo=1)
        timeout_s = checks.positive_seconds(timeout_s, "timeout_s")
        checks.flags(low_latency_mode=low_latency_mode, allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
                     allow_mnnvl=allow_mnnvl, explicitly_destroy=explicitly_destroy, enable_shrink=enable_shrink)
        self._local = transport == "local" or (group is None and comm is None and not dist.is_initialized())
        if self._local:
            self._check_local(group, transport)
        elif group is None and comm is not None and not dist.is_initialized():
            # DeepEP's `comm`: an mpi4py communicator instead of a group; it bootstraps torch.distributed.
            from .mpi import init_from_mpi

            init_from_mpi()
        if not self._local and group is None and comm is not None and comm.Get_size() != dist.get_world_size():
            raise ValueError(f"comm: expected a communicator of all {dist.get_world_size()} ranks (the default "
                             f"group), got one of {comm.Get_size()}")
        if timeout_s <= 0:
            raise ArgumentError(f"timeout_s: expected > 0, got {timeout_s}")
        self._group_arg = group  # None: the default group, looked up again by reset() (never pinned after destroy)
        if self._local:
            self.group, self.rank, self.group_size = group, 0, 1
        else:
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.group_size = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        self.low_latency_mode = low_latency_mode
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = bool(allow_mnnvl)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        if allow_mnnvl:
            log.debug("allow_mnnvl: no multi-node NVLink engine here; nodes talk through torch.distributed")
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden_hint = hidden
        self._requested_transport = transport
        self._num_ranks_per_node_arg = num_ranks_per_node
        self._masked: set[int] = set()
        self._last_layout: tuple | None = None
        self._zero_copy_bufs: dict[tuple, torch.Tensor] = {}
        self._setup()

    # ------------------------------------------------------------------ setup / reset

    @staticmethod
    def _check_local(group: dist.ProcessGroup | None, transport: str) -> None:
        if group is not None and dist.get_world_size(group) != 1:
            raise ArgumentError(f"transport: expected a group of one rank with transport='local', got a group of "
                                f"{dist.get_world_size(group)}")
        if transport == "local":
            return
        launched = {v: os.environ[v] for v in LAUNCHER_WORLD_VARS if os.environ.get(v, "1") not in ("", "1")}
        if launched:
            # One of several processes that forgot to initialize torch.distributed: a one-rank buffer
            # here would silently keep every token in this process.
            raise RuntimeError(f"Buffer: torch.distributed is not initialized, but this process is one of several "
                               f"({', '.join(f'{k}={v}' for k, v in launched.items())}): call "
                               "dist.init_process_group or deepep.init_from_mpi first, or pass an mpi4py `comm` "
                               "(transport='local' forces a one-rank buffer)")
        log.debug("Buffer: torch.distributed is not initialized; a group of one rank (the local engine)")

    def _setup(self) -> None:
        self._destroyed = False
        self._shrink_auto = False  # set below where the transport can drop a silent peer
        if self.group is None and not self._local:
            self.group = dist.group.WORLD
        _LIVE.add(self)
        self._ll_bufs = LowLatencyBuffers()
        self._comm_stream = None
        if self._local:
            from .engines.local import LocalDispatcher
            from .transport.local import LocalTransport

            self._transport: Any = LocalTransport(self.timeout_s)
            self.num_ranks_per_node = 1
            self.transport = "local"
            self._backend: Dispatcher = LocalDispatcher(EngineOptions(self.group, self.timeout_s, 1,
                                                                      self.num_max_tokens_per_rank,
                                                                      self.num_nvl_bytes))
            return
        self._transport = TorchDistTransport(self.group, self.timeout_s)
        # Shrink mode on Gloo: low-latency exchanges over two-rank groups, so a silent peer can be dropped.
        self._shrink_auto = self.enable_shrink and self._transport.enable_pair_groups()
        self.num_ranks_per_node = self._num_ranks_per_node_arg or self._detect_ranks_per_node()
        if self.group_size % self.num_ranks_per_node:
            raise ArgumentError(f"num_ranks_per_node: expected a divisor of the group size {self.group_size}, "
                             f"got {self.num_ranks_per_node}")
        self.transport = self._choose_transport()
        options = EngineOptions(self.group, self.timeout_s, self.num_ranks_per_node, self.num_max_tokens_per_rank,
                                self.num_nvl_bytes, self.enable_shrink)
        if self.transport == "nvlink":
            from .engines.nvlink import NvlinkDispatcher

            self._backend = NvlinkDispatcher(options)
        elif self.transport == "hierarchical":
            from .engines.hierarchical import HierarchicalDispatcher

            self._backend = HierarchicalDispatcher(options)
        else:
            self._backend = TorchDispatcher(options)
        log.debug("Buffer rank %d/%d: transport %s", self.rank, self.group_size, self.transport)

    def _detect_ranks_per_node(self) -> int:
        names: list[Any] = [None] * self.group_size
        dist.all_gather_object(names, socket.gethostname(), group=self.group)
        per_node = names.count(names[0])
        # Hierarchical needs equal, contiguous nodes; anything else is treated as one flat group.
        contiguous = all(names[i] == names[(i // per_node) * per_node] for i in range(self.group_size))
        if self.group_size % per_node or not contiguous:
            log.debug("hosts of the group are not equal contiguous blocks (%s); treating it as one node", names)
            return self.group_size
        return per_node

    def _choose_transport(self) -> str:
        want = self._requested_transport
        if want in ("torch", "hierarchical"):
            return want
        from .engines.nvlink import nvlink_unavailable_reason

        reason = nvlink_unavailable_reason(self.group, self.group_size, self.num_ranks_per_node)
        if want == "nvlink":
            if reason:
                raise RuntimeError(f"transport='nvlink' is not possible here: {reason}")
            return "nvlink"
        if reason is None:
            return "nvlink"
        log.debug("NVLink fast path not taken: %s", reason)
        return "hierarchical" if self.num_ranks_per_node < self.group_size else "torch"

    def reset(self, group: dist.ProcessGroup | None = None) -> None:
        """Forget all cached state (e.g. after a CommTimeoutError), optionally moving to a new group.

        After a timeout the old group may be unusable (a dead peer, a stuck NCCL communicator):
        build a group of the survivors and pass it here.
        """
        self.destroy()
        if group is not None:
            self._local = self._requested_transport == "local"
            if self._local:
                self._check_local(group, "local")
            self.group = self._group_arg = group
            self.rank = dist.get_rank(group)
            self.group_size = dist.get_world_size(group)
            self._num_ranks_per_node_arg = min(self._num_ranks_per_node_arg or self.group_size, self.group_size)
        self._setup()

    def destroy(self) -> None:
        """Release the engine's resources now (DeepEP: required with explicitly_destroy=True; here always
        allowed). Any later call on this Buffer raises RuntimeError until reset().

        Outstanding transfers (an async call whose event or hook was never used) are waited for,
        within timeout_s; the groups deepep made itself (the NVLink engine's Gloo side group, the
        hierarchical engine's Gloo node/rail groups) are destroyed; and the Buffer lets go of every
        group it holds, the default group included (not one passed as `group`: that is the caller's).
        So after `buffer.destroy()` and `dist.destroy_process_group()` no thread of those groups is
        left. A Buffer still alive at interpreter exit is destroyed by an atexit hook."""
        backend = getattr(self, "_backend", None)
        transport = getattr(self, "_transport", None)
        self._backend = self._transport = None
        self._destroyed = True
        _LIVE.discard(self)
        try:
            if backend is not None:
                backend.destroy()
        finally:
            if transport is not None and hasattr(transport, "close"):
                transport.close()
            if getattr(self, "_group_arg", None) is None and not getattr(self, "_local", True):
                self.group = None

    def _alive(self) -> None:
        if getattr(self, "_destroyed", False):
            raise RuntimeError("Buffer: destroy() was called; call reset() to use it again")

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP's build query; our kernels JIT-compile for sm_90 (and fp8 casts run anywhere): True."""
        return True

    # ------------------------------------------------------------------ rank masking (DeepEP's shrink mode)

    def _need_shrink(self, api: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"{api}: expected a Buffer made with enable_shrink=True")

    def _nvlink_ll(self) -> Any:
        """The NVLink low-latency engine (it keeps the rank mask on the device), or None."""
        return self._backend.low_latency() if self.transport == "nvlink" else None

    def _sync_mask_from_device(self) -> None:
        """Ranks the NVLink kernels masked on their own (shrink mode) join the host's set (one D2H copy)."""
        ll = self._nvlink_ll()
        if ll is not None and self.enable_shrink:
            self._masked |= {int(r) for r in ll.mask.nonzero().flatten().tolist()}

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask a rank: low-latency dispatch/combine then neither send to nor wait for
        it; tokens routed to its experts are dropped (they combine as zeros), and the others go on.

        With enable_shrink a rank is also masked on its own when a low-latency wait on it passes
        timeout_s: by the NVLink kernels (in the device mask; no sync) and by the torch engine over Gloo
        (two-rank groups per peer; see docs/deepep.md). The call then finishes for the live ranks."""
        self._need_shrink("low_latency_update_mask_buffer")
        expect(0 <= rank_to_mask < self.group_size and rank_to_mask != self.rank, "rank_to_mask",
               f"another rank of the group (0..{self.group_size - 1}, not {self.rank})", rank_to_mask)
        (self._masked.add if mask else self._masked.discard)(rank_to_mask)
        ll = self._nvlink_ll()
        if ll is not None:
            ll.update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask of every rank (1 = masked) into mask_status (int32 [num_ranks]): the ranks masked
        by the caller and those masked after a timeout."""
        self._need_shrink("low_latency_query_mask_buffer")
        expect(isinstance(mask_status, torch.Tensor) and tuple(mask_status.shape) == (self.group_size,)
               and mask_status.dtype == torch.int32, "mask_status", f"an int32 tensor [{self.group_size}]",
               _shape(mask_status))
        self._sync_mask_from_device()
        m = torch.zeros(self.group_size, dtype=torch.int32)
        m[sorted(self._masked)] = 1
        mask_status.copy_(m)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank. (On Gloo, a peer dropped after a timeout stays unreachable: its two-rank
        group closed; the next call that needs it masks it again.)"""
        self._need_shrink("low_latency_clean_mask_buffer")
        self._masked.clear()
        ll = self._nvlink_ll()
        if ll is not None:
            ll.clean_mask()

    # ------------------------------------------------------------------ config

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms < 2 or new_num_sms % 2:
            raise ArgumentError(f"new_num_sms: expected an even number >= 2, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return default_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return default_combine_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of device memory low-latency mode shares per rank (DeepEP's sizing helper). Ours
        sizes its buffers itself at the first call, so passing this as `num_rdma_bytes` is optional."""
        from .engines.nvlink.low_latency import size_hint

        expect(num_experts % num_ranks == 0, "num_experts", f"a multiple of num_ranks={num_ranks}", num_experts)
        expect(hidden % 128 == 0, "hidden", "a multiple of 128", hidden)
        return size_hint(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as `previous_event` (DeepEP's `Buffer.capture`)."""
        return EventOverlap.capture()

    # ------------------------------------------------------------------ streams

    def _device_of(self, t: torch.Tensor) -> torch.device:
        return t.device

    @contextlib.contextmanager
    def _comm_scope(self, device: torch.device, previous_event: EventOverlap | None, async_finish: bool,
                    result: list[EventOverlap]) -> Iterator[None]:
        """Run the body on a communication stream (CUDA) and produce the EventOverlap."""
        if device.type != "cuda":
            yield
            result.append(EventOverlap(None))
            return
        if previous_event is None and not async_finish:
            # Synchronous call: the current stream is already in order, a side stream would only add
            # stream switches and events (and record_stream for every output).
            yield
            result.append(EventOverlap(None))
            return
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=device)
        comm, compute = self._comm_stream, torch.cuda.current_stream(device)
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            yield
        event = torch.cuda.Event()
        event.record(comm)
        ev = EventOverlap(event)
        if not async_finish:
            compute.wait_event(event)
        result.append(ev)

    @staticmethod
    def _hand_to_compute(tensors: list[Any], event: EventOverlap | None = None) -> None:
        """Tensors made on the comm stream are used on the compute stream: tell the allocator."""
        if not torch.cuda.is_available() or (event is not None and event.event is None):
            return  # made on the current stream (synchronous call) or on the CPU
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))

    # ------------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """-> (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] or None,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)."""
        num_experts = checks.check_int(num_experts, "num_experts", lo=1, hi=checks.INT32_MAX)
        checks.tensor(topk_idx, "topk_idx", ndim=2, dtypes=(torch.int64,))
        checks.flags(async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        result: list[EventOverlap] = []
        with self._comm_scope(topk_idx.device, previous_event, async_finish, result):
            lay = self._backend.layout(topk_idx, num_experts)
        outs = [lay.num_tokens_per_rank, lay.num_tokens_per_rdma_rank, lay.num_tokens_per_expert,
                lay.is_token_in_rank]
        self._last_layout = tuple((t, t._version) for t in (topk_idx, lay.is_token_in_rank, lay.num_tokens_per_expert))
        self._hand_to_compute(outs, result[0])
        return (*outs, result[0])  # type: ignore[return-value]

    # ------------------------------------------------------------------ normal dispatch / combine

    def _check_x(self, x: XTensor) -> DispatchInput:
        if isinstance(x, tuple):
            expect(len(x) == 2, "x", "a tensor or a (x_fp8, scales) pair", f"a tuple of {len(x)}")
            xf, sf = x
            expect(isinstance(xf, torch.Tensor) and xf.dim() == 2, "x[0]", "a 2-D tensor [T, H]", _shape(xf))
            expect(xf.dtype == torch.float8_e4m3fn, "x[0].dtype", "torch.float8_e4m3fn", xf.dtype)
            want = (xf.shape[0], (xf.shape[1] + 127) // 128)
            expect(isinstance(sf, torch.Tensor) and tuple(sf.shape) == want, "x[1] (scales)",
                   f"shape {want} (one scale per 128 channels)", _shape(sf))
            expect(sf.dtype == torch.float32, "x[1].dtype", "torch.float32", sf.dtype)
            expect(sf.device == xf.device, "x[1].device", xf.device, sf.device)
            return DispatchInput(xf.contiguous(), sf.contiguous(), None, None)
        expect(isinstance(x, torch.Tensor) and x.dim() == 2, "x", "a 2-D tensor [T, H]", _shape(x))
        expect(x.dtype in (torch.bfloat16, torch.float16, torch.float32), "x.dtype",
               "bfloat16, float16 or float32 (fp8 as an (x_fp8, scales) pair)", x.dtype)
        return DispatchInput(x.contiguous(), None, None, None)

    def dispatch(self, x: XTensor, handle: Any = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token once to every rank owning one of its experts.

        Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event). recv_x is a tensor, or (x_fp8, scales) when x was; rows are ordered by source rank,
        then by token. recv_topk_idx holds local expert ids, -1 for experts of other ranks (whose
        weights read 0). With `handle`, the cached layout of an earlier dispatch is reused.
        With `num_worst_tokens` > 0 the outputs are padded to that many rows (no size-dependent
        shapes) and the per-expert list is empty, as in DeepEP.
        """
        self._alive()
        inp = self._check_x(x)
        t, dev = inp.num_tokens, inp.x.device
        expert_alignment = checks.check_int(expert_alignment, "expert_alignment", lo=1)
        num_worst_tokens = checks.check_int(num_worst_tokens, "num_worst_tokens", lo=0, hi=checks.INT32_MAX)
        checks.tensor(topk_idx, "topk_idx", optional=True)
        checks.tensor(topk_weights, "topk_weights", optional=True)
        checks.tensor(num_tokens_per_expert, "num_tokens_per_expert", ndim=1, optional=True,
                      dtypes=(torch.int32, torch.int64))
        checks.tensor(is_token_in_rank, "is_token_in_rank", ndim=2, optional=True)
        checks.flags(async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if topk_idx is not None:
            expect(topk_idx.dim() == 2 and topk_idx.shape[0] == t, "topk_idx", f"shape [{t}, k]", _shape(topk_idx))
            expect(topk_idx.dtype == torch.int64, "topk_idx.dtype", "torch.int64", topk_idx.dtype)
            expect(topk_idx.device == dev, "topk_idx.device", dev, topk_idx.device)
            inp.topk_idx = topk_idx.contiguous()
        if topk_weights is not None:
            expect(topk_idx is not None, "topk_weights", "to come with topk_idx", "topk_idx=None")
            expect(tuple(topk_weights.shape) == tuple(topk_idx.shape), "topk_weights",
                   f"shape {tuple(topk_idx.shape)}", _shape(topk_weights))
            expect(topk_weights.dtype == torch.float32, "topk_weights.dtype", "torch.float32", topk_weights.dtype)
            inp.topk_weights = topk_weights.contiguous()
        if handle is not None:
            self._check_handle(handle, "handle")
            expect(handle.num_tokens == t, "x", f"{handle.num_tokens} tokens (as in the handle)", t)
            experts_per_rank = handle.experts_per_rank
            cached_in = getattr(handle, "is_token_in_rank", None)
            if topk_idx is not None and isinstance(cached_in, torch.Tensor) and not (
                    self._backend.device_layout and dev.type == "cuda"):
                # The cached layout moves rows by the handle's routing: a different topk_idx would be sent
                # to the wrong ranks (or not at all) without a word.
                now = compute_layout(topk_idx.to("cpu"), experts_per_rank * self.group_size, self.group_size,
                                     self.num_ranks_per_node).is_token_in_rank  # on the CPU, as below
                cached_cpu = cached_in.to("cpu")
                expect(torch.equal(now, cached_cpu), "topk_idx",
                       "the routing the handle was dispatched with (dispatch without the handle to change it)",
                       f"tokens {now.ne(cached_cpu).any(1).nonzero().flatten()[:8].tolist()} routed differently")
        else:
            expect(num_tokens_per_expert is not None, "num_tokens_per_expert",
                   "a tensor (from get_dispatch_layout) when no handle is given", None)
            expect(is_token_in_rank is not None or topk_idx is not None, "is_token_in_rank",
                   "a tensor (from get_dispatch_layout), or topk_idx to derive it, when no handle is given", None)
            num_experts = num_tokens_per_expert.numel()
            expect(num_experts % self.group_size == 0, "num_tokens_per_expert",
                   f"a multiple of {self.group_size} experts", num_experts)
            on_device = self._backend.device_layout and dev.type == "cuda"
            if is_token_in_rank is None:
                is_token_in_rank = self._backend.layout(topk_idx, num_experts).is_token_in_rank
            expect(tuple(is_token_in_rank.shape) == (t, self.group_size), "is_token_in_rank",
                   f"shape ({t}, {self.group_size})", _shape(is_token_in_rank))
            expect(is_token_in_rank.dtype == torch.bool, "is_token_in_rank.dtype", "torch.bool",
                   is_token_in_rank.dtype)
            if topk_idx is not None:
                check_topk_idx(topk_idx, num_experts, values=not on_device)
                if not on_device and not self._is_last_layout(topk_idx, is_token_in_rank, num_tokens_per_expert):
                    self._check_layout_agrees(topk_idx, num_experts, is_token_in_rank, num_tokens_per_expert)
            experts_per_rank = num_experts // self.group_size
        config = self._call_config(config, combine=False)
        result: list[EventOverlap] = []
        with self._comm_scope(dev, previous_event, async_finish, result):
            out = self._backend.dispatch(inp, handle, is_token_in_rank, num_tokens_per_expert, experts_per_rank,
                                         expert_alignment, num_worst_tokens, config=config)
        recv_x: XTensor = out.recv_x if out.recv_scales is None else (out.recv_x, out.recv_scales)
        self._hand_to_compute([out.recv_x, out.recv_scales, out.recv_topk_idx, out.recv_topk_weights], result[0])
        if handle is not None:
            # DeepEP's cached dispatch returns only the data (and the event).
            return recv_x, None, None, None, None, result[0]
        per_expert = [] if num_worst_tokens else list(out.handle.num_recv_tokens_per_expert_list)
        return recv_x, out.recv_topk_idx, out.recv_topk_weights, per_expert, out.handle, result[0]

    def _is_last_layout(self, topk_idx: torch.Tensor, is_token_in_rank: torch.Tensor,
                        num_tokens_per_expert: torch.Tensor) -> bool:
        """Whether these are the tensors the last get_dispatch_layout took and returned, unmodified since
        (then they agree by construction, and the check below is skipped: no extra work per layer)."""
        last = self._last_layout
        return last is not None and all(a is b and a._version == v for a, (b, v) in zip(
            (topk_idx, is_token_in_rank, num_tokens_per_expert), last))

    def _check_layout_agrees(self, topk_idx: torch.Tensor, num_experts: int, is_token_in_rank: torch.Tensor,
                             num_tokens_per_expert: torch.Tensor) -> None:
        """is_token_in_rank and num_tokens_per_expert must be what topk_idx implies: wrong per-expert counts
        would reach the grouped GEMM of every receiving rank (checked on every engine but the NVLink one
        with CUDA inputs, whose layout kernel avoids the device-to-host read this needs)."""
        # Computed and compared on the CPU (the engines without a device layout check CUDA tensors here too).
        want = compute_layout(topk_idx.to("cpu"), num_experts, self.group_size, self.num_ranks_per_node)
        got_in = is_token_in_rank.to("cpu")
        if not torch.equal(got_in, want.is_token_in_rank):
            bad = got_in.ne(want.is_token_in_rank).any(1).nonzero().flatten()[:8].tolist()
            expect(False, "is_token_in_rank", "the ranks topk_idx routes each token to", f"tokens {bad} differ")
        got_n = num_tokens_per_expert.to("cpu", torch.int64).view(-1)
        if not torch.equal(got_n, want.num_tokens_per_expert.to(torch.int64)):
            bad = got_n.ne(want.num_tokens_per_expert.to(torch.int64)).nonzero().flatten()[:8].tolist()
            expect(False, "num_tokens_per_expert", "the per-expert token counts of topk_idx",
                   f"experts {bad} differ ({got_n[bad].tolist()} vs {want.num_tokens_per_expert[bad].tolist()})")

    def _check_handle(self, handle: Any, arg: str) -> None:
        want = self._backend.handle_type
        expect(isinstance(handle, want), arg, f"a {want.__name__} from this Buffer's dispatch",
               type(handle).__name__)

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Return each received row to its source rank and sum them per token (dispatch's backward).

        `bias`: one or two [T, H] tensors added to the result (DeepEP's combine bias).
        -> (combined_x [T, H] in x's dtype, combined_topk_weights [T, k] or None, event).
        """
        self._alive()
        self._check_handle(handle, "handle")
        checks.tensor(topk_weights, "topk_weights", optional=True)
        checks.flags(async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        n = handle.num_recv_tokens
        expect(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] >= n and x.shape[1] == handle.hidden,
               "x", f"[>= {n}, {handle.hidden}] (the dispatch's received rows)", _shape(x))
        expect(x.dtype in (torch.bfloat16, torch.float16, torch.float32), "x.dtype", "bfloat16/float16/float32",
               x.dtype)
        if topk_weights is not None:
            expect(topk_weights.dim() == 2 and topk_weights.shape[0] >= n, "topk_weights", f"[>= {n}, k]",
                   _shape(topk_weights))
            topk_weights = topk_weights.float()
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        expect(len(biases) <= 2, "bias", "a tensor or a pair of tensors", f"{len(biases)} tensors")
        for i, b in enumerate(biases):
            expect(isinstance(b, torch.Tensor) and tuple(b.shape) == (handle.num_tokens, handle.hidden)
                   and b.device == x.device, f"bias[{i}]", f"[{handle.num_tokens}, {handle.hidden}] on {x.device}",
                   _shape(b))
        config = self._call_config(config, combine=True)
        result: list[EventOverlap] = []
        with self._comm_scope(x.device, previous_event, async_finish, result):
            combined, combined_w = self._backend.combine(x.contiguous(), handle, topk_weights, config=config)
            if biases:
                acc = combined.float()
                for b in biases:
                    acc += b.float()
                combined = acc.to(combined.dtype)
        self._hand_to_compute([combined, combined_w], result[0])
        return combined, combined_w, result[0]

    def _call_config(self, config: Config | None, combine: bool) -> Config:
        """The config of one dispatch/combine: the caller's, else the default for this group and
        Buffer.num_sms. The NVLink engine takes its grid and chunk size from it."""
        if config is None:
            return (self.get_combine_config if combine else self.get_dispatch_config)(self.group_size)
        expect(isinstance(config, Config), "config", "a deepep.Config", type(config).__name__)
        if self.transport != "nvlink":
            log.debug("config %s: the %s engine has no SMs or chunks to pick; ignored", config, self.transport)
        return config

    # ------------------------------------------------------------------ low latency

    def _ll_engine(self, round_scale: bool, use_ue8m0: bool, wait_stats: bool) -> str:
        """'nvlink' (the NVLink kernels) or 'torch' (ll.py over the group): say why the kernels are not used."""
        if self._backend.low_latency() is None:
            return "torch"
        why = None
        if not self.allow_nvlink_for_low_latency_mode:
            why = "allow_nvlink_for_low_latency_mode=False"
        elif round_scale or use_ue8m0:
            why = "round_scale/use_ue8m0 (the kernels quantize with exact amax / 448 scales)"
        elif wait_stats:
            why = "wait-cost statistics (timed per peer by the torch engine)"
        if why:
            log.debug("low-latency mode on the torch.distributed engine instead of the NVLink kernels: %s", why)
            self._sync_mask_from_device()  # the torch engine skips what the kernels masked
            return "torch"
        return "nvlink"

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> tuple[XTensor, torch.Tensor, Any, EventOverlap, Callable[[], None] | None]:
        """Send each (token, expert) pair into the expert's fixed slot on its rank (DeepEP's argument order).

        -> (recv_x [local_experts, ranks * max_tokens, H] (a (fp8, scales) pair when use_fp8),
        recv_count [local_experts] int32, handle, event, hook). The outputs are views of two buffer sets
        used in turn, so two results are live at once (a third call reuses the first's storage).
        fp8 scales are [local_experts, ranks * max_tokens, H / 128] fp32 stored column-major (TMA-aligned:
        what deepgemm's masked GEMM reads), rounded up to powers of two with `round_scale`, and packed
        four UE8M0 bytes per int32 ([.., H / 512]) with `use_ue8m0` (needs round_scale). With
        `return_recv_hook` the receive half is deferred: call `hook()` before reading the outputs.
        `cumulative_local_expert_recv_stats` (int32 [local_experts]) gets each call's recv_count added;
        `dispatch_wait_recv_cost_stats` (int64 [num_ranks]) the nanoseconds waited for each source rank.
        The handle indexes like DeepEP's: (src_info, layout_range, max_tokens, hidden, num_experts).
        """
        self._alive()
        num_max_dispatch_tokens_per_rank = checks.check_int(num_max_dispatch_tokens_per_rank,
                                                            "num_max_dispatch_tokens_per_rank", lo=1,
                                                            hi=checks.INT32_MAX // max(self.group_size, 1))
        num_experts = checks.check_int(num_experts, "num_experts", lo=1, hi=checks.INT32_MAX)
        checks.tensor(topk_idx, "topk_idx", ndim=2, dtypes=(torch.int64,))
        checks.flags(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                     return_recv_hook=return_recv_hook)
        t = x.shape[0] if isinstance(x, torch.Tensor) else -1
        expect(isinstance(x, torch.Tensor) and x.dim() == 2, "x", "a 2-D tensor [T, H]", _shape(x))
        expect(x.dtype == torch.bfloat16 or not use_fp8 and x.dtype in (torch.float16, torch.float32), "x.dtype",
               "torch.bfloat16 (or float16/float32 with use_fp8=False)", x.dtype)
        expect(x.shape[1] % 128 == 0, "x.shape[1] (hidden)", "a multiple of 128", x.shape[1])
        expect(t <= num_max_dispatch_tokens_per_rank, "x.shape[0]",
               f"<= num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}", t)
        expect(num_experts % self.group_size == 0, "num_experts", f"a multiple of {self.group_size}", num_experts)
        expect(tuple(topk_idx.shape[:1]) == (t,) and topk_idx.dim() == 2, "topk_idx", f"[{t}, k]", _shape(topk_idx))
        expect(not use_ue8m0 or (round_scale and use_fp8), "use_ue8m0", "round_scale=True and use_fp8=True with it",
               f"round_scale={round_scale}, use_fp8={use_fp8}")
        expect(not use_ue8m0 or x.shape[1] % 512 == 0, "x.shape[1] (hidden)",
               "a multiple of 512 with use_ue8m0 (four scales per int32)", x.shape[1])
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            epr = num_experts // self.group_size
            expect(tuple(stats.shape) == (epr,) and stats.dtype == torch.int32 and stats.device == x.device,
                   "cumulative_local_expert_recv_stats", f"int32 [{epr}] on {x.device}",
                   f"{stats.dtype} {_shape(stats)} on {stats.device}")
        wait = dispatch_wait_recv_cost_stats
        if wait is not None:
            expect(tuple(wait.shape) == (self.group_size,) and wait.dtype == torch.int64,
                   "dispatch_wait_recv_cost_stats", f"int64 [{self.group_size}]", f"{wait.dtype} {_shape(wait)}")
        engine = self._ll_engine(round_scale, use_ue8m0, wait is not None)
        # The NVLink kernel checks the ids itself (no device-to-host sync, graph-capturable).
        check_topk_idx(topk_idx, num_experts, values=engine == "torch")
        if engine == "nvlink":
            result = self._backend.low_latency().dispatch(x.contiguous(), topk_idx.contiguous(),
                                                          num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                                          return_recv_hook)
            if stats is None:
                return result
            recv_hook = result[4]
            if recv_hook is None:  # stream-ordered after the kernel: no sync, graph-capturable
                stats.add_(result[1])
                return result

            def hook_and_count() -> None:  # the counts exist once the receive phase has run
                recv_hook()
                stats.add_(result[1])
            return (*result[:4], hook_and_count)
        masked = frozenset(self._masked)
        wait_cpu = torch.zeros(self.group_size, dtype=torch.int64) if wait is not None else None
        lost: set[int] | None = set() if self._shrink_auto else None
        try:
            finish, handle = ll_dispatch(self._transport, self._ll_bufs, x.contiguous(), topk_idx,
                                         num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                         use_ue8m0, masked, wait_cpu, lost)
        finally:
            self._masked |= lost or set()
        box: list[tuple] = []

        def receive() -> tuple[XTensor, torch.Tensor]:
            if not box:
                try:
                    box.append(finish())
                finally:
                    self._masked |= lost or set()
                if stats is not None:
                    stats.add_(box[0][1])
                if wait is not None:
                    wait.add_(wait_cpu.to(wait.device))
            return box[0]

        if return_recv_hook:
            out = self._ll_outputs(x, num_experts, num_max_dispatch_tokens_per_rank, use_fp8, use_ue8m0,
                                   self._ll_bufs.parity ^ 1)
            return out[0], out[1], handle, EventOverlap(None), lambda: (receive(), None)[1]
        recv_x, recv_count = receive()
        return recv_x, recv_count, handle, EventOverlap.capture(x.device), None

    def _ll_outputs(self, x, num_experts, max_tokens, use_fp8, use_ue8m0=False, parity=0):
        """The buffer set `parity` (the same storage ll.py fills), for results handed out before the receive."""
        epr, cap, h = num_experts // self.group_size, self.group_size * max_tokens, x.shape[1]
        sfx = f"/{parity}"
        count = self._ll_bufs.get("count" + sfx, (epr,), torch.int32, x.device)
        if use_fp8:
            if use_ue8m0:
                scales = self._ll_bufs.get("scales_ue8m0" + sfx, (epr, cap, h // 512), torch.int32, x.device, True)
            else:
                scales = self._ll_bufs.get("scales" + sfx, (epr, cap, h // 128), torch.float32, x.device, True)
            return (self._ll_bufs.get("x" + sfx, (epr, cap, h), torch.float8_e4m3fn, x.device), scales), count
        return self._ll_bufs.get("x_bf16" + sfx, (epr, cap, h), x.dtype, x.device), count

    def get_next_low_latency_combine_buffer(self, handle: Any) -> torch.Tensor:
        """The bf16 [local_experts, ranks * max_tokens, hidden] buffer that low_latency_combine(...,
        zero_copy=True) sends from: write the experts' outputs here and skip passing them (DeepEP's API)."""
        num_experts, max_tokens, hidden = handle.num_experts, handle.num_max_dispatch_tokens_per_rank, handle.hidden
        shape = (num_experts // self.group_size, self.group_size * max_tokens, hidden)
        dev = handle.recv_src_info.device if hasattr(handle, "recv_src_info") else handle.pair_token.device
        buf = self._zero_copy_bufs.get(shape)
        if buf is None or buf.device != dev:
            buf = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
            self._zero_copy_bufs = {shape: buf}
        return buf

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Weighted sum over each token's top-k experts of their outputs (DeepEP's argument order).
        -> (combined_x [T, H], event, hook).

        `zero_copy`: send what was written into get_next_low_latency_combine_buffer(handle) instead of x.
        `use_logfmt`: rows travel as bf16 (no LogFMT encoder here: more bytes, no precision lost; logged).
        `combine_wait_recv_cost_stats` (int64 [num_ranks]): nanoseconds waited for each rank's rows.
        """
        self._alive()
        checks.tensor(topk_idx, "topk_idx", ndim=2, dtypes=(torch.int64,))
        checks.tensor(topk_weights, "topk_weights", ndim=2)
        checks.flags(use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
                     return_recv_hook=return_recv_hook)
        engine_ll = self._backend.low_latency()
        expect(isinstance(handle, (LowLatencyHandle,) + ((engine_ll.handle_type,) if engine_ll else ())), "handle",
               "the handle of low_latency_dispatch", type(handle).__name__)
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        if use_logfmt:
            log.debug("use_logfmt: combine rows travel as bf16 (no LogFMT encoder in deepep)")
        epr = handle.num_experts // self.group_size
        shape = (epr, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        expect(isinstance(x, torch.Tensor) and tuple(x.shape) == shape, "x", f"shape {shape}", _shape(x))
        expect(tuple(topk_weights.shape) == tuple(topk_idx.shape) == (handle.num_tokens, topk_idx.shape[1]),
               "topk_weights", f"shape {tuple(topk_idx.shape)} with {handle.num_tokens} tokens",
               _shape(topk_weights))
        if out is not None:
            expect(tuple(out.shape) == (handle.num_tokens, handle.hidden), "out",
                   f"shape {(handle.num_tokens, handle.hidden)}", _shape(out))
        wait = combine_wait_recv_cost_stats
        if wait is not None:
            expect(tuple(wait.shape) == (self.group_size,) and wait.dtype == torch.int64,
                   "combine_wait_recv_cost_stats", f"int64 [{self.group_size}]", f"{wait.dtype} {_shape(wait)}")
        if not isinstance(handle, LowLatencyHandle):
            expect(wait is None, "combine_wait_recv_cost_stats", "None for a dispatch that ran on the NVLink kernels",
                   "a tensor")
            return engine_ll.combine(x, topk_idx, topk_weights, handle, return_recv_hook, out)
        wait_cpu = torch.zeros(self.group_size, dtype=torch.int64) if wait is not None else None
        lost: set[int] | None = set() if self._shrink_auto else None
        finish = ll_combine(self._transport, x, topk_weights, handle, out, wait_cpu, frozenset(self._masked), lost)

        def done() -> torch.Tensor:
            try:
                res = finish()
            finally:
                self._masked |= lost or set()
            if wait is not None:
                wait.add_(wait_cpu.to(wait.device))
            return res

        if return_recv_hook:
            box: list[torch.Tensor] = []
            target = out if out is not None else torch.empty(handle.num_tokens, handle.hidden, dtype=x.dtype,
                                                             device=x.device)

            def hook() -> None:
                box.append(done())
                if box[0] is not target:
                    target.copy_(box[0])
            return target, EventOverlap(None), hook
        return done(), EventOverlap.capture(x.device), None

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                                 num_experts: int = 0) -> None:
        """Our low-latency buffers need no cleaning between calls. In shrink mode on Gloo it is, as DeepEP's,
        also a barrier of the live ranks in which a rank that does not arrive within timeout_s is masked
        (one int exchanged with every unmasked peer over the two-rank groups)."""
        self._alive()
        if not self._shrink_auto:
            return
        lost: set[int] = set()
        try:
            self._transport.exchange_counts(torch.zeros(self.group_size, 1, dtype=torch.int64),
                                            "clean_low_latency_buffer/barrier", frozenset(self._masked), lost)
        finally:
            self._masked |= lost
