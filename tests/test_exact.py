"""Exact on-policy mode (EngineConfig.exact_logprobs): rollout log-probs equal the trainer's bit for bit.

Every clause of the contract on CPU, on the torch paths (the engine's CPU kernels) and on the Triton kernels
under the interpreter (`_launch.use_kernel` patched): batch composition, n, max_num_seqs, preemption and
recompute, packing and micro-batch size on the training side, N in {1, 2, 4} gloo ranks with tg in {1, 2};
greedy batch invariance; the first `ppo_step` on the rollout's log-probs sees a ratio of exactly 1.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import hybridengine as he
from _dist import reporting, spawn
from conftest import DEVICE
from hybridengine.ops import _launch

LENS = [3, 9, 17, 6, 1]
T = 0.8


def engine_for(name="tiny-qwen2", *, exact=True, dtype=torch.float32, tp=1, num_kv_blocks=None, max_num_seqs=8,
               device=DEVICE, **kw):
    cfg = he.EngineConfig(dtype=dtype, device=str(device), block_size=4, max_model_len=48, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=64, num_kv_blocks=num_kv_blocks, tp_generation=tp,
                          exact_logprobs=exact, tuning=he.EngineTuning(sampler="torch"), **kw)
    return he.HybridEngine(he.model_config(name) if isinstance(name, str) else name, cfg)


def prompts(vocab, lens=LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def sampled(seed=5, n=2, max_tokens=8):
    return he.SamplingParams(n=n, temperature=T, max_tokens=max_tokens, seed=seed)


def generate(engine, ps, params):
    with engine.rollout():
        return engine.generate(ps, params)


def completions(outs):
    """[(prompt, completion ids, rollout log-probs)] in request and sample order."""
    return [(o.prompt_token_ids, c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def trainer_logprobs(engine, seqs, *, micro_batch_tokens=16384, temperature=T):
    """The trainer's log-probs of each completion's tokens (one log_probs call over all sequences)."""
    batch = he.PPOBatch(input_ids=[torch.tensor(p + c) for p, c, _ in seqs])
    logp = engine.trainer.log_probs(batch, temperature=temperature, micro_batch_tokens=micro_batch_tokens)
    return [logp[b, len(p) - 1:len(p) - 1 + len(c)] for b, (p, c, _) in enumerate(seqs)]


def assert_bitwise(seqs, trained):
    for (p, c, rollout), got in zip(seqs, trained):
        expected = torch.tensor(rollout, dtype=torch.float32)
        assert torch.equal(got.cpu(), expected), (len(p), (got.cpu() - expected).abs().max().item())


@pytest.fixture(params=["native", "interpreter"])
def kernels(request, monkeypatch):
    """The device's own path (CPU: the torch ops; CUDA: the kernels), or on CPU the Triton kernels under the
    interpreter."""
    if request.param == "interpreter":
        if DEVICE.type == "cuda":
            pytest.skip("the interpreter runs the kernels on CPU; on CUDA the native path is the kernels")
        monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    return request.param


@pytest.mark.parametrize("name,dtype", [("tiny-qwen2", torch.float32), ("tiny-qwen3", torch.bfloat16),
                                        ("tiny-llama", torch.bfloat16)])
def test_rollout_logprobs_equal_the_trainers_bitwise(name, dtype, kernels):
    if kernels == "interpreter" and name != "tiny-qwen3":
        pytest.skip("the interpreter runs one model (bf16, q/k norms, head_dim 24): its kernels are slow on CPU")
    engine = engine_for(name, dtype=dtype)
    vocab = engine.model_config.vocab_size
    lens, tokens = (LENS, 8) if kernels == "native" else ([3, 9, 1], 5)
    seqs = completions(generate(engine, prompts(vocab, lens), sampled(max_tokens=tokens)))
    assert_bitwise(seqs, trainer_logprobs(engine, seqs))
    # the training side's batch does not matter: one sequence at a time, and micro-batches of a few tokens
    assert_bitwise(seqs[:3], [trainer_logprobs(engine, [s])[0] for s in seqs[:3]])
    assert_bitwise(seqs, trainer_logprobs(engine, seqs, micro_batch_tokens=20))


def test_the_batch_does_not_change_a_requests_tokens_or_logprobs(kernels):
    """A seeded request alone, with others, with max_num_seqs 1 or 3, and preempted under a tiny cache:
    the same tokens and the same log-probs, bit for bit; greedy requests too (batch invariance)."""
    ps = prompts(128)
    params = [sampled(seed=11, n=3), he.SamplingParams(n=2, temperature=0.0, max_tokens=8)]
    cases = [("alone", {}, None), ("batched", {}, ps), ("max-3", dict(max_num_seqs=3), ps),
             ("max-4", dict(max_num_seqs=4), ps), ("preempted", dict(num_kv_blocks=12), ps),
             ("no-graphs", dict(cuda_graphs=False), ps)]
    if kernels == "interpreter":  # the kernels under the interpreter are slow on CPU: three compositions
        ps = ps[1:4]
        params = [sampled(seed=11, n=3, max_tokens=4), he.SamplingParams(n=2, temperature=0.0, max_tokens=4)]
        cases = [("alone", {}, None), ("batched", {}, ps), ("preempted", dict(num_kv_blocks=6, max_num_seqs=3), ps)]
    runs = {}
    for label, kw, batch in cases:
        engine = engine_for(**kw)
        got, preemptions = {}, 0
        for p in params:
            outs = generate(engine, [ps[1]] if batch is None else batch, [p] * (1 if batch is None else len(batch)))
            got[p.seed] = [(c.token_ids, c.logprobs) for c in outs[0 if batch is None else 1].outputs]
            preemptions += engine.stats["preemptions"]
        runs[label] = got
        if label == "preempted":
            assert preemptions > 0
    for label, got in runs.items():
        assert got == runs["alone"], label


def test_first_ppo_step_on_rollout_logprobs_has_ratio_one(kernels):
    """old_logprobs = the rollout's: the step's own forward computes the same bits (ratio 1, nothing clipped,
    KL 0), and rollout correction weights are exactly 1."""
    engine = engine_for()
    ps = prompts(128, [4, 7])
    seqs = completions(generate(engine, ps, sampled(n=2)))
    ids, mask, old = [], [], []
    for p, c, lp in seqs:
        ids.append(torch.tensor(p + c))
        m = torch.zeros(len(p) + len(c) - 1)
        m[len(p) - 1:] = 1
        mask.append(m)
        o = torch.zeros_like(m)
        o[len(p) - 1:] = torch.tensor(lp)
        old.append(o)
    adv = [m * (1.0 if i % 2 else -1.0) for i, m in enumerate(mask)]
    batch = he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=old, advantages=adv, rollout_logprobs=old)
    stats = engine.ppo_step(batch, he.PPOConfig(lr=1e-3, temperature=T, rollout_correction="tis",
                                                micro_batch_tokens=16))
    assert stats["ppo_kl"] == 0.0 and stats["pg_clipfrac"] == 0.0
    assert stats["rollout_corr_weight"] == 1.0


U32 = 2.0**-23
K = 4.0
"""Engine error <= K x the same-dtype plain forward's error + FLOOR_ULPS fp32 ulps of the largest log-prob.
Measured at fp32 on CPU: the engine's worst token is 0.9x (tiny-qwen2) and 1.2x (tiny-qwen3) the plain
forward's; an attention scale 2% off, or the exact GEMM's output rounded once through bf16, is 1000x or more."""
FLOOR_ULPS = 4


def plain_logprobs(model, seqs, dtype):
    """Each completion's log-probs at temperature T from the transformers model itself (eager attention, its own
    GEMMs), every sequence alone, in `dtype`."""
    model = copy.deepcopy(model).to(dtype)
    out = []
    with torch.no_grad():
        for p, c, _ in seqs:
            ids = torch.tensor(p + c)
            logp = (model(ids[None]).logits[0, :-1].to(dtype) / T).log_softmax(-1)
            out.append(logp.gather(-1, ids[1:, None]).squeeze(1)[len(p) - 1:].double())
    return out


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_exact_logprobs_are_the_models_up_to_fp32_rounding(name, kernels):
    """Rollout and trainer agree bit for bit (the tests above), so a numeric error in what they share (the exact
    GEMM, exact attention, their kernels) would pass those: here both are held to the same weights' log-probs
    from transformers in float64, within K x what transformers' own float32 forward is off them."""
    if kernels == "interpreter" and name != "tiny-qwen2":
        pytest.skip("the interpreter runs one model: its kernels are slow on CPU")
    from test_training import build

    hf = build(name)
    engine = engine_for(hf, device="cpu")
    lens, tokens = ([3, 9, 17], 6) if kernels == "native" else ([3, 9], 4)
    seqs = completions(generate(engine, prompts(engine.model_config.vocab_size, lens), sampled(max_tokens=tokens)))
    truth = plain_logprobs(hf, seqs, torch.float64)
    same_dtype_err = max((a - b).abs().max().item() for a, b in zip(plain_logprobs(hf, seqs, torch.float32), truth))
    floor = FLOOR_ULPS * U32 * max(t.abs().max().item() for t in truth)
    for label, got in (("rollout", [torch.tensor(lp, dtype=torch.float64) for _, _, lp in seqs]),
                       ("trainer", [t.double().cpu() for t in trainer_logprobs(engine, seqs)])):
        err = max((a - b).abs().max().item() for a, b in zip(got, truth))
        assert err <= K * same_dtype_err + floor, (
            f"{label} log-probs {err:.3g} off the float64 forward; transformers in float32 is {same_dtype_err:.3g} "
            f"off (allowed {K} x that + {floor:.2g})")


