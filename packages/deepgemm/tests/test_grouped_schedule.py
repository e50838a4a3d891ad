"""The grouped kernels' tile schedules on the CPU: a pure-Python model of kernels/gemm_sm90.cuh's TileScheduler
(contiguous: the default band raster and the opt-in expert-major raster, with and without 2-CTA A multicast;
masked: the default scan from group 0 and the opt-in cursor walk) checked with hypothesis (every output tile
exactly once, each with its m-block's expert, the expert-major order walks one expert at a time, multicast pairs
agree, the cursor walk is the scan), and the kernel's own ExpertWalk / MaskedWalk (the text between its BEGIN/END
expert_walk markers, with tilehal's band_tile_coords) built by the host C++ compiler and compared with the model
on the same inputs. The kernels themselves: test_grouped_variants.py (NVRTC compile, GPU outputs)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

KERNEL = Path(__file__).resolve().parents[1] / "src/deepgemm/kernels/gemm_sm90.cuh"
COMMON = Path(__file__).resolve().parents[2] / "hal/src/tilehal/include/tilehal/common.cuh"
SWIZZLE_GROUP_N = 16  # kSwizzleGroupN
TABLE_BLOCKS = 2048  # kExpertTableBlocks


# ------------------------------------------------------------------------------------------- the model
def band_tile_coords(t: int, num_m: int, band: int, num_n: int) -> tuple[int, int]:
    """tilehal band_tile_coords<BAND, NUM_N>: unit t of a num_m x num_n grid -> (m, n), bands of `band` columns."""
    per_band = num_m * band
    b = t // per_band
    first_n = b * band
    n_in_band = min(band, num_n - first_n)
    in_band = t - b * per_band
    return in_band // n_in_band, first_n + in_band % n_in_band


def block_groups(m_indices: list[int], block_m: int = 128) -> list[int]:
    """Each m-block's expert as the kernel reads it: its first row's index (-1 = padding)."""
    return [m_indices[i] for i in range(0, len(m_indices), block_m)]


def n_units(num_n_blocks: int, mcast: int) -> int:
    return (num_n_blocks + 1) // 2 if mcast == 2 else num_n_blocks


def default_walk(ids: list[int], num_n_blocks: int, num_groups: int, cta: int, grid: int, mcast: int = 1):
    """TileScheduler::next, contiguous, default raster: (m_block, n_block, group) of CTA `cta`, in order."""
    nu, band = n_units(num_n_blocks, mcast), SWIZZLE_GROUP_N // mcast
    unit, rank, stride = cta // mcast, cta % mcast, grid // mcast
    out = []
    while unit < len(ids) * nu:
        m, u = band_tile_coords(unit, len(ids), band, nu)
        unit += stride
        g = ids[m]
        if 0 <= g < num_groups:
            out.append((m, 2 * u + rank if mcast == 2 else u, g))
    return out


def segments(ids: list[int], num_groups: int) -> list[tuple[int, int, int]]:
    """(first m-block, length, expert) of each maximal run of one valid expert (ExpertWalk::seek)."""
    out, mb, nmb = [], 0, min(len(ids), TABLE_BLOCKS)
    valid = [g if 0 <= g < num_groups else -1 for g in ids[:nmb]]
    while mb < nmb:
        if valid[mb] < 0:
            mb += 1
            continue
        end = mb + 1
        while end < nmb and valid[end] == valid[mb]:
            end += 1
        out.append((mb, end - mb, valid[mb]))
        mb = end
    return out


def expert_units(ids: list[int], num_n_blocks: int, num_groups: int, mcast: int = 1, band: int = 0):
    """The expert-major raster's global unit order: unit -> (m_block, n_unit, group)."""
    nu = n_units(num_n_blocks, mcast)
    b = band if 0 < band < nu else nu
    out = []
    for m0, length, g in segments(ids, num_groups):
        for t in range(length * nu):
            m, u = band_tile_coords(t, length, b, nu)
            out.append((m0 + m, u, g))
    return out


