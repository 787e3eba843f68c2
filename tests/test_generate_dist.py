"""Generation on the sharded buffer over gloo: N = 2 and 4 with tg in {1, 2, 4} equals one process."""


import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hybridengine as he
from _dist import reporting, spawn

PROMPT_LENS = [3, 9, 17, 6]


def build(name):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(he.model_config(name)).eval()
    for p in hf.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    return hf


def config(tp, sampler="auto"):
    return he.EngineConfig(dtype=torch.float32, device="cpu", tp_generation=tp, block_size=4, max_model_len=48,
                           max_num_seqs=8, max_num_batched_tokens=64,
                           tuning=he.EngineTuning(sampler=sampler))


def prompts(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(engine, vocab, rounds=2, params=None):
    outs = []
    for _ in range(rounds):  # two rollouts: the switch back and forth keeps the weights
        with engine.rollout():
            res = engine.generate(prompts(vocab), params or he.SamplingParams(n=2, temperature=0.0, max_tokens=8))
        outs.append([[o.token_ids for o in r.outputs] for r in res])
    return outs


# The fused sampler, vocab-parallel at tg > 1: greedy rows, seeded samples at T = 0.8 (their noise is
# drawn per vocabulary column, so a TP rank's slice draws what one process draws there), and a mixed
# batch where one request truncates (that step gathers the vocabulary).
FUSED_PARAMS = [he.SamplingParams(n=2, temperature=0.0, max_tokens=8),
                he.SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=7),
                he.SamplingParams(temperature=0.9, top_k=5, max_tokens=6, seed=2),
                he.SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=1)]


def _worker(rank, world, init_file, name, tp, expected, errors, sampler="auto"):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        hf = build(name)
        engine = he.HybridEngine(hf, config(tp, sampler))
        got = run(engine, hf.config.vocab_size, params=FUSED_PARAMS if sampler == "fused" else None)
        if got != expected:
            errors.put(f"rank {rank} (N={world}, tg={tp}): {got} != {expected}")


@pytest.mark.parametrize("name,world,tp", [("tiny-qwen2", 2, 1), ("tiny-qwen2", 2, 2), ("tiny-llama", 4, 2),
                                           ("tiny-qwen3", 2, 2)])
def test_sharded_generation_equals_single_process(name, world, tp):
    hf = build(name)
    expected = run(he.HybridEngine(hf, config(1)), hf.config.vocab_size)
    spawn(_worker, world, name, tp, expected)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused sampler on CPU runs in the interpreter")
@pytest.mark.parametrize("name,world,tp", [("tiny-qwen2", 2, 2), ("tiny-llama", 4, 2)])
def test_vocab_parallel_fused_sampling_equals_single_process(name, world, tp):
    hf = build(name)
    expected = run(he.HybridEngine(hf, config(1, "fused")), hf.config.vocab_size, params=FUSED_PARAMS)
    spawn(_worker_fused, world, name, tp, expected)


def _worker_fused(rank, world, init_file, name, tp, expected, errors):
    _worker(rank, world, init_file, name, tp, expected, errors, sampler="fused")
