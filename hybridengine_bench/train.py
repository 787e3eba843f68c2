"""hybridengine train step (the `hybridengine` provider of bench `train_step`): one PPO optimizer
step on the shared buffer, per GPU 4 x 1024 tokens (the peers' workload) and a packed
variable-length batch of the same token count, each with activation checkpointing off (every
layer's activations kept, parameters gathered again in backward) and on (every layer recomputed);
case activation_checkpointing says which, as in the FSDP2 and DeepSpeed rows.
"""

from __future__ import annotations

import torch

from .common import Ctx, record_train, release_memory


def train_step(ctx: Ctx) -> None:
    import hybridengine as he

    if not ctx.cuda:
        ctx.rec.not_run("train_step", "hybridengine", None, "GPU only")
        return
    w = ctx.work
    tokens = w.train_batch * w.train_seq
    for model in ctx.models:
        cfg = he.model_config(model)
        engine = he.HybridEngine(cfg, he.EngineConfig(dtype=torch.bfloat16, device=str(ctx.device)))
        trainer = engine.trainer
        g = torch.Generator().manual_seed(100 + ctx.rank)
        layouts = {"dense": [w.train_seq] * w.train_batch,
                   "packed": [tokens // 8, tokens * 3 // 8, tokens // 4, tokens // 4]}

        def run(batch, layout: str, desc: str) -> None:
            for checkpointing in (False, True):
                ppo = he.PPOConfig(micro_batch_tokens=tokens, lr=1e-6, max_grad_norm=1.0,
                                   activation_checkpointing=checkpointing)
                with ctx.peak() as pm:
                    times = ctx.measure(lambda: engine.ppo_step(batch, ppo), warmup=2, repeats=5, desc=desc)
                # Training maps this rank's shard of the buffer (pages outside torch's allocator); max over ranks.
                buffer_gib = ctx.slowest([engine.sharded.gen.mapped_bytes() / 2**30])[0]
                split = {"split_master": True} if trainer.split_master else {}
                record_train(ctx, "hybridengine", model, times, pm, buffer_gib=buffer_gib, layout=layout,
                             activation_checkpointing=checkpointing, fused_training=trainer.fused, **split)

        for name, lengths in layouts.items():
            ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
            batch = he.PPOBatch(input_ids=ids, response_mask=[torch.ones(n - 1) for n in lengths],
                                old_logprobs=[-5 + 0.1 * torch.randn(n - 1, generator=g) for n in lengths],
                                advantages=[torch.randn(n - 1, generator=g) for n in lengths])
            run(batch, name, f"train_step {name}")
            if name != "dense":
                continue
            # The other EngineTuning.fused_training setting (Triton norms, RoPE, SiLU * up) ...
            trainer.fused = not trainer.fused
            run(batch, name, "train_step, other fused_training")
            trainer.fused = not trainer.fused
            # ... and the other EngineTuning.split_master setting (fp32 or split AdamW masters): a new
            # optimizer over the same weights.
            trainer.reset_optimizer(split_master=not engine.config.tuning.split_master)
            release_memory()
            run(batch, name, "train_step, other split_master")
            trainer.reset_optimizer(split_master=engine.config.tuning.split_master)
            release_memory()
        del engine, trainer
