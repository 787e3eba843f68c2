"""Prefix caching (BlockManager's cache of full KV blocks): the bookkeeping, and outputs equal to a run without it.

Block manager: hits across sequences that share whole blocks of a prefix, never a partial block or a block
whose earlier tokens differ, at least one token left to compute, LRU eviction (tail blocks first), reference
counts, the hit counter, decode blocks registered for the next turn, the blocks a decode step's appends take,
invariants over a scheduled random workload, and with caching off the bookkeeping of the manager before prefix
caching, step for step.

Engine (tiny-qwen2, fp32, CPU): prompts that share prefixes, repeat, or extend another prompt's completion (the
next turn) give the tokens and log-probs of a run without caching (greedy: tokens equal, log-probs within fp32
GEMM rounding; exact_logprobs: bitwise, and equal to the trainer's); so does a cache small enough to evict.
"""

from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace

import pytest
import torch

import hybridengine as he
from hybridengine.rollout.block_manager import BlockManager, block_hash
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.scheduler import Scheduler
from hybridengine.rollout.sequence import PLACEHOLDER, Sequence


def seq_of(tokens, **kw) -> Sequence:
    return Sequence(request=0, token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams(), **kw)


# --------------------------------------------------------------------------------------------------
# the block manager


def test_hits_cover_whole_blocks_of_a_shared_prefix():
    bm = BlockManager(16, 4)
    a = seq_of(range(10))                                   # blocks [0..3] [4..7] [8, 9]
    bm.allocate(a)
    assert a.num_cached_tokens == 0 and bm.num_cached_tokens_hit == 0
    b = seq_of([*range(8), 100, 101, 102])                  # shares a's two full blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == 8 and bm.ref_counts[a.block_table[0]] == 2
    c = seq_of(range(8))                                    # a's blocks exactly: the last token is computed
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] not in a.block_table and bm.block_keys[c.block_table[1]] is None  # a's key stays a's
    assert bm.num_cached_tokens_hit == 12
    d = seq_of(range(6))                                    # a partial second block: only the first is reused
    bm.allocate(d)
    assert d.num_cached_tokens == 4 and d.block_table[1] not in a.block_table + b.block_table
    e = seq_of([99, *range(1, 10)])                         # first block differs: the second's tokens alone
    bm.allocate(e)                                          # do not make a hit (the key is the whole prefix)
    assert e.num_cached_tokens == 0 and not set(e.block_table) & set(a.block_table)
    assert bm.num_cached_tokens_hit == 16


def test_keys_are_chain_hashes_of_whole_prefixes():
    bm = BlockManager(8, 2)
    a = seq_of([5, 6, 7, 8, 9])
    bm.allocate(a)
    first = block_hash(b"", [5, 6])
    assert a.block_hashes == [first, block_hash(first, [7, 8])]
    assert bm.cached == {first: a.block_table[0], a.block_hashes[1]: a.block_table[1]}
    assert block_hash(b"", [7, 8]) != a.block_hashes[1]


def test_partial_blocks_are_never_cached():
    bm = BlockManager(8, 4)
    a = seq_of(range(6))
    bm.allocate(a)
    full, partial = a.block_table
    assert bm.block_keys[partial] is None and bm.cached == {a.block_hashes[0]: full}
    bm.free(a)
    assert list(bm.evictable) == [full] and partial in bm.free_ids and bm.num_free == 8
    b = seq_of(range(7))
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_refcounts_free_list_and_evictable_blocks():
    bm = BlockManager(6, 4)
    a, b = seq_of(range(9)), seq_of([*range(8), 50])
    bm.allocate(a)
    bm.allocate(b)
    shared = a.block_table[:2]
    assert [bm.ref_counts[x] for x in shared] == [2, 2] and bm.num_free == 2
    bm.free(a)
    assert [bm.ref_counts[x] for x in shared] == [1, 1] and not bm.evictable  # b still holds them
    assert bm.num_free == 3
    bm.free(b)
    assert bm.ref_counts == [0] * 6 and list(bm.evictable) == shared[::-1] and bm.num_free == 6
    c = seq_of([*range(8), 60, 61])  # hits take the blocks back out of the LRU
    bm.allocate(c)
    assert c.block_table[:2] == shared and not bm.evictable and [bm.ref_counts[x] for x in shared] == [1, 1]


