"""The engine contract: what `Buffer` asks of every dispatch/combine engine, and the types they share.

An engine (engines/torch, engines/hierarchical, engines/nvlink, engines/local) is built as
`Engine(options: EngineOptions)` and moves one dispatch's rows between the ranks of its group.
`Buffer` does every argument check before it calls an engine; an engine checks only what its own
mechanism limits (row widths a kernel takes, buffer capacity) and what the ranks must agree on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tilehal import ShapeError

from .packing import RowFormat

if TYPE_CHECKING:
    from .config import Config
    from .event import EventOverlap
    from .layout import Layout


@dataclass(frozen=True)
class EngineOptions:
    """What every engine is built from (one constructor shape for all of them).

    group: the torch.distributed group (None: one process without torch.distributed, the local
    engine, or an emulated NVLink context that carries its own rank). timeout_s bounds every wait
    on a peer. num_ranks_per_node: ranks per host (the hierarchical engine's node size).
    num_max_tokens_per_rank and num_nvl_bytes size the NVLink engine's receive regions.
    enable_shrink: the low-latency kernels mask a peer whose wait times out and go on (DeepEP's
    shrink mode) instead of recording the timeout.
    """

    group: Any
    timeout_s: float
    num_ranks_per_node: int = 1
    num_max_tokens_per_rank: int = 4096
    num_nvl_bytes: int = 0
    enable_shrink: bool = False


@dataclass
class DispatchInput:
    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]


class HandleTuple:
    """A handle that also reads as DeepEP's handle tuple: `as_tuple()` (each handle's own) builds it;
    indexing and iteration go through it. `_TUPLE_LEN` (the tuple's length) answers len() without
    building the tuple, which may launch kernels."""

    _TUPLE_LEN: int

    def __getitem__(self, i: int) -> object:
        return self.as_tuple()[i]

    def __iter__(self):
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return self._TUPLE_LEN


@dataclass
class DispatchOutput:
    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    handle: Any
    extra: dict = field(default_factory=dict)


class Dispatcher(Protocol):
    """Normal-mode dispatch/combine over one group (DeepEP's intranode/internode kernels' role)."""

    rank: int
    num_ranks: int
    handle_type: type  # the handles this engine's dispatch returns (Buffer checks a passed handle against it)
    # True when layout() runs on the device without a host synchronization and checks expert ids there
    # (Buffer then skips its host-side value checks for CUDA inputs).
    device_layout: bool

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        """get_dispatch_layout's counts and token-to-rank mask for this engine's group."""
        ...

    def dispatch(self, inp: DispatchInput, handle: Any, is_token_in_rank: torch.Tensor | None,
                 num_tokens_per_expert: torch.Tensor | None, experts_per_rank: int, expert_alignment: int,
                 num_worst_tokens: int, config: Config | None = None) -> DispatchOutput:
        """Send each token once to every rank owning one of its experts (`handle`: repeat its layout)."""
        ...

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return each received row to its source and sum the copies of a token (fp32, cast to x's dtype)."""
        ...

    def low_latency(self) -> LowLatencyEngine | None:
        """The engine's own low-latency mode, or None (Buffer then runs the torch.distributed one)."""
        ...

    def destroy(self) -> None:
        """Release what the engine holds (device memory, peers' mappings)."""
        ...


class LowLatencyEngine(Protocol):
    """An engine's own low-latency kernels (fixed per-expert buffers, no host sync)."""

    handle_type: type

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int, use_fp8: bool,
                 return_recv_hook: bool) -> tuple[Any, torch.Tensor, Any, EventOverlap, Any]:
        ...

    def combine(self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any,
                return_recv_hook: bool, out: torch.Tensor | None) -> tuple[torch.Tensor, EventOverlap, Any]:
        ...


# ----------------------------------------------------------------------------- the layout header

# What every rank must agree on before any row moves, exchanged in a fixed-size header so that a
# disagreement can never reach the transport as mismatched byte counts (Gloo aborts the process).
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5,
               torch.int64: 6, torch.int32: 7}
_DTYPE_NAMES = {v: str(k).removeprefix("torch.") for k, v in DTYPE_CODES.items()}
META_FIELDS = ("magic", "row_bytes", "hidden", "x_dtype", "scales_cols", "topk", "topk_weights", "experts_per_rank")
_MAGIC = 0x44455045  # "DEPE"


