"""Async decode: the pieces of a rollout step between the model and the sequences.

A decode step is launched before the previous step's tokens reach the host. Each launched step gives its
sequences a PLACEHOLDER token (`reserve`), so the next step can be scheduled at once; its input ids are
copied from the previous step's sampled tokens on the device (`ModelRunner.step(prev_tokens=)`, with
`next_rows` mapping each sequence to its row of that step), and the host reads step t's tokens (`resolve`,
`append`) while step t + 1 runs. After a prefill, each prompt becomes its n samples (`fork_prefilled`).
`RolloutSession.step` (rollout/requests.py) strings them together; before a prefill or a preemption it
resolves the step in flight first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridengine.rollout.runner import Readback
from hybridengine.rollout.scheduler import Batch, Scheduler
from hybridengine.rollout.sequence import PLACEHOLDER, Sequence, Status
from hybridengine.rollout.tp_group import TPGroup


def fork_prefilled(sched: Scheduler, batch: Batch, logits: torch.Tensor, device: torch.device):
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


def next_rows(seqs: list[Sequence], prev: list[Sequence], device: torch.device) -> torch.Tensor | None:
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
class Sampled:
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


def launch(seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, tp: TPGroup | None,
            readback: Readback) -> Sampled:
    """Start the tokens' and log-probs' way to the host (`Readback`); under TP every rank continues with
    rank tp.src's tokens (one broadcast)."""
    packed = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
    next_ids = tokens
    if tp is not None:
        dist.broadcast(packed, src=tp.src, group=tp.group)
        next_ids = packed[0].long()
    host, slot, writes, ready = readback.write(packed)
    return Sampled(seqs, next_ids, host, ready, [False] * len(seqs), readback, (slot, writes))


def reserve(sched: Scheduler, step: Sampled) -> None:
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


def resolve(sched: Scheduler, step: Sampled, finished: list[Sequence]) -> None:
    """Wait for a step's tokens, then `append` them."""
    append(sched, step, *step.wait(), finished)


def append(sched: Scheduler, step: Sampled, tokens: list[int], logprobs: list[float],
            finished: list[Sequence]) -> None:
    """Put each token in place of its sequence's PLACEHOLDER, with its log-prob; finish the sequences
    that emitted a stop token (or reached max_tokens in `reserve`)."""
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
