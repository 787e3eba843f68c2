"""The fused sampler (hybridengine.ops.sample_fused, hybridengine/kernels/sampling.py) against its plain-torch
reference under the Triton interpreter (on CUDA: the kernel on the GPU), and the engine's use of it."""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

import hybridengine as he
from hybridengine.ops.sample_fused import philox_ref, race_exp_ref, sample_fused, sample_fused_ref
from hybridengine.rollout.sampling_params import SamplingParams

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _randint4x_kernel(Keys, Offsets, Out, N: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N)
    off = tl.load(Offsets + row * N + i)
    words = tl.randint4x(tl.load(Keys + row), off)
    for j in tl.static_range(4):
        tl.store(Out + (row * 4 + j) * N + i, words[j].to(tl.int64) & 0xFFFFFFFF)


def test_philox_ref_equals_triton_randint4x(device):
    """The reference's Philox4x32-10 is bit for bit Triton's `tl.randint4x` (all four words), with the
    counter's low and high words both in use."""
    keys = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**61 + 12345, 2**62 - 1], dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    offsets = torch.randint(0, 2**31, (len(keys), 16), generator=g, dtype=torch.int64)
    offsets[:, :8] += torch.randint(0, 2**20, (len(keys), 8), generator=g) << 32  # the draw word
    out = torch.empty(len(keys), 4, 16, dtype=torch.int64, device=device)
    _randint4x_kernel[(len(keys),)](keys.to(device), offsets.to(device), out, N=16)
    ref = torch.stack(philox_ref(keys[:, None], offsets & 0xFFFFFFFF, offsets >> 32), 1)
    assert torch.equal(out.cpu(), ref)


def _tolerances(s: torch.Tensor, splits: int, block: int) -> tuple[float, float]:
    """Race-score and log-prob bounds from the rounding of exp/log and of the sums' order.
    The kernel's score log(exp(s - M)) - log(E) + M with |s - M| <= 2 max|s| and |log E| <= 23 (E in
    [2^-33, 23]): a few ulps of each exp/log -> 16 ulps of (max|s| + 23). lse: each lane adds
    V / (splits * block) terms, then block lanes and splits merge: (V / block + log2 block + splits + 8)
    ulps, plus the exp/log ulps of max|s|."""
    u = 2.0**-23
    V = s.shape[1]
    score_tol = 16 * u * (s.abs().max().item() + 23)
    lp_tol = u * (4 * s.abs().max().item() + V / block + math.log2(block) + splits + 8)
    return score_tol, lp_tol


def _check_against_ref(logits, inv_temp, keys, draws, splits, block):
    tok, lp = sample_fused(logits, inv_temp, keys, draws, splits=splits, block=block)
    ref_tok, ref_lp = sample_fused_ref(logits.cpu(), inv_temp.cpu(), keys.cpu(), draws.cpu())
    s = logits.cpu().float() * inv_temp.cpu()[:, None]
    noise = -torch.log(race_exp_ref(keys.cpu().clamp(min=0), draws.cpu(), s.shape[1]))
    score = torch.where((keys.cpu() < 0)[:, None], s, s + noise)
    score_tol, lp_tol = _tolerances(s, splits or 1, block)
    tok = tok.cpu()
    for r in range(len(tok)):
        if tok[r] != ref_tok[r]:  # only a near-tie of two race scores may go either way
            assert score[r, tok[r]] >= score[r, ref_tok[r]] - score_tol, (r, tok[r], ref_tok[r])
    greedy = keys.cpu() < 0
    assert torch.equal(tok[greedy], ref_tok[greedy])  # no noise: the first maximal logit, exactly
    same = tok == ref_tok
    torch.testing.assert_close(lp.cpu()[same], ref_lp[same], rtol=0, atol=lp_tol)
    return tok, lp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,splits,block", [(97, 1, 32), (1000, 3, 128), (3001, None, 256), (517, 7, 64)])
