"""hybridengine train step (the `hybridengine` provider of bench `train_step`): one PPO optimizer
step on the shared buffer, per GPU 4 x 1024 tokens (the peers' workload) and a packed
variable-length batch of the same token count, each with activation checkpointing off (every
layer's activations kept, parameters gathered again in backward) and on (every layer recomputed);
case activation_checkpointing says which, as in the FSDP2 and DeepSpeed rows.
"""

from __future__ import annotations

import os

import torch

from .common import Ctx, record_train


def train_step(ctx: Ctx) -> None:
    import hybridengine as he

    if not ctx.cuda:
        ctx.rec.not_run("train_step", "hybridengine", None, "GPU only")
        return
    w = ctx.work
    tokens = w.train_batch * w.train_seq
    for model in ctx.models:
        cfg = he.model_config(model)
        # HE_BENCH_SPLIT_MASTER=1: the engine keeps split masters (EngineConfig.split_master), rows say so
        split = os.environ.get("HE_BENCH_SPLIT_MASTER") == "1"
        engine = he.HybridEngine(cfg, he.EngineConfig(dtype=torch.bfloat16, device=str(ctx.device), split_master=split))
        g = torch.Generator().manual_seed(100 + ctx.rank)
        layouts = {"dense": [w.train_seq] * w.train_batch,
                   "packed": [tokens // 8, tokens * 3 // 8, tokens // 4, tokens // 4]}
        for name, lengths in layouts.items():
            ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
            batch = he.PPOBatch(input_ids=ids, response_mask=[torch.ones(n - 1) for n in lengths],
                                old_logprobs=[-5 + 0.1 * torch.randn(n - 1, generator=g) for n in lengths],
                                advantages=[torch.randn(n - 1, generator=g) for n in lengths])
            for checkpointing in (False, True):
                ppo = he.PPOConfig(micro_batch_tokens=tokens, lr=1e-6, max_grad_norm=1.0,
                                   activation_checkpointing=checkpointing)
                with ctx.peak() as pm:
                    times = ctx.measure(lambda: engine.ppo_step(batch, ppo), warmup=2, repeats=5,
                                        desc=f"train_step {name}")
                record_train(ctx, "hybridengine", model, times, pm, layout=name,
                             activation_checkpointing=checkpointing, fused_training=engine.config.fused_training,
                             **({"split_master": True} if split else {}))
            if name == "dense":  # the other EngineConfig.fused_training setting (Triton norms, RoPE, SiLU * up)
                engine._trainer().fused = not engine.config.fused_training
                for checkpointing in (False, True):
                    ppo = he.PPOConfig(micro_batch_tokens=tokens, lr=1e-6, max_grad_norm=1.0,
                                       activation_checkpointing=checkpointing)
                    with ctx.peak() as pm:
                        times = ctx.measure(lambda: engine.ppo_step(batch, ppo), warmup=2, repeats=5,
                                            desc="train_step fused")
                    record_train(ctx, "hybridengine", model, times, pm, layout=name,
                                 activation_checkpointing=checkpointing, fused_training=not engine.config.fused_training,
                                 **({"split_master": True} if split else {}))
                engine._trainer().fused = engine.config.fused_training
        del engine