def _sharded_worker(rank, world, init_file, tp, expected, name, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        engine = engine_for(name, tp=tp, device="cpu")
        seqs = completions(generate(engine, prompts(128), sampled()))
        got = [lp for _, _, lp in seqs]
        if got != expected:
            errors.put(f"rank {rank} (N={world}, tg={tp}): rollout log-probs differ from one process's: "
                       f"{_differences(got, expected)}")
        trained = trainer_logprobs(engine, seqs, micro_batch_tokens=24)
        rollout = [lp for _, _, lp in seqs]
        if not all(torch.equal(t, torch.tensor(lp, dtype=torch.float32)) for t, lp in zip(trained, rollout)):
            errors.put(f"rank {rank} (N={world}, tg={tp}): trainer log-probs differ from the rollout's: "
                       f"{_differences([t.tolist() for t in trained], rollout)}")


def _differences(got: list[list[float]], expected: list[list[float]]) -> str:
    """Where two lists of per-token log-probs part: unequal sequences and tokens, the largest difference."""
    pairs = [(g, e) for g, e in zip(got, expected) if g != e]
    tokens = sum(sum(a != b for a, b in zip(g, e)) + abs(len(g) - len(e)) for g, e in pairs)
    diff = max((abs(a - b) for g, e in pairs for a, b in zip(g, e)), default=0.0)
    return (f"{len(pairs)} of {len(expected)} sequences, {tokens} tokens, max |difference| {diff:.3g}, "
            f"lengths {[len(g) for g in got]} vs {[len(e) for e in expected]}, threads {torch.get_num_threads()}")


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2), (2, 1)])
def test_sharded_ranks_and_tp_give_the_single_process_bits(world, tp):
    """N in {2, 4} gloo ranks and tg in {1, 2}: the rollout's log-probs are one process's, bit for bit (the
    row-parallel projections add two fp32 halves in the TP all-reduce as one process adds them), and each
    rank's trainer (ZeRO-3 shards, this rank's micro-batches) computes them again exactly."""
    engine = engine_for(device="cpu")
    expected = [lp for _, _, lp in completions(generate(engine, prompts(128), sampled()))]
    spawn(_sharded_worker, world, tp, expected, "tiny-qwen2")


