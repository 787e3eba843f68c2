"""The shipped losses (`hybridengine.train.losses`) through `HybridEngine.train_step` against full-logits
references in plain torch, at N = 1 and N = 2 gloo ranks, with packing and several micro-batches a rank.

The references share no code with the package: a transformers model (eager attention) scores each sequence
alone (full [T, V] logits, log-softmax), and each loss is written again from its paper's definition, with
loops over sequences and pairs, over a rank's whole batch at once (no micro-batches): the engine's split
into micro-batches and its weighting (`TrainConfig.loss_scale`) must give the same loss. The step's loss
is the mean of the ranks' losses ("tokens" / "sequences") or the mean over every rank's tokens
("global-tokens") or sequences ("global-sequences"); its gradient is compared with the engine's gradient
shards (keep_grads), gathered.

Tolerance, as in tests/test_ppo_loss.py: the truth is the reference in float64; the engine (float32) may be
off it by at most K x what the same reference in float32 is off it, plus a floor. The float32 reference
measures the conditioning of each quantity on these inputs; but the engine's forward rounds differently
from the reference model's (packed attention, its own kernels), so the log-probs the loss sees carry their
own fp32 errors, which a sum over a sequence (GSPO's ratio, DPO's margins) gathers: the floor is the
worst-case rounding of an n-term sum, n fp32 ulps of the quantity's scale, with n the step's response
tokens (all ranks). Measured: DPO's gradients are off by up to ~35 fp32 ulps of their scale with n = 52,
the other losses' by at most ~2 x the float32 reference's error.
"""

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridengine as he
import _formulas as formulas
from hybridengine.train import losses as L
from _dist import reporting, spawn
from test_train_step import engine_for, full_grads
from test_training import build

torch.set_num_threads(1)

K = 2.0
"""Engine error <= K x the float32 reference's error + the floor (module docstring)."""
U32 = 2.0**-23
U64 = 2.0**-53
TEMPERATURE = 0.9
MICRO_BATCH_TOKENS = 24

LOSSES = {
    # name: (options, TrainConfig fields)
    "ppo_clip": (dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01), dict(loss_scale="tokens")),
    "gspo": (dict(clip_low=0.04, clip_high=0.05), dict(loss_agg="seq-mean-token-mean", loss_scale="sequences")),
    "cispo": (dict(clip_high=0.2), dict(loss_scale="tokens")),
    "sft_nll": (dict(), dict(loss_scale="tokens")),
    "sft_nll_global": (dict(), dict(loss_scale="global-tokens")),
    # each sequence's mean NLL, averaged over every rank's sequences: sequences of 3 to 11 response tokens,
    # so a weighting by tokens (of micro-batches, of ranks) gives another loss and gradient
    "sft_nll_global_sequences": (dict(loss_agg="seq-mean-token-mean"), dict(loss_scale="global-sequences")),
    "dpo": (dict(beta=0.5, label_smoothing=0.1), dict(loss_scale="sequences")),
}


def loss_fn(name):
    options = LOSSES[name][0]
    return functools.partial(getattr(L, name.removesuffix("_sequences").removesuffix("_global")), **options)


# ---------------------------------------------------------------------------------------------------------
# the data: per rank, a batch of sequences (pairs for DPO) with fields, reference log-probs from a frozen engine


