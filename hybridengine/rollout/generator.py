"""The rollout loop behind `HybridEngine.generate`: schedule -> run the model -> sample -> post-process.

Async decode: a decode step is launched before the previous step's tokens reach the host. Each
launched step gives its sequences a PLACEHOLDER token (`_reserve`), so the next step can be
scheduled at once; its input ids are copied from the previous step's sampled tokens on the device
(`ModelRunner.step(prev_tokens=)`), and the host reads step t's tokens (`_resolve`) while step
t + 1 runs. Before a prefill or a preemption the loop resolves the step in flight first.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridengine import checks
from hybridengine.config import EngineConfig
from hybridengine.rollout.block_manager import BlockManager
from hybridengine.rollout.outputs import CompletionOutput, RequestOutput
from hybridengine.rollout.runner import ModelRunner
from hybridengine.rollout.sampler import Sampler
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.scheduler import Batch, Scheduler
from hybridengine.rollout.sequence import PLACEHOLDER, Sequence, Status


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


def check_requests(prompts, params: list[SamplingParams], *, vocab_size: int, config: EngineConfig,
                   num_blocks: int) -> None:
    """Every prompt is a non-empty list of in-vocabulary integer token ids whose samples fit the engine
    (a batch, max_model_len, the cache); raises ValueError naming the first bad request."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be token ids (a list of token-id lists), got text: the engine has no "
                         "tokenizer; encode the prompts first")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {checks.describe(prompts)}")
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
    max_len = config.max_model_len
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        if isinstance(prompt, str):
            raise ValueError(f"prompts[{i}] is text ({prompt[:20]!r}); prompts must be token ids (the engine has no "
                             "tokenizer; encode the prompts first)")
        if checks.is_int(prompt):
            raise ValueError(f"prompts[{i}] is a single token id {prompt!r}: prompts must be a list of token-id "
                             "lists (for one prompt, pass [ids])")
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompts[{i}] must be a list of token ids, got {checks.describe(prompt)}")
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        if not all(map(checks.is_int, prompt)):
            j = next(j for j, t in enumerate(prompt) if not checks.is_int(t))
            raise ValueError(f"prompts[{i}][{j}] must be an integer token id, got {checks.describe(prompt[j])}")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            bad = next(t for t in prompt if not 0 <= t < vocab_size)
            raise ValueError(f"prompts[{i}] has token id {bad!r} outside the vocabulary [0, {vocab_size})")
        if p.n > config.max_num_seqs:
            raise ValueError(f"sampling_params[{i}]: n={p.n} samples exceed EngineConfig.max_num_seqs="
                             f"{config.max_num_seqs} (a prompt's samples decode in one batch)")
        if len(prompt) + p.max_tokens > max_len:
            raise ValueError(f"prompts[{i}]: prompt length {len(prompt)} + max_tokens {p.max_tokens} exceeds "
                             f"max_model_len={max_len}")
        need = math.ceil((len(prompt) + p.max_tokens) / config.block_size)
        if need > num_blocks:
            raise ValueError(f"prompts[{i}]: needs {need} KV blocks at its longest, the cache has {num_blocks}")


@dataclass(frozen=True, slots=True)
class TPGroup:
    """The TP group of generation: every rank continues with rank `src`'s tokens."""

    group: object
    src: int
    """Global rank of the group's first rank."""


def generate(runner: ModelRunner, sampler: Sampler, prompts: list[list[int]], params: list[SamplingParams], *,
             config: EngineConfig, tp: TPGroup | None = None,
             progress: bool = False) -> tuple[list[RequestOutput], dict[str, float]]:
    """Run checked requests to completion; returns (outputs in prompt order, samples in index order;
    the call's stats: generate_s, steps, decode_s, preemptions, cuda_graph_capture_s, async_steps)."""
    device = runner.device
    sched = Scheduler(BlockManager(runner.kv.num_blocks, config.block_size), max_num_seqs=config.max_num_seqs,
                      max_num_batched_tokens=config.max_num_batched_tokens)
    outputs = [RequestOutput(list(p)) for p in prompts]
    finished: list[Sequence] = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        sched.add(Sequence(request=i, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=p, fork=p.n))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.n * p.max_tokens for p in params), desc="generate", unit="tok")
    t0, steps, decode_s, ahead = time.perf_counter(), 0, 0.0, 0
    inflight: _Sampled | None = None
    while not sched.done:
        if inflight is not None and not sched.decodes_next():
            _resolve(sched, inflight, finished)  # a prefill or a preemption comes next: sync first
            inflight = None
            continue
        ts, captured = time.perf_counter(), runner.graph_capture_s
        batch = sched.schedule()
        prev = None if inflight is None else (inflight.next_ids, _rows(batch.seqs, inflight.seqs, device))
        logits = runner.step(batch, prev)
        seqs = batch.seqs
        if batch.is_prefill:
            logits, seqs = _fork_prefilled(sched, batch, logits, device)
        tokens, logprobs = sampler(logits, seqs, config.sampler)
        step = _launch(seqs, tokens, logprobs, tp)
        if inflight is not None:
            _resolve(sched, inflight, finished)
            ahead += 1
        _reserve(sched, step)
        if batch.is_prefill or not config.async_scheduling:
            _resolve(sched, step, finished)
            inflight = None
        else:
            inflight = step
        if not batch.is_prefill:  # the whole iteration, host bookkeeping included (a lazy graph capture not)
            decode_s += time.perf_counter() - ts - (runner.graph_capture_s - captured)
        steps += 1
        if bar is not None:
            bar.update(len(seqs))
    if inflight is not None:
        _resolve(sched, inflight, finished)
    if bar is not None:
        bar.close()
    for seq in sorted(finished, key=lambda s: (s.request, s.sample)):
        outputs[seq.request].outputs.append(
            CompletionOutput(seq.sample, seq.completion_ids, seq.logprobs, seq.finish_reason))
    stats = dict(generate_s=time.perf_counter() - t0, steps=steps, decode_s=decode_s,
                 preemptions=sched.num_preemptions, cuda_graph_capture_s=runner.graph_capture_s, async_steps=ahead)
    return outputs, stats