def expert_walk(ids, num_n_blocks, num_groups, cta, grid, mcast=1, band=0):
    """TileScheduler::next with EXPERT: CTA `cta`'s tiles (m_block, n_block, group), in order."""
    units = expert_units(ids, num_n_blocks, num_groups, mcast, band)
    rank = cta % mcast
    return [(m, 2 * u + rank if mcast == 2 else u, g) for m, u, g in units[cta // mcast::grid // mcast]]


def masked_walk(masked_m, shape_m, block_m, nu, cta, grid, mcast=1, pair_m=False):
    """TileScheduler::next, masked, default scan (and, tile for tile, MaskedWalk): CTA `cta`'s tiles
    (m_block, n_block, group). `mcast` 2 pairs n-blocks (A shared) unless `pair_m` (pairs of m-blocks share B)."""
    band = SWIZZLE_GROUP_N // 2 if mcast == 2 and not pair_m else SWIZZLE_GROUP_N
    unit, rank, stride = cta // mcast, cta % mcast, grid // mcast
    out = []
    while True:
        u = unit
        for g, rows in enumerate(masked_m):
            m_blocks = -(-min(max(rows, 0), shape_m) // block_m)
            m_units = (m_blocks + 1) // 2 if pair_m else m_blocks
            if u < m_units * nu:
                mu, nn = band_tile_coords(u, m_units, band, nu)
                pm, pn = mcast == 2 and pair_m, mcast == 2 and not pair_m
                out.append((2 * mu + rank if pm else mu, 2 * nn + rank if pn else nn, g))
                break
            u -= m_units * nu
        else:
            return out
        unit += stride


# ------------------------------------------------------------------------------------------- strategies
@st.composite
def layouts(draw):
    """Per-m-block expert ids as a contiguous layout makes them: runs of one expert (any order, an expert may
    come back later), whole padding blocks (-1) and out-of-range ids (skipped by the kernel)."""
    num_groups = draw(st.integers(1, 6))
    runs = draw(st.lists(st.tuples(st.integers(-1, num_groups), st.integers(1, 9)), min_size=0, max_size=7))
    ids = [g for g, length in runs for _ in range(length)]
    return ids, num_groups


N_UNITS = (1, 2, 3, 5, 7, 16, 17, 33)  # n-units the host harness instantiates
BANDS = (0, 1, 2, 4, 16)
GRIDS = (2, 4, 6, 10, 132)


def _all_tiles(walk, ids, nb, groups, grid, mcast, **kw):
    return [t for cta in range(grid) for t in walk(ids, nb, groups, cta, grid, mcast, **kw)]


def _expected(ids, nb, groups, mcast):
    n_total = 2 * n_units(nb, mcast) if mcast == 2 else nb  # with pairs: a phantom n-block when nb is odd
    return sorted((m, n, g) for m, g in enumerate(ids[:TABLE_BLOCKS]) if 0 <= g < groups for n in range(n_total))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(N_UNITS), st.sampled_from(GRIDS), st.sampled_from((1, 2)), st.sampled_from(BANDS),
       st.booleans())
def test_every_tile_exactly_once_with_its_expert(layout, nu, grid, mcast, band, odd):
    ids, groups = layout
    nb = 2 * nu - odd if mcast == 2 else nu  # odd: the last pair's second n-block is a phantom (past N)
    want = _expected(ids, nb, groups, mcast)
    assert sorted(_all_tiles(default_walk, ids, nb, groups, grid, mcast)) == want
    got = _all_tiles(expert_walk, ids, nb, groups, grid, mcast, band=band)
    assert sorted(got) == want  # no tile twice, none missing, every tile's expert is its m-block's
    assert all(0 <= n < max(nb, 2 * n_units(nb, mcast)) for _, n, _ in got)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(N_UNITS), st.sampled_from(GRIDS), st.sampled_from((1, 2)), st.sampled_from(BANDS))
def test_expert_raster_walks_one_expert_at_a_time(layout, nu, grid, mcast, band):
    ids, groups = layout
    nb = 2 * nu if mcast == 2 else nu
    units = expert_units(ids, nb, groups, mcast, band)
    segs = segments(ids, groups)
    seg_of = {m: i for i, (m0, length, _) in enumerate(segs) for m in range(m0, m0 + length)}
    order = [seg_of[m] for m, _, _ in units]
    assert order == sorted(order)  # a segment's units are contiguous in the global order, segments in M order
    # inside a segment: bands of `band` n-units, every m-block of the segment inside a band
    b = band if 0 < band < nu else nu
    for m0, length, g in segs:
        seg = [(m, u) for m, u, gg in units if seg_of[m] == seg_of[m0]]
        assert [u // b for _, u in seg] == sorted(u // b for _, u in seg)
        assert {m for m, _ in seg} == set(range(m0, m0 + length))
    # padding takes no units: the clusters' tile counts differ by at most one
    clusters = grid // mcast
    counts = [len(units[c::clusters]) for c in range(clusters)]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=100, deadline=None)
@given(layouts(), st.sampled_from(N_UNITS), st.sampled_from(GRIDS), st.sampled_from(BANDS))
def test_multicast_pairs_share_the_m_block(layout, nu, grid, band):
    ids, groups = layout
    for walk, kw in ((default_walk, {}), (expert_walk, {"band": band})):
        for c in range(0, grid, 2):
            a = walk(ids, 2 * nu, groups, c, grid, 2, **kw)
            b = walk(ids, 2 * nu, groups, c + 1, grid, 2, **kw)
            assert len(a) == len(b)  # both CTAs of a cluster run the same number of pipeline steps
            assert all(x[0] == y[0] and x[2] == y[2] and (x[1], y[1]) == (x[1], x[1] + 1) and x[1] % 2 == 0
                       for x, y in zip(a, b))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-3, 40), min_size=1, max_size=6), st.integers(1, 40), st.sampled_from((1, 2, 3, 5, 17)),
       st.sampled_from(GRIDS), st.sampled_from(((1, False), (2, False), (2, True))))
