"""A KV cache that grows while the rollout runs (offload 'rollout': into the optimizer state's memory once
its copy to host memory is done): the cache, the block manager, the scheduler's waiting, the engine.

Off CUDA the cache holds its whole capacity from the start and growth is bookkeeping; the engine's growth
path is forced there (`OffloadPolicy.cache_grows`) to run the same logic as on CUDA, where the cache is a VMM
range whose planes are mapped as it grows (the GPU tests at the end).
"""

from __future__ import annotations

import pytest
import torch

import hybridengine as he
from hybridengine.model.config import ModelConfig
from hybridengine.rollout.block_manager import BlockManager
from hybridengine.rollout.kv_cache import KVCache, growing_kv_blocks
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.scheduler import Scheduler
from hybridengine.rollout.sequence import Sequence
from hybridengine.train.offload_policy import OffloadPolicy

SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def test_cache_grows_up_to_its_capacity_and_keeps_its_blocks():
    kv = KVCache(num_blocks=2, capacity=6, dtype=torch.float32, device=torch.device("cpu"), **SHAPE)
    per_block = KVCache.bytes_per_block(dtype=torch.float32, **SHAPE)
    assert (kv.num_blocks, kv.capacity, kv.nbytes(), kv.capacity_bytes()) == (2, 6, 2 * per_block, 6 * per_block)
    kv.data[:, :, :2] = torch.randn(kv.data[:, :, :2].shape)
    before = kv.data[:, :, :2].clone()
    assert kv.grow_to(5) == 5 and kv.nbytes() == 5 * per_block
    assert torch.equal(kv.data[:, :, :2], before)  # growth moves nothing
    assert kv.grow_to(3) == 5  # never shrinks
    assert kv.grow_to(100) == 6  # at most the capacity
    k, v = kv.layers[1]
    assert k.shape == (6, 4, 2, 8) and k.data_ptr() == kv.data[1, 0].data_ptr()
    kv.release()  # no-op without VMM
    with pytest.raises(ValueError, match=r"need 0 <= num_blocks \(7\) <= capacity \(6\)"):
        KVCache(num_blocks=7, capacity=6, dtype=torch.float32, device=torch.device("cpu"), **SHAPE)


def test_growing_sizes_count_the_freed_memory_and_cap_at_what_sequences_hold():
    config = he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64, max_num_seqs=4, block_size=4)
    model = ModelConfig.from_hf(he.model_config("tiny-qwen2"))
    per_block = KVCache.bytes_per_block(dtype=torch.float32, num_layers=model.num_hidden_layers, block_size=4,
                                        num_kv_heads=model.num_key_value_heads, head_dim=model.head_dim)
    cpu = torch.device("cpu")
    assert growing_kv_blocks(config, model, cpu, budget=20 * per_block, freed_bytes=10 * per_block + 7) == (20, 30, 1)
    # capacity: at most max_num_seqs sequences of max_model_len (4 x 16 blocks)
    assert growing_kv_blocks(config, model, cpu, budget=20 * per_block, freed_bytes=10**3 * per_block) == (20, 64, 1)
    # nothing free now: one growth step is mapped anyway, the rest waits for the freed memory
    assert growing_kv_blocks(config, model, cpu, budget=-5, freed_bytes=40 * per_block) == (1, 40, 1)
    with pytest.raises(RuntimeError, match="does not hold one sequence of max_model_len=64"):
        growing_kv_blocks(config, model, cpu, budget=5 * per_block, freed_bytes=5 * per_block)


def test_block_manager_extends_its_free_list():
    bm = BlockManager(2, 4)
    seq = Sequence(request=0, token_ids=list(range(8)), num_prompt_tokens=8, params=SamplingParams())
    bm.allocate(seq)
    assert bm.num_free == 0 and seq.block_table == [0, 1]
    bm.extend(5)
    bm.extend(3)  # not more: no-op
    assert bm.num_blocks == 5 and bm.num_free == 3 and list(bm.free_ids) == [2, 3, 4]
    other = Sequence(request=1, token_ids=list(range(50, 59)), num_prompt_tokens=9, params=SamplingParams())
    assert bm.can_allocate(other)
    bm.allocate(other)
    assert other.block_table == [2, 3, 4] and bm.ref_counts == [1] * 5 and bm.num_free == 0