def test_tp_bits_with_a_hidden_size_under_one_column_chunk():
    """tg = 2 with hidden_size 32: o_proj's and down_proj's partials are narrower than the torch path's 64-column
    chunk (`exact_linear.COL_CHUNK`) and span several rows, so a partial that was a strided slice of the padded
    chunk products went into the all-reduce as it stood, and the all-reduce summed the wrong elements. The
    rollout's log-probs are one process's, bit for bit, and the trainer's."""
    narrow = he.model_config("tiny-qwen2")
    narrow.hidden_size = 32  # head_dim 8
    expected = [lp for _, _, lp in completions(generate(engine_for(narrow, device="cpu"), prompts(128), sampled()))]
    spawn(_sharded_worker, 2, 2, expected, narrow)


def _strided_sum_worker(rank, world, init_file, errors):
    from hybridengine.model.tensor_parallel import GroupAllReduce, all_reduce_fp32

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        for reduce in (lambda t: all_reduce_fp32(t, None), GroupAllReduce(None).all_reduce_):
            padded = torch.arange(4 * 8, dtype=torch.float32).view(4, 8) * (rank + 1)
            part = padded[:3, :5]  # rows of a padded product: not contiguous
            got = reduce(part)
            assert torch.equal(got, padded[:3, :5] / (rank + 1) * 3), got


