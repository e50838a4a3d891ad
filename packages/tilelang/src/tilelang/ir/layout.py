"""How a fragment tile maps onto the threads of a block and their registers.

A `Fragment` writes each index of the tile as a sum of mixed-radix *axes*. A thread axis takes
the value `(tx // tstride) % extent` of the thread index; a register axis is a loop over the
thread's registers. For dim d, `index_d = sum(axis_value * coeff)` over the axes of dim d.
Thread axes that no dim uses are *replication*: those threads hold the same elements (a row
vector reduced from a 2-D accumulator lives in every thread that held part of the row).

Examples: the m16n8 accumulator of `mma.sync` (`mma_accumulator`), the default layout of a
fragment nobody constrains (`default_fragment`: 16-byte vectors, threads spread from the last
dim outwards), and the full replication of a scalar-like fragment (`replicated`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Axis:
    kind: str  # "t" (thread) or "r" (register)
    extent: int
    coeff: int
    tstride: int = 0  # thread axes: value = (tx // tstride) % extent

    def __repr__(self) -> str:
        if self.kind == "t":
            return f"t[{self.extent}@{self.tstride}]*{self.coeff}"
        return f"r[{self.extent}]*{self.coeff}"


@dataclass(frozen=True)
class Fragment:
    shape: tuple[int, ...]
    dims: tuple[tuple[Axis, ...], ...]
    reg_order: tuple[tuple[int, Axis], ...]  # (dim, axis), outermost register axis first
    threads: int
    parent: Fragment | None = field(default=None, compare=False)
    parent_dims: tuple[int, ...] = field(default=(), compare=False)

    # ------------------------------------------------------------ queries

    @property
    def nregs(self) -> int:
        n = 1
        for _, a in self.reg_order:
            n *= a.extent
        return n

    def reg_stride(self, dim: int, axis: Axis) -> int:
        s = 1
        for d, a in reversed(self.reg_order):
            if d == dim and a == axis:
                return s
            s *= a.extent
        raise KeyError(axis)

    def thread_axes(self) -> list[Axis]:
        return [a for axes in self.dims for a in axes if a.kind == "t"]

    def replication(self) -> list[tuple[int, int]]:
        """(tstride, extent) runs of the thread index that no dim uses: replicas of the same elements."""
        used = sorted((a.tstride, a.extent) for a in self.thread_axes())
        out = []
        pos = 1
        for ts, e in used:
            if ts > pos:
                out.append((pos, ts // pos))
            pos = max(pos, ts * e)
        if pos < self.threads:
            out.append((pos, self.threads // pos))
        return out

    def covered(self, dim: int) -> int:
        return sum((a.extent - 1) * a.coeff for a in self.dims[dim]) + 1

    def padded(self) -> bool:
        return any(self.covered(d) > n for d, n in enumerate(self.shape))

    def register_only(self, dim: int) -> bool:
        return all(a.kind == "r" for a in self.dims[dim])

    def same_mapping(self, other: Fragment) -> bool:
        return self.shape == other.shape and all(set(a) == set(b) for a, b in zip(self.dims, other.dims))

    # ------------------------------------------------------------ derived layouts

    def project(self, keep: list[int]) -> Fragment:
        """The layout of a tile indexed by dims `keep` of this one (the others are replicated)."""
        remap = {d: i for i, d in enumerate(keep)}
        return Fragment(tuple(self.shape[d] for d in keep), tuple(self.dims[d] for d in keep),
                        tuple((remap[d], a) for d, a in self.reg_order if d in remap), self.threads,
                        parent=self, parent_dims=tuple(keep))

    def permute(self, perm: list[int]) -> Fragment:
        """Layout whose dim i is this layout's dim perm[i]."""
        inv = {d: i for i, d in enumerate(perm)}
        return Fragment(tuple(self.shape[d] for d in perm), tuple(self.dims[d] for d in perm),
                        tuple((inv[d], a) for d, a in self.reg_order), self.threads)

    def with_unit_dim(self, at: int) -> Fragment:
        dims = list(self.dims)
        dims.insert(at, ())
        shape = list(self.shape)
        shape.insert(at, 1)
        order = tuple((d + (d >= at), a) for d, a in self.reg_order)
        return Fragment(tuple(shape), tuple(dims), order, self.threads)

    def __repr__(self) -> str:
        dims = "; ".join(" + ".join(map(repr, axes)) or "0" for axes in self.dims)
        return f"Fragment({list(self.shape)}: {dims}; regs={self.nregs})"


