"""Workload for `ncu` on one GPU: the low-latency dispatch phases of 2 emulated ranks (each with
the whole GPU's 132 SMs, as on its own GPU), run in an order where no kernel waits on another
(send 0, send 1, receive 0, receive 1), so ncu may serialize them. (The combine's send phase
waits for the peers' weights, so it cannot run serialized.) Usage on the device machine:

    source scripts/device_env.sh
    ncu --kernel-name regex:deepep_ll --metrics gpu__time_duration.sum python3 scripts/ncu_deepep_ll.py
"""

import torch
from deepep.engines.nvlink.emulation import EmulatedRegions, emulated_context
from deepep.engines.nvlink.low_latency import NvlinkLowLatency

R, T, H, k, E, M = 2, 128, 7168, 8, 256, 128
torch.manual_seed(0)
regions = EmulatedRegions(R)
lls = [NvlinkLowLatency(emulated_context(regions, r, sms=132)) for r in range(R)]
xs = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(R)]
idx = [torch.rand(T, E, device="cuda").topk(k, dim=1).indices for _ in range(R)]
for _ in range(3):
    outs = [lls[r].dispatch(xs[r], idx[r], M, E, True, True) for r in range(R)]
    for o in outs:
        o[4]()
torch.cuda.synchronize()
print("done")