def run(sched, steps=400, length=20):
    """Decode every scheduled sequence by one token until each has `length` tokens; returns the batches."""
    batches = []
    while not sched.done and len(batches) < steps:
        batch = sched.schedule()
        batches.append(batch)
        seqs = ([c for s in batch.seqs for c in (sched.fork(s) if s.fork > 1 else [s])] if batch.is_prefill
                else batch.seqs)
        for seq in seqs:
            seq.token_ids.append(1)
            if seq.num_tokens >= length:
                sched.finish(seq, "length")
    assert sched.done
    return batches


class Growth:
    """A grow callback: grows once to `to` blocks (counting the calls)."""

    def __init__(self, to: int):
        self.to, self.calls, self.grown = to, 0, False

    def __call__(self) -> int:
        self.calls += 1
        if self.grown:
            return 0
        self.grown = True
        return self.to


def sequences(sched, lengths=(5, 9, 2, 7)):
    for i, n in enumerate(lengths):
        sched.add(Sequence(request=i, token_ids=list(range(n)), num_prompt_tokens=n, params=SamplingParams(), fork=2))


def test_scheduler_waits_for_the_cache_to_grow_instead_of_preempting():
    """A cache of 2 blocks that can grow to 40: the scheduler admits what fits, then waits for the growth
    where it would preempt (or where nothing can start); no preemption, the same work done as with 40
    blocks from the start."""
    grow = Growth(40)
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=8, max_num_batched_tokens=64, grow=grow)
    sequences(sched)
    batches = run(sched)
    # one call, at the first step that would have preempted: the cache grows only when full
    assert grow.calls == 1 and sched.num_preemptions == 0 and sched.blocks.num_blocks == 40
    ref = Scheduler(BlockManager(40, 4), max_num_seqs=8, max_num_batched_tokens=64)
    sequences(ref)
    assert sum(len(b.seqs) for b in batches) >= sum(len(b.seqs) for b in run(ref))
    # without growth, the same 2 blocks cannot even start the longest prompt: it never will
    small = Scheduler(BlockManager(2, 4), max_num_seqs=8, max_num_batched_tokens=64)
    sequences(small)
    with pytest.raises(RuntimeError, match="KV blocks needed but only"):
        run(small)


def test_a_growth_that_adds_nothing_is_not_waited_for_again():
    """A growth that cannot add blocks ends the growth: the scheduler preempts as without it."""
    calls = []

    def grow():
        calls.append(1)
        return 6

    sched = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=64, grow=grow)
    sequences(sched, (5, 5, 5))
    run(sched, length=12)
    assert len(calls) == 1 and sched.grow is None and sched.num_preemptions > 0


# -- the engine (offload 'rollout'; the growth path forced off CUDA) -----------------------------------

CFG = he.PPOConfig(lr=1e-3, micro_batch_tokens=64)


def engine(mode, **kwargs):
    return he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
        dtype=torch.float32, device="cpu", max_model_len=64, max_num_seqs=8, block_size=4, offload=mode, **kwargs))


def ppo_batch(step):
    g = torch.Generator().manual_seed(step)
    lengths = [9, 14, 6]
    return he.PPOBatch(input_ids=[torch.randint(0, 128, (n,), generator=g) for n in lengths],
                       response_mask=[torch.ones(n - 1) for n in lengths],
                       old_logprobs=[torch.randn(n - 1, generator=g) - 4 for n in lengths],
                       advantages=[torch.randn(n - 1, generator=g) for n in lengths])


@pytest.fixture
def growing(monkeypatch):
    monkeypatch.setattr(OffloadPolicy, "cache_grows",
                        lambda self: self.config.offload == "rollout" and self.has_state())


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]


def rollout_and_step(e, step, params):
    with e.rollout():
        out = e.generate(PROMPTS, params)
        report = e.memory_report()
        stats = dict(e.stats)
    b = ppo_batch(step)
    logp = e.log_probs(b)
    e.ppo_step(b, CFG)
    return [(s.token_ids, s.logprobs) for o in out for s in o.outputs], logp, report, stats


