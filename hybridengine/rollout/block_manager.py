"""The paged-KV block manager: a free list and reference counts over the cache's blocks.

The n samples of one prompt are prefilled once, as one sequence, then forked: the children share
every block of the prompt, including the partial last one, which is copied on the first write
(copy-on-write), so a GRPO group pays prefill and KV memory for its prompt once.
"""

from __future__ import annotations

from collections import deque

from hybridengine.rollout.sequence import Sequence


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

    def append_needs_block(self, seq: Sequence) -> bool:
        """Writing the KV of the last token needs a fresh block (a new one, or a private copy)."""
        index = (seq.num_tokens - 1) // self.block_size
        return index == len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def can_append(self, seq: Sequence) -> bool:
        return not self.append_needs_block(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the last token's slot writable; returns a (src, dst) block copy for copy-on-write."""
        if not self.append_needs_block(seq):
            return None
        index = (seq.num_tokens - 1) // self.block_size
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        shared = seq.block_table[index]
        seq.block_table[index] = self._take()
        self._release(shared)
        return shared, seq.block_table[index]
