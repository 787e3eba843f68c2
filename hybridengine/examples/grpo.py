"""GRPO or PPO on hybridengine, end to end: prompts -> rollout (n samples each) -> rewards -> advantages
-> PPO update, repeated; the policy trains and generates on one copy of its weights.

Default task (synthetic and verifiable, no downloads): the prompt is a few random digits, the answer
is the prompt's first digit. A random tiny model answers right 1 time in 10 (chance); training raises
the mean reward to ~1. Run alone on CPU or GPU, or under torchrun (each rank samples its own prompts).

- `--algo grpo` (default): group-normalised advantages over the n samples of each prompt.
- `--algo ppo`: a critic (a second engine, `role="critic"`) scores every response token; the sequence
  reward sits on the last response token; GAE advantages (whitened over the batch) and returns; one
  critic step toward the returns next to each policy step.
- `--kl-coef C` (either algo): a frozen reference engine (the initial policy: same source and seed)
  computes log-probs of each rollout batch; the loss adds C * KL(policy || reference) (`--kl-estimator`).
- old log-probs: by default the trainer recomputes them (`engine.log_probs`, one forward pass over the
  batch) and the rollout's own log-probs enter as `rollout_logprobs` with truncated importance sampling
  (`PPOConfig(rollout_correction="tis")`): rollout and training kernels round differently. With `--exact`
  (`EngineConfig(exact_logprobs=True)`) the rollout's log-probs are the trainer's bit for bit, so they are
  the old log-probs and the recompute pass is skipped.

    hybridengine grpo                                    # tiny model, CPU, about a minute
    hybridengine grpo --algo ppo                         # with a critic and GAE
    hybridengine grpo --kl-coef 0.05                     # GRPO with a KL penalty to the initial policy
    hybridengine grpo --model-config qwen2.5-1.5b        # random init from an embedded config (GPU)
    torchrun --nproc-per-node 2 -m hybridengine.examples.grpo --model /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

import hybridengine as he
from hybridengine.train.advantages import gae, grpo_advantages, whiten

DIGITS = 10
TASK_CONFIG = dict(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def make_prompts(num: int, length: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(0, DIGITS, (num, length), generator=gen).tolist()


def reward(prompt: list[int], completion: list[int]) -> float:
    """1 when the first generated token is the prompt's first digit."""
    return float(bool(completion) and completion[0] == prompt[0])