def test_engine_cache_grows_into_the_offloaded_state_and_equals_a_whole_cache(growing):
    """offload 'rollout' with a growing cache of 3 blocks now plus the state's memory: the same tokens,
    log-probs, training log-probs and weights as offload 'none' with a cache that holds everything, no
    preemption (the scheduler waits for the growth where it would preempt); the cache grew past its entry
    size, the state left the device, and the stats say so."""
    # exact_logprobs: the batches differ while the cache is small, and the exact mode's log-probs do not
    # depend on the batch
    ref, e = engine("none", exact_logprobs=True), engine("rollout", num_kv_blocks=3, exact_logprobs=True)
    for x in (ref, e):
        x.ppo_step(ppo_batch(0), CFG)  # the state exists: its memory is what the cache grows into
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3)
    for step in (1, 2):
        got, want = rollout_and_step(e, step, params), rollout_and_step(ref, step, params)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
        stats = got[3]
        assert stats["kv_blocks_at_entry"] == 3 < stats["kv_blocks"] and stats["preemptions"] == 0
        assert stats["kv_grow_s"] >= 0 and "offload_copy_out_s" not in stats  # device copy times: CUDA only
        assert got[2]["kv_cache_capacity"] == pytest.approx(stats["kv_cache_GiB"])
        assert got[2]["host_optimizer"] > 0 and got[2]["optimizer"] == 0  # grown: the state has left
        assert e.stats["rollout_kv_blocks"] == e.stats["kv_blocks"]
        assert e.trainer.optimizer.state_location() == "device"  # brought back by the training calls
    got = dict(e.state_dict())
    for name, w in ref.state_dict():
        assert torch.equal(got[name], w), name


def test_engine_rollout_that_fits_keeps_the_state_on_the_device(growing):
    """A rollout that never fills the memory free at entry does not take the state's memory: the state
    stays on the device (its host copy is dropped at exit) and nothing comes back; training equals
    offload 'none' bit for bit."""
    ref, e = engine("none"), engine("rollout", num_kv_blocks=40)
    for x in (ref, e):
        x.ppo_step(ppo_batch(0), CFG)
    opt = e.trainer.optimizer
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5)
    for step in (1, 2):
        got, want = rollout_and_step(e, step, params), rollout_and_step(ref, step, params)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
        stats = got[3]
        assert stats["kv_blocks_at_entry"] == e.stats["rollout_kv_blocks"] == 40 < stats["kv_blocks"]
        assert "kv_grow_s" not in e.stats
        assert got[2]["optimizer"] > 0 and got[2]["host_optimizer"] == 0  # inside: still on the device
        assert not opt.offload.in_flight and opt.offload.location == "device"
        assert "offload_start_back_s" not in e.stats  # never brought back
    assert opt.offload.host is not None  # the copy out ran (the host allocation exists)
    got = dict(e.state_dict())
    for name, w in ref.state_dict():
        assert torch.equal(got[name], w), name


def test_engine_without_state_sizes_the_cache_once(growing):
    """Before any step there is no state to offload: the fixed-size path."""
    e = engine("rollout", num_kv_blocks=40)
    with e.rollout():
        e.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert e.stats["kv_blocks_at_entry"] == e.stats["kv_blocks"] == e.stats["rollout_kv_blocks"] == 40


def test_a_failed_growth_leaves_the_state_whole_and_the_engine_usable(growing, monkeypatch):
    """The driver refuses the growth's mapping: the generate call raises, the rollout ends, the state (now in
    host memory) comes back whole at the next training call, and the next rollout and step equal offload
    'none'."""
    ref, e = engine("none", exact_logprobs=True), engine("rollout", num_kv_blocks=3, exact_logprobs=True)
    for x in (ref, e):
        x.ppo_step(ppo_batch(0), CFG)
    opt = e.trainer.optimizer
    before = [t.clone() for ts in opt.state_lists().values() for t in ts]
    grow_to = KVCache.grow_to

    def refused(self, num_blocks):
        if num_blocks > self.num_blocks and self.num_blocks:  # the growth, not the first mapping
            raise RuntimeError("injected: cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY")
        return grow_to(self, num_blocks)

    monkeypatch.setattr(KVCache, "grow_to", refused)
    with pytest.raises(RuntimeError, match="injected: cuMemCreate failed"):
        with e.rollout():
            e.generate(PROMPTS, SamplingParams(n=2, max_tokens=12))
    assert e.sharded.state == "training" and opt.state_location() == "host"
    e.log_probs(ppo_batch(9))  # brings the state back
    assert opt.state_location() == "device"
    after = [t for ts in opt.state_lists().values() for t in ts]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    monkeypatch.setattr(KVCache, "grow_to", grow_to)
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3)
    got, want = rollout_and_step(e, 1, params), rollout_and_step(ref, 1, params)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    ref_state = dict(ref.state_dict())
    for name, w in e.state_dict():
        assert torch.equal(ref_state[name], w), name