def test_sample_fused_equals_reference(device, dtype, V, splits, block):
    g = torch.Generator().manual_seed(V)
    B = 6
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
    logits[1, V // 3] = logits[1, 2 * V // 3] = logits[1].max() + 1  # a greedy row with a tie: the first wins
    inv_temp = torch.tensor([1.0, 1.0, 1 / 0.7, 2.0, 1.0, 1 / 1.3])
    keys = torch.tensor([5, -1, 2**61 + 3, 17, -1, 2**40], dtype=torch.int64)
    draws = torch.tensor([0, 0, 9, 123456, 0, 2], dtype=torch.int32)
    tok, _ = _check_against_ref(logits.to(device), inv_temp.to(device), keys.to(device), draws.to(device),
                                splits, block)
    assert tok[1] == V // 3


@pytest.mark.parametrize("drawn_at", [0.7, 0.9 * 0.7])
def test_sample_fused_ref_follows_the_distribution(drawn_at):
    """The reference's race over 20000 independent keys samples softmax(logits / T), T = 0.7: Pearson's
    chi-square accepts its draws (p > 1e-4) and rejects a race run at 0.9 T instead (noncentrality
    n * sum((p_0.9T - p_T)^2 / p_T) = 190 against the 1e-4 critical value 23.5 at 4 degrees of freedom)."""
    from conftest import chi_square_p_value

    n, T = 20000, 0.7
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).repeat(n, 1)
    keys = torch.arange(n, dtype=torch.int64) * 7919 + 11
    tokens, lp = sample_fused_ref(logits, torch.full((n,), 1 / drawn_at), keys, torch.zeros(n, dtype=torch.int32))
    probs = (logits[0] / T).softmax(-1)
    p_value = chi_square_p_value(tokens, probs)
    assert (p_value > 1e-4) == (drawn_at == T), p_value
    if drawn_at == T:
        torch.testing.assert_close(lp, probs.log()[tokens], rtol=0, atol=1e-5)
        # the draw counter gives fresh numbers: the same key at draw 1 is another sample
        again, _ = sample_fused_ref(logits, torch.full((n,), 1 / T), keys, torch.ones(n, dtype=torch.int32))
        assert 0.2 < (again != tokens).float().mean() < 0.9


def test_sample_fused_rejects_bad_arguments():
    logits = torch.randn(3, 10)
    inv, keys, draws = torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)
    cases = [((torch.randn(10), inv, keys, draws), "logits must be a non-empty 2-D"),
             ((logits.t(), torch.ones(10), torch.zeros(10, dtype=torch.int64), torch.zeros(10, dtype=torch.int32)),
              "unit stride"),
             ((logits.long(), inv, keys, draws), "logits must be bf16/fp16/fp32"),
             ((logits, torch.ones(2), keys, draws), r"inv_temp must be a \[3\] torch.float32"),
             ((logits, inv, keys.int(), draws), r"keys must be a \[3\] torch.int64"),
             ((logits, inv, keys, draws.float()), r"draws must be a \[3\]")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            sample_fused(*args)
    with pytest.raises(ValueError, match="splits must be an int >= 1"):
        sample_fused(logits, inv, keys, draws, splits=0)
    with pytest.raises(ValueError, match="block must be a power of 2 >= 16"):
        sample_fused(logits, inv, keys, draws, block=24)
    with pytest.raises(ValueError, match="col_offset must be a non-negative multiple of 4, got 6"):
        sample_fused(logits, inv, keys, draws, col_offset=6)
    with pytest.raises(ValueError, match=r"n_valid must be an int in \[0, 10\], got 11"):
        sample_fused(logits, inv, keys, draws, n_valid=11)


def _vocab_parallel_worker(rank, world, init_file, logits, inv, keys, draws, expected, errors):
    import torch.distributed as dist

    from _dist import reporting

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        rows = -(-logits.shape[1] // world // 4) * 4  # a multiple of 4; the last rank's shard is zero-padded
        part = torch.zeros(logits.shape[0], rows, dtype=logits.dtype)
        mine = logits[:, rank * rows:(rank + 1) * rows]
        part[:, :mine.shape[1]] = mine
        tok, lp = sample_fused(part, inv, keys, draws, col_offset=rank * rows, n_valid=mine.shape[1],
                               group=dist.group.WORLD, splits=2, block=32)
        if not torch.equal(tok, expected[0]):
            errors.put(f"rank {rank}: tokens {tok.tolist()} != {expected[0].tolist()}")
        elif not torch.allclose(lp, expected[1], rtol=0, atol=1e-5):
            errors.put(f"rank {rank}: log-probs {lp.tolist()} != {expected[1].tolist()}")


@pytest.mark.skipif(not _INTERP, reason="CPU tensors through the kernels: the interpreter")
def test_sample_fused_vocab_parallel_equals_one_rank():
    """Two gloo ranks, each with half of a 203-column vocabulary (the second half zero-padded to 104
    columns): the same tokens as one call over all columns (the noise follows the vocabulary column);
    log-probs to the order of the sum's adds."""
    from _dist import spawn

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 203, generator=g) * 3
    inv = torch.tensor([1.0, 1 / 0.7, 1.0, 2.0, 1.0])
    keys = torch.tensor([-1, 11, 2**50, 3, -1], dtype=torch.int64)
    draws = torch.tensor([0, 4, 1, 0, 0], dtype=torch.int32)
    expected = sample_fused(logits, inv, keys, draws, splits=3, block=32)
    spawn(_vocab_parallel_worker, 2, logits, inv, keys, draws, expected)


def _engine(sampler, **kw):
    torch.manual_seed(0)
    return he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
        dtype=torch.float32, device="cpu", block_size=4, max_model_len=64, max_num_seqs=8,
        tuning=he.EngineTuning(sampler=sampler), **kw))


