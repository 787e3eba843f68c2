"""The paged-KV block manager: a free list, reference counts and a prefix cache over the cache's blocks.

The n samples of one prompt are prefilled once, as one sequence, then forked: the children share
every block of the prompt, including the partial last one, which is copied on the first write
(copy-on-write), so a GRPO group pays prefill and KV memory for its prompt once.

Prefix caching: a full block is keyed by the chain hash of every token up to its end (`block_hash` of
the previous block's key and its own token ids), so one key names a whole prefix. `allocate` reuses
the longest run of cached blocks matching a sequence's leading full blocks, and the runner computes
only the tokens after them. A block is registered once the step that writes its KV is launched or
about to be: a prompt's full blocks at `allocate`, since any later user is scheduled after that
prefill and runs after it on the same stream (a user in the same prefill reads the keys back from
the cache after each layer's store); a decoded block when its sequence moves on to the next block
(`append`) or is freed. A freed block with a key stays cached in an LRU of evictable blocks, which
`_take` evicts from, oldest first, once the free list is empty. A cached block holds the KV of one
set of weights: a manager lives for one rollout (`reset_prefix_cache` drops every key sooner).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque

from hybridengine.rollout.sequence import PLACEHOLDER, Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block: a 128-bit BLAKE2b digest of the previous block's key (b"" for the first
    block) and this block's token ids. 128 bits keep a false hit, which would serve another prefix's
    KV, out of reach (a collision among 2^32 cached blocks has odds near 2^-64)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Free list + reference counts over `num_blocks` KV blocks of `block_size` tokens, and a prefix
    cache of full blocks (`enable_prefix_caching`; off: blocks return to the free list when freed).

    `num_cached_tokens_hit` counts the tokens `allocate` has served from cached blocks (cumulative).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager: num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.block_keys: list[bytes | None] = [None] * num_blocks
        """The key each cached block is registered under (None: not cached)."""
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks that no sequence holds, least recently freed first."""
        self.stale: set[int] = set()
        """Blocks held at the last `reset_prefix_cache`: a sequence whose first block is one of them (every
        sequence that held blocks then, and its forks) never registers a block."""
        self.num_cached_tokens_hit = 0

    def extend(self, num_blocks: int) -> None:
        """The cache grew: blocks [self.num_blocks, num_blocks) are free (no-op when not more)."""
        if num_blocks > self.num_blocks:
            added = num_blocks - self.num_blocks
            self.ref_counts += [0] * added
            self.block_keys += [None] * added
            self.free_ids.extend(range(self.num_blocks, num_blocks))
            self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        """Blocks `_take` can hand out: free ones and evictable cached ones."""
        return len(self.free_ids) + len(self.evictable)

    def _take(self) -> int:
        if not self.free_ids and self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys[block]]
            self.block_keys[block] = None
            self.free_ids.append(block)
        block = self.free_ids.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.stale.discard(block)
            if self.block_keys[block] is None:
                self.free_ids.append(block)
            else:
                self.evictable[block] = None

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of seq's first num_blocks full blocks, or of fewer when a block holds a token still on
        the device (PLACEHOLDER). Extends seq.block_hashes; a block seq holds that is registered carries
        seq's own key (it was registered by seq, by the sequence it forked from, or hit with seq's key)."""
        keys, bs, table = seq.block_hashes, self.block_size, seq.block_table
        while len(keys) < num_blocks:
            j = len(keys)
            key = self.block_keys[table[j]] if j < len(table) else None
            if key is None:
                ids = seq.token_ids[j * bs:(j + 1) * bs]
                if PLACEHOLDER in ids:
                    break
                key = block_hash(keys[-1] if keys else b"", ids)
            keys.append(key)
        return keys[:num_blocks]

    def _hits(self, seq: Sequence) -> list[int]:
        """The cached blocks of seq's longest cached prefix of full blocks, leaving at least its last token
        to compute (the prefill samples from that token's logits)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _register(self, seq: Sequence, index: int) -> None:
        """Cache block `index` of seq's table under its key: the block is full and the step that writes its
        last token's KV is launched. A key already cached by another block keeps that block."""
        if not self.enable_prefix_caching or not 0 <= index < len(seq.block_table) or seq.block_table[0] in self.stale:
            return
        keys = self._keys(seq, index + 1)
        block = seq.block_table[index]
        if len(keys) > index and self.block_keys[block] is None and keys[index] not in self.cached:
            self.block_keys[block] = keys[index]
            self.cached[keys[index]] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their KV no longer matches the weights, or a step that was to write
        them failed): evictable blocks become free, held ones stay held without a key, and the sequences
        holding them register nothing more (their later KV attends over the old)."""
        self.free_ids.extend(self.evictable)
        self.evictable.clear()
        for block in self.cached.values():
            self.block_keys[block] = None
        self.cached.clear()
        self.stale = {block for block, refs in enumerate(self.ref_counts) if refs}

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._hits(seq)
        idle_hits = sum(1 for block in hits if self.ref_counts[block] == 0)  # counted in num_free too
        return seq.blocks_needed(self.block_size) - len(hits) <= self.num_free - idle_hits

    def allocate(self, seq: Sequence) -> None:
        """Blocks for the whole context of a sequence about to be prefilled: its cached prefix's blocks
        (seq.num_cached_tokens tokens), then fresh ones; registers its full blocks."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._hits(seq)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        seq.block_table = hits + [self._take() for _ in range(seq.blocks_needed(self.block_size) - len(hits))]
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_cached_tokens_hit += seq.num_cached_tokens
        for index in range(len(hits), seq.num_tokens // self.block_size):
            self._register(seq, index)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first (so that a prefix's tail is evicted before its head). The last
        full block whose KV is written (every token's but the last's) is registered first: the block
        before a final token that opens a block was never passed by an `append`."""
        self._register(seq, (seq.num_tokens - 1) // self.block_size - 1)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def share(self, seq: Sequence, times: int) -> list[int]:
        """A copy of seq's block table whose blocks gain `times` more references (a fork)."""
        for block in seq.block_table:
            self.ref_counts[block] += times
        return list(seq.block_table)

    def append_needs_block(self, seq: Sequence) -> bool:
        """Writing the KV of the last token needs a fresh block (a new one, or a private copy)."""
        index = (seq.num_tokens - 1) // self.block_size
        return index == len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def num_append_blocks(self, seqs: list[Sequence]) -> int:
        """Fresh blocks that `append` takes for each of seqs in turn: one where the last token opens a block,
        one per private copy of a shared block, whose last holder among them writes it in place (when every
        holder is among them: k writers of a block with r holders copy min(k, r - 1) times)."""
        opened, writers = 0, Counter()
        for seq in seqs:
            index = (seq.num_tokens - 1) // self.block_size
            if index == len(seq.block_table):
                opened += 1
            elif self.ref_counts[seq.block_table[index]] > 1:
                writers[seq.block_table[index]] += 1
        return opened + sum(min(k, self.ref_counts[block] - 1) for block, k in writers.items())

    def can_append(self, seq: Sequence) -> bool:
        return not self.append_needs_block(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the last token's slot writable; returns a (src, dst) block copy for copy-on-write. A new
        block means the one before is full, its last KV written by the step before: it is registered."""
        if not self.append_needs_block(seq):
            return None
        index = (seq.num_tokens - 1) // self.block_size
        if index == len(seq.block_table):
            self._register(seq, index - 1)
            seq.block_table.append(self._take())
            return None
        shared = seq.block_table[index]
        seq.block_table[index] = self._take()
        self._release(shared)
        return shared, seq.block_table[index]
