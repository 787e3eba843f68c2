"""The continuous-batching scheduler (plain Python): which sequences the next model step runs.

Prefill first (whole prompts, up to a token budget of the tokens not already in the prefix cache),
else one decode step for every running sequence. When blocks run out during decode, the newest
running sequence is preempted: its blocks are freed and it goes back to the waiting queue, to be
recomputed (prompt + tokens so far) when it is prefilled again. Its sampling generator keeps its
state, so seeded outputs do not depend on preemption. A request kept across a weight update
re-enters the same way (`rollout.requests`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridengine.rollout.block_manager import BlockManager
from hybridengine.rollout.sequence import Sequence, Status


@dataclass(slots=True)
class Batch:
    """What one model step runs."""

    seqs: list[Sequence]
    is_prefill: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) blocks to copy before the step (copy-on-write of shared partial blocks)."""


class Scheduler:
    """Prefill first (whole prompts, up to a token budget), else one decode step for every running sequence."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 grow: Callable[[], int] | None = None, on_finish: Callable[[Sequence], None] | None = None):
        self.blocks = blocks
        self.on_finish = on_finish
        """Called with a sequence that finishes (stop or length), before its blocks are freed (the rollout's
        read of its routed experts)."""
        self.grow = grow
        """A cache that can grow while it runs (`KVCache.grow_to`): grow() waits for its growth and returns the
        blocks usable then, 0 once it never grows again. Called where a step would preempt, or a queue
        cannot start: the cache grows only when it is full."""
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
        nothing preempted: what async decode needs to schedule a step before the previous step's
        tokens reach the host."""
        if not self.running:
            return False
        if self.waiting:
            head = self.waiting[0]
            if len(self.running) + head.fork <= self.max_num_seqs and self.blocks.can_allocate(head):
                return False
        return self.blocks.num_append_blocks(self.running) <= self.blocks.num_free

    def _grow(self) -> bool:
        """Take the growth of the cache (see `grow`); True when blocks were added."""
        if self.grow is None:
            return False
        before = self.blocks.num_blocks
        self.blocks.extend(self.grow())
        added = self.blocks.num_blocks > before
        if not added:
            self.grow = None  # it has nothing more to give
        return added

    def schedule(self) -> Batch:
        prefill, tokens = [], 0
        seqs = len(self.running)  # a prompt awaiting its fork counts as its `fork` samples
        while self.waiting and seqs + self.waiting[0].fork <= self.max_num_seqs:
            seq = self.waiting[0]
            # The whole context bounds the admission: the cached part is known only once allocated.
            if prefill and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            if not self.blocks.can_allocate(seq):
                break
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            tokens += seq.num_tokens - seq.num_cached_tokens
            seqs += seq.fork
            prefill.append(self.waiting.popleft())
        if prefill:
            self.running.extend(prefill)
            return Batch(prefill, True)
        if not self.running:
            if self._grow():
                return self.schedule()  # the cache grew: admit again
            # Nothing runs and the head of the queue cannot get its blocks: it never will.
            seq = self.waiting[0]
            raise RuntimeError(f"request {seq.request}: {seq.blocks_needed(self.blocks.block_size)} KV blocks "
                               f"needed but only {self.blocks.num_free} of {self.blocks.num_blocks} are free")
        if self.grow is not None and self.blocks.num_append_blocks(self.running) > self.blocks.num_free:
            self._grow()  # before any sequence leaves `running`: a growth that raises leaves it whole
        decode, copies = [], []
        while self.running:
            seq = self.running.popleft()
            if not self.blocks.append_needs_block(seq):  # most steps: the token fits the last block
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
            child = Sequence(request=seq.request, token_ids=list(seq.token_ids),
                             num_prompt_tokens=seq.num_prompt_tokens, params=seq.params, sample=j,
                             block_table=self.blocks.share(seq, 1), status=Status.RUNNING)
            children.append(child)
        i = self.running.index(seq)
        for k, child in enumerate(children[1:], 1):
            self.running.insert(i + k, child)
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if self.on_finish is not None:
            self.on_finish(seq)
        self.blocks.free(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished sequence, running or waiting, and free its blocks now."""
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self.blocks.free(seq)
