"""ShardedBuffer checks over NCCL on GPUs, with the VMM generation buffer:
    torchrun --nproc-per-node 2 tests/dist_sharded.py
(the same checks test_sharded.py runs over gloo on CPU)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from test_sharded import check_sharded_buffer  # noqa: E402


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    # switch_batch_bytes: the default (a tiny model: all but the first unit in one NCCL group call), 0 (one all-gather
    # per unit), 4 MiB (small groups).
    for model, dtype, batch in [("odd-hidden", torch.float32, None),
                                ("tied-no-bias", torch.bfloat16, None),
                                ("odd-hidden", torch.bfloat16, 0),
                                ("tied-no-bias", torch.float32, 4 << 20)]:
        kwargs = {} if batch is None else {"switch_batch_bytes": batch}
        check_sharded_buffer(rank, world, model, dtype, device="cuda", **kwargs)
        if rank == 0:
            print(f"dist_sharded: {model} {dtype} world_size={world} {kwargs}: all checks passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