def _pow2_floor(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def mma_accumulator(m: int, n: int, warps_m: int, warps_n: int, threads: int, *, n_warp_split: bool = True) -> Fragment:
    """The m16n8 `mma.sync` accumulator tiled over a (warps_m x warps_n) grid of warps (warp
    w = tx // 32 sits at row w // warps_n, column w % warps_n). With `n_warp_split=False` the
    columns are not split over warps: the layout of an A operand held in registers, rows as the
    accumulator's and K as an accumulator's columns (every warp of a row holds the same A rows)."""
    wm = m // warps_m
    wn = n // warps_n if n_warp_split else n
    rm, rn = Axis("r", wm // 16, 16), Axis("r", wn // 8, 8)
    rh, rc = Axis("r", 2, 8), Axis("r", 2, 1)
    d0 = [Axis("t", warps_m, wm, 32 * warps_n), rm, rh, Axis("t", 8, 1, 4)]
    d1 = [Axis("t", warps_n if n_warp_split else 1, wn, 32), rn, Axis("t", 4, 2, 1), rc]
    d0 = [a for a in d0 if a.extent > 1]
    d1 = [a for a in d1 if a.extent > 1]
    order = [(d, a) for d, a in [(0, rm), (1, rn), (0, rh), (1, rc)] if a.extent > 1]
    return Fragment((m, n), (tuple(d0), tuple(d1)), tuple(order), threads)


def default_fragment(shape: tuple[int, ...], threads: int, vec: int) -> Fragment:
    """`vec` contiguous elements per thread in the last dim, threads from the last dim outwards,
    the rest in registers; sizes that do not divide are padded (accesses past the end are masked)."""
    nd = len(shape)
    dims: list[list[Axis]] = [[] for _ in range(nd)]
    order: list[tuple[int, Axis]] = []
    inner: list[tuple[int, Axis]] = []
    tleft, tstride = threads, 1
    v = 1
    if nd and shape[-1] > 1:
        while v * 2 <= vec and shape[-1] % (v * 2) == 0:
            v *= 2
    for d in range(nd - 1, -1, -1):
        cov = 1
        if d == nd - 1 and v > 1:
            ax = Axis("r", v, 1)
            dims[d].append(ax)
            inner.append((d, ax))
            cov = v
        e = -(-shape[d] // cov)
        te = min(tleft, _pow2_floor(e)) if e > 1 else 1
        if te > 1:
            dims[d].append(Axis("t", te, cov, tstride))
            tstride *= te
            tleft //= te
        re = -(-e // te)
        if re > 1:
            ax = Axis("r", re, cov * te)
            dims[d].append(ax)
            order.append((d, ax))
    order.reverse()  # outer dims' registers outermost
    return Fragment(tuple(shape), tuple(tuple(a) for a in dims), tuple(order + inner), threads)


def replicated(shape: tuple[int, ...], threads: int) -> Fragment:
    """Every thread holds the whole tile (scalar-like fragments, thread-local buffers)."""
    dims = tuple((Axis("r", n, 1),) if n > 1 else () for n in shape)
    order = tuple((d, axes[0]) for d, axes in enumerate(dims) if axes)
    return Fragment(tuple(shape), dims, order, threads)


__all__ = ["Axis", "Fragment", "default_fragment", "mma_accumulator", "replicated"]
