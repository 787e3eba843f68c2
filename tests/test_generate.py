"""Rollout generation on CPU: greedy parity with transformers, log-probs, prefix sharing, preemption."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import hybridengine as he
from hybridengine.rollout import sampler as sampling
from hybridengine.rollout.block_manager import BlockManager
from hybridengine.rollout.sampler import _to_device, sample, sample_ref
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.sequence import Sequence

PROMPT_LENS = [3, 9, 17, 6]


def make_engine(name, *, block_size=4, num_kv_blocks=None, max_num_seqs=8, seed=0):
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(he.model_config(name), attn_implementation="eager").eval()
    for p in hf.parameters():  # move norms/biases off 1/0 so a missing one shows
        p.data.add_(torch.randn_like(p) * 0.02)
    cfg = he.EngineConfig(dtype=torch.float32, device="cpu", block_size=block_size, max_model_len=64,
                          num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    return he.HybridEngine(hf, cfg), hf


def prompts_for(vocab, lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_greedy_matches_transformers_and_logprobs_match_forward(name):
    engine, hf = make_engine(name)
    prompts = prompts_for(hf.config.vocab_size)
    with engine.rollout():
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        got = out.outputs[0]
        assert got.token_ids == ref, (name, len(prompt))
        assert got.finish_reason == "length"
        with torch.no_grad():
            full = torch.tensor([prompt + got.token_ids[:-1]])
            logp = hf(full).logits[0, len(prompt) - 1:].float().log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(got.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(got.logprobs), expected, rtol=0, atol=1e-4)


def test_prefix_sharing_equals_unshared():
    engine, hf = make_engine("tiny-qwen2")
    prompts = prompts_for(hf.config.vocab_size, [5, 11])
    with engine.rollout():
        shared = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=10))
        alone = engine.generate([p for p in prompts for _ in range(3)], SamplingParams(temperature=0.0, max_tokens=10))
    for i, out in enumerate(shared):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        for j, o in enumerate(out.outputs):
            assert o.token_ids == alone[3 * i + j].outputs[0].token_ids
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(alone[3 * i + j].outputs[0].logprobs),
                                       rtol=0, atol=1e-5)


def test_preemption_under_a_tiny_cache_gives_the_same_outputs():
    prompts = None
    results = []
    for blocks in (None, 12):
        engine, hf = make_engine("tiny-llama", num_kv_blocks=blocks)
        prompts = prompts or prompts_for(hf.config.vocab_size)
        params = SamplingParams(n=2, temperature=0.8, top_k=20, max_tokens=14, seed=7)
        with engine.rollout():
            outs = engine.generate(prompts, params)
        results.append([[o.token_ids for o in r.outputs] for r in outs])
        if blocks is not None:
            assert engine.stats["preemptions"] > 0
    assert results[0] == results[1]


def test_seeded_samples_do_not_depend_on_the_batch():
    engine, hf = make_engine("tiny-qwen3")
    prompts = prompts_for(hf.config.vocab_size)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=3)
    with engine.rollout():
        together = engine.generate(prompts, [seeded] + [SamplingParams(max_tokens=8)] * 3)
        alone = engine.generate(prompts[:1], seeded)
    assert together[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_stop_tokens_and_finish_reasons():
    engine, hf = make_engine("tiny-qwen2")
    prompt = prompts_for(hf.config.vocab_size, [7])
    with engine.rollout():
        greedy = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
        stop = greedy.token_ids[3]
        out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop,)))
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == greedy.token_ids[:greedy.token_ids.index(stop) + 1]


@pytest.mark.parametrize("blocks,max_num_seqs", [(None, 8), (None, 3), (10, 8)])
def test_async_scheduling_gives_the_same_outputs(blocks, max_num_seqs):
    """Async decode (each step launched before the previous step's tokens are on the host) against the
    synchronous loop: mixed greedy / seeded rows, n > 1, different max_tokens, stop tokens that end
    sequences mid-batch (their next row is void), admissions from the waiting queue (max_num_seqs=3)
    and preemptions under a tiny cache (10 blocks)."""
    engine, hf = make_engine("tiny-qwen2", num_kv_blocks=blocks, max_num_seqs=max_num_seqs)
    prompts = prompts_for(hf.config.vocab_size, [3, 9, 17, 6, 5])
    with engine.rollout():
        engine.config.tuning.async_scheduling = False
        params = [SamplingParams(temperature=1.0, max_tokens=12, seed=11),
                  SamplingParams(n=2, temperature=1.0, top_k=30, max_tokens=9, seed=5),
                  SamplingParams(temperature=0.0, max_tokens=5),
                  SamplingParams(n=2, temperature=0.9, max_tokens=11, seed=3),
                  SamplingParams(temperature=0.7, max_tokens=1, seed=2)]
        probe = engine.generate(prompts, params)

        def mid_stop(ids):  # a token whose first appearance is in the middle of the completion
            return next(t for i, t in enumerate(ids) if 2 <= i <= len(ids) - 3 and t not in ids[:i])

        # seeded rows draw the same tokens in any batch: these stops end sequences while others go on
        params[0].stop_token_ids = (mid_stop(probe[0].outputs[0].token_ids),)
        params[3].stop_token_ids = (mid_stop(probe[3].outputs[1].token_ids),)
        runs = {}
        for mode in (False, True):
            engine.config.tuning.async_scheduling = mode
            outs = engine.generate(prompts, params)
            runs[mode] = ([[(o.token_ids, o.finish_reason) for o in r.outputs] for r in outs],
                          [[o.logprobs for o in r.outputs] for r in outs], dict(engine.stats))
    (sync_ids, sync_lp, sync_stats), (async_ids, async_lp, async_stats) = runs[False], runs[True]
    assert async_ids == sync_ids
    for a, b in zip(async_lp, sync_lp):
        torch.testing.assert_close(torch.tensor(sum(a, [])), torch.tensor(sum(b, [])), rtol=0, atol=1e-5)
    reasons = [reason for r in sync_ids for _, reason in r]
    assert "stop" in reasons and "length" in reasons
    assert all(-1 not in ids for r in async_ids for ids, _ in r)
    assert sync_stats["async_steps"] == 0 and async_stats["async_steps"] > 5
    if blocks is not None:
        assert async_stats["preemptions"] > 0


def test_decodes_next_predicts_a_plain_decode():
    """Scheduler.decodes_next() is True exactly when schedule() then returns a decode of every running
    sequence with no admission and no preemption."""
    from hybridengine.rollout.scheduler import Scheduler

    for blocks, max_seqs in ((40, 8), (10, 8), (40, 3)):
        sched = Scheduler(BlockManager(blocks, 4), max_num_seqs=max_seqs, max_num_batched_tokens=64)
        for i, n in enumerate([5, 9, 2, 7]):
            sched.add(Sequence(request=i, token_ids=list(range(n)), num_prompt_tokens=n,
                               params=SamplingParams(), fork=2))
        checked = 0
        while not sched.done and checked < 200:
            predicted = sched.decodes_next()
            running, preempted = list(sched.running), sched.num_preemptions
            batch = sched.schedule()
            plain = (not batch.is_prefill and batch.seqs == running and sched.num_preemptions == preempted)
            assert predicted == plain or (not predicted and not running), checked
            seqs = ([c for s in batch.seqs for c in (sched.fork(s) if s.fork > 1 else [s])] if batch.is_prefill
                    else batch.seqs)
            for seq in seqs:
                seq.token_ids.append(1)
                if seq.num_tokens >= 22:
                    sched.finish(seq, "length")
            checked += 1
        assert sched.done


@pytest.mark.parametrize("prompts,params,match", [
    ([[]], SamplingParams(), r"prompts\[0\] is empty"),
    ([[1, 2], [3, 10_000]], SamplingParams(), r"prompts\[1\] has token id 10000 outside the vocabulary"),
    ([[1, -1]], SamplingParams(), "outside the vocabulary"),
    ([[1] * 60], SamplingParams(max_tokens=10),
     r"prompts\[0\]: prompt length 60 \+ max_tokens 10 exceeds max_model_len=64"),
    ([], SamplingParams(), "non-empty list"),
    ([[1]], [SamplingParams(), SamplingParams()], "2 given for 1 prompts"),
])
def test_bad_requests_fail_before_any_work(prompts, params, match):
    engine, _ = make_engine("tiny-qwen2")
    with engine.rollout():
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, params)


def test_generate_outside_rollout_and_bad_params():
    engine, _ = make_engine("tiny-qwen2")
    with pytest.raises(ValueError, match="inside `with engine.rollout"):
        engine.generate([[1, 2]])
    for kwargs, match in [(dict(n=0), "n must be"), (dict(temperature=-1.0), "temperature must be >= 0"),
                          (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
                          (dict(top_k=0), "top_k must be -1 or >= 1"), (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="block_size must be a power of 2"):
        he.EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="tp_generation"):
        he.EngineConfig(tp_generation=0)
    with pytest.raises(ValueError, match=r"split_master=True needs dtype=torch.bfloat16"):
        he.EngineConfig(dtype=torch.float32, tuning=he.EngineTuning(split_master=True))
    with pytest.raises(ValueError, match=r"tp_all_reduce must be one of \('auto', 'nccl', 'symm_mem'\), got 'ring'"):
        he.EngineTuning(tp_all_reduce="ring")
    for kwargs, match in [(dict(max_tokens=2.5), "max_tokens"), (dict(n=True), "n must be"),
                          (dict(temperature="hot"), "temperature"), (dict(top_p=float("nan")), "top_p"),
                          (dict(seed="7"), "seed must be None or an int"),
                          (dict(stop_token_ids=("a",)), "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    for kwargs, match in [(dict(dtype=torch.int64), "dtype must be a floating torch.dtype"),
                          (dict(device="gpu0"), "device must name a torch device"),
                          (dict(max_model_len=64.0), "max_model_len must be a finite integer"),
                          (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
                          (dict(num_kv_blocks=0), "num_kv_blocks must be None or >= 1"),
                          (dict(cuda_graphs=1), "cuda_graphs must be a bool"),
                          (dict(tuning=dict(sampler="torch")), "tuning must be an EngineTuning, got dict")]:
        with pytest.raises(ValueError, match=match):
            he.EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="EngineTuning.split_master must be None or a bool"):
        he.EngineTuning(split_master="yes")
    with pytest.raises(ValueError, match="EngineTuning.async_scheduling must be a bool"):
        he.EngineTuning(async_scheduling=1)
    assert he.EngineConfig(device=torch.device("cpu")).device == "cpu"
    with pytest.raises(ValueError, match="config must be an EngineConfig, got dict"):
        he.HybridEngine(he.model_config("tiny-qwen2"), dict(device="cpu"))
    with engine.rollout():
        with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
            engine.generate([[1, 2]], dict(max_tokens=2))
        with pytest.raises(ValueError, match="prompts must be token ids .*got text: the engine has no tokenizer"):
            engine.generate("1 2")
        with pytest.raises(ValueError, match="prompts must be a non-empty list"):
            engine.generate([])


def test_tp_all_reduce_modes_on_cpu():
    """'nccl' and 'auto' off CUDA give no symmetric-memory all-reduce (dist.all_reduce); 'symm_mem' off
    CUDA is an error that says why. (tests/dist_generate.py checks the CUDA path against NCCL.)"""
    from hybridengine.model.tensor_parallel import make_all_reduce

    kw = dict(capacity=64, dtype=torch.float32, device=torch.device("cpu"))
    assert make_all_reduce("nccl", None, **kw) is None
    assert make_all_reduce("auto", None, **kw) is None
    with pytest.raises(RuntimeError, match=r"tp_all_reduce='symm_mem'.*needs a CUDA device"):
        make_all_reduce("symm_mem", None, **kw)
    with pytest.raises(ValueError, match="tp_all_reduce must be one of"):
        make_all_reduce("ring", None, **kw)


def test_prepare_rollout_then_rollout():
    """prepare_rollout() (pages mapped ahead; a no-op for the CPU buffer) leaves generation unchanged and
    is refused inside a rollout, where the buffer is in the generation state."""
    engine, _ = make_engine("tiny-qwen2")
    params = SamplingParams(max_tokens=5, temperature=0.0)
    with engine.rollout():
        plain = [o.outputs[0].token_ids for o in engine.generate([[1, 2, 3]], params)]
        with pytest.raises(RuntimeError, match=r"prepare_generation\(\) needs the training state"):
            engine.prepare_rollout()
    engine.prepare_rollout()
    with engine.rollout():
        assert [o.outputs[0].token_ids for o in engine.generate([[1, 2, 3]], params)] == plain


def test_admission_counts_a_prompts_samples():
    """A prompt awaiting its fork into n samples takes n of max_num_seqs: a decode batch never exceeds it
    (9 sequences once ran in a batch of max_num_seqs=8, past the largest CUDA graph bucket)."""
    from hybridengine.rollout.scheduler import Scheduler

    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=1024)
    for i, fork in enumerate([1, 3, 1, 3, 1]):
        sched.add(Sequence(request=i, token_ids=[1, 2, 3], num_prompt_tokens=3, params=SamplingParams(n=fork),
                           fork=fork))
    batch = sched.schedule()
    assert batch.is_prefill and [s.fork for s in batch.seqs] == [1, 3, 1, 3]  # 8 samples; the 5th waits
    for seq in list(batch.seqs):
        sched.fork(seq)
    assert len(sched.running) == 8 and len(sched.schedule().seqs) == 8
    with pytest.raises(ValueError, match="request 9: 9 samples exceed max_num_seqs=8"):
        sched.add(Sequence(request=9, token_ids=[1], num_prompt_tokens=1, params=SamplingParams(n=9), fork=9))
    engine, _ = make_engine("tiny-qwen2")
    with engine.rollout():
        with pytest.raises(ValueError, match=r"n=9 samples exceed EngineConfig.max_num_seqs=8"):
            engine.generate([[1, 2]], SamplingParams(n=9))


def test_block_manager_refcounts_and_copy_on_write():
    bm = BlockManager(6, 4)
    seq = Sequence(request=0, token_ids=list(range(6)), num_prompt_tokens=6, params=SamplingParams())
    bm.allocate(seq)
    assert seq.block_table == [0, 1] and bm.num_free == 4
    child = Sequence(request=0, token_ids=list(range(6)), num_prompt_tokens=6, params=SamplingParams(),
                     block_table=bm.share(seq, 1))
    assert bm.ref_counts[:2] == [2, 2]
    seq.token_ids.append(9)  # the 7th token lands in the shared partial block 1: copy on write
    assert bm.append(seq) == (1, 2) and seq.block_table == [0, 2] and bm.ref_counts[1] == 1
    child.token_ids.append(9)
    assert bm.append(child) is None and child.block_table == [0, 1]  # now the sole owner: write in place
    for _ in range(2):
        seq.token_ids.append(1)
    assert bm.append(seq) is None and len(seq.block_table) == 3  # crossed into a fresh block
    bm.free(seq)
    bm.free(child)
    assert bm.num_free == 6 and bm.ref_counts == [0] * 6


def test_sampler_truncation_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    params = [SamplingParams(temperature=0.7, top_k=3)] * 32 + [SamplingParams(temperature=1.3, top_p=0.3)] * 32
    tokens, logprobs = sample(logits, params, [None] * 64)
    top3 = logits[:32].topk(3, dim=-1).indices
    assert bool((tokens[:32, None] == top3).any(-1).all())
    probs = (logits[32:] / 1.3).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < 0.3
    for row, tok in enumerate(tokens[32:].tolist()):
        assert tok in order[row][keep[row]].tolist()
    expected = torch.cat([(logits[:32] / 0.7).log_softmax(-1), (logits[32:] / 1.3).log_softmax(-1)])
    torch.testing.assert_close(logprobs, expected.gather(-1, tokens[:, None]).squeeze(1))
    greedy_tokens, _ = sample(logits, [SamplingParams(temperature=0.0)] * 64, [None] * 64)
    assert torch.equal(greedy_tokens, logits.argmax(-1))


@pytest.mark.parametrize("drawn_at", [1.0, 0.9])
def test_sampler_follows_the_distribution(drawn_at):
    """20000 draws at temperature 1.0: Pearson's chi-square accepts them as softmax(logits) (p > 1e-4) and
    rejects a sampler running at T = 0.9 instead. Its noncentrality n * sum((p_0.9 - p_1)^2 / p_1) = 134 is
    6x the 1e-4 critical value 21.1 (3 degrees of freedom; the statistic's sd at T = 0.9 is 23): rejected at
    practically every seed, not only this one."""
    from conftest import chi_square_p_value

    n = 20000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(n, 1)
    gen = torch.Generator().manual_seed(5)
    tokens, _ = sample(logits, [SamplingParams(temperature=drawn_at)] * n, [gen] * n)
    p_value = chi_square_p_value(tokens, logits[0].softmax(-1))
    assert (p_value > 1e-4) == (drawn_at == 1.0), p_value


SAMPLER_CASES = {
    "unit temperature": [SamplingParams()] * 6,
    "all greedy": [SamplingParams(temperature=0.0)] * 6,
    "one temperature": [SamplingParams(temperature=0.6)] * 6,
    "truncation": [SamplingParams(top_k=7), SamplingParams(top_p=0.5)] * 3,
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(top_k=5, seed=2), SamplingParams(top_p=0.8), SamplingParams(temperature=0.0, seed=4),
              SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=5), SamplingParams(temperature=2.0)],
    "all seeded": [SamplingParams(temperature=0.9, seed=s) for s in range(5)],
}


def _generators(params, offset=0):
    return [torch.Generator().manual_seed(100 + offset + i) if p.seed is not None else None
            for i, p in enumerate(params)]


@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_sample_returns_exactly_what_the_reference_returns(case):
    params = SAMPLER_CASES[case]
    logits = torch.randn(len(params), 97) * 3
    torch.manual_seed(7)
    tokens, logprobs = sample(logits, params, _generators(params))
    torch.manual_seed(7)
    ref_tokens, ref_logprobs = sample_ref(logits, params, _generators(params))
    assert torch.equal(tokens, ref_tokens) and torch.equal(logprobs, ref_logprobs)


def test_sample_decides_on_the_host(monkeypatch):
    """No tensor is read back (on CUDA each read is a wait for the GPU); the plain case copies nothing in."""
    copies = []
    monkeypatch.setattr(sampling, "_to_device", lambda *a: copies.append(a) or _to_device(*a))
    for name in ("__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name,
                            lambda *a, name=name: pytest.fail(f"sample read a tensor back ({name})"))
    logits = torch.randn(8, 50)
    for params in SAMPLER_CASES.values():
        sample(logits[:len(params)], params, _generators(params))
    copies.clear()
    sample(logits, [SamplingParams()] * 8, [None] * 8)
    assert copies == []


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    logits = torch.randn(6, 64)
    alone = sample(logits[2:3], [seeded], [torch.Generator().manual_seed(5)])
    for others in (SAMPLER_CASES["mixed"][:5], [SamplingParams(temperature=0.0)] * 5, [SamplingParams()] * 5):
        params = others[:2] + [seeded] + others[2:5]
        gens = _generators(params, offset=10)
        gens[2] = torch.Generator().manual_seed(5)
        tokens, logprobs = sample(logits, params, gens)
        assert tokens[2] == alone[0][0] and logprobs[2] == alone[1][0]


def _naive_decode_inputs(runner, seqs, pad_to):
    """The decode inputs built the plain way (one list per input, `_slots` for the slot)."""
    B = len(seqs)
    tables = torch.full((pad_to, runner.max_blocks), -1, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    return dict(ids=torch.tensor([s.token_ids[-1] for s in seqs] + [0] * (pad_to - B)),
                positions=torch.tensor([s.num_tokens - 1 for s in seqs] + [0] * (pad_to - B)),
                slots=torch.tensor([runner._slots(s, s.num_tokens - 1, s.num_tokens)[0] for s in seqs]
                                   + [-1] * (pad_to - B)),
                lens=torch.tensor([s.num_tokens for s in seqs] + [0] * (pad_to - B), dtype=torch.int32),
                tables=tables)


def test_decode_inputs_follow_forks_copy_on_write_preemption_and_finishes():
    """The staged inputs (table rows rewritten only when a table changed) equal the plain construction
    at every step of a run with forks, copy-on-write, preemptions and sequences finishing mid-batch."""
    from types import SimpleNamespace

    from hybridengine.rollout.kv_cache import KVCache
    from hybridengine.rollout.runner import ModelRunner
    from hybridengine.rollout.scheduler import Scheduler

    bs, max_len = 4, 40
    kv = KVCache(num_layers=1, num_blocks=16, block_size=bs, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                 device=torch.device("cpu"))
    runner = ModelRunner(SimpleNamespace(config=SimpleNamespace(head_dim=2)), kv, max_num_seqs=6,
                         max_model_len=max_len, use_cuda_graphs=False)
    sched = Scheduler(BlockManager(16, bs), max_num_seqs=6, max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(0)
    for i, (n, fork) in enumerate([(5, 3), (9, 1), (2, 2), (13, 1), (7, 2)]):
        sched.add(Sequence(request=i, token_ids=list(range(n)), num_prompt_tokens=n,
                           params=SamplingParams(), fork=fork))
    decode_steps = copies = 0
    while not sched.done:
        batch = sched.schedule()
        copies += len(batch.block_copies)
        seqs = ([c for s in batch.seqs for c in (sched.fork(s) if s.fork > 1 else [s])] if batch.is_prefill
                else batch.seqs)
        if not batch.is_prefill:
            decode_steps += 1
            for pad_to in (len(seqs), len(seqs) + 2):
                got, want = runner._decode_inputs(seqs, pad_to), _naive_decode_inputs(runner, seqs, pad_to)
                for name, value in want.items():
                    assert torch.equal(got[name], value), (decode_steps, name)
        for seq in seqs:
            seq.token_ids.append(int(torch.randint(0, 100, (), generator=g)))
            if seq.num_tokens >= max_len - 4 or torch.rand((), generator=g) < 0.04:
                sched.finish(seq, "length")
    assert decode_steps > 20 and sched.num_preemptions > 0 and copies > 0
    # a copy-on-write of the last block of a table the runner already holds (same list, same length)
    seq = Sequence(request=0, token_ids=list(range(6)), num_prompt_tokens=6, params=SamplingParams(),
                   block_table=[3, 4])
    runner._decode_inputs([seq], 1)
    seq.block_table[-1] = 9
    assert runner._decode_inputs([seq], 1)["slots"].tolist() == [9 * bs + 1]


def test_profile_decode_runs_on_cpu(tmp_path):
    import json

    from hybridengine_bench.probes import profile_decode

    profile_decode.main(["--model", "tiny-qwen2", "--batch", "3", "--prompt", "5", "--new-tokens", "4",
                         "--device", "cpu", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "profile_decode.json").read_text())
    assert result["decode_steps"] == 3 and result["wall_ms_per_step"] > 0
    assert set(result["gpu_ms_per_step"]) == {"communication", "attention", "gemm", "sampling", "elementwise/other",
                                              "memcpy/memset"}
    for name in ("schedule", "prepare_inputs", "forward", "sample", "d2h", "bookkeeping"):
        assert result["host_ranges"][name]["calls"] >= 3, name
    assert (tmp_path / "trace.json.gz").stat().st_size > 0


def test_profile_decode_times_kernel_configs_on_cpu(tmp_path):
    """The kernel-config mode runs a rollout per config and puts the launcher's config back (on CPU the
    decode attention is the reference, so this checks the harness, not the configs)."""
    import json

    from hybridengine_bench.probes import profile_decode
    from hybridengine.ops import paged_attention

    original = paged_attention._decode_config
    profile_decode.main(["--model", "tiny-qwen2", "--batch", "2", "--prompt", "5", "--new-tokens", "3",
                         "--device", "cpu", "--kernel-configs", "32:4:2:1,64:8:1:0:1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "decode_kernel_configs.json").read_text())
    assert [r["config"]["BLOCK_N"] for r in result["kernel_configs"]] == [32, 64]
    assert [r["config"]["PREFETCH"] for r in result["kernel_configs"]] == [False, True]
    assert all(r["step_ms"] > 0 for r in result["kernel_configs"])
    assert paged_attention._decode_config is original


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_sample_returns_exactly_what_the_reference_returns_on_cuda(case):
    params = SAMPLER_CASES[case]
    logits = torch.randn(len(params), 151936, device="cuda") * 3

    def gens():
        return [torch.Generator("cuda").manual_seed(100 + i) if p.seed is not None else None
                for i, p in enumerate(params)]

    torch.manual_seed(7)
    tokens, logprobs = sample(logits, params, gens())
    torch.manual_seed(7)
    ref_tokens, ref_logprobs = sample_ref(logits, params, gens())
    assert torch.equal(tokens, ref_tokens) and torch.equal(logprobs, ref_logprobs)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_decode():
    """Inputs staged through the graphs' static buffers (pinned, double-buffered) = the eager path;
    graphs captured lazily (each bucket at its first decode step, mid-generation) = captured up front."""
    outs, captured = [], {}
    for graphs, lazy in ((True, False), (False, False), (True, True)):
        torch.manual_seed(0)
        engine = he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
            dtype=torch.float32, device="cuda", block_size=4, max_model_len=64, num_kv_blocks=40, max_num_seqs=8,
            cuda_graphs=graphs, tuning=he.EngineTuning(lazy_cuda_graphs=lazy)))
        prompts = prompts_for(engine.vocab_size, [3, 9, 17, 6, 5])
        with engine.rollout():
            res = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=20),
                                            SamplingParams(n=3, temperature=0.9, top_k=30, max_tokens=14, seed=3)] * 2
                                  + [SamplingParams(temperature=0.0, max_tokens=7)])
            captured[(graphs, lazy)] = sorted(engine._runner.graphs)
        outs.append(res)
    assert captured[(True, False)] == [1, 2, 4, 8] and captured[(False, False)] == []
    # 11 sequences over 8 rows, finishing at 7, 14 and 20 tokens: only the buckets the batch went through
    assert 0 < len(captured[(True, True)]) < 4 and 8 in captured[(True, True)], captured
    graphed, eager, lazy = outs
    for run in (graphed, lazy):  # the graphs run padded batches: other GEMM shapes, other rounding
        for g, e in zip(run, eager):
            for a, b in zip(g.outputs, e.outputs):
                assert a.token_ids == b.token_ids
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    for g, e in zip(lazy, graphed):  # the same graphs, captured at another time: bitwise
        for a, b in zip(g.outputs, e.outputs):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_async_scheduling_equals_sync(graphs):
    """On the GPU (pinned copies, events, ids copied on the stream into the graphs' static inputs):
    async decode gives the outputs of the synchronous loop, with stop tokens ending sequences mid-batch
    and the batch shrinking through the graph buckets. A void row can put a step in another batch
    bucket (other GEMM shapes), so log-probs agree to rounding, not bitwise."""
    torch.manual_seed(0)
    engine = he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
        dtype=torch.float32, device="cuda", block_size=4, max_model_len=64, num_kv_blocks=40, max_num_seqs=8,
        cuda_graphs=graphs))
    prompts = prompts_for(engine.vocab_size, [3, 9, 17, 6, 5])
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=11),
              SamplingParams(n=3, temperature=0.9, top_k=30, max_tokens=14, seed=3),
              SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=5),
              SamplingParams(temperature=0.0, max_tokens=7)]
    with engine.rollout():
        engine.config.tuning.async_scheduling = False
        probe = engine.generate(prompts, params)
        ids = probe[0].outputs[0].token_ids
        params[0].stop_token_ids = (next(t for i, t in enumerate(ids) if 2 <= i <= 15 and t not in ids[:i]),)
        ids = probe[1].outputs[2].token_ids
        params[1].stop_token_ids = (next(t for i, t in enumerate(ids) if 2 <= i <= 10 and t not in ids[:i]),)
        runs = {}
        for mode in (False, True):
            engine.config.tuning.async_scheduling = mode
            runs[mode] = engine.generate(prompts, params)
            assert (engine.stats["async_steps"] > 5) == mode
    for a, b in zip(runs[True], runs[False]):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-4)
    assert "stop" in [o.finish_reason for r in runs[True] for o in r.outputs]


@pytest.mark.gpu
def test_gpu_rollout_exit_releases_kv_cache_and_graphs(device):
    """Leaving rollout() frees the KV cache and the CUDA graphs' memory: allocated and reserved bytes
    return to their level before the rollout (training gets that memory back), at every rollout. Measured
    from after a first rollout: on the fallback path (no VMM extension) the generation buffer stays
    allocated by design, and the process's first captures leave the capture stream's cuBLAS workspace,
    which torch keeps for the process. A 512 MiB cache, so that its release is told apart from what
    earlier tests in the same worker left in the allocator; three rollouts, so a leak per rollout (a
    capture stream per rollout once left a 33 MiB workspace each time) shows."""
    engine = he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
        dtype=torch.bfloat16, device=str(device), max_model_len=128, max_num_seqs=8, num_kv_blocks=2**17))
    with engine.rollout():  # without the VMM extension the generation buffer stays allocated after this
        engine.generate([[1, 2, 3]], he.SamplingParams(max_tokens=2))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(3):
        with engine.rollout():
            engine.generate([[1, 2, 3]] * 4, he.SamplingParams(max_tokens=8))
            kv_bytes = engine._runner.kv.nbytes()
            assert torch.cuda.memory_allocated() - before >= kv_bytes
        torch.cuda.synchronize()
        numbers = (f"allocated {before} -> {torch.cuda.memory_allocated()}, reserved {reserved_before} -> "
                   f"{torch.cuda.memory_reserved()}, KV {kv_bytes}")
        assert torch.cuda.memory_allocated() - before < 2**20, numbers
        assert kv_bytes >= 2**29 and torch.cuda.memory_reserved() - reserved_before < kv_bytes // 8, numbers


def test_rollout_exit_empties_the_allocator_after_the_last_reference_to_the_kv_cache(monkeypatch):
    """The allocator can only give back blocks nobody holds: when `_leave_rollout` empties the device
    cache, the KV cache (held by the engine, the runner and the session) must already be unreferenced.
    Otherwise the cache's memory stays reserved on the device after the exit, out of training's reach."""
    import weakref

    import hybridengine.engine as engine_module

    engine, _ = make_engine("tiny-qwen2")
    seen = []
    monkeypatch.setattr(engine_module, "_empty_device_cache", lambda device: seen.append(
        (kv_ref() is None, data_ref() is None)))
    for keep in (False, True):
        with engine.rollout(keep_unfinished=keep):
            kv_ref, data_ref = weakref.ref(engine._kv), weakref.ref(engine._kv.data)
            engine.generate([[1, 2, 3]] * 2, he.SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="inside"):
        with engine.rollout():
            kv_ref, data_ref = weakref.ref(engine._kv), weakref.ref(engine._kv.data)
            raise RuntimeError("inside")
    assert seen == [(True, True)] * 3


def test_cuda_kv_cache_is_capped_by_what_running_sequences_can_hold(monkeypatch):
    """On CUDA the cache takes the memory budget, but no more than max_num_seqs sequences of
    max_model_len can use (every block beyond that would be allocated and freed for nothing)."""
    import math

    from hybridengine.rollout.kv_cache import KVCache, num_kv_blocks

    engine, _ = make_engine("tiny-qwen2")  # max_num_seqs=8, max_model_len=64, block_size=4
    c, m = engine.config, engine.model.config
    cap = c.max_num_seqs * math.ceil(c.max_model_len / c.block_size)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    for free_gib, expect_cap in ((100, True), (None, False)):
        total = 141 * 2**30
        if free_gib is None:  # a budget of 40 blocks: below the cap, so it binds
            per_block = KVCache.bytes_per_block(dtype=c.dtype, num_layers=m.num_hidden_layers, block_size=c.block_size,
                                                num_kv_heads=m.num_key_value_heads, head_dim=m.head_dim)
            reserve = 2 * c.max_num_batched_tokens * max(m.hidden_size, m.intermediate_size) * 4 \
                + c.max_num_seqs * m.vocab_size * 4 * 2
            free = total - int(total * c.gpu_memory_utilization) + reserve + 40 * per_block
        else:
            free = free_gib * 2**30
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, total))
        assert num_kv_blocks(c, m, torch.device("cuda", 0)) == (cap if expect_cap else 40), free_gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, total))
    with pytest.raises(RuntimeError, match="does not hold one sequence of max_model_len=64"):
        num_kv_blocks(c, m, torch.device("cuda", 0), rank=3)


def test_async_decode_guards():
    """The async-decode guards: prev_tokens on a prefill, a placeholder id with no device ids, a sequence
    missing from the previous step's batch."""
    from hybridengine.rollout.async_decode import next_rows
    from hybridengine.rollout.scheduler import Batch
    from hybridengine.rollout.sequence import PLACEHOLDER

    engine, _ = make_engine("tiny-qwen2")
    with engine.rollout():
        runner = engine._runner
        seq = Sequence(request=0, token_ids=[1, 2, PLACEHOLDER], num_prompt_tokens=2, params=SamplingParams(),
                       block_table=[0])
        with pytest.raises(RuntimeError, match="prev_tokens is for decode steps only"):
            runner.step(Batch([seq], True), (torch.zeros(1, dtype=torch.int64), None))
        with pytest.raises(RuntimeError, match="input token is still on the device and no prev_tokens"):
            runner.step(Batch([seq], False))
    other = Sequence(request=1, token_ids=[3], num_prompt_tokens=1, params=SamplingParams())
    with pytest.raises(RuntimeError, match="has no token in the previous step"):
        next_rows([seq, other], [seq], torch.device("cpu"))
    assert next_rows([seq], [seq, other], torch.device("cpu")) is None
    assert next_rows([other], [seq, other], torch.device("cpu")).tolist() == [1]


def test_readback_slots_hold_bit_copies_and_catch_a_rewritten_slot(device):
    """`Readback.write` stores a step's float64 words bit for bit (NaN payloads, -0.0, ids up to 2^53) into the
    next of SLOTS slots, and a step whose slot was rewritten before it was read raises instead of returning
    another step's tokens."""
    from hybridengine.rollout.runner import Readback

    rb = Readback(device)
    ids = torch.tensor([0, 2**53 - 1, 151643, 7], dtype=torch.float64)
    logprobs = torch.tensor([-0.0, float("nan"), -1e-30, -3.5], dtype=torch.float64)
    packed = torch.stack((ids, logprobs)).to(device)
    packed[1].view(torch.int64)[1] = 0x7FF8_0000_DEAD_BEEF  # a NaN with a payload: a value copy may lose it
    steps = [rb.write(packed) for _ in range(Readback.SLOTS)]
    assert len({slot for _, slot, _, _ in steps}) == Readback.SLOTS
    for host, slot, writes, ready in steps:
        if ready is not None:
            ready.synchronize()
        rb.check(slot, writes)
        assert torch.equal(host.view(torch.int64), packed.view(torch.int64).cpu())
    host, slot, writes, _ = steps[0]
    rb.write(packed)  # SLOTS + 1-th write: slot 0 again
    with pytest.raises(RuntimeError, match="rewritten before its step was read"):
        rb.check(slot, writes)
    bigger = torch.zeros(2, 300, dtype=torch.float64, device=device)  # past the slots' capacity: new slots
    host, slot, writes, ready = rb.write(bigger)
    if ready is not None:
        ready.synchronize()
    assert host.shape == (2, 300) and not host.any()
    rb.close()



def test_mapped_takes_only_pinned_host_memory():
    """`mapped` gives the device a view of pinned host memory; pageable memory has no device address."""
    from hybridengine.rollout.runner import mapped

    with pytest.raises(ValueError, match="host must be a pinned CPU tensor"):
        mapped(torch.zeros(4), torch.device("cuda"))
