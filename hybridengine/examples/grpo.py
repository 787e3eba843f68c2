"""GRPO on hybridengine, end to end: prompts -> rollout (n samples each) -> rewards -> group-normalised
advantages -> PPO update, repeated; one engine, one copy of the weights.

Default task (synthetic and verifiable, no downloads): the prompt is a few random digits, the answer
is the prompt's first digit. A random tiny model answers right 1 time in 10 (chance); GRPO raises the
mean reward to ~1. Run alone on CPU or GPU, or under torchrun (each rank samples its own prompts).

    hybridengine grpo                                    # tiny model, CPU, about a minute
    hybridengine grpo --model-config qwen2.5-1.5b        # random init from an embedded config (GPU)
    torchrun --nproc-per-node 2 -m hybridengine.examples.grpo --model /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hybridengine as he
from hybridengine.algos import grpo_advantages

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


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="hybridengine grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--model-config", help="embedded config name, random init (e.g. qwen2.5-1.5b)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step per rank")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--entropy-coef", type=float, default=0.01,
                   help="entropy bonus: keeps the groups diverse (a collapsed group has zero advantage)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grpo_out", help="folder for metrics.jsonl and curves.png")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)

    if "LOCAL_RANK" in __import__("os").environ and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    engine = he.HybridEngine(source_for(args), he.EngineConfig(dtype=dtype, max_model_len=64 if not args.model else 4096,
                                                               max_num_seqs=args.prompts * args.n, seed=args.seed,
                                                               cuda_graphs=False))
    ppo = he.PPOConfig(clip_low=0.2, clip_high=0.28, lr=args.lr, max_grad_norm=1.0, temperature=args.temperature,
                       entropy_coef=args.entropy_coef, loss_agg="token-mean", micro_batch_tokens=8192)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "metrics.jsonl", "w") if rank == 0 else None
    history = []
    from tqdm import tqdm

    bar = tqdm(range(1, args.steps + 1), desc="grpo", disable=rank != 0)
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
                lp[len(prompt) - 1:] = torch.tensor(c.logprobs)  # the rollout's own log-probs: on-policy
                old.append(lp)
                scores.append(reward(prompt, c.token_ids))
        adv = grpo_advantages(torch.tensor(scores), group_size=args.n)
        batch = he.PPOBatch(input_ids=seqs, response_mask=masks, old_logprobs=old,
                            advantages=[a * m for a, m in zip(adv.tolist(), masks)])
        stats = engine.ppo_step(batch, ppo)                      # training view, same buffer
        mean_reward = torch.tensor(scores).mean()
        if dist.is_initialized():
            dist.all_reduce(mean_reward)
            mean_reward /= dist.get_world_size()
        row = dict(step=step, reward=float(mean_reward), loss=stats["loss"], kl=stats["ppo_kl"],
                   entropy=stats["entropy"], clipfrac=stats["pg_clipfrac"], grad_norm=stats["grad_norm"],
                   step_s=time.perf_counter() - t0)
        history.append(row)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        bar.set_postfix(reward=f"{row['reward']:.2f}", entropy=f"{row['entropy']:.2f}")
    if log:
        log.close()
        if not args.no_plot:
            plot(history, out / "curves.png")
        print(f"grpo: final mean reward {history[-1]['reward']:.3f} (chance {1 / DIGITS:.2f}); "
              f"log {out / 'metrics.jsonl'}" + ("" if args.no_plot else f", plot {out / 'curves.png'}"))
    return history


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, key, title in zip(axes, ("reward", "kl", "entropy"), ("mean reward", "PPO KL (old || new)", "entropy")):
        ax.plot(steps, [h[key] for h in history])
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