def test_lru_eviction_order_under_pressure():
    bm = BlockManager(4, 2)
    a, b, c = seq_of([1, 2, 3]), seq_of([4, 5, 6]), seq_of([7, 8, 9])
    for s in (a, b, c):
        bm.allocate(s)
        bm.free(s)
    keyed = {name: s.block_hashes[0] for name, s in zip("abc", (a, b, c))}
    assert [bm.block_keys[x] for x in bm.evictable] == [keyed["a"], keyed["b"], keyed["c"]]
    again = seq_of([1, 2, 10])  # a's block is used again: now the most recently freed
    bm.allocate(again)
    bm.free(again)
    assert [bm.block_keys[x] for x in bm.evictable] == [keyed["b"], keyed["c"], keyed["a"]]
    big = seq_of(range(20, 27))  # 4 blocks: the free one, then b's and c's, then a's
    assert bm.can_allocate(big)
    b_block, c_block = bm.cached[keyed["b"]], bm.cached[keyed["c"]]
    bm.allocate(big)
    assert keyed["b"] not in bm.cached and keyed["c"] not in bm.cached and keyed["a"] not in bm.cached
    assert {b_block, c_block} <= set(big.block_table)
    bm.free(big)
    for tokens in ([4, 5, 6], [7, 8, 9], [1, 2, 3]):  # evicted: recomputed, not reused
        s = seq_of(tokens)
        bm.allocate(s)
        assert s.num_cached_tokens == 0
        bm.free(s)


def test_eviction_takes_a_prefix_tail_before_its_head():
    bm = BlockManager(5, 2)
    a = seq_of(range(7))        # 3 full blocks and a partial one
    bm.allocate(a)
    head, middle, tail = a.block_table[:3]
    bm.free(a)
    assert list(bm.evictable) == [tail, middle, head]
    other = seq_of(range(50, 56))
    bm.allocate(other)  # the free block, then the tail: the head and middle stay cached
    assert a.block_hashes[2] not in bm.cached and bm.cached[a.block_hashes[0]] == head
    bm.free(other)
    b = seq_of(range(7))
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_can_allocate_counts_hits():
    bm = BlockManager(4, 4)
    a = seq_of(range(9))
    bm.allocate(a)
    bm.free(a)                                                  # blocks 0, 1 cached and evictable; 2, 3 free
    assert bm.can_allocate(seq_of([*range(8), *[7] * 8]))       # 4 blocks, 2 of them the evictable hits
    assert not bm.can_allocate(seq_of(range(20, 37)))           # 5 blocks
    held = seq_of([*range(8), 7, 7, 7, 7])
    bm.allocate(held)                                           # holds the hits and one more block: 1 left
    assert bm.num_free == 1
    assert bm.can_allocate(seq_of([*range(8), 9]))              # 3 blocks: 2 held hits + the one left
    assert not bm.can_allocate(seq_of([*range(8), *[9] * 5]))   # 4 blocks: 2 held hits + 2 > 1


def test_decoded_blocks_serve_the_next_turn():
    bm = BlockManager(16, 4)
    turn = seq_of(range(6))
    bm.allocate(turn)
    for t in range(6, 12):  # decode: the block of tokens 4..7 is registered when token 8 opens the next one
        turn.token_ids.append(t)
        bm.append(turn)
    assert len(bm.cached) == 2 and bm.block_keys[turn.block_table[1]] == turn.block_hashes[1]
    turn.token_ids.append(12)  # the final token, sampled and never fed: it opens a block no append passed,
    bm.free(turn)              # so [8..11], whose KV is written, is registered when the sequence is freed
    assert len(bm.cached) == 3
    nxt = seq_of([*range(13), 90, 91])  # the next turn: the conversation so far, then an observation
    bm.allocate(nxt)
    assert nxt.num_cached_tokens == 12 and bm.num_cached_tokens_hit == 12


def test_blocks_with_a_token_still_on_the_device_are_not_registered():
    bm = BlockManager(8, 2)
    s = seq_of([1, 2, 3])
    bm.allocate(s)
    s.token_ids.append(PLACEHOLDER)  # an async decode step's reserved token
    bm.append(s)
    s.token_ids.append(PLACEHOLDER)
    bm.append(s)                     # block [3, PLACEHOLDER] is full but its ids are not known yet
    assert len(bm.cached) == 1 and len(s.block_hashes) == 1
    s.token_ids[3:] = [4, 5]         # the ids reach the host
    for t in (6, 7):
        s.token_ids.append(t)
        bm.append(s)
    assert len(bm.cached) == 2 and bm.block_keys[s.block_table[2]] == block_hash(block_hash(s.block_hashes[0], [3, 4]),
                                                                                [5, 6])


