"""Sequences, the paged-KV block manager and the continuous-batching scheduler (plain Python).

Blocks are reference counted. The n samples of one prompt are prefilled once, as one sequence,
then forked: the children share every block of the prompt, including the partial last one, which
is copied on the first write (copy-on-write), so a GRPO group pays prefill and KV memory for its
prompt once. When blocks run out during decode, the newest running sequence is preempted: its
blocks are freed and it goes back to the waiting queue, to be recomputed (prompt + tokens so far)
by a later prefill. Its sampling generator keeps its state, so seeded outputs do not depend on
preemption.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from hybridengine.rollout.sampler import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()

PLACEHOLDER = -1
"""A sequence's last token id while the step that sampled it has not reached the host (async decode)."""


@dataclass(slots=True, eq=False)
class Sequence:
    """One prompt or one sample: its tokens, its block table, and where it is."""

    request: int
    """Index of the request (prompt) in the generate() call."""
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    sample: int = 0
    """Which of the request's n samples; a prompt awaiting its fork has `fork` > 1."""
    fork: int = 1
    """> 1 for a request's prompt sequence until its prefill: then it becomes `fork` samples."""
    generator: torch.Generator | None = None
    draws: int = 0
    """Tokens drawn for this sequence by the fused sampler (the Philox counter of a seeded sample)."""
    seq_id: int = field(default_factory=lambda: next(_ids))
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        return -(-(self.num_tokens if num_tokens is None else num_tokens) // block_size)


class BlockManager:
    """Free list + reference counts over `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager: num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def _take(self) -> int:
        block = self.free_ids.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids.append(block)

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.blocks_needed(self.block_size) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for the whole context of a sequence about to be prefilled."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        seq.block_table = [self._take() for _ in range(seq.blocks_needed(self.block_size))]

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def share(self, seq: Sequence, times: int) -> list[int]:
        """A copy of seq's block table whose blocks gain `times` more references (a fork)."""
        for block in seq.block_table:
            self.ref_counts[block] += times
        return list(seq.block_table)

    def _append_needs_block(self, seq: Sequence) -> bool:
        """Writing the KV of the last token needs a fresh block (a new one, or a private copy)."""
        index = (seq.num_tokens - 1) // self.block_size
        return index == len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def can_append(self, seq: Sequence) -> bool:
        return not self._append_needs_block(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the last token's slot writable; returns a (src, dst) block copy for copy-on-write."""
        if not self._append_needs_block(seq):
            return None
        index = (seq.num_tokens - 1) // self.block_size
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        shared = seq.block_table[index]
        seq.block_table[index] = self._take()
        self._release(shared)
        return shared, seq.block_table[index]


@dataclass(slots=True)
class Batch:
    """What one model step runs."""

    seqs: list[Sequence]
    is_prefill: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) blocks to copy before the step (copy-on-write of shared partial blocks)."""


class Scheduler:
    """Prefill first (whole prompts, up to a token budget), else one decode step for every running sequence."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.fork > self.max_num_seqs:
            raise ValueError(f"request {seq.request}: {seq.fork} samples exceed max_num_seqs={self.max_num_seqs} "
                             "(a prompt's samples decode in one batch)")
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def decodes_next(self) -> bool:
        """The next `schedule()` is a decode of every running sequence, with no prompt admitted and
        nothing preempted: what the engine's async decode needs to schedule a step before the
        previous step's tokens reach the host."""
        if not self.running:
            return False
        if self.waiting:
            head = self.waiting[0]
            if len(self.running) + head.fork <= self.max_num_seqs and self.blocks.can_allocate(head):
                return False
        need = sum(1 for seq in self.running if self.blocks._append_needs_block(seq))
        return need <= self.blocks.num_free

    def schedule(self) -> Batch:
        prefill, tokens = [], 0
        seqs = len(self.running)  # a prompt awaiting its fork counts as its `fork` samples
        while self.waiting and seqs + self.waiting[0].fork <= self.max_num_seqs:
            seq = self.waiting[0]
            if prefill and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            if not self.blocks.can_allocate(seq):
                break
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            tokens += seq.num_tokens
            seqs += seq.fork
            prefill.append(self.waiting.popleft())
        if prefill:
            self.running.extend(prefill)
            return Batch(prefill, True)
        if not self.running:
            # Nothing runs and the head of the queue cannot get its blocks: it never will.
            seq = self.waiting[0]
            raise RuntimeError(f"request {seq.request}: {seq.blocks_needed(self.blocks.block_size)} KV blocks "
                               f"needed but only {self.blocks.num_free} of {self.blocks.num_blocks} are free")
        decode, copies = [], []
        while self.running:
            seq = self.running.popleft()
            if not self.blocks._append_needs_block(seq):  # most steps: the token fits the last block
                decode.append(seq)
                continue
            while not self.blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    seq = None
                    break
            if seq is None:
                break
            copy = self.blocks.append(seq)
            if copy is not None:
                copies.append(copy)
            decode.append(seq)
        self.running.extend(decode)
        if not decode:
            return self.schedule()  # everything was preempted: prefill again
        return Batch(decode, False, copies)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Turn a prefilled prompt sequence into its `fork` samples, sharing all its blocks."""
        n, seq.fork = seq.fork, 1
        children = [seq]
        for j in range(1, n):
            child = Sequence(request=seq.request, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                             params=seq.params, sample=j, block_table=self.blocks.share(seq, 1), status=Status.RUNNING)
            children.append(child)
        i = self.running.index(seq)
        for k, child in enumerate(children[1:], 1):
            self.running.insert(i + k, child)
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.free(seq)
        self.running.remove(seq)
