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
    # per unit), 4 MiB (small groups); batch_page_calls: one cuMemSetAccess per switch batch; direct_gather: the
    # training gather at N == tg with column-parallel parameters gathered in place; copy_engine: the pack/unpack as
    # cudaMemcpy2DAsync runs; p2p: the training gather by send/recv in chunks.
    for model, dtype, batch, pages in [("odd-hidden", torch.float32, None, False),
                                       ("tied-no-bias", torch.bfloat16, None, False),
                                       ("odd-hidden", torch.bfloat16, 0, False),
                                       ("tied-no-bias", torch.float32, 4 << 20, False),
                                       ("odd-hidden", torch.bfloat16, None, True),
                                       ("tied-no-bias", torch.float32, 4 << 20, True),
                                       ("odd-hidden", torch.bfloat16, None, "direct"),
                                       ("tied-no-bias", torch.bfloat16, None, "copy_engine"),
                                       ("odd-hidden", torch.bfloat16, None, "p2p")]:
        kwargs = ({} if batch is None else {"switch_batch_bytes": batch}) | ({"batch_page_calls": True} if pages is True else {})
        kwargs |= {"direct_gather": True, "prefetch_unpack_blocks": 4} if pages == "direct" else {}
        kwargs |= {"reshard_copy": "copy_engine"} if pages == "copy_engine" else {}
        kwargs |= {"p2p_gather": True, "p2p_chunks": 3} if pages == "p2p" else {}
        check_sharded_buffer(rank, world, model, dtype, device="cuda", **kwargs)
        if rank == 0:
            print(f"dist_sharded: {model} {dtype} world_size={world} {kwargs}: all checks passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