def source_for(args):
    from transformers import AutoConfig

    if args.model:
        return args.model
    if args.model_config:
        return he.model_config(args.model_config)
    kw = dict(TASK_CONFIG)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridengine grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--model-config", help="embedded config name, random init (e.g. qwen2.5-1.5b)")
    p.add_argument("--algo", choices=("grpo", "ppo"), default="grpo",
                   help="grpo: group-normalised advantages; ppo: a critic engine and GAE")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step per rank")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--entropy-coef", type=float, default=0.01,
                   help="entropy bonus: keeps the groups diverse (a collapsed group has zero advantage)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=1.0, help="ppo: GAE discount")
    p.add_argument("--lam", type=float, default=1.0,
                   help="ppo: GAE lambda (1: Monte-Carlo advantages, unbiased by the critic's errors)")
    p.add_argument("--critic-lr", type=float, default=2e-3, help="ppo: the critic's learning rate")
    p.add_argument("--value-clip", type=float, default=0.2,
                   help="ppo: clip the critic's values around the rollout's (0: off); inert in this loop, whose "
                        "one critic step per rollout starts at those values; it binds when a batch is reused")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL penalty to a frozen copy of the initial policy (0: no reference model)")
    p.add_argument("--kl-estimator", choices=("k1", "k2", "k3"), default="k3")
    p.add_argument("--exact", action="store_true",
                   help="EngineConfig(exact_logprobs=True): use the rollout's log-probs as old_logprobs (no recompute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grpo_out", help="folder for metrics.jsonl and curves.png")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name} must be in [0, 1], got {getattr(args, name)}")
    for name in ("kl_coef", "value_clip"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.critic_lr > 0:
        p.error(f"--critic-lr must be > 0, got {args.critic_lr}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if "LOCAL_RANK" in __import__("os").environ and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = (getattr(torch, args.dtype) if args.dtype
             else (torch.bfloat16 if torch.cuda.is_available() else torch.float32))
    source = source_for(args)
    engine_config = he.EngineConfig(dtype=dtype, max_model_len=64 if not args.model else 4096,
                                    max_num_seqs=args.prompts * args.n, seed=args.seed, cuda_graphs=False,
                                    exact_logprobs=args.exact)
    engine = he.HybridEngine(source, engine_config)
    # The same source and seed give the same weights: the reference is the initial policy, frozen (never stepped).
    reference = he.HybridEngine(source, engine_config) if args.kl_coef else None
    critic = he.HybridEngine(source, engine_config, role="critic") if args.algo == "ppo" else None
    ppo = he.PPOConfig(clip_low=0.2, clip_high=0.28, lr=args.lr, max_grad_norm=1.0, temperature=args.temperature,
                       entropy_coef=args.entropy_coef, kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                       loss_agg="token-mean", micro_batch_tokens=8192,
                       rollout_correction=None if args.exact else "tis")
    value = he.ValueConfig(clip=args.value_clip or None, lr=args.critic_lr, max_grad_norm=1.0,
                           loss_agg="token-mean", micro_batch_tokens=8192)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    # The CPU's (unfused) sampler draws unseeded rows from torch's default generator: seeded, a run repeats.
    torch.manual_seed(args.seed * 1000 + rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "metrics.jsonl", "w") if rank == 0 else None
    history = []
    from tqdm import tqdm

    bar = tqdm(range(1, args.steps + 1), desc=args.algo, disable=rank != 0)
    for step in bar:
        t0 = time.perf_counter()
        prompts = make_prompts(args.prompts, args.prompt_len, gen)
        with engine.rollout():                                   # generation view + KV cache
            outs = engine.generate(prompts, he.SamplingParams(n=args.n, temperature=args.temperature,
                                                              max_tokens=args.max_tokens, seed=None))
        seqs, masks, old, scores = [], [], [], []
        for prompt, o in zip(prompts, outs):
            for c in o.outputs:
                seqs.append(torch.tensor(prompt + c.token_ids))
                m = torch.zeros(len(prompt) + len(c.token_ids) - 1)
                m[len(prompt) - 1:] = 1                          # train on the response tokens only
                masks.append(m)
                lp = torch.zeros_like(m)
                lp[len(prompt) - 1:] = torch.tensor(c.logprobs)  # the rollout's own log-probs
                old.append(lp)
                scores.append(reward(prompt, c.token_ids))
        if args.exact:  # bitwise the trainer's: the old log-probs, no recompute pass
            batch = he.PPOBatch(input_ids=seqs, response_mask=masks, old_logprobs=old)
        else:  # recomputed by the trainer; the rollout's weight each token by truncated importance sampling
            batch = he.PPOBatch(input_ids=seqs, response_mask=masks)
            recomputed = unpad(engine.log_probs(batch, temperature=args.temperature).cpu(), batch.lengths)
            batch = dataclasses.replace(batch, old_logprobs=recomputed, rollout_logprobs=old)
        row = dict(step=step, recomputed_old_logprobs=not args.exact)
        if critic is not None:
            adv, value_batch, row_critic = critic_advantages(critic, batch, scores, args)
        else:
            adv = [a * m for a, m in zip(grpo_advantages(torch.tensor(scores), group_size=args.n).tolist(), masks)]
        ref = None
        if reference is not None:
            # on the CPU beside the batch's other per-token tensors (log_probs returns on the engine's device)
            ref = unpad(reference.log_probs(batch, temperature=args.temperature).cpu(), batch.lengths)
        stats = engine.ppo_step(dataclasses.replace(batch, advantages=adv, ref_logprobs=ref), ppo)  # same buffer
        mean_reward = torch.tensor(scores).mean()
        if dist.is_initialized():
            dist.all_reduce(mean_reward)
            mean_reward /= dist.get_world_size()
        row.update(reward=float(mean_reward), loss=stats["loss"], kl=stats["ppo_kl"], entropy=stats["entropy"],
                   clipfrac=stats["pg_clipfrac"], grad_norm=stats["grad_norm"])
        if reference is not None:
            row["kl_loss"] = stats["kl_loss"]                    # the estimator's KL(policy || reference), token mean
        if critic is not None:
            critic_stats = critic.value_step(value_batch, value)
            row.update(row_critic, vf_loss=critic_stats["vf_loss"], vf_grad_norm=critic_stats["grad_norm"])
        row["step_s"] = time.perf_counter() - t0
        history.append(row)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        bar.set_postfix(reward=f"{row['reward']:.2f}", entropy=f"{row['entropy']:.2f}")
    if log:
        log.close()
        if not args.no_plot:
            plot(history, out / "curves.png")
        print(f"{args.algo}: final mean reward {history[-1]['reward']:.3f} (chance {1 / DIGITS:.2f}); "
              f"log {out / 'metrics.jsonl'}" + ("" if args.no_plot else f", plot {out / 'curves.png'}"))
    return history


def unpad(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """[B, max_len - 1] -> per sequence [T_b - 1] (what PPOBatch fields hold)."""
    return [x[b, :n - 1] for b, n in enumerate(lengths)]


def critic_advantages(critic: he.HybridEngine, batch: he.PPOBatch, scores: list[float], args):
    """PPO's advantages from the critic: values of the rollout, the sequence reward on each response's
    last token, GAE (whitened over the batch). Returns (advantages per sequence, the critic's batch
    toward the GAE returns, metrics: the values' mean and explained variance of the returns)."""
    values = critic.values(batch).cpu()                          # [B, max_len - 1]; the batch's tensors are on the CPU
    mask = pad_sequence(batch.response_mask, batch_first=True)
    rewards = torch.zeros_like(values)
    last = torch.tensor(batch.lengths) - 2                       # the last target position: the last response token
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores)
    advantages, returns = gae(rewards, values, mask, gamma=args.gamma, lam=args.lam)
    advantages = whiten(advantages, mask)
    valid = mask.bool()
    # 1 - Var(returns - values) / Var(returns) over the response tokens (1: the critic predicts every return);
    # undefined (None in the log) when every return is equal, e.g. a batch that is all right.
    spread = returns[valid].var(correction=0)
    explained = float(1 - (returns - values)[valid].var(correction=0) / spread) if spread > 0 else None
    critic_batch = dataclasses.replace(batch, old_logprobs=None, old_values=unpad(values, batch.lengths),
                                       returns=unpad(returns, batch.lengths))
    metrics = dict(vf_explained_var=explained, vpred_mean=float(values[valid].mean()))
    return unpad(advantages, batch.lengths), critic_batch, metrics


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "mean reward"), ("kl", "PPO KL (old || new)"), ("entropy", "entropy"),
              ("kl_loss", "KL to the reference"), ("vf_explained_var", "critic: explained variance")]
    panels = [(key, title) for key, title in panels if key in history[0]]
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        ax.plot(steps, [math.nan if h[key] is None else h[key] for h in history])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].axhline(1 / DIGITS, color="gray", ls="--", lw=1, label="chance")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
