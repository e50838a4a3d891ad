# requires: cuda
"""How many clusters of the sparse decode's split CTAs fit the GPU at once (cuOccupancyMaxActiveClusters), per
mma build (2 / 3 stages, bf16 d128 G4) and cluster size: the b8 x 128K step launches B * kv_heads = 64 clusters
of its 4 splits, so fewer than 64 resident means a second wave (KVPOOL_DECODE_COMBINE=cluster)."""

import json

import torch
from kvpool import cuda_decode as cd


def main() -> None:
    out = {"gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    for stages in (2, 3):
        cfg = cd.KernelConfig("mma", 64, stages)
        module = cd.compile_decode(torch.bfloat16, 128, 4, cfg=cfg, cluster_merge=True)
        kern = module.get_kernel(cd.kernel_names(torch.bfloat16, 128, 4, cfg)[0])
        smem = cd.smem_bytes(torch.bfloat16, 128, 4, cfg)
        for size in (2, 4, 8):
            try:
                out[f"mma{stages}_cluster{size}"] = kern.max_active_clusters(cd.THREADS, smem, (size, 1, 1))
            except Exception as e:  # the driver cannot say: the row says why
                out[f"mma{stages}_cluster{size}"] = f"failed: {type(e).__name__}: {e}"[:200]
        out[f"mma{stages}_smem_bytes"] = smem
    print(json.dumps(out))


if __name__ == "__main__":
    main()