def _growth_on_ranks(rank, world, init_file, errors):
    import torch.distributed as dist

    from _dist import reporting

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        OffloadPolicy.cache_grows = lambda self: self.config.offload == "rollout" and self.has_state()
        ref, e = engine("none", exact_logprobs=True), engine("rollout", num_kv_blocks=3, exact_logprobs=True)
        for x in (ref, e):
            x.ppo_step(ppo_batch(rank), CFG)
        params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=rank)
        for step in (1, 2):
            got, want = rollout_and_step(e, 10 * step + rank, params), rollout_and_step(ref, 10 * step + rank, params)
            assert got[0] == want[0] and torch.equal(got[1], want[1])
            assert e.stats["rollout_kv_blocks"] > e.stats["kv_blocks_at_entry"] == 3
        ref_state = dict(ref.state_dict())
        for name, w in e.state_dict():
            assert torch.equal(ref_state[name], w), name


def test_growth_on_two_ranks_equals_none():
    """Two gloo ranks (sharded training, each rank generating its own batch): each rank's cache grows into
    its own shard's state memory; tokens, log-probs and weights equal offload 'none' bit for bit."""
    from _dist import spawn

    spawn(_growth_on_ranks, 2)


# -- CUDA: the VMM cache ------------------------------------------------------------------------------

def _vmm_or_skip():
    from hybridengine.sharding.generation_memory import vmm_status

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ok, why = vmm_status(0)
    if not ok:
        pytest.skip(why)


@pytest.mark.gpu
def test_cuda_vmm_cache_maps_as_it_grows_and_gives_the_memory_back():
    _vmm_or_skip()
    dev = torch.device("cuda")
    step = KVCache.granule(dev, 4 * 2 * 8 * 2)
    kv = KVCache(num_blocks=step, capacity=3 * step, dtype=torch.bfloat16, device=dev, use_vmm=True, **SHAPE)
    assert kv.vmm.mapped_bytes() == kv.nbytes() == 2 * 2 * step * kv.block_bytes
    k, v = kv.layers[1]
    k[:step].fill_(1.5)
    assert kv.grow_to(2 * step + 1) == 2 * step  # whole growth steps only
    v[step:2 * step].fill_(-2.0)
    k[step:2 * step] = k[:step]
    torch.cuda.synchronize()
    assert kv.vmm.mapped_bytes() == kv.nbytes() == 2 * 2 * 2 * step * kv.block_bytes
    assert bool((k[:2 * step] == 1.5).all()) and bool((v[step:2 * step] == -2.0).all())
    kv.release()
    assert kv.vmm.mapped_bytes() == 0 and kv.num_blocks == 0
    with pytest.raises(ValueError, match="must be a multiple of"):
        KVCache(num_blocks=0, capacity=step + 1, dtype=torch.bfloat16, device=dev, use_vmm=True, **SHAPE)


@pytest.mark.gpu
def test_cuda_engine_offload_with_a_growing_cache_equals_none():
    """On CUDA (no forcing): offload 'rollout' starts the copy at rollout() entry with a VMM cache in the
    memory free then; tokens, log-probs and the steps after equal offload 'none' bit for bit. (The tiny
    rollout fits, so the state stays on the device; the bench's forced growth runs the growth at 7B.)"""
    _vmm_or_skip()

    def make(mode):
        return he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
            dtype=torch.bfloat16, device="cuda", max_model_len=64, max_num_seqs=8, offload=mode))

    ref, e = make("none"), make("rollout")
    for x in (ref, e):
        x.ppo_step(ppo_batch(0), CFG)
    assert e._offload.cache_grows()
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3)
    for step in (1, 2):
        got, want = rollout_and_step(e, step, params), rollout_and_step(ref, step, params)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
        assert got[3]["preemptions"] == 0 and e.stats["offload_copy_out_s"] > 0
    got = dict(e.state_dict())
    for name, w in ref.state_dict():
        assert torch.equal(got[name], w), name