def test_masked_schedule_covers_each_group(masked_m, shape_m, nu, grid, pairing):
    mcast, pair_m = pairing
    bm = 4  # the model is generic in BLOCK_M: small blocks give many per group
    tiles = sorted(t for c in range(grid) for t in masked_walk(masked_m, shape_m, bm, nu, c, grid, mcast, pair_m))
    want = []
    for g, rows in enumerate(masked_m):
        mb = -(-min(max(rows, 0), shape_m) // bm)
        mb_total = 2 * ((mb + 1) // 2) if pair_m else mb  # pairs: a phantom m-block past masked_m when odd
        nb_total = 2 * nu if mcast == 2 and not pair_m else nu
        want += [(m, n, g) for m in range(mb_total) for n in range(nb_total)]
    assert tiles == sorted(want)


def test_table_limit_matches_the_host():
    from deepgemm import heuristics

    assert heuristics.EXPERT_TABLE_BLOCKS == TABLE_BLOCKS
    assert f"kExpertTableBlocks = {TABLE_BLOCKS}" in KERNEL.read_text()
    assert f"kSwizzleGroupN = {SWIZZLE_GROUP_N};" in KERNEL.read_text()


# ------------------------------------------------------------------------------------------- the kernel's walk
def _extract(text: str, pattern: str) -> str:
    m = re.search(pattern, text, re.S)
    assert m, pattern
    return m.group(0)


HARNESS = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
#define TILEHAL_DEVICE inline
#define __ldg(p) (*(p))
using std::max;
using std::min;
%(band)s
%(walk)s
// One case per input line: nu band mcast grid num_groups nmb id0 id1 ...; prints each CTA's tiles.
template <int BAND, int NU> void run(const std::vector<short>& ids, int mcast, int grid) {
  for (int cta = 0; cta < grid; ++cta) {
    ExpertWalk walk;
    int unit = cta / mcast, m_block, n_unit, group;
    std::printf("cta %%d:", cta);
    while (walk.locate<BAND, NU>(ids.data(), (int)ids.size(), unit, m_block, n_unit, group)) {
      std::printf(" %%d,%%d,%%d", m_block, mcast == 2 ? 2 * n_unit + cta %% 2 : n_unit, group);
      unit += grid / mcast;
    }
    std::printf("\n");
  }
}
int main() {
  int nu, band, mcast, grid, groups, nmb;
  while (std::scanf("%%d %%d %%d %%d %%d %%d", &nu, &band, &mcast, &grid, &groups, &nmb) == 6) {
    std::vector<short> ids(nmb);
    for (int i = 0; i < nmb; ++i) {
      int g;
      std::scanf("%%d", &g);
      ids[i] = (short)(g >= 0 && g < groups ? g : -1);  // the producer's table fill
    }
    int b = band > 0 && band < nu ? band : nu;
    bool done = false;
%(dispatch)s
    if (!done) { std::printf("unsupported %%d %%d\n", nu, b); return 1; }
    std::printf("end\n");
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def walk_binary(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    walk = _extract(KERNEL.read_text(), r"// BEGIN expert_walk.*?// END expert_walk")
    band = _extract(COMMON.read_text(), r"template <int BAND, int NUM_N>\s*TILEHAL_DEVICE void band_tile_coords\(.*?\n\}")
    combos = sorted({(nu, b if 0 < b < nu else nu) for nu in N_UNITS for b in BANDS})
    dispatch = "\n".join(f"    if (nu == {nu} && b == {b}) {{ run<{b}, {nu}>(ids, mcast, grid); done = true; }}"
                         for nu, b in combos)
    d = tmp_path_factory.mktemp("expert_walk")
    src = d / "walk.cpp"
    src.write_text(HARNESS % {"band": band, "walk": walk, "dispatch": dispatch})
    return _build(cxx, src)


def _build(cxx: str, src: Path) -> Path:
    exe = src.with_suffix("")
    res = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-o", str(exe),
                          str(src)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return exe


def _run_kernel_walk(exe, cases):
    text = "".join(f"{nu} {band} {mcast} {grid} {groups} {len(ids)} {' '.join(map(str, ids))}\n"
                   for ids, groups, nu, grid, mcast, band in cases)
    return _parse(subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True,
                                 timeout=60).stdout)


def _parse(out: str) -> list:
    """The harnesses' output: per case, each CTA's list of (m_block, n_block, group)."""
    results, cur = [], []
    for line in out.splitlines():
        if line == "end":
            results.append(cur)
            cur = []
        else:
            body = line.split(":", 1)[1].split()
            cur.append([tuple(map(int, x.split(","))) for x in body])
    return results


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(layouts(), st.sampled_from(N_UNITS), st.sampled_from(GRIDS), st.sampled_from((1, 2)),
                          st.sampled_from(BANDS)), min_size=1, max_size=8))
def test_kernel_expert_walk_matches_the_model(walk_binary, cases):
    flat = [(ids, groups, nu, grid, mcast, band) for (ids, groups), nu, grid, mcast, band in cases]
    got = _run_kernel_walk(walk_binary, flat)
    for (ids, groups, nu, grid, mcast, band), per_cta in zip(flat, got):
        nb = 2 * nu if mcast == 2 else nu
        assert per_cta == [expert_walk(ids, nb, groups, c, grid, mcast, band) for c in range(grid)]


MASKED_HARNESS = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
#define TILEHAL_DEVICE inline
#define __ldg(p) (*(p))
using std::max;
using std::min;
%(band)s
%(walk)s
// One case per line: groups nu grid mcast pair_m shape_m masked_m[groups]; MaskedWalk with BLOCK_M = 4 and the
// scheduler's band (16, or 8 for n-block pairs); prints each CTA's tiles as TileScheduler::take makes them.
template <int G, bool PAIR_M, int BAND, int NU> void run(const std::vector<int>& mm, int shape_m, int mcast, int grid) {
  for (int cta = 0; cta < grid; ++cta) {
    MaskedWalk walk;
    int unit = cta / mcast, mu, nu, g;
    const int rank = cta %% mcast;
    std::printf("cta %%d:", cta);
    while (walk.locate<G, 4, PAIR_M, BAND, NU>(mm.data(), shape_m, unit, mu, nu, g)) {
      const bool pm = mcast == 2 && PAIR_M, pn = mcast == 2 && !PAIR_M;
      std::printf(" %%d,%%d,%%d", pm ? 2 * mu + rank : mu, pn ? 2 * nu + rank : nu, g);
      unit += grid / mcast;
    }
    std::printf("\n");
  }
}
int main() {
  int groups, nu, grid, mcast, pair_m, shape_m;
  while (std::scanf("%%d %%d %%d %%d %%d %%d", &groups, &nu, &grid, &mcast, &pair_m, &shape_m) == 6) {
    std::vector<int> mm(groups);
    for (int i = 0; i < groups; ++i) std::scanf("%%d", &mm[i]);
    const int band = mcast == 2 && !pair_m ? 8 : 16;
    bool done = false;
%(dispatch)s
    if (!done) { std::printf("unsupported\n"); return 1; }
    std::printf("end\n");
  }
  return 0;
}
"""
MASKED_GROUPS, MASKED_NU = (1, 3, 6), (1, 2, 3, 5, 17)


@pytest.fixture(scope="module")
def masked_binary(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    walk = _extract(KERNEL.read_text(), r"// BEGIN expert_walk.*?// END expert_walk")
    band = _extract(COMMON.read_text(), r"template <int BAND, int NUM_N>\s*TILEHAL_DEVICE void band_tile_coords\(.*?\n\}")
    lines = []
    for g in MASKED_GROUPS:
        for nu in MASKED_NU:
            for pm in (0, 1):
                for b in (8, 16):
                    lines.append(f"    if (groups == {g} && nu == {nu} && pair_m == {pm} && band == {b}) "
                                 f"{{ run<{g}, {'true' if pm else 'false'}, {b}, {nu}>(mm, shape_m, mcast, grid); "
                                 "done = true; }")
    d = tmp_path_factory.mktemp("masked_walk")
    src = d / "walk.cpp"
    src.write_text(MASKED_HARNESS % {"band": band, "walk": walk, "dispatch": "\n".join(lines)})
    return _build(cxx, src)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MASKED_GROUPS).flatmap(
    lambda g: st.lists(st.integers(-3, 40), min_size=g, max_size=g)), st.sampled_from(MASKED_NU),
    st.sampled_from(GRIDS), st.sampled_from(((1, False), (2, False), (2, True))), st.integers(1, 40)),
    min_size=1, max_size=8))
def test_kernel_masked_cursor_walk_is_the_scan(masked_binary, cases):
    text = "".join(f"{len(mm)} {nu} {grid} {mc} {int(pm)} {shape_m} {' '.join(map(str, mm))}\n"
                   for mm, nu, grid, (mc, pm), shape_m in cases)
    got = _parse(subprocess.run([str(masked_binary)], input=text, capture_output=True, text=True, check=True,
                                timeout=60).stdout)
    for (mm, nu, grid, (mc, pm), shape_m), per_cta in zip(cases, got):
        assert per_cta == [masked_walk(mm, shape_m, 4, nu, c, grid, mc, pm) for c in range(grid)]