def _fork_prefilled(sched: Scheduler, batch: Batch, logits: torch.Tensor, device: torch.device):
    """After a prefill: each prompt awaiting its fork becomes its samples, which all draw from its row;
    fresh seeded samples get their generator. Returns (logits row per sequence, sequences)."""
    rows, seqs = [], []
    for r, seq in enumerate(batch.seqs):
        children = sched.fork(seq) if seq.fork > 1 else [seq]
        rows += [r] * len(children)
        seqs += children
    for seq in seqs:
        if seq.generator is None and seq.params.seed is not None:
            seq.generator = torch.Generator(device).manual_seed((seq.params.seed * 100003 + seq.sample) % 2**64)
    if rows != list(range(len(batch.seqs))):
        logits = logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
    return logits, seqs


def _rows(seqs: list[Sequence], prev: list[Sequence], device: torch.device) -> torch.Tensor | None:
    """Row of each of seqs in the previous step's batch (None: row i is row i). A decode scheduled
    ahead runs the previous step's sequences minus those that finished, in the same order."""
    if len(seqs) <= len(prev) and all(a is b for a, b in zip(seqs, prev)):
        return None
    where = {id(seq): i for i, seq in enumerate(prev)}
    rows = [where.get(id(seq), -1) for seq in seqs]
    if min(rows) < 0:
        raise RuntimeError("async decode: a sequence of the step has no token in the previous step")
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


@dataclass(slots=True)
class _Sampled:
    """A step's sampled tokens and log-probs on their way to the host."""

    seqs: list[Sequence]
    next_ids: torch.Tensor
    """int64 [B] on the device: the next decode step's input ids (under TP, rank tp.src's)."""
    host: torch.Tensor
    """float64 [2, B]: tokens and log-probs (float64 holds both exactly: ids < 2^53, fp32 log-probs)."""
    ready: torch.cuda.Event | None
    void: list[bool]
    """Rows whose sequence had finished (a stop token read after this step was launched): ignored."""

    def wait(self) -> tuple[list[int], list[float]]:
        """The tokens and log-probs as Python lists, once the copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[0].long().tolist(), self.host[1].tolist()


def _launch(seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, tp: TPGroup | None) -> _Sampled:
    """Start the device-to-host copy (pinned, non-blocking on CUDA); under TP every rank continues
    with rank tp.src's tokens (one broadcast)."""
    packed = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
    next_ids = tokens
    if tp is not None:
        dist.broadcast(packed, src=tp.src, group=tp.group)
        next_ids = packed[0].long()
    ready = None
    if packed.is_cuda:
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host = packed
    return _Sampled(seqs, next_ids, host, ready, [False] * len(seqs))


def _reserve(sched: Scheduler, step: _Sampled) -> None:
    """Give every sequence of a launched step its next token as PLACEHOLDER, so that the next step can
    be scheduled before the token is known; a sequence that reaches max_tokens with it finishes now
    (its blocks are freed: steps that reuse them run after this one on the stream)."""
    for i, seq in enumerate(step.seqs):
        if seq.status is Status.FINISHED:  # stopped in the previous step: this row is void
            step.void[i] = True
            continue
        seq.token_ids.append(PLACEHOLDER)
        if seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")


def _resolve(sched: Scheduler, step: _Sampled, finished: list[Sequence]) -> None:
    """Wait for a step's tokens, then `_append` them."""
    _append(sched, step, *step.wait(), finished)


def _append(sched: Scheduler, step: _Sampled, tokens: list[int], logprobs: list[float],
            finished: list[Sequence]) -> None:
    """Put each token in place of its sequence's PLACEHOLDER, with its log-prob; finish the sequences
    that emitted a stop token (or reached max_tokens in `_reserve`)."""
    for seq, tok, lp, void in zip(step.seqs, tokens, logprobs, step.void):
        if void:
            continue
        seq.token_ids[-1] = tok
        seq.logprobs.append(lp)
        stop = tok in seq.params.stop_token_ids
        if seq.status is Status.FINISHED:  # reached max_tokens with this token
            seq.finish_reason = "stop" if stop else "length"
            finished.append(seq)
        elif stop:
            sched.finish(seq, "stop")
            finished.append(seq)