def test_forked_samples_register_their_own_blocks():
    bm = BlockManager(16, 4)
    parent = seq_of(range(6))
    bm.allocate(parent)
    child = seq_of(range(6), block_table=bm.share(parent, 1))
    shared = parent.block_table[1]
    for s, tokens in ((parent, [6, 7, 8]), (child, [16, 17, 18])):
        for t in tokens:
            s.token_ids.append(t)
            bm.append(s)
    assert parent.block_table[1] != shared and child.block_table[1] == shared  # copy-on-write, then in place
    assert bm.block_keys[parent.block_table[1]] is not None and bm.block_keys[child.block_table[1]] is not None
    assert child.block_hashes[0] == parent.block_hashes[0]
    for tokens in ([*range(8), 50], [*range(6), 16, 17, 50]):
        s = seq_of(tokens)
        bm.allocate(s)
        assert s.num_cached_tokens == 8


def test_num_append_blocks_counts_what_the_appends_take():
    """Siblings sharing a partial block: all but its last holder copy it (the scheduler's decode prediction)."""
    bm = BlockManager(32, 4)
    parents = [seq_of(range(n)) for n in (5, 8, 3)]
    family = []
    for p, n in zip(parents, (3, 2, 1)):
        bm.allocate(p)
        family += [p] + [seq_of(p.token_ids, block_table=bm.share(p, 1)) for _ in range(n - 1)]
    for s in family:
        s.token_ids.append(0)
    # 5 tokens: 3 holders of block 1 -> 2 copies; 8 tokens: 2 holders open block 2 each; 3 tokens: written in place
    for seqs, want in ((family[:2], 2), (family[3:5], 2), (family[5:], 0), (family, 2 + 2)):
        assert bm.num_append_blocks(seqs) == want
    free = bm.num_free
    for s in family:
        bm.append(s)
    assert free - bm.num_free == 4


def test_reset_prefix_cache_forgets_every_block():
    bm = BlockManager(8, 2)
    a, b = seq_of(range(5)), seq_of(range(10, 15))
    bm.allocate(a)
    bm.allocate(b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.cached and not bm.evictable and bm.block_keys == [None] * 8 and bm.num_free == 5
    for t in (15, 16, 17):  # b's KV after the reset attends over its KV from before: never cached
        b.token_ids.append(t)
        bm.append(b)
    bm.free(b)
    assert bm.num_free == 8 and not bm.evictable and not bm.cached and not bm.stale
    for tokens in (range(5), range(10, 18)):
        c = seq_of(tokens)
        bm.allocate(c)
        assert c.num_cached_tokens == 0
        bm.free(c)
    c = seq_of(range(5))
    bm.allocate(c)
    assert c.num_cached_tokens == 4  # blocks registered after the reset are cached as before


class PreviousBlockManager:
    """The block manager before prefix caching (free list and reference counts), for the disabled mode."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids = deque(range(num_blocks))

    @property
    def num_free(self):
        return len(self.free_ids)

    def _take(self):
        block = self.free_ids.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block):
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids.append(block)

    def can_allocate(self, seq):
        return seq.blocks_needed(self.block_size) <= self.num_free

    def allocate(self, seq):
        seq.block_table = [self._take() for _ in range(seq.blocks_needed(self.block_size))]

    def free(self, seq):
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def share(self, seq, times):
        for block in seq.block_table:
            self.ref_counts[block] += times
        return list(seq.block_table)

    def append_needs_block(self, seq):
        index = (seq.num_tokens - 1) // self.block_size
        return index == len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def can_append(self, seq):
        return not self.append_needs_block(seq) or self.num_free > 0

    def append(self, seq):
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


def run_workload(blocks, *, seed, steps_seen=None):
    """A scheduled random workload over `blocks`: prompts that share prefixes (a common head, repeats, a
    prompt extending another), forks, random completions and finishes, preemption under a small cache.
    Calls steps_seen(sched, batch) after every schedule(); returns the batches' (prefill, block tables)."""
    rng = random.Random(seed)
    sched = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=48)
    head = [rng.randrange(50) for _ in range(9)]
    prompts = []
    for i in range(12):
        kind = rng.choice(["head", "repeat", "fresh"]) if prompts else "head"
        prompt = {"head": head[:rng.randrange(3, 10)] + [rng.randrange(50) for _ in range(rng.randrange(1, 6))],
                  "repeat": list(rng.choice(prompts)) if prompts else head,
                  "fresh": [rng.randrange(50) for _ in range(rng.randrange(1, 12))]}[kind]
        prompts.append(prompt)
        sched.add(Sequence(request=i, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=SamplingParams(),
                           fork=rng.choice([1, 1, 2, 3])))
    history = []
    while not sched.done and len(history) < 400:
        batch = sched.schedule()
        if steps_seen is not None:
            steps_seen(sched, batch)
        history.append((batch.is_prefill, [list(s.block_table) for s in batch.seqs]))
        seqs = batch.seqs
        if batch.is_prefill:
            seqs = [c for s in batch.seqs for c in (sched.fork(s) if s.fork > 1 else [s])]
        for seq in seqs:
            seq.token_ids.append(rng.randrange(50))
            if seq.num_tokens >= 30 or rng.random() < 0.05:
                sched.finish(seq, "length")
    assert sched.done
    return history