@pytest.mark.skipif(not _INTERP, reason="the engine's fused sampler on CPU runs under TRITON_INTERPRET=1")
def test_engine_fused_sampler_greedy_matches_torch_and_seeded_ignores_the_batch():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=6)
    seeded = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3)
    outs = {}
    for sampler in ("torch", "fused"):
        engine = _engine(sampler)
        with engine.rollout():
            outs[sampler] = engine.generate(prompts, greedy)
            if sampler == "fused":
                # a seeded request alone, beside other requests, and beside a truncating request (a mixed
                # step: the truncating rows take `sample`), gives the same tokens
                alone = engine.generate(prompts[1:2], seeded)
                mixed = engine.generate(prompts, [SamplingParams(max_tokens=4), seeded,
                                                  SamplingParams(top_k=5, max_tokens=6, seed=1)])
                again = engine.generate(prompts[1:2], seeded)
    for a, b in zip(outs["torch"], outs["fused"]):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=1e-5)
    ids = [o.token_ids for o in alone[0].outputs]
    assert ids == [o.token_ids for o in mixed[1].outputs] == [o.token_ids for o in again[0].outputs]
    assert ids[0] != ids[1]  # the samples of one request draw different streams


def test_engine_config_sampler_checks(monkeypatch):
    with pytest.raises(ValueError, match="sampler must be 'auto', 'fused' or 'torch', got 'gumbel'"):
        he.EngineTuning(sampler="gumbel")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"sampler='fused' on device 'cpu' needs CUDA or TRITON_INTERPRET=1"):
        he.EngineConfig(device="cpu", tuning=he.EngineTuning(sampler="fused"))


# ---------------------------------------------------------------------------------------------------------
# top-p at its boundary: the rows that truncate (`sample`, `sample_ref`, and the fused sampler's mixed steps,
# which give them to `sample`) against the nucleus written out here

NUCLEUS_PROBS = [0.0625, 0.5, 0.125, 0.0625, 0.25]
"""Binary fractions, shuffled: their log-softmax and every partial sum are exact in fp32, so a top_p of 0.5,
0.75 or 0.875 lands exactly on a prefix's mass (the two 0.0625 tie, and no top_p here splits them)."""