def layout_meta(fmt: RowFormat, inp: DispatchInput, experts_per_rank: int) -> list[int]:
    """This rank's values of META_FIELDS for one dispatch (-1: absent)."""
    return [_MAGIC, fmt.row_bytes, inp.x.shape[1], DTYPE_CODES.get(inp.x.dtype, 0),
            -1 if inp.scales is None else inp.scales.shape[1], -1 if inp.topk_idx is None else inp.topk_idx.shape[1],
            -1 if inp.topk_weights is None else inp.topk_weights.shape[1], experts_per_rank]


def check_meta(mine: list[int], recv: torch.Tensor, rank: int, stage: str, fields: tuple[str, ...] = META_FIELDS,
               what: str = "dispatch the same layout", hint: str | None = None) -> None:
    """Raise ShapeError, on this rank, if any peer's header (row r of `recv`) differs from `mine`."""
    want = torch.tensor(mine, dtype=torch.int64)
    got = recv[:, : len(mine)].to("cpu", torch.int64)
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    if not bad:
        return
    peer = bad[0]
    diffs = describe_meta_diff(mine, got[peer].tolist(), "here", f"on rank {peer}", fields)
    if hint is None:
        hint = ("Every rank must pass x of one hidden size and dtype, the same scales/topk_idx/topk_weights presence "
                "and widths, and the same number of experts")
    raise ShapeError(f"{stage}: expected every rank to {what}, got {diffs} (rank {rank}; ranks {bad} differ). {hint}")


def describe_meta_diff(a: list[int], b: list[int], a_name: str, b_name: str,
                       fields: tuple[str, ...] = META_FIELDS) -> str:
    def show(name, v):
        if name.endswith("dtype"):
            return _DTYPE_NAMES.get(v, f"code {v}")
        return "none" if v == -1 and name in ("scales_cols", "topk", "topk_weights") else v

    return ", ".join(f"{n} {show(n, x)} {a_name} vs {show(n, y)} {b_name}"
                     for n, x, y in zip(fields, a, b) if x != y)


COMBINE_FIELDS = ("magic", "x_dtype", "hidden", "topk_weights")


def combine_meta(x: torch.Tensor, topk_weights: torch.Tensor | None) -> list[int]:
    """This rank's values of COMBINE_FIELDS for one combine: what both ends of its rows must agree on."""
    return [_MAGIC + 1, DTYPE_CODES.get(x.dtype, 0), x.shape[1], -1 if topk_weights is None else topk_weights.shape[1]]


def check_combine_meta(mine: list[int], recv: torch.Tensor, rank: int, stage: str = "combine") -> None:
    check_meta(mine, recv, rank, stage, COMBINE_FIELDS, "combine the same layout",
               "Every rank must pass combine x of one dtype and hidden size, and topk_weights of one width (or none)")


# ----------------------------------------------------------------------------- shared row helpers


def send_order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Token indices grouped by destination rank (token order within a rank) and the group sizes."""
    dest, tok = is_token_in_rank.t().nonzero(as_tuple=True)
    counts = torch.bincount(dest, minlength=is_token_in_rank.shape[1]).tolist()
    return tok, counts


def to_local_experts(recv_topk_idx: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    lo = rank * experts_per_rank
    local = recv_topk_idx - lo
    ok = (recv_topk_idx >= lo) & (recv_topk_idx < lo + experts_per_rank)
    return torch.where(ok, local, torch.full_like(local, -1))


def align_counts(counts: list[int], alignment: int) -> list[int]:
    return [(c + alignment - 1) // alignment * alignment for c in counts]


def pad_rows(t: torch.Tensor, rows: int, fill: float | int = 0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def dispatch_format(inp: DispatchInput) -> RowFormat:
    fields = [("x", inp.x.dtype, inp.x.shape[1]), ("src", torch.int64, 1)]
    if inp.scales is not None:
        fields.append(("scales", inp.scales.dtype, inp.scales.shape[1]))
    if inp.topk_idx is not None:
        fields.append(("topk_idx", torch.int64, inp.topk_idx.shape[1]))
    if inp.topk_weights is not None:
        fields.append(("topk_weights", torch.float32, inp.topk_weights.shape[1]))
    return RowFormat(fields)


def pack_dispatch(fmt: RowFormat, inp: DispatchInput, token_idx: torch.Tensor) -> torch.Tensor:
    parts = {"x": inp.x.index_select(0, token_idx), "src": token_idx}
    if inp.scales is not None:
        parts["scales"] = inp.scales.index_select(0, token_idx)
    if inp.topk_idx is not None:
        parts["topk_idx"] = inp.topk_idx.index_select(0, token_idx)
    if inp.topk_weights is not None:
        parts["topk_weights"] = inp.topk_weights.index_select(0, token_idx)
    return fmt.pack(parts, token_idx.numel(), inp.x.device)