def make_batches(hf, world: int, seed: int = 11) -> list[dict]:
    """Per rank: PPOBatch kwargs. Ranks get different numbers of sequences and tokens (the weighting across
    ranks matters); sequences 2k and 2k + 1 form DPO pair k (groups). ref_logprobs: the log-probs of a frozen
    engine on a perturbed copy of the model."""
    g = torch.Generator().manual_seed(seed)
    V = hf.config.vocab_size
    ref_model = copy.deepcopy(hf)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    frozen = engine_for(ref_model)
    out = []
    for rank in range(world):
        pairs = 3 + rank
        ids, mask, old, adv = [], [], [], []
        for _ in range(pairs):
            prompt = torch.randint(0, V, (int(torch.randint(2, 6, (), generator=g)),), generator=g)
            a = float(torch.randn((), generator=g))
            for _ in range(2):
                response = torch.randint(0, V, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
                seq = torch.cat([prompt, response])
                m = torch.zeros(len(seq) - 1)
                m[len(prompt) - 1:] = 1
                ids.append(seq)
                mask.append(m)
                adv.append(torch.full((len(seq) - 1,), a))  # constant over the sequence: GSPO is GSPO-token
                a = -a
        batch = he.PPOBatch(input_ids=ids, response_mask=mask)
        logp = frozen.log_probs(batch, temperature=TEMPERATURE)
        ref = [logp[b, :len(s) - 1].clone() for b, s in enumerate(ids)]
        with torch.no_grad():
            cur = [_seq_logprobs(hf, s, torch.float32) for s in ids]
        old = [c + 0.3 * torch.randn(c.shape, generator=g) for c in cur]
        out.append(dict(input_ids=ids, response_mask=mask, old_logprobs=old, advantages=adv, ref_logprobs=ref,
                        groups=[b // 2 for b in range(len(ids))]))
    return out


# ---------------------------------------------------------------------------------------------------------
# the references: per-sequence full logits and each loss from its definition


def _seq_logprobs(model, seq, dtype):
    logits = model(seq[None]).logits[0, :-1].to(dtype) / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, seq[1:, None]).squeeze(1)


def _seq_entropy(model, seq, dtype):
    logp = (model(seq[None]).logits[0, :-1].to(dtype) / TEMPERATURE).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def rank_loss(name, model, b, dtype):
    """(the loss of one rank's whole batch from the definitions (no micro-batches), its response tokens; its
    sequences for a per-sequence mean)."""
    options = LOSSES[name][0]
    seqs = b["input_ids"]
    masks = [m.to(dtype) for m in b["response_mask"]]
    logps = [_seq_logprobs(model, s, dtype) for s in seqs]
    olds = [o.to(dtype) for o in b["old_logprobs"]]
    advs = [a.to(dtype) for a in b["advantages"]]
    tokens = sum(m.sum() for m in masks)
    if name == "sft_nll_global_sequences":
        per_seq = [-(m * lp).sum() / m.sum() for m, lp in zip(masks, logps)]
        return sum(per_seq) / len(per_seq), len(per_seq)
    if name.startswith("sft_nll"):
        return -sum((m * lp).sum() for m, lp in zip(masks, logps)) / tokens, tokens
    if name == "cispo":
        total = 0
        for m, lp, o, a in zip(masks, logps, olds, advs):
            weight = torch.clamp(torch.exp(lp.detach() - o), max=1 + options["clip_high"])  # no lower bound
            total = total - (m * weight * a * lp).sum()
        return total / tokens, tokens
    if name == "gspo":
        per_seq = []
        for m, lp, o, a in zip(masks, logps, olds, advs):
            s = torch.exp((m * (lp - o)).sum() / m.sum())  # the sequence-level ratio
            adv = a[0]
            if adv > 0:
                per_seq.append(-adv * torch.clamp(s, max=1 + options["clip_high"]))
            else:
                per_seq.append(-adv * torch.clamp(s, min=1 - options["clip_low"]))
        return sum(per_seq) / len(per_seq), tokens
    if name == "dpo":
        refs = [r.to(dtype) for r in b["ref_logprobs"]]
        beta, ls = options["beta"], options["label_smoothing"]
        pair_losses = []
        for k in range(0, len(seqs), 2):
            chosen = (masks[k] * (logps[k] - refs[k])).sum()
            rejected = (masks[k + 1] * (logps[k + 1] - refs[k + 1])).sum()
            z = beta * (chosen - rejected)
            pair_losses.append(-(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z))
        return sum(pair_losses) / len(pair_losses), tokens
    assert name == "ppo_clip"
    width = max(len(s) for s in seqs) - 1
    pad = lambda rows: torch.stack([F.pad(r, (0, width - len(r))) for r in rows])  # noqa: E731
    hidden = torch.nn.utils.rnn.pad_sequence([model.model(s[None]).last_hidden_state[0, :-1] for s in seqs],
                                             batch_first=True)
    targets = pad([s[1:] for s in seqs])
    loss, _ = formulas.ppo_loss(hidden, model.lm_head.weight, targets, pad(olds), pad(advs), pad(masks),
                                temperature=TEMPERATURE, clip_low=options["clip_low"], clip_high=options["clip_high"],
                                clip_ratio_c=None, ref_logprobs=pad([r.to(dtype) for r in b["ref_logprobs"]]),
                                kl_coef=options["kl_coef"], kl_estimator="k3", entropy_coef=options["entropy_coef"],
                                loss_agg="token-mean")
    return loss, tokens


def reference(hf, name, batches, dtype):
    """(step loss, gradients) in `dtype`: the mean of the ranks' losses, or for 'global-tokens' the sum of
    every rank's token sum over all tokens ('global-sequences': sequence sums over all sequences)."""
    model = copy.deepcopy(hf).to(dtype)
    per_rank = [rank_loss(name, model, b, dtype) for b in batches]
    if LOSSES[name][1]["loss_scale"] in ("global-tokens", "global-sequences"):
        total = sum(t for _, t in per_rank)
        loss = sum(l * t for l, t in per_rank) / total
    else:
        loss = sum(l for l, _ in per_rank) / len(per_rank)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def references(hf, batches):
    return {name: (reference(hf, name, batches, torch.float64), reference(hf, name, batches, torch.float32))
            for name in LOSSES}


# ---------------------------------------------------------------------------------------------------------
# the engine side


def assert_close_to_truth(label, got, same_dtype, truth, tokens):
    err = (got.double() - truth.double()).abs().max().item()
    ref_err = (same_dtype.double() - truth.double()).abs().max().item()
    floor = tokens * U32 * max(truth.double().abs().max().item(), 1e-3)
    assert err <= K * ref_err + floor, (f"{label}: {err:.3g} off the fp64 truth; the fp32 reference is {ref_err:.3g} "
                                        f"off (allowed {K} x that + {floor:.2g})")


def check_engine(hf, batches, refs, rank, world):
    tokens = sum(float(m.sum()) for b in batches for m in b["response_mask"])
    for name, ((loss64, grads64), (loss32, grads32)) in refs.items():
        engine = engine_for(hf, keep_grads=True)
        cfg = he.TrainConfig(micro_batch_tokens=MICRO_BATCH_TOKENS, temperature=TEMPERATURE, max_grad_norm=None,
                             lr=1e-3, **LOSSES[name][1])
        stats = engine.train_step(he.PPOBatch(**batches[rank]), loss_fn(name), cfg)
        assert stats["micro_batches"] >= 3, stats["micro_batches"]
        assert stats["skipped"] == 0
        loss = torch.tensor(stats["loss"], dtype=torch.float64)
        if name == "sft_nll_global":  # the rank's stat is its own token mean: weight it by its tokens
            tokens = torch.tensor(sum(float(m.sum()) for m in batches[rank]["response_mask"]), dtype=torch.float64)
            loss = loss * tokens
            if world > 1:
                dist.all_reduce(loss)
                dist.all_reduce(tokens)
            loss = loss / tokens
        elif name == "sft_nll_global_sequences":  # the rank's stat is its own sequence mean
            seqs = torch.tensor(float(len(batches[rank]["input_ids"])), dtype=torch.float64)
            loss = loss * seqs
            if world > 1:
                dist.all_reduce(loss)
                dist.all_reduce(seqs)
            loss = loss / seqs
        elif world > 1:
            dist.all_reduce(loss)
            loss /= world
        assert_close_to_truth(f"{name} loss", loss, loss32, loss64, tokens)
        grads = full_grads(engine)
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
        for n, truth in grads64.items():
            if n in tied and n not in grads:
                continue  # tied: the embedding's gradient holds both shares (the reference's too)
            assert_close_to_truth(f"{name} grad {n}", grads[n], grads32[n], truth, tokens)


def test_losses_match_full_logits_reference_single_process():
    hf = build()
    batches = make_batches(hf, 1)
    check_engine(hf, batches, references(hf, batches), 0, 1)


def _worker(rank, world, init_file, batches, refs, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        check_engine(build(), batches, refs, rank, world)


def test_losses_match_full_logits_reference_data_parallel():
    hf = build()
    batches = make_batches(hf, 2)
    spawn(_worker, 2, batches, references(hf, batches))


def test_dpo_needs_whole_pairs():
    """Without groups a pair can straddle two micro-batches: DPO says what to set."""
    hf = build()
    b = make_batches(hf, 1)[0]
    b.pop("groups")
    engine = engine_for(hf)
    with pytest.raises(L.LossFnError, match=r"dpo: the micro-batch holds sequences \[.*\]; it must hold whole pairs"):
        engine.train_step(he.PPOBatch(**b), loss_fn("dpo"), he.TrainConfig(micro_batch_tokens=MICRO_BATCH_TOKENS))
    assert not engine.trainer.has_optimizer


def test_loss_options_are_checked():
    fields = L.LossFields(mask=torch.ones(2, 3, dtype=torch.bool), old_logprobs=torch.zeros(2, 3),
                          advantages=torch.ones(2, 3), ref_logprobs=torch.zeros(2, 3),
                          seq_index=torch.tensor([[0] * 3, [1] * 3]))
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="gspo: clip_low must be a finite number >= 0, got -0.1"):
        L.gspo(logp, logp, fields, clip_low=-0.1)
    with pytest.raises(ValueError, match="cispo: loss_agg must be one of"):
        L.cispo(logp, logp, fields, loss_agg="mean")
    with pytest.raises(ValueError, match="dpo: beta must be a finite number > 0, got 0"):
        L.dpo(logp, logp, fields, beta=0)
    with pytest.raises(ValueError, match="ppo_clip.*clip_low must be in"):
        L.ppo_clip(logp, logp, fields, clip_low=1.5)
    with pytest.raises(L.MissingFieldError, match=r"fields\['nope'\]: this batch has no such field"):
        fields["nope"]
    assert isinstance(L.MissingFieldError("x"), KeyError)


# ---------------------------------------------------------------------------------------------------------
# the options that bind only past a bound: written out per token, in float64, on planted log-ratios


def _planted_fields(log_ratios, advantages, lengths, width):
    """fp64 LossFields of len(lengths) sequences padded to `width`: row i's first lengths[i] tokens masked in
    with log(pi / pi_old) = log_ratios[i] (a list per token) and advantage advantages[i]; the masked-out
    tail carries a log-ratio of 50 and an advantage of -3, which must reach nothing. Returns (logp leaf,
    fields)."""
    g = torch.Generator().manual_seed(4)
    B = len(lengths)
    logp = -torch.rand(B, width, generator=g, dtype=torch.float64) * 3 - 0.1
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    diff = torch.full((B, width), 50.0, dtype=torch.float64)
    for i, r in enumerate(log_ratios):
        diff[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
    adv = torch.where(mask, torch.tensor(advantages, dtype=torch.float64)[:, None], -3.0)
    fields = L.LossFields(mask=mask, old_logprobs=logp - diff, advantages=adv,
                          seq_index=torch.arange(B)[:, None].expand(B, width))
    return logp.clone().requires_grad_(), fields


def _assert_fp64_close(label, got, want, terms):
    """Two float64 evaluations of one formula in different orders, over sums of at most `terms` terms: 4 fp64
    ulps of the largest value per term."""
    tol = 4 * terms * U64 * max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    assert err <= tol, f"{label}: {err:.3g} off the formula (allowed {tol:.2g})\n{got}\n{want}"



@pytest.mark.parametrize("clip_low", [0.2, None])
def test_cispo_clips_the_weight_below_at_clip_low(clip_low):
    """CISPO's weight is clamp(r, 1 - clip_low, 1 + clip_high), no lower bound for clip_low None, and carries
    no gradient: loss = -sum(w A logp) / tokens, dloss/dlogp = -w A / tokens. The planted ratios
    e^-0.7 = 0.50 and e^-0.3 = 0.74 lie below 1 - 0.2, e^-0.1 = 0.90 and e^0.2 = 1.22 inside, e^0.5 = 1.65
    above 1 + 0.28: with clip_low 0.2 the first two weigh 0.8, with None 0.50 and 0.74."""
    ratios = [[-0.7, 0.2, -0.1], [0.5, -0.3], [-0.1, -0.7, 0.5, 0.2]]
    logp, fields = _planted_fields(ratios, [1.5, -0.8, 0.6], [3, 2, 4], width=5)
    clip_high = 0.28
    low = 0.0 if clip_low is None else 1 - clip_low
    total, grad, tokens, clipped = 0.0, torch.zeros_like(logp), 0, 0
    for i, row in enumerate(ratios):
        a = fields["advantages"][i, 0].item()
        for t, lr in enumerate(row):
            r = math.exp(lr)
            w = min(max(r, low), 1 + clip_high)
            total -= w * a * logp[i, t].item()
            grad[i, t] = -w * a
            tokens += 1
            clipped += w != r
    loss, metrics = L.cispo(logp, None, fields, clip_low=clip_low, clip_high=clip_high)
    loss.backward()
    _assert_fp64_close("loss", loss.detach(), torch.tensor(total / tokens, dtype=torch.float64), tokens)
    _assert_fp64_close("dloss/dlogp", logp.grad, grad / tokens, tokens)
    # 3 weights below 0.8, 2 above 1.28
    assert metrics["is_clipfrac"].item() == clipped / tokens == (5 if clip_low is not None else 2) / 9


def test_gspo_caps_the_sequence_log_ratio_at_10():
    """GSPO's sequence ratio s = exp(min(mean_t log(pi / pi_old), 10)) (verl's cap, a clamp: no gradient past
    it), pg = max(-A s, -A clamp(s, 1 - clip_low, 1 + clip_high)), seq-mean-token-mean; the gradient of a
    token is -A s / (its sequence's tokens x sequences) on the unclipped branch, else 0. With A < 0 the
    unclipped branch wins, so the cap sets the loss: row 0's mean log-ratio 14 counts as 10 (e^14 would be
    55x larger), row 1's 9.5 lies under the cap and counts as itself, row 2 is a plain in-range sequence."""
    ratios = [[13.0, 15.0, 14.0], [9.0, 10.0], [0.05, 0.15, 0.1, 0.1]]
    advantages = [-0.5, -1.0, 2.0]
    logp, fields = _planted_fields(ratios, advantages, [3, 2, 4], width=6)
    clip_low, clip_high = 0.2, 0.28
    per_seq, grad = [], torch.zeros_like(logp)
    for i, (row, a) in enumerate(zip(ratios, advantages)):
        mean = sum(row) / len(row)
        s = math.exp(min(mean, 10.0))
        unclipped, clipped = -a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high)
        per_seq.append(max(unclipped, clipped))
        if mean < 10.0 and unclipped >= clipped:
            grad[i, :len(row)] = -a * s / (len(row) * len(ratios))
    loss, _ = L.gspo(logp, None, fields, clip_low=clip_low, clip_high=clip_high)
    loss.backward()
    tokens = sum(map(len, ratios))
    _assert_fp64_close("loss", loss.detach(), torch.tensor(sum(per_seq) / len(per_seq), dtype=torch.float64), tokens)
    _assert_fp64_close("dloss/dlogp", logp.grad, grad, tokens)


# ---------------------------------------------------------------------------------------------------------
# the op under the hook: `masked_logprobs`, its fused path (Triton kernels under TRITON_INTERPRET=1 on CPU)

from hybridengine.ops import masked_logprobs as ML  # noqa: E402
from hybridengine.ops import token_logprobs as TL  # noqa: E402
from test_ppo_loss import block_v, interpreter, make_batch  # noqa: E402
from test_ppo_loss import assert_close_to_truth as assert_op_close  # noqa: E402


@interpreter
@pytest.mark.parametrize("dtype,V,bias,temperature,chunk_rows",
                         [(torch.float32, 1000, True, 0.8, 4), (torch.bfloat16, 1000, False, 1.0, 4),
                          (torch.bfloat16, 17, True, 1.3, None)])
def test_masked_logprobs_fused_matches_fp64(dtype, V, bias, temperature, chunk_rows):
    """logp, entropy and the gradients of any sum(g_logp * logp + g_ent * entropy) against the float64
    formulas, over the masked-in tokens: several chunks with a partial last one (kept from the forward, the
    others recomputed) or one chunk (none recomputed); masked-out tokens give 0 and no gradient."""
    batch = make_batch(dtype=dtype, V=V, bias=bias, B=3, T=7, temperature=temperature)
    mask = batch["mask"]
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    def run(fn, cast):
        leaves = {k: cast(batch[k]).clone().requires_grad_() for k in ("hidden", "weight", "bias")
                  if batch[k] is not None}
        logp, ent = fn(leaves["hidden"], leaves["weight"], batch["targets"], bias=leaves.get("bias"),
                       temperature=temperature)
        m = mask.to(logp.dtype)
        ((logp * g_logp.to(logp.dtype) * m).sum() + (ent * g_ent.to(ent.dtype) * m).sum()).backward()
        return logp.detach() * m, ent.detach() * m, {k: v.grad for k, v in leaves.items()}

    def fused(h, w, t, *, bias, temperature):
        return ML._masked_logprobs_fused(h, w, t, mask, int(mask.sum()), bias=bias, temperature=temperature,
                                        chunk_rows=chunk_rows, block_v=block_v(V))

    def reference(h, w, t, *, bias, temperature):
        return ML.masked_logprobs(h, w, t, mask, bias=bias, temperature=temperature)

    truth = run(formulas.token_logprobs, lambda x: x.double())
    same = run(formulas.token_logprobs, lambda x: x)
    for label, fn in (("reference", reference), ("fused", fused)):
        got = run(fn, lambda x: x)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert_op_close(f"{label} logp", got[0], same[0], truth[0])
        assert_op_close(f"{label} entropy", got[1], same[1], truth[1])
        for name in truth[2]:
            assert_op_close(f"{label} grad {name}", got[2][name], same[2][name], truth[2][name])
        assert not got[2]["hidden"][~mask].any()  # masked-out tokens: no gradient
    raw = fused(batch["hidden"], batch["weight"], batch["targets"], bias=batch["bias"], temperature=temperature)
    assert not raw[0][~mask].any() and not raw[1][~mask].any()


@interpreter
def test_masked_logprobs_exact_is_token_logprobs_exact():
    """exact=True: the hook's log-probs are token_logprobs(exact=True)'s bits on the masked-in tokens, chunked
    or not (batch-invariant logits), with a gradient."""
    batch = make_batch(dtype=torch.bfloat16, V=1000, B=3, T=7)
    mask = batch["mask"]
    h = batch["hidden"].clone().requires_grad_()
    want = TL._token_logprobs_fused(batch["hidden"], batch["weight"], batch["targets"], bias=None, temperature=0.7,
                                   exact=True)[0]
    for chunk_rows in (4, None):
        logp, _ = ML._masked_logprobs_fused(h, batch["weight"], batch["targets"], mask, int(mask.sum()), bias=None,
                                           temperature=0.7, exact=True, chunk_rows=chunk_rows)
        assert torch.equal(logp[mask], want[mask])
        logp.sum().backward()
        assert h.grad is not None and h.grad[mask].abs().sum() > 0


@interpreter
def test_engine_on_kernels_ppo_through_hook_matches_ppo_step(monkeypatch):
    """On the kernel path (the fused ppo_loss in one pass; masked_logprobs + autograd) the two steps agree to
    rounding: the hook differentiates the loss by autograd, the fused op by its hand-written coefficients."""
    from hybridengine.ops import _launch
    from test_train_step import ppo_hook
    from test_training import CFG
    from test_training import make_batches as ppo_batches

    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    hf = build()
    batch = he.PPOBatch(**ppo_batches(hf, 1, steps=1)[0][0])
    cfg = he.PPOConfig(**CFG)
    out = {}
    for mode in ("ppo_step", "train_step"):
        engine = engine_for(hf, keep_grads=True)
        stats = engine.ppo_step(batch, cfg) if mode == "ppo_step" else engine.train_step(batch, ppo_hook(cfg), cfg)
        out[mode] = stats, full_grads(engine)
    (s1, g1), (s2, g2) = out["ppo_step"], out["train_step"]
    assert s1["micro_batches"] > 1
    for k in ("loss", "pg_loss", "entropy", "kl_loss", "pg_clipfrac", "grad_norm"):
        assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-7), k
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