def nucleus(probs: list[float], top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p (HF's TopPLogitsWarper and vLLM keep
    the token that crosses it; at an exact tie the prefix that reaches it is enough)."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def _assert_draws_from_nucleus(tokens: torch.Tensor, top_p: float) -> None:
    """Every kept token drawn and nothing else (the smallest kept probability is >= 1/16: 400 draws all miss
    it with probability < 1e-11), in proportions the chi-square test accepts (p > 1e-4)."""
    from conftest import chi_square_p_value

    kept = sorted(nucleus(NUCLEUS_PROBS, top_p))
    assert set(tokens.tolist()) == set(kept), (top_p, sorted(set(tokens.tolist())), kept)
    if len(kept) > 1:
        index = torch.tensor([kept.index(t) for t in tokens.tolist()])
        probs = torch.tensor([NUCLEUS_PROBS[t] for t in kept], dtype=torch.float64)
        p_value = chi_square_p_value(index, probs / probs.sum())
        assert p_value > 1e-4, (top_p, p_value)


TOP_PS = [0.5, 0.6, 0.75, 0.8, 0.875, 1.0]
"""Exactly at a prefix's mass (0.5, 0.75, 0.875: keep that prefix), between two (0.6, 0.8: keep the token
that crosses), and the whole vocabulary."""


@pytest.mark.parametrize("sampler", ["sample", "sample_ref"])
def test_top_p_keeps_the_smallest_prefix_that_reaches_p(sampler):
    from hybridengine.rollout.sampler import sample, sample_ref

    fn = sample if sampler == "sample" else sample_ref
    n = 400
    logits = torch.tensor(NUCLEUS_PROBS).log()
    assert logits.softmax(-1).tolist() == NUCLEUS_PROBS  # the ties are exact in fp32
    params = [SamplingParams(temperature=1.0, top_p=p) for p in TOP_PS for _ in range(n)]
    tokens, logprobs = fn(logits.repeat(len(params), 1), params, [None] * len(params))
    for i, p in enumerate(TOP_PS):
        _assert_draws_from_nucleus(tokens[i * n:(i + 1) * n], p)
    # the log-probs are the untruncated distribution's
    assert torch.equal(logprobs, logits.log_softmax(-1)[tokens])


@pytest.mark.skipif(not _INTERP and not torch.cuda.is_available(), reason="the fused sampler needs CUDA or the "
                    "Triton interpreter")
def test_fused_sampler_steps_keep_the_top_p_nucleus(device):
    """The fused sampler does not truncate: in a step that mixes its rows with truncating ones, the truncating
    rows take `sample` and keep the nucleus at its boundary."""
    from hybridengine.rollout.sampler import Sampler
    from hybridengine.rollout.sequence import Sequence

    n = 400
    rows = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=1.0, top_p=p) for p in (0.75, 0.6)
                                                for _ in range(n)] + [SamplingParams(temperature=1.0)]
    seqs = [Sequence(request=i, token_ids=[1], num_prompt_tokens=1, params=p) for i, p in enumerate(rows)]
    logits = torch.tensor(NUCLEUS_PROBS).log().repeat(len(rows), 1).to(device)
    tokens, _ = Sampler(seed=0)(logits, seqs, "fused")
    tokens = tokens.cpu()
    assert tokens[0] == 1
    _assert_draws_from_nucleus(tokens[1:n + 1], 0.75)
    _assert_draws_from_nucleus(tokens[n + 1:2 * n + 1], 0.6)


@pytest.mark.gpu
def test_sample_fused_on_cuda_at_a_real_vocabulary():
    """The GPU kernel (ex2/lg2 approximations) at Qwen2's 151,936 columns, the auto split plan."""
    g = torch.Generator().manual_seed(3)
    B, V = 16, 151936
    logits = (torch.randn(B, V, generator=g) * 4).to(torch.bfloat16)
    inv_temp = torch.tensor([1.0, 1 / 0.6] * 8)
    keys = torch.tensor([-1 if i % 5 == 0 else 1000 + i for i in range(B)], dtype=torch.int64)
    draws = torch.arange(B, dtype=torch.int32)
    _check_against_ref(logits.cuda(), inv_temp.cuda(), keys.cuda(), draws.cuda(), None, 1024)
