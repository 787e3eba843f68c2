"""One process of a run (torchrun starts one per GPU): sets up the group, runs the suite's benches.

A bench that raises is logged and recorded as a `not_run` row with the error, and the suite goes on.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from . import (e2e, exact, floors, generate, grouped_gemm, moe, offload, paged_attention, peers, ppo_loss,
               prefill_attention, requests, sampler, segment_copy, switch, train, trl)
from . import train_step as loss_hook
from .common import Ctx, Recorder, release_memory

BENCHES = {
    "hbm_copy": floors.hbm_copy,
    "gemm": floors.gemm,
    "all_gather": floors.all_gather,
    "hf_generate": peers.hf_generate,
    "fsdp2": peers.fsdp2,
    "fsdp2_train": functools.partial(peers.fsdp2, switch=False),
    "deepspeed": peers.deepspeed_zero3,
    "deepspeed_train": functools.partial(peers.deepspeed_zero3, rest=False),
    "deepspeed_switch": peers.deepspeed_switch,
    "segment_copy": segment_copy.segment_copy,
    "sampler": sampler.sampler,
    "switch": switch.switch,
    "unit_gather": switch.unit_gather,
    "generate": generate.generate,
    "paged_attention": paged_attention.paged_attention,
    "paged_attention_sweep": paged_attention.paged_attention_sweep,
    "paged_attention_splits": paged_attention.paged_attention_splits,
    "paged_attention_prefetch": paged_attention.paged_attention_prefetch,
    "prefill_attention": prefill_attention.prefill_attention,
    "ppo_loss": ppo_loss.ppo_loss,
    "train_step": train.train_step,
    "ppo_e2e": e2e.ppo_e2e,
    "ppo_e2e_deepspeed": e2e.ppo_e2e_deepspeed,
    "exact": exact.exact,
    "offload_rollout": offload.offload_rollout,
    "offload_optimizer": offload.offload_optimizer,
    "offload_deepspeed": offload.offload_deepspeed,
    "trl": trl.trl_grpo,
    "loss_hook": loss_hook.loss_hook,
    "multi_turn": requests.multi_turn,
    "long_tail": requests.long_tail,
    "request_api": requests.request_api,
    "grouped_gemm": grouped_gemm.grouped_gemm,
    "moe_routing": moe.moe_routing,
    "moe_e2e": moe.moe_e2e,
    "moe_e2e_fsdp2": moe.moe_e2e_fsdp2,
}
FLOORS = ["hbm_copy", "gemm", "all_gather"]
# Each suite is sized to finish in under 10 minutes on 2 x H200 with one model (pass --model per run for the peers).
# DeepSpeed goes last: zero.Init patches module construction globally.
SUITES: dict[str, list[str]] = {
    "smoke": [*FLOORS, "hf_generate", "fsdp2", "segment_copy"],
    "floors": FLOORS,
    "baselines": [*FLOORS, "hf_generate", "fsdp2", "deepspeed"],
    "deepspeed": [*FLOORS, "deepspeed"],
    "fsdp2": [*FLOORS, "fsdp2"],
    "hf_generate": [*FLOORS, "hf_generate"],
    "segment_copy": ["hbm_copy", "segment_copy"],
    "sampler": ["hbm_copy", "sampler"],
    "switch": ["all_gather", "switch", "unit_gather", "deepspeed_switch"],  # DeepSpeed last (zero.Init)
    "unit_gather": ["unit_gather"],
    "generate": ["hbm_copy", "generate"],
    "paged_attention": ["hbm_copy", "paged_attention"],
    "paged_attention_sweep": ["hbm_copy", "paged_attention_sweep"],
    "paged_attention_splits": ["hbm_copy", "paged_attention_splits"],
    "paged_attention_prefetch": ["hbm_copy", "paged_attention_prefetch"],
    "prefill_attention": ["gemm", "prefill_attention"],
    "ppo_loss": ["gemm", "ppo_loss"],
    "train_step": ["gemm", "train_step"],
    # hybridengine's train step with both peers' in one run (one model per run at 7B)
    "train_peers": ["gemm", "train_step", "fsdp2_train", "deepspeed_train"],  # DeepSpeed last (zero.Init)
    "ppo_e2e": ["ppo_e2e", "ppo_e2e_deepspeed"],  # DeepSpeed last (zero.Init)
    "exact": ["exact"],
    # issue 25 (optimizer-state offload), Qwen2-7B on 1 GPU; each part alone fits a 10-minute call
    "offload": ["offload_rollout", "offload_optimizer", "offload_deepspeed"],  # DeepSpeed last (zero.Init)
    "offload_rollout": ["offload_rollout"],
    "offload_optimizer": ["offload_optimizer"],
    "offload_deepspeed": ["offload_deepspeed"],
    "offload_zero": ["offload_optimizer", "offload_deepspeed"],  # DeepSpeed last (zero.Init)
    # issue 26: HybridGRPOTrainer against TRL's GRPOTrainer (needs TRL: hybridengine_bench/trl.py)
    "trl": ["trl"],
    # issue 26: custom losses through the fused LM-head pass (train_step vs ppo_step vs full logits); 1 GPU
    "loss_hook": ["gemm", "loss_hook"],
    # issue 24: the request API (multi-turn prefix caching, partial rollouts, step() vs generate); 1 GPU
    "requests": ["multi_turn", "long_tail", "request_api"],
    "multi_turn": ["multi_turn"],
    "long_tail": ["long_tail"],
    "request_api": ["request_api"],
    # issue 43: the MoE model (default qwen3-moe-7b) on 1 GPU: grouped GEMM vs its floor, routing mismatch in exact
    # mode, the GRPO step and decode vs the bytes floor, then transformers + FSDP2 (hybridengine_bench/moe.py)
    "moe": ["hbm_copy", "gemm", "grouped_gemm", "moe_routing", "moe_e2e", "moe_e2e_fsdp2"],
    "moe_e2e": ["hbm_copy", "moe_e2e", "moe_e2e_fsdp2"],
    "moe_routing": ["moe_routing"],
    "grouped_gemm": ["hbm_copy", "gemm", "grouped_gemm"],
}
DEFAULT_MODELS = {"smoke": ["tiny-qwen2"],
                  **{s: ["qwen3-moe-7b"] for s in ("moe", "moe_e2e", "moe_routing", "grouped_gemm")},
                  **{s: ["qwen2-7b"] for s in ("offload", "offload_rollout", "offload_optimizer", "offload_deepspeed",
                                               "offload_zero")}}


def run(suite: str, *, models: list[str], scale: float, out: Path, run_id: str, cpu: bool) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    for name, value in (("WORLD_SIZE", world), ("RANK", rank), ("LOCAL_RANK", 0)):  # one process without
        os.environ.setdefault(name, str(value))  # torchrun: DeepSpeed reads these
    use_cuda = torch.cuda.is_available() and not cpu and suite != "smoke"  # smoke: the CPU harness check
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=5)  # a peer that died must not hold the call until the 10 min limit
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout,
                                device_id=device if use_cuda else None)
    else:  # one process: FSDP2 and DeepSpeed still want a group
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    rec = Recorder(path=out if rank == 0 else None, run_id=run_id,
                   gpu=torch.cuda.get_device_name(device) if use_cuda else "cpu",
                   num_gpus=world if use_cuda else 0)
    ctx = Ctx(rec=rec, device=device, rank=rank, world=world, models=models, scale=scale)
    ctx.log(f"run {run_id}: suite {suite}, models {models}, {world} x {rec.gpu}, commit {rec.commit}, -> {out}")
    try:
        for name in SUITES[suite]:
            ctx.log(f"== {name}")
            try:
                BENCHES[name](ctx)
            except Exception as e:  # noqa: BLE001 - keep the other benches' rows
                ctx.log(traceback.format_exc())
                rec.not_run(name, name, None, f"failed: {type(e).__name__}: {str(e)[:300]}")
            release_memory()
    finally:
        dist.destroy_process_group()


def run_args(args) -> None:
    run(args.suite, models=args.model or DEFAULT_MODELS.get(args.suite, ["qwen2.5-1.5b"]), scale=args.scale,
        out=Path(args.out), run_id=os.environ["HE_BENCH_RUN_ID"], cpu=args.cpu)


def main() -> None:
    from .__main__ import parser

    run_args(parser().parse_args(["run", *sys.argv[1:]]))

if __name__ == "__main__":
    main()