def test_disabled_caching_keeps_the_previous_bookkeeping():
    for blocks, seed in ((40, 0), (12, 1), (9, 2)):
        off = BlockManager(blocks, 4, enable_prefix_caching=False)
        assert run_workload(off, seed=seed) == run_workload(PreviousBlockManager(blocks, 4), seed=seed)
        assert off.num_cached_tokens_hit == 0 and not off.cached and not off.evictable


def check_invariants(sched, batch):
    """Reference counts are the running tables' references; a free block is in exactly one of the free list and
    the LRU; the LRU holds exactly the cached blocks nobody holds; a held cached block carries its holder's key."""
    bm = sched.blocks
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        for block in seq.block_table:
            refs[block] += 1
    assert refs == bm.ref_counts
    idle = [b for b in range(bm.num_blocks) if refs[b] == 0]
    assert sorted([*bm.free_ids, *bm.evictable]) == idle
    assert all(bm.block_keys[b] is None for b in bm.free_ids)
    assert all(bm.block_keys[b] is not None for b in bm.evictable)
    assert {key: block for block, key in enumerate(bm.block_keys) if key is not None} == bm.cached
    for seq in sched.running:
        key = b""
        for j, block in enumerate(seq.block_table[:seq.num_tokens // bm.block_size]):
            key = block_hash(key, seq.token_ids[j * bm.block_size:(j + 1) * bm.block_size])
            assert bm.block_keys[block] in (None, key)
        if batch.is_prefill and seq in batch.seqs:
            assert seq.num_cached_tokens % bm.block_size == 0 and seq.num_cached_tokens < seq.num_tokens


def test_scheduled_workload_keeps_the_invariants_and_hits():
    for blocks, seed in ((40, 0), (12, 1), (9, 2)):
        bm = BlockManager(blocks, 4)
        run_workload(bm, seed=seed, steps_seen=check_invariants)
        assert bm.num_cached_tokens_hit > 0


# --------------------------------------------------------------------------------------------------
# the engine


@pytest.fixture
def managers(monkeypatch):
    """Every BlockManager the test builds, with prefix caching set by `managers.enable`, and a count of
    evictions."""
    state = SimpleNamespace(enable=True, built=[], evictions=0)
    init, take = BlockManager.__init__, BlockManager._take

    def patched_init(self, num_blocks, block_size, enable_prefix_caching=True):
        init(self, num_blocks, block_size, state.enable)
        state.built.append(self)

    def counted_take(self):
        state.evictions += not self.free_ids and bool(self.evictable)
        return take(self)

    monkeypatch.setattr(BlockManager, "__init__", patched_init)
    monkeypatch.setattr(BlockManager, "_take", counted_take)
    return state


def engine_for(*, caching, exact=False, num_kv_blocks=None, max_num_seqs=8):
    torch.manual_seed(0)
    cfg = he.EngineConfig(dtype=torch.float32, device="cpu", block_size=4, max_model_len=64,
                          num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          exact_logprobs=exact, tuning=he.EngineTuning(sampler="torch"),
                          enable_prefix_caching=caching)
    return he.HybridEngine(he.model_config("tiny-qwen2"), cfg)


def run(managers, prompts, params, *, caching, **kw):
    """[(token ids, log-probs)] of every sample, and the prefix-cache hits of the run."""
    managers.enable, managers.built = caching, []
    engine = engine_for(caching=caching, **kw)
    with engine.rollout():
        outs = engine.generate(prompts, params)
    hits = sum(bm.num_cached_tokens_hit for bm in managers.built)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs], hits, engine


def tokens(g, n, vocab=128):
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def assert_same_samples(got, want, *, bitwise):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp), (_, ref) in zip(got, want):
        if bitwise:
            assert torch.equal(torch.tensor(lp), torch.tensor(ref))
        else:
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), rtol=0, atol=1e-5)


