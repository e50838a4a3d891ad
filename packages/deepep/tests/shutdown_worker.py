"""Child of test_shutdown.py: one rank of a Gloo job with a tcp:// rendezvous (a TCPStore, served
by rank 0) that exits the normal way (no os._exit), as a user's script does.

    python shutdown_worker.py RANK WORLD PORT MODE

MODE "destroy": buffer.destroy(), then dist.destroy_process_group(), then gc.collect(). MODE "atexit":
dist.destroy_process_group() only; the Buffer is still alive when the script ends (deepep's atexit
hook destroys it). Prints `THREADS <checkpoint> <count> <names>` at each checkpoint: the last one
from an atexit handler registered before deepep is imported, so it runs after deepep's hook and
before the interpreter tears down."""

import atexit
import datetime
import gc
import os
import sys


def threads() -> list[str]:
    names = []
    for t in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            pass
    return names


def report(point: str) -> None:
    names = threads()
    print(f"THREADS {point} {len(names)} {','.join(names)}", flush=True)


rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
report("start")
atexit.register(report, "atexit")  # registered first: runs last, after deepep's own hook

import deepep  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
report("imported")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
buf = deepep.Buffer(None, transport="torch", timeout_s=30, num_max_tokens_per_rank=64)
g = torch.Generator().manual_seed(rank)
x = torch.randn(8 + rank, 128, generator=g)
idx = torch.randint(0, 4 * world, (x.shape[0], 2), generator=g)
_, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4 * world)
recv_x, _, _, _, handle, _ = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
out, _, _ = buf.combine(recv_x, handle)
assert torch.equal(out, x * in_rank.sum(1, keepdim=True)), "combine of an identity dispatch"
ll = deepep.Buffer(None, transport="torch", timeout_s=30, low_latency_mode=True)
# An async low-latency dispatch whose receive hook is never called: its transfer stays outstanding
# (every rank issued it, so it completes); destroy() / the atexit hook must wait for it.
ll.low_latency_dispatch(x.to(torch.bfloat16), idx, 16, 4 * world, use_fp8=False, return_recv_hook=True)
report("running")
if mode == "destroy":
    buf.destroy()
    ll.destroy()
dist.destroy_process_group()
report("after_destroy_process_group")
gc.collect()
report("after_gc")  # shown in a failure's log (see test_shutdown's docstring)
print(f"rank {rank} done", flush=True)
