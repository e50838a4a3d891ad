"""The config heuristic: fewest waves, then the fullest last wave, then the larger tile."""

import math

import pytest
from deepgemm import heuristics
from deepgemm.heuristics import block_n_candidates, pick_config, waves

DENSE_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]


def test_waves():
    assert waves(132, 132) == (1, 132)
    assert waves(133, 132) == (2, 1)
    assert waves(1, 132) == (1, 1)


def test_fp8_candidates_respect_register_and_scale_limits():
    for n in block_n_candidates("fp8"):
        assert n % 8 == 0 and n <= 160
        assert n <= 128 + math.gcd(n, 128)  # at most two 128-wide B scale blocks per tile
    assert 176 not in block_n_candidates("fp8") and 160 in block_n_candidates("fp8")
    assert max(block_n_candidates("bf16")) == 256


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("m", [64, 128, 4096])
@pytest.mark.parametrize("n,k", DENSE_NK)
def test_pick_is_optimal_under_its_rule(kind, m, n, k):
    cfg = pick_config(kind, m, n, k, num_sms=132)
    best = min(
        (waves(math.ceil(m / bm) * math.ceil(n / bn), 132)[0],
         -waves(math.ceil(m / bm) * math.ceil(n / bn), 132)[1])
        for bm in ((64,) if m <= 64 else (64, 128)) for bn in block_n_candidates(kind)
    )
    assert (cfg.num_waves, -cfg.last_wave_util) == best
    assert cfg.smem_bytes <= heuristics.SMEM_CAPACITY
    assert 2 <= cfg.stages <= heuristics.MAX_STAGES
    assert cfg.block_k == (128 if kind == "fp8" else 64)
    assert cfg.multicast == 1


def test_small_m_uses_one_math_warpgroup():
    cfg = pick_config("fp8", 64, 2112, 7168, num_sms=132)
    assert cfg.block_m == 64 and cfg.num_threads == 256
    # 2112 / 16 = 132 tiles: exactly one full wave
    assert (cfg.block_n, cfg.num_waves, cfg.last_wave_util) == (16, 1, 132)


def test_large_m_prefers_fewer_waves_of_big_tiles():
    cfg = pick_config("fp8", 4096, 7168, 2048, num_sms=132)
    assert cfg.block_m == 128 and cfg.num_threads == 384
    assert (cfg.block_n, cfg.num_waves) == (160, 11)  # 32 x 45 = 1440 tiles


def test_grouped_modes():
    c = pick_config("fp8", 8192 * 4, 4096, 7168, num_groups=4, grouping="contiguous", num_sms=132)
    assert c.block_m == 128  # one expert per M block (the layout's 128-row alignment)
    m = pick_config("fp8", 256, 4096, 7168, num_groups=4, grouping="masked", num_sms=132)
    tiles = 4 * math.ceil(256 / m.block_m) * math.ceil(4096 / m.block_n)
    assert waves(tiles, 132) == (m.num_waves, m.last_wave_util)


def test_num_sms_changes_the_choice():
    a = pick_config("bf16", 4096, 7168, 2048, num_sms=132)
    b = pick_config("bf16", 4096, 7168, 2048, num_sms=66)
    assert a.num_sms == 132 and b.num_sms == 66
    assert b.num_waves >= a.num_waves


def test_stages_fill_shared_memory():
    cfg = pick_config("fp8", 4096, 7168, 2048, num_sms=132)
    assert heuristics.smem_bytes("fp8", cfg.block_m, cfg.block_n, cfg.stages + 1) > heuristics.SMEM_CAPACITY \
        or cfg.stages == heuristics.MAX_STAGES


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        pick_config("fp16", 1, 1, 1)
    with pytest.raises(ValueError, match="grouping"):
        pick_config("fp8", 1, 1, 1, grouping="ragged")
