"""GPU tests: the NCCL transport and the NVLink kernels on 2 GPUs (nvidia-h200-x2)."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.timeout(300)]

WORLD = min(torch.cuda.device_count(), int(os.environ.get("DEEPEP_TEST_GPUS", "8"))) if torch.cuda.is_available() else 0

CASES = [
    {"tokens": [40, 0, 33, 17, 5, 9, 60, 1][:max(WORLD, 2)], "experts": 16 * max(WORLD, 2) // 2, "k": 4, "hidden": 64},
    {"tokens": [64] * max(WORLD, 2), "experts": 8 * max(WORLD, 2), "k": 8, "hidden": 512, "dtype": torch.bfloat16,
     "kind": "hot"},
    {"tokens": [50] * max(WORLD, 2), "experts": 4 * max(WORLD, 2), "k": 2, "hidden": 128, "kinds": {1: "silent"},
     "align": 4, "worst": 200 * max(WORLD, 2)},
    {"tokens": [0] * max(WORLD, 2), "experts": 4 * max(WORLD, 2), "k": 2, "hidden": 64},
]


@pytest.mark.parametrize("transport", ["torch", "nvlink"])
def test_dispatch_combine_gpu(ranks, transport):
    ranks(WORLD, "dispatch_combine", cases=CASES, transport=transport, device="cuda", backend="nccl",
          timeout_s=240)


@pytest.mark.parametrize("transport", ["torch", "nvlink"])
def test_fp8_dispatch_gpu(ranks, transport):
    ranks(WORLD, "fp8_dispatch", transport=transport, device="cuda", backend="nccl", timeout_s=240)


@pytest.mark.parametrize("transport, use_fp8", [("torch", True), ("nvlink", True), ("nvlink", False)])
def test_low_latency_gpu(ranks, transport, use_fp8):
    ranks(WORLD, "low_latency", use_fp8=use_fp8, tokens=[32, 7, 0, 20, 32, 1, 5, 9][:WORLD], experts=8 * WORLD,
          k=4, hidden=512, transport=transport, device="cuda", exact=False, rounds=3,
          backend="nccl", timeout_s=240)


def test_nvlink_stalled_peer_times_out(ranks):
    out = ranks(WORLD, "nvlink_stalled_peer", comm_timeout_s=2.0, backend="nccl", timeout_s=120)
    err = out[0]
    assert err["elapsed"] < 2.0 + 3.0, err
    assert err["rank"] == 0 and err["stage"].startswith("dispatch/") and 0 < err["peer"] < WORLD, err


def test_nvlink_layout_kernel(ranks):
    assert ranks(WORLD, "nvlink_layout", backend="nccl", timeout_s=120) == [4] * WORLD


def test_deepep_dropin_points_on_gpus():
    """Issue 18 on 2+ GPUs: per-call Config on the NVLink engine, handle tuple, LL round_scale/use_ue8m0."""
    from pathlib import Path

    from deepep.testing import run_on_ranks

    run_on_ranks(WORLD, str(Path(__file__).with_name("compat_workers.py")), "nvlink_compat", backend="nccl",
                 timeout_s=240)
