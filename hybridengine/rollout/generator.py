"""Request checks and `generate` over a rollout's requests.

`check_request(s)` validate prompts and sampling params at the boundary (a request that passes fits the
engine: a batch, max_model_len, the cache, the vocabulary). `generate` is a thin loop over the rollout's
`RolloutSession` (rollout/requests.py): add every prompt, step until they have all finished, collect the
outputs in prompt order.
"""

from __future__ import annotations

import math
import time

import torch

from hybridengine import checks
from hybridengine.config import EngineConfig
from hybridengine.rollout.outputs import RequestOutput
from hybridengine.rollout.sampling_params import SamplingParams


def token_id_lists(prompts):
    """Prompts given as tensors, as lists: a 2-D tensor is one prompt per row, a 1-D tensor one prompt,
    and 1-D tensors in a list are prompts. Anything else comes back as given, for `check_requests` to
    judge (it rejects non-integer ids, so a float tensor fails there, naming the first one)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2):
            raise ValueError(f"prompts as a tensor must be 1-D (one prompt) or 2-D (one prompt per row), got "
                             f"{checks.describe(prompts)}")
        return [prompts.tolist()] if prompts.dim() == 1 else prompts.tolist()
    if isinstance(prompts, (list, tuple)):
        return [p.tolist() if isinstance(p, torch.Tensor) and p.dim() == 1 else p for p in prompts]
    return prompts


def batch_params(prompts, sampling_params) -> list:
    """`generate`'s sampling_params as one per prompt: None (the defaults), one for all, or a list."""
    params = SamplingParams() if sampling_params is None else sampling_params
    if isinstance(params, SamplingParams):
        return [params] * (len(prompts) if isinstance(prompts, (list, tuple)) else 1)
    if isinstance(params, (list, tuple)):
        return list(params)
    raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")


def check_request(prompt, params, *, name: str, params_name: str, vocab_size: int, config: EngineConfig,
                  num_blocks: int) -> None:
    """One request: `prompt` is a non-empty list of in-vocabulary integer token ids whose samples fit the
    engine (a batch, max_model_len, the cache), and its stop ids are in the vocabulary (SamplingParams does
    not know it; a stop id the model cannot emit would never stop a sample). Raises ValueError naming the
    argument (`name`, `params_name`)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"{params_name} must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        raise ValueError(f"{name} is text ({prompt[:20]!r}); prompts must be token ids (the engine has no "
                         "tokenizer; encode the prompts first)")
    if isinstance(prompt, torch.Tensor):  # a 1-D one was made a list by the caller
        raise ValueError(f"{name} must be one prompt: a list or 1-D tensor of token ids, got "
                         f"{checks.describe(prompt)}")
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {checks.describe(prompt)}")
    if len(prompt) == 0:
        raise ValueError(f"{name} is empty; every prompt needs at least one token")
    if not all(map(checks.is_int, prompt)):
        j = next(j for j, t in enumerate(prompt) if not checks.is_int(t))
        raise ValueError(f"{name}[{j}] must be an integer token id, got {checks.describe(prompt[j])}")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise ValueError(f"{name} has token id {bad!r} outside the vocabulary [0, {vocab_size})")
    stop = params.stop_token_ids  # checked again: the dataclass may have been changed since its construction
    if not isinstance(stop, (tuple, list)) or not all(checks.is_int(t) and 0 <= t < vocab_size for t in stop):
        raise ValueError(f"{params_name}.stop_token_ids must be token ids in the vocabulary [0, {vocab_size}), "
                         f"got {stop!r}")
    if params.n > config.max_num_seqs:
        raise ValueError(f"{params_name}: n={params.n} samples exceed EngineConfig.max_num_seqs="
                         f"{config.max_num_seqs} (a prompt's samples decode in one batch)")
    if len(prompt) + params.max_tokens > config.max_model_len:
        raise ValueError(f"{name}: prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds "
                         f"max_model_len={config.max_model_len}")
    need = math.ceil((len(prompt) + params.max_tokens) / config.block_size)
    if need > num_blocks:
        raise ValueError(f"{name}: needs {need} KV blocks at its longest, the cache has {num_blocks}")


def check_requests(prompts, params: list[SamplingParams], *, vocab_size: int, config: EngineConfig,
                   num_blocks: int) -> None:
    """`generate`'s batch: a non-empty list of prompts, one SamplingParams each, every request as
    `check_request` wants it; raises ValueError naming the first bad request."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be token ids (a list of token-id lists), got text: the engine has no "
                         "tokenizer; encode the prompts first")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {checks.describe(prompts)}")
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if checks.is_int(prompt):
            raise ValueError(f"prompts[{i}] is a single token id {prompt!r}: prompts must be a list of token-id "
                             "lists (for one prompt, pass [ids])")
        check_request(prompt, p, name=f"prompts[{i}]", params_name=f"sampling_params[{i}]", vocab_size=vocab_size,
                      config=config, num_blocks=num_blocks)


def generate(session, prompts: list[list[int]], params: list[SamplingParams], *,
             progress: bool = False) -> tuple[list[RequestOutput], dict[str, float]]:
    """Run checked requests to completion in `session` (a `RolloutSession`, which may hold other
    requests: they progress too); returns (outputs in prompt order, samples in index order; the call's
    stats: generate_s, steps, decode_s, preemptions, cuda_graph_capture_s, async_steps)."""
    t0 = time.perf_counter()
    before = session.counters()
    requests = [session.admit(prompt, p) for prompt, p in zip(prompts, params)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.n * p.max_tokens for p in params), desc="generate", unit="tok")
    while not all(r.finished for r in requests):
        session.step()
        if bar is not None:
            bar.update(session.num_scheduled)
    if bar is not None:
        bar.close()
    stats = {k: v - before[k] for k, v in session.counters().items()}
    stats.update(generate_s=time.perf_counter() - t0, cuda_graph_capture_s=session.runner.graph_capture_s)
    return [r.output() for r in requests], stats