def test_a_strided_partial_is_summed_whole():
    """`all_reduce_fp32` and `GroupAllReduce.all_reduce_` sum every element of a strided partial (gloo alone
    reduces `numel` elements from the data pointer: here the first row and part of the second)."""
    spawn(_strided_sum_worker, 2)


@pytest.mark.parametrize("exact", [False, True])
def test_ppo_steps_repeat_bitwise_and_resume_bitwise(exact, tmp_path):
    """The same inputs and seed give the same weights after two steps; a run saved after one step and
    resumed equals the uninterrupted one."""
    def batch():
        g = torch.Generator().manual_seed(3)
        ids = [torch.randint(0, 128, (n,), generator=g) for n in (9, 14, 5)]
        mask = [torch.ones(len(i) - 1) for i in ids]
        return he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=[-torch.rand(len(i) - 1, generator=g)
                                                                           for i in ids],
                           advantages=[torch.randn(len(i) - 1, generator=g) for i in ids])

    cfg = he.PPOConfig(lr=1e-3, micro_batch_tokens=12)

    def weights(engine):
        """The bf16 weights and every optimizer state tensor (the fp32 master's low halves, the moments)."""
        return [engine.sharded.flat_buffer.data.clone(), *(t.clone() for t in engine.trainer.optimizer.state_tensors())]

    def equal(x, y):
        return len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    a, b = engine_for(exact=exact, dtype=dtype), engine_for(exact=exact, dtype=dtype)
    for _ in range(2):
        a.ppo_step(batch(), cfg)
        b.ppo_step(batch(), cfg)
    assert equal(weights(a), weights(b))
    c = engine_for(exact=exact, dtype=dtype)
    c.ppo_step(batch(), cfg)
    c.save(tmp_path / "ckpt")
    resumed = he.HybridEngine.load(tmp_path / "ckpt")
    resumed.ppo_step(batch(), cfg)
    assert equal(weights(resumed), weights(a))


def test_exact_config_is_checked():
    with pytest.raises(ValueError, match="exact_logprobs must be a bool"):
        he.EngineConfig(device="cpu", exact_logprobs=1)
    with pytest.raises(ValueError, match="exact_logprobs=True needs tp_generation 1 or 2"):
        he.EngineConfig(device="cpu", exact_logprobs=True, tp_generation=4)
    with pytest.raises(ValueError, match="exact_logprobs=True on CUDA needs EngineTuning.fused_training=True"):
        he.EngineConfig(device="cuda", exact_logprobs=True, tuning=he.EngineTuning(fused_training=False))
