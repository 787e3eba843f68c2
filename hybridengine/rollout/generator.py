"""The rollout loop's pieces: request checks, `generate` over a rollout's requests, and async decode.

`generate` is a thin loop over the rollout's `RolloutSession` (rollout/requests.py): add every prompt,
step until they have all finished, collect the outputs in prompt order. The session's step is
schedule -> run the model -> sample -> post-process, with the async decode pipeline below.

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
from hybridengine.rollout.outputs import RequestOutput
from hybridengine.rollout.runner import Readback
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


@dataclass(frozen=True, slots=True)
class TPGroup:
    """The TP group of generation: every rank continues with rank `src`'s tokens, and rank `src` drives
    the group's requests (`RolloutSession.send`)."""

    group: object
    src: int
    """Global rank of the group's first rank."""
    messages: object
    """A gloo group over the same ranks for the driver's per-step messages: on the host, so that they
    never wait for the device (an object broadcast over NCCL syncs with the step in flight)."""

    @classmethod
    def of(cls, group, parent, timeout) -> "TPGroup":
        """The TP group `group`, one of the TP groups that split `parent` (ShardedBuffer's layout: TP
        group j holds parent ranks j, j + m, j + 2m, ...). Every rank of `parent` calls it: the gloo
        twins are made collectively, each group in the same order on every rank."""
        mine = dist.get_process_group_ranks(group)
        messages = group
        if dist.get_backend(group) != "gloo":
            ranks, tp = dist.get_process_group_ranks(parent), len(mine)
            m = len(ranks) // tp
            for j in range(m):
                members = [ranks[t * m + j] for t in range(tp)]
                twin = dist.new_group(members, timeout=timeout, backend="gloo")
                if members == mine:
                    messages = twin
            assert messages is not group, f"TP group {mine} is not one of the layout's groups over {ranks}"
        return cls(group, mine[0], messages)


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
    """float64 [2, B]: tokens and log-probs (float64 holds both exactly: ids < 2^53, fp32 log-probs), in a
    `Readback` slot."""
    ready: torch.cuda.Event | None
    void: list[bool]
    """Rows whose sequence had finished (a stop token read after this step was launched) or was aborted
    while the step was in flight: ignored."""
    readback: Readback
    slot: tuple[int, int]
    """(slot, its write count) in readback."""

    def wait(self) -> tuple[list[int], list[float]]:
        """The tokens and log-probs as Python lists, once the store has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        self.readback.check(*self.slot)
        return self.host[0].long().tolist(), self.host[1].tolist()


def _launch(seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, tp: TPGroup | None,
            readback: Readback) -> _Sampled:
    """Start the tokens' and log-probs' way to the host (`Readback`); under TP every rank continues with
    rank tp.src's tokens (one broadcast)."""
    packed = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
    next_ids = tokens
    if tp is not None:
        dist.broadcast(packed, src=tp.src, group=tp.group)
        next_ids = packed[0].long()
    host, slot, writes, ready = readback.write(packed)
    return _Sampled(seqs, next_ids, host, ready, [False] * len(seqs), readback, (slot, writes))


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
