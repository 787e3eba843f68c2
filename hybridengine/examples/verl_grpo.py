"""GRPO through verl's own trainer (`python -m verl.trainer.main_ppo`) on hybridengine: the demo task of
`hybridengine grpo` (the answer is the prompt's first digit) with verl's data files, tokenizer, reward
function and config, and the one switch that puts both actor and rollout on one HybridEngine:

    actor_rollout_ref.actor.strategy=hybridengine actor_rollout_ref.rollout.name=hybridengine

`prepare` writes what verl reads (a tiny random Llama checkpoint with a 16-word tokenizer, train/val
parquet files of chat prompts, the reward function); `overrides` is the Hydra command line; `main` runs
verl's trainer in a subprocess and returns its per-step metrics (verl's file logger). On a machine without
a GPU it selects hybridengine's CPU platform for verl (VERL_PLATFORM=cpu) and gives Ray one logical GPU
slot per worker.

    python -m hybridengine.examples.verl_grpo --out /tmp/verl_grpo --steps 30
    python -m hybridengine.examples.verl_grpo --exact   # old log-probs = rollout log-probs (bypass mode)
    python -m hybridengine.examples.verl_grpo --exact --recompute-old-logprobs   # verl compares them
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hybridengine.examples.grpo import DIGITS, TASK_CONFIG

# The 16 words of the task's vocabulary (TASK_CONFIG's vocab_size): the digits, then special tokens.
WORDS = [str(d) for d in range(DIGITS)] + ["<pad>", "<eos>", "<bos>", "<unk>", "<x>", "<y>"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
REWARD_SOURCE = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1 when the first generated token is the prompt's first digit."""
    words = solution_str.split()
    return float(bool(words) and words[0] == ground_truth)
'''


def write_model(path: Path, seed: int) -> None:
    """A random tiny Llama (the demo's TASK_CONFIG) and its word-level tokenizer, saved as a checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    kw = dict(TASK_CONFIG)
    vocab = {w: i for i, w in enumerate(WORDS)}
    config = AutoConfig.for_model(kw.pop("model_type"), **kw, pad_token_id=vocab["<pad>"],
                                  eos_token_id=vocab["<eos>"], bos_token_id=vocab["<bos>"])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def write_data(path: Path, num: int, prompt_len: int, seed: int) -> None:
    """verl's RLHF parquet layout: a chat prompt of `prompt_len` random digits, the first one the answer."""
    import pandas as pd

    gen = torch.Generator().manual_seed(seed)
    digits = torch.randint(0, DIGITS, (num, prompt_len), generator=gen).tolist()
    rows = [dict(data_source="first_digit", prompt=[dict(role="user", content=" ".join(map(str, d)))],
                 ability="copy", reward_model=dict(style="rule", ground_truth=str(d[0])), extra_info=dict(index=i))
            for i, d in enumerate(digits)]
    pd.DataFrame(rows).to_parquet(path)


def prepare(out: Path, *, num_prompts: int = 512, prompt_len: int = 4, seed: int = 0) -> dict[str, Path]:
    """Write the checkpoint, the data and the reward function under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(model=out / "model", train=out / "train.parquet", val=out / "val.parquet", reward=out / "reward.py")
    write_model(paths["model"], seed)
    write_data(paths["train"], num_prompts, prompt_len, seed)
    write_data(paths["val"], 64, prompt_len, seed + 1)
    paths["reward"].write_text(REWARD_SOURCE)
    return paths


def overrides(paths: dict[str, Path], args: argparse.Namespace) -> list[str]:
    """verl's Hydra overrides for the demo: GRPO, the hybridengine actor and rollout, one-token answers."""
    batch = args.prompts
    over = [
        "trainer.use_v1=false",  # verl 0.9.1's v1 trainer needs the transfer_queue package, not a verl dependency
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
        f"data.train_batch_size={batch}", f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.max_tokens}", "data.dataloader_num_workers=0",
        f"data.seed={args.seed}",
        f"actor_rollout_ref.model.path={paths['model']}",
        "actor_rollout_ref.actor.strategy=hybridengine",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * args.n}",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.rollout.name=hybridengine",
        f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * args.n}",
        f"actor_rollout_ref.rollout.max_num_seqs={batch * args.n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.seed={args.seed}",
        f"reward.custom_reward_function.path={paths['reward']}", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        f"trainer.total_training_steps={args.steps}", "trainer.total_epochs=1000",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console,file]", "trainer.project_name=hybridengine",
        "trainer.experiment_name=verl_grpo",
        f"trainer.default_local_dir={args.out}/checkpoints",
        f"hydra.run.dir={args.out}/hydra",  # Hydra's own run folder, else ./outputs/<date>/<time> in the cwd
    ]
    if args.exact:  # rollout log-probs are the trainer's bit for bit
        over.append("+actor_rollout_ref.rollout.engine_kwargs.hybridengine.exact_logprobs=true")
        if not args.recompute_old_logprobs:  # verl takes them as the old log-probs: no recompute pass
            over.append("algorithm.rollout_correction.bypass_mode=true")
    if not torch.cuda.is_available():
        # Ray's CPU count is logical: verl's placement groups ask max_colocate_count (3) CPUs per worker bundle.
        over += ["trainer.device=cpu", "+ray_kwargs.ray_init.num_cpus=8", "+ray_kwargs.ray_init.num_gpus=1",
                 "+ray_kwargs.ray_init.include_dashboard=false"]
    return over


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybridengine.examples.verl_grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="verl_grpo_out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact", action="store_true", help="exact log-probs; verl skips its old-log-prob recompute")
    p.add_argument("--recompute-old-logprobs", action="store_true",
                   help="with --exact: keep verl's recompute, which then logs the rollout/trainer difference "
                        "(training/rollout_probs_diff_max)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the verl run is stopped")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run verl's trainer on the demo; return one dict of verl's metrics per step."""
    args = parse_args(argv)
    out = Path(args.out).resolve()
    args.out = str(out)
    paths = prepare(out, num_prompts=max(512, args.prompts * args.steps), prompt_len=args.prompt_len, seed=args.seed)
    metrics = out / "metrics.jsonl"
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics), TOKENIZERS_PARALLELISM="false")
    if not torch.cuda.is_available():
        env["VERL_PLATFORM"] = "cpu"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(paths, args)]
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    with open(out / "verl.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (out / "verl.log").read_text().splitlines()[-40:]
        raise RuntimeError(f"verl's trainer exited with status {proc.returncode}; log {out / 'verl.log'}:\n"
                           + "\n".join(tail))
    history = [dict(json.loads(line)["data"], step=json.loads(line)["step"]) for line in metrics.open()]
    rewards = [row.get("critic/score/mean") for row in history]
    print(f"verl GRPO on hybridengine: {len(history)} steps, mean reward per step "
          + " ".join(f"{r:.2f}" for r in rewards if r is not None) + f"; log {out / 'verl.log'}")
    return history


if __name__ == "__main__":
    main()