@pytest.mark.parametrize("exact", [False, True])
def test_shared_prefixes_give_the_outputs_without_caching(managers, exact):
    """One prefill step: the prompts after the first read its blocks back from the cache in the step that
    writes them."""
    g = torch.Generator().manual_seed(3)
    head = tokens(g, 14)
    first = head + tokens(g, 3)
    # a shared head (3 blocks), a repeat (4 blocks: the 17th token is computed), a prefix of 2 blocks, a stranger
    prompts = [first, head + tokens(g, 6), list(first), head[:9], tokens(g, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=8)] * 4 + [SamplingParams(n=2, temperature=0.0, max_tokens=8)]
    want, none, _ = run(managers, prompts, params, caching=False, exact=exact)
    got, hits, _ = run(managers, prompts, params, caching=True, exact=exact)
    assert none == 0 and hits == 12 + 16 + 8
    assert_same_samples(got, want, bitwise=exact)


def next_turn(managers, *, exact):
    """Turn 1, then turn 2 (turn 1's prompt and greedy completion, then an observation) and a prompt sharing
    turn 1's head, in one generate call: n = 2 = max_num_seqs, so each is prefilled after the one before has
    decoded and freed its blocks. Returns (prompts, samples with caching, samples without, hits, engine)."""
    g = torch.Generator().manual_seed(4)
    prompt = tokens(g, 13)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    (first, _), = run(managers, [prompt], greedy, caching=False, exact=exact)[0]
    prompts = [prompt, prompt + first + tokens(g, 3), prompt[:10] + tokens(g, 4)]
    later = (SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=11) if exact
             else SamplingParams(n=2, temperature=0.0, max_tokens=6))
    params = [greedy, later, later]
    want, _, _ = run(managers, prompts, params, caching=False, exact=exact, max_num_seqs=2)
    got, hits, engine = run(managers, prompts, params, caching=True, exact=exact, max_num_seqs=2)
    assert got[0][0] == first
    # turn 1 wrote the KV of its 13 + 10 tokens but the last: 5 full blocks; the third prompt shares 2
    assert hits == 20 + 8
    return prompts, got, want, engine


def test_next_turn_reuses_the_previous_turns_blocks(managers):
    _, got, want, _ = next_turn(managers, exact=False)
    assert_same_samples(got, want, bitwise=False)


def test_exact_mode_stays_bitwise_with_cached_prefixes(managers):
    prompts, got, want, engine = next_turn(managers, exact=True)
    assert_same_samples(got, want, bitwise=True)
    seqs = [(p, t, lp) for p, (t, lp) in zip([p for p in prompts[1:] for _ in range(2)], got[1:])]
    batch = he.PPOBatch(input_ids=[torch.tensor(p + t) for p, t, _ in seqs])
    trained = engine.trainer.log_probs(batch, temperature=0.8)
    for b, (p, t, lp) in enumerate(seqs):  # the trainer's bits, as without caching
        assert torch.equal(trained[b, len(p) - 1:len(p) - 1 + len(t)].cpu(), torch.tensor(lp, dtype=torch.float32))


def test_a_tiny_cache_evicts_and_stays_correct(managers):
    g = torch.Generator().manual_seed(5)
    head = tokens(g, 12)
    prompts = [head + tokens(g, k) for k in (1, 5, 2, 7, 3)] + [tokens(g, 9), head + tokens(g, 4)]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    want, _, _ = run(managers, prompts, params, caching=False)
    got, hits, _ = run(managers, prompts, params, caching=True, num_kv_blocks=16)
    assert hits > 0 and managers.evictions > 0
    assert_same_samples(got, want, bitwise=False)
