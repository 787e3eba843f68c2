"""Exact on-policy log-probs and the rollout correction of `hybridengine.ops.ppo_loss`.

Exact log-probs: `chosen_logprobs` (the sampler's) is batch-invariant on its torch path and on its
kernel path, and `token_logprobs(exact=True)` / `ppo_loss(exact=True)` give each token the bits of
`chosen_logprobs(linear_exact(its hidden row, weight), its token, 1 / T)`, whatever the batch, its
padding and the chunking; so log-probs taken that way make the PPO ratio exactly 1. The kernel path
runs on CPU tensors under TRITON_INTERPRET=1 with `_launch.use_kernel` patched, which sends
`chosen_logprobs` to its kernel as on CUDA; the test_gpu_* tests run the whole chain on CUDA.

Rollout correction: the loss and its gradients against the float64 formulas of tests/_formulas.py.
Weighting the policy-gradient term of each token by w >= 0 is the same as scaling its advantage by
w (the clipped surrogate is positively homogeneous in A, and w carries no gradient), so the truth
is the formulas' loss with advantages w * A, w computed here in float64 from the definitions; the
clip metrics, ppo_kl, entropy and kl_loss are the formulas' with the unweighted advantages.
Tolerances as in tests/test_ppo_loss.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import _formulas as formulas
from hybridengine.ops import _launch
from hybridengine.ops import chosen_logprobs as CL
from hybridengine.ops import policy_loss as PL
from hybridengine.ops import ppo_loss as P
from hybridengine.ops import token_logprobs as TL
from hybridengine.ops.exact_linear import linear_exact
from hybridengine.train.batch import PPOBatch
from hybridengine.train.config import PPOConfig
from test_ppo_loss import (CHUNK, ROLLOUT_METRICS, assert_close_to_truth, fused_policy, interpreter, make_batch,
                           run_policy)


@pytest.fixture
def kernel_path(monkeypatch):
    """`chosen_logprobs` takes its kernel on CPU tensors under the interpreter, as on CUDA."""
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)


@pytest.fixture
def logits_kernel_path(monkeypatch):
    """`chosen_logprobs` takes its kernel on logits rows ([.., V], V >= 1000 here), as the fused pass does;
    `linear_exact` keeps its torch path (batch-invariant too) for hidden rows ([.., H], H = 16): under the
    interpreter its kernel made these tests take minutes instead of seconds, and its invariance is its own
    tests' subject (test_gpu_exact_logprobs_are_the_samplers runs both kernels on CUDA)."""
    monkeypatch.setattr(_launch, "use_kernel", lambda t: t.shape[-1] >= 1000)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int64)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    diff = (bits(got) != bits(want)).nonzero()
    assert diff.numel() == 0, f"{what}: {len(diff)} entries differ, first at {diff[0].tolist()}: " \
                              f"{got[tuple(diff[0])].item()!r} vs {want[tuple(diff[0])].item()!r}"


def per_token_chosen(hidden, weight, targets, temperature, bias=None) -> torch.Tensor:
    """The contract's right-hand side: each token's own [1, V] logits row through `chosen_logprobs`."""
    B, T, _ = hidden.shape
    out = torch.empty(B, T, device=hidden.device)
    for b in range(B):
        for t in range(T):
            logits = linear_exact(hidden[b, t][None], weight, bias)
            out[b, t] = CL.chosen_logprobs(logits, targets[b, t][None], 1 / temperature)[0]
    return out


def relayout(batch: dict, seed: int = 1) -> tuple[dict, torch.Tensor]:
    """The batch's sequences in another order, in a wider [B + 1, T + 2] batch padded with random states:
    returns the new batch and, per new row, the old row it holds (-1: a padding row)."""
    g = torch.Generator().manual_seed(seed)
    B, T, H = batch["hidden"].shape
    order = torch.randperm(B + 1, generator=g) - 1  # one row of padding (-1) somewhere
    hidden = torch.randn(B + 1, T + 2, H, generator=g).to(batch["hidden"].dtype)
    targets = torch.randint(0, batch["weight"].shape[0], (B + 1, T + 2), generator=g)
    hidden, targets = hidden.to(batch["hidden"].device), targets.to(batch["hidden"].device)
    for new, old in enumerate(order.tolist()):
        if old >= 0:
            hidden[new, :T], targets[new, :T] = batch["hidden"][old], batch["targets"][old]
    return dict(batch, hidden=hidden, targets=targets), order


# --------------------------------------------------------------------------------------------
# chosen_logprobs


def _chosen_inputs(R, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (R,), generator=g)
    inv_t = (1 / (0.5 + torch.rand(R, generator=g, dtype=torch.float64))).float()  # T in [0.5, 1.5)
    inv_t[0] = 1.0  # a greedy row
    return logits, tokens, inv_t


def _check_row_invariance(logits, tokens, inv_t):
    """Every row alone, the rows in reverse order, and inside a larger batch: the same bits."""
    full = CL.chosen_logprobs(logits, tokens, inv_t)
    R = logits.shape[0]
    for r in range(R):
        one = CL.chosen_logprobs(logits[r:r + 1], tokens[r:r + 1], inv_t[r:r + 1])
        assert_same_bits(one, full[r:r + 1], f"row {r} alone")
    rev = torch.arange(R - 1, -1, -1)
    assert_same_bits(CL.chosen_logprobs(logits[rev], tokens[rev], inv_t[rev]), full[rev], "reversed")
    dev = logits.device
    extra = torch.randn(5, logits.shape[1]).to(dev, logits.dtype)
    bigger = CL.chosen_logprobs(torch.cat([extra, logits]),
                               torch.cat([torch.randint(0, logits.shape[1], (5,)).to(dev), tokens]),
                               torch.cat([torch.full((5,), 1.25, device=dev), inv_t]))
    assert_same_bits(bigger[5:], full, "inside a larger batch")
    # A float inverse temperature is that float rounded to fp32 for every row.
    same_t = CL.chosen_logprobs(logits, tokens, 1 / 0.7)
    assert_same_bits(same_t, CL.chosen_logprobs(logits, tokens, torch.full((R,), 1 / 0.7, device=dev)),
                     "float vs [R] tensor")
    return full


def _check_chosen_against_fp64(got, logits, tokens, inv_t):
    """Against the float64 truth, within K x plain torch's float32 error (the torch path is that formula)."""
    def formula(dt):
        return (logits.to(dt) * inv_t.to(dt)[:, None]).log_softmax(-1).gather(1, tokens[:, None])[:, 0]

    assert got.dtype == torch.float32
    assert_close_to_truth("chosen_logprobs", got, formula(torch.float32), formula(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V", [(1, 17), (13, 1000), (6, 5003)])
def test_chosen_logprobs_torch_path_is_row_invariant(dtype, R, V):
    logits, tokens, inv_t = _chosen_inputs(R, V, dtype)
    got = _check_row_invariance(logits, tokens, inv_t)
    _check_chosen_against_fp64(got, logits, tokens, inv_t)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V", [(1, 17), (13, 1000), (6, 5003)])
def test_chosen_logprobs_kernel_is_row_invariant(kernel_path, dtype, R, V):
    """V = 5003: two vocabulary blocks of 4096, the last partial."""
    logits, tokens, inv_t = _chosen_inputs(R, V, dtype)
    got = _check_row_invariance(logits, tokens, inv_t)
    _check_chosen_against_fp64(got, logits, tokens, inv_t)
    strided = torch.randn(R, V + 7).to(dtype)[:, :V]
    strided.copy_(logits)
    assert_same_bits(CL.chosen_logprobs(strided, tokens, inv_t), got, "a row-strided view")


@pytest.mark.parametrize("args,match", [
    ((torch.randn(4), torch.zeros(4, dtype=torch.long), 1.0), "logits must be a float \\[R, V\\] tensor"),
    ((torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, dtype=torch.long), 1.0), "logits must be a float"),
    ((torch.randn(4, 5), torch.zeros(3, dtype=torch.long), 1.0), "tokens must be an int64 \\[R\\] = \\[4\\]"),
    ((torch.randn(4, 5), torch.zeros(4, dtype=torch.int32), 1.0), "tokens must be an int64"),
    ((torch.randn(4, 5), torch.zeros(4, dtype=torch.long), 0.0), "inv_temperature must be a finite number > 0"),
    ((torch.randn(4, 5), torch.zeros(4, dtype=torch.long), float("inf")), "inv_temperature must be a finite"),
    ((torch.randn(4, 5), torch.zeros(4, dtype=torch.long), True), "inv_temperature must be a finite"),
    ((torch.randn(4, 5), torch.zeros(4, dtype=torch.long), torch.ones(3)),
     "inv_temperature must be a float > 0 or an fp32 \\[R\\] = \\[4\\] tensor"),
    ((torch.randn(4, 5), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.float64)),
     "inv_temperature must be a float > 0 or an fp32"),
])
def test_chosen_logprobs_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        CL.chosen_logprobs(*args)


# --------------------------------------------------------------------------------------------
# token_logprobs(exact=True) and ppo_loss(exact=True): the sampler's bits


@pytest.mark.parametrize("dtype,bias,temperature", [(torch.bfloat16, False, 0.7), (torch.float32, True, 1.0)])
def test_exact_token_logprobs_torch_path_are_the_samplers(dtype, bias, temperature):
    batch = make_batch(dtype=dtype, bias=bias)
    want = per_token_chosen(batch["hidden"], batch["weight"], batch["targets"], temperature, batch["bias"])
    got = TL.token_logprobs(batch["hidden"], batch["weight"], batch["targets"], bias=batch["bias"],
                           temperature=temperature, exact=True)
    assert_same_bits(got, want, "token_logprobs(exact=True)")
    other, order = relayout(batch)
    got = TL.token_logprobs(other["hidden"], batch["weight"], other["targets"], bias=batch["bias"],
                           temperature=temperature, exact=True)
    for new, old in enumerate(order.tolist()):
        if old >= 0:
            assert_same_bits(got[new, :batch["hidden"].shape[1]], want[old], f"row {old} placed at {new}, padded")
    # The exact log-probs are log-probs: close to the float64 truth like the default path's.
    truth, _ = formulas.token_logprobs(batch["hidden"].double(), batch["weight"].double(), batch["targets"],
                                       bias=None if batch["bias"] is None else batch["bias"].double(),
                                       temperature=temperature)
    same, _ = formulas.token_logprobs(batch["hidden"], batch["weight"], batch["targets"], bias=batch["bias"],
                                      temperature=temperature)
    assert_close_to_truth("exact logp", want, same, truth)


@interpreter
@pytest.mark.parametrize("V,temperature", [(1000, 0.7), (5003, 1.0)])
def test_exact_token_logprobs_kernel_path_are_the_samplers(logits_kernel_path, V, temperature):
    """The fused pass (linear_exact chunks, the logit_stats kernel with per-row temperatures) at chunk sizes
    1, 3 (a partial last chunk) and the default, with and without a gradient (the autograd Function)."""
    batch = make_batch(B=2, T=4, V=V)
    want = per_token_chosen(batch["hidden"], batch["weight"], batch["targets"], temperature)
    for chunk in (1, 3, None):
        got, _ = TL._token_logprobs_fused(batch["hidden"], batch["weight"], batch["targets"], bias=None,
                                         temperature=temperature, exact=True, chunk_rows=chunk)
        assert_same_bits(got, want, f"chunk_rows={chunk}")
    h = batch["hidden"].clone().requires_grad_()
    got, _ = TL._token_logprobs_fused(h, batch["weight"], batch["targets"], bias=None, temperature=temperature,
                                     exact=True, chunk_rows=3)
    assert_same_bits(got.detach(), want, "with a gradient")
    got.sum().backward()  # the exact path's backward runs (its values: the default path's math)
    h2 = batch["hidden"].clone().requires_grad_()
    TL._token_logprobs_fused(h2, batch["weight"], batch["targets"], bias=None, temperature=temperature,
                            chunk_rows=3)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad)
    other, order = relayout(batch)
    got, _ = TL._token_logprobs_fused(other["hidden"], batch["weight"], other["targets"], bias=None,
                                     temperature=temperature, exact=True, chunk_rows=CHUNK)
    for new, old in enumerate(order.tolist()):
        if old >= 0:
            assert_same_bits(got[new, :4], want[old], f"row {old} placed at {new}, padded")


def _exact_old_logprobs(batch, temperature):
    """The rollout's log-probs of the batch's tokens (the sampler's bits), 0 on padding."""
    old = per_token_chosen(batch["hidden"], batch["weight"], batch["targets"], temperature, batch["bias"])
    return torch.where(batch["mask"], old, 0.0)


def _assert_on_policy(fn, batch, old, temperature):
    """With old = the sampler's log-probs, logp == old bitwise on every response token: the k2 KL
    against old (a sum of squares, zero only if every difference is), the ratio metrics, and with zero
    clip bounds (any ratio other than 1 is clipped under one sign of A) for A and -A."""
    for adv in (batch["adv"], -batch["adv"]):
        loss, m = fn(batch["hidden"], batch["weight"], batch["targets"], old, adv, batch["mask"], bias=batch["bias"],
                     temperature=temperature, exact=True, ref_logprobs=old, kl_coef=1.0, kl_estimator="k2",
                     clip_low=0.0, clip_high=0.0, clip_ratio_c=3.0)
        assert m["kl_loss"].item() == 0 and m["ppo_kl"].item() == 0
        assert m["pg_clipfrac"].item() == 0 and m["pg_clipfrac_lower"].item() == 0
        # ratio 1: pg = -A exactly, and the loss is agg(-A)
        assert loss.item() == PL.aggregate(-adv, batch["mask"], "token-mean").item()


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, False), (torch.float32, True)])
def test_exact_ppo_loss_torch_path_ratio_is_one(dtype, bias):
    batch = make_batch(dtype=dtype, bias=bias)
    old = _exact_old_logprobs(batch, 0.7)
    _assert_on_policy(P.ppo_loss, batch, old, 0.7)
    _assert_on_policy(P.ppo_loss_ref, batch, old, 0.7)


@interpreter
def test_exact_ppo_loss_kernel_path_ratio_is_one(logits_kernel_path):
    batch = make_batch(B=2, T=5)
    old = _exact_old_logprobs(batch, 0.7)

    def fused(*args, exact, **kw):
        return fused_policy(*args, exact=exact, chunk_rows=3, **kw)

    _assert_on_policy(fused, batch, old, 0.7)


@interpreter
def test_exact_gradients_are_the_default_paths(logits_kernel_path):
    """exact=True changes the forward's logits GEMM only: the loss and gradients agree with the default
    path's to fp32 rounding (the two GEMMs sum in different orders), on the fused and the torch path."""
    batch = make_batch(dtype=torch.float32, bias=True)
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, entropy_coef=0.01, temperature=0.8)
    for fn in (fused_policy, P.ppo_loss_ref):
        exact = run_policy(lambda *a, **k: fn(*a, exact=True, **k), batch, **kw)
        default = run_policy(fn, batch, **kw)
        torch.testing.assert_close(exact[0], default[0])
        for name in default[2]:
            torch.testing.assert_close(exact[2][name], default[2][name], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------
# rollout correction


def rollout_weight(old, rollout, mode, cap, dtype=torch.float64):
    """(w, flagged) in `dtype` from the definitions: r = pi_old / pi_rollout."""
    r = torch.exp(old.to(dtype) - rollout.to(dtype))
    if mode == "tis":
        return torch.where(r > cap, torch.full_like(r, cap), r), r > cap
    inside = (1 / cap <= r) & (r <= cap)
    return inside.to(dtype), ~inside


def with_rollout(batch, *, seed=3, scale=0.5):
    """The batch with rollout log-probs around old (|log r| ~ scale), and planted on row 0 (response
    tokens in `make_batch`): r = e (past a cap of 1.5), r = 1 / e (below 1 / cap) and r = 1."""
    g = torch.Generator().manual_seed(seed)
    rollout = batch["old"] + scale * torch.randn(batch["old"].shape, generator=g)
    rollout[0, :3] = batch["old"][0, :3] - torch.tensor([1.0, -1.0, 0.0])
    return dict(batch, rollout=rollout)


def test_rollout_correction_by_hand():
    """policy_loss on values worked out by hand: w, the metrics, and the weighted pg."""
    logp = torch.zeros(1, 6, dtype=torch.float64)
    old = torch.zeros(1, 6, dtype=torch.float64)  # ratio 1: pg = -A
    log_r = torch.tensor([[math.log(0.25), math.log(0.6), 0.0, math.log(1.9), math.log(2.5), 7.0]], dtype=torch.float64)
    rollout = old - log_r
    rollout[0, 5] = float("nan")  # masked out: never read
    adv = torch.tensor([[1.0, -2.0, 3.0, 1.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    ent = torch.zeros_like(logp)
    cases = {  # mode: (w of the 5 tokens, flagged)
        "tis": ([0.25, 0.6, 1.0, 1.9, 2.0], [0, 0, 0, 0, 1]),
        "mis": ([0.0, 1.0, 1.0, 1.0, 0.0], [1, 0, 0, 0, 1]),
    }
    for mode, (w, flagged) in cases.items():
        cfg = PL.LossConfig(rollout_correction=mode, rollout_correction_cap=2.0)
        loss, m = PL.policy_loss(logp, ent, old, adv, mask, None, cfg, rollout)
        pg = [-a * wi for a, wi in zip(adv[0, :5].tolist(), w)]
        assert loss.item() == pytest.approx(sum(pg) / 5, rel=1e-15)
        assert m["pg_loss"].item() == pytest.approx(sum(pg) / 5, rel=1e-15)
        assert m["rollout_corr_weight"].item() == pytest.approx(sum(w) / 5, rel=1e-15)
        assert m["rollout_corr_clipfrac"].item() == pytest.approx(sum(flagged) / 5, rel=1e-15)
        diff = sum(abs(x) for x in log_r[0, :5].tolist()) / 5
        assert m["rollout_corr_logprob_diff"].item() == pytest.approx(diff, rel=1e-15)
    # Off: weight 1 and clipfrac 0; the log-prob difference is still measured when rollout_logprobs is given.
    loss, m = PL.policy_loss(logp, ent, old, adv, mask, None, PL.LossConfig(), rollout)
    assert loss.item() == pytest.approx(-adv[0, :5].mean().item(), rel=1e-15)
    assert m["rollout_corr_weight"].item() == 1 and m["rollout_corr_clipfrac"].item() == 0
    assert m["rollout_corr_logprob_diff"].item() == pytest.approx(diff, rel=1e-15)


@pytest.mark.parametrize("mode", PL.ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("loss_agg", PL.LOSS_AGGS)
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_rollout_grad_coefficients_match_autograd(mode, loss_agg, clip_ratio_c):
    """The hand-written dloss/dlogp with the correction equals torch autograd of `policy_loss`."""
    B, T = 4, 9
    logp = -torch.rand(B, T, dtype=torch.float64) * 5
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.5
    old[0, :3] = logp[0, :3]  # ratio exactly 1: the maximum's tie
    rollout = old + torch.randn(B, T, dtype=torch.float64) * 0.8
    rollout[1, :2] = old[1, :2]  # w = 1
    adv = torch.randn(B, T, dtype=torch.float64)
    ref = logp + torch.randn(B, T, dtype=torch.float64)
    mask = torch.rand(B, T) > 0.2
    mask[3] = False
    rollout[3] = float("nan")  # masked-out garbage must not leak
    cfg = PL.LossConfig(clip_low=0.1, clip_high=0.28, clip_ratio_c=clip_ratio_c, kl_coef=0.7, loss_agg=loss_agg,
                       rollout_correction=mode, rollout_correction_cap=1.5)
    lp = logp.clone().requires_grad_()
    loss, _ = PL.policy_loss(lp, torch.zeros_like(lp), old, adv, mask, ref, cfg, rollout)
    (expected,) = torch.autograd.grad(loss, lp)
    w, _ = PL.rollout_weight(old, rollout, cfg, torch.float64)
    got = PL.policy_grad_logp(logp, old, adv, ref, PL.agg_weights(mask, loss_agg, torch.float64), cfg, w)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)
    assert expected.isfinite().all()


CASES = [
    # (id, mode, batch kwargs, loss kwargs)
    ("tis-fp32-token-mean", "tis", dict(dtype=torch.float32), dict(kl_coef=0.1, clip_low=0.1, clip_high=0.28)),
    ("mis-bf16-seqmean-dual-T0.7", "mis", dict(bias=True),
     dict(kl_coef=0.2, kl_estimator="k1", clip_ratio_c=3.0, loss_agg="seq-mean-token-mean", temperature=0.7,
          entropy_coef=0.01)),
    ("tis-bf16-seqsum-dual", "tis", dict(mask="ones"),
     dict(kl_coef=0.05, kl_estimator="k2", loss_agg="seq-mean-token-sum", clip_ratio_c=3.0, entropy_coef=0.02)),
    ("mis-fp32-token-mean", "mis", dict(dtype=torch.float32), dict(kl_coef=0.1)),
]


def check_rollout_correction(batch, mode, *, fused=fused_policy, cap=1.5, **loss_kw):
    """The package's reference and `fused` against the float64 truth: the loss, pg_loss and the gradients
    are the formulas' with advantages w * A; the other PPO metrics are the uncorrected formulas'; the
    correction's metrics are the token means of w, of the flags and of |old - rollout| from the definitions."""
    mask = batch["mask"]
    w64, flagged = rollout_weight(batch["old"], batch["rollout"], mode, cap)
    assert 0 < (flagged & mask).sum().item() < mask.sum().item(), "the case must flag some response tokens, not all"
    kw = dict(loss_kw, ref_logprobs=batch["ref"])
    weighted = dict(batch, adv=batch["adv"].double() * w64)
    truth_w = run_policy(formulas.ppo_loss, weighted, torch.float64, **kw)
    same_w = run_policy(formulas.ppo_loss, dict(weighted, adv=weighted["adv"].float()), **kw)
    truth, same = (run_policy(formulas.ppo_loss, batch, dt, **kw)[1] for dt in (torch.float64, None))

    def means(dt):  # the correction's metrics from the definitions, in dt
        w, flags = rollout_weight(batch["old"], batch["rollout"], mode, cap, dt)
        diff = (batch["old"].to(dt) - batch["rollout"].to(dt)).abs()
        return {"rollout_corr_weight": w[mask].mean(), "rollout_corr_clipfrac": flags[mask].to(dt).mean(),
                "rollout_corr_logprob_diff": diff[mask].mean()}

    means_truth, means_same = means(torch.float64), means(torch.float32)
    for label, fn in (("reference", P.ppo_loss_ref), ("fused", fused)):
        loss, m, grads = run_policy(fn, batch, rollout_logprobs=batch["rollout"], rollout_correction=mode,
                                    rollout_correction_cap=cap, **kw)
        assert set(m) == set(PL.METRICS)
        assert_close_to_truth(f"{label} loss", loss, same_w[0], truth_w[0])
        assert_close_to_truth(f"{label} pg_loss", m["pg_loss"], same_w[1]["pg_loss"], truth_w[1]["pg_loss"])
        for name in truth_w[2]:
            assert_close_to_truth(f"{label} grad {name}", grads[name], same_w[2][name], truth_w[2][name])
        for name in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss"):
            assert_close_to_truth(f"{label} {name}", m[name], same[name], truth[name])
        for name in ROLLOUT_METRICS:
            assert_close_to_truth(f"{label} {name}", m[name], means_same[name], means_truth[name])


@interpreter
@pytest.mark.parametrize("mode,batch_kw,loss_kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rollout_correction_matches_fp64(mode, batch_kw, loss_kw):
    batch = with_rollout(make_batch(temperature=loss_kw.get("temperature", 1.0), **batch_kw))
    check_rollout_correction(batch, mode, **loss_kw)


@interpreter
@pytest.mark.parametrize("mode", PL.ROLLOUT_CORRECTIONS)
def test_rollout_correction_is_the_identity_when_rollout_equals_old(mode):
    """old == rollout bitwise: w == 1 exactly, and loss, metrics and gradients are the uncorrected ones, bit for bit."""
    batch = make_batch(bias=True)
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, entropy_coef=0.01, clip_ratio_c=3.0, temperature=0.9)
    w, _ = PL.rollout_weight(batch["old"], batch["old"].clone(), PL.LossConfig(rollout_correction=mode), torch.float32)
    assert torch.equal(w, torch.ones_like(w))
    for fn in (P.ppo_loss_ref, fused_policy):
        plain = run_policy(fn, batch, **kw)
        corrected = run_policy(fn, batch, rollout_logprobs=batch["old"].clone(), rollout_correction=mode, **kw)
        assert_same_bits(corrected[0], plain[0], "loss")
        for name in plain[1]:
            if name not in ROLLOUT_METRICS:
                assert_same_bits(corrected[1][name], plain[1][name], name)
        assert [corrected[1][k].item() for k in ROLLOUT_METRICS] == [1.0, 0.0, 0.0]
        for name in plain[2]:
            assert torch.equal(corrected[2][name], plain[2][name]), name


@interpreter
def test_masked_rollout_garbage_is_ignored():
    """NaN / inf rollout log-probs on masked-out tokens: loss and gradients as with clean padding."""
    batch = with_rollout(make_batch(dtype=torch.float32))
    off = ~batch["mask"]
    for mode in PL.ROLLOUT_CORRECTIONS:
        kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, rollout_correction=mode, rollout_correction_cap=1.5)
        for fn in (P.ppo_loss_ref, fused_policy):
            clean = run_policy(fn, batch, rollout_logprobs=batch["rollout"], **kw)
            for garbage in (float("nan"), float("inf"), -float("inf")):
                dirty = run_policy(fn, batch, rollout_logprobs=batch["rollout"].masked_fill(off, garbage), **kw)
                assert torch.equal(dirty[0], clean[0]), (mode, fn, garbage)
                for name in clean[1]:
                    assert torch.equal(dirty[1][name], clean[1][name]), (mode, fn, garbage, name)
                for name in clean[2]:
                    assert torch.equal(dirty[2][name], clean[2][name]), (mode, fn, garbage, name)


def test_rollout_correction_public_op_on_cpu():
    """The public op (the reference on CPU) with a config's loss_kwargs, rollout fields included."""
    batch = with_rollout(make_batch(dtype=torch.float32))
    cfg = PPOConfig(rollout_correction="tis", rollout_correction_cap=1.5, kl_coef=0.1)
    kwargs = cfg.loss_kwargs()
    assert kwargs["rollout_correction"] == "tis" and kwargs["rollout_correction_cap"] == 1.5
    got = run_policy(P.ppo_loss, batch, ref_logprobs=batch["ref"], rollout_logprobs=batch["rollout"], **kwargs)
    want = run_policy(P.ppo_loss_ref, batch, ref_logprobs=batch["ref"], rollout_logprobs=batch["rollout"], **kwargs)
    assert torch.equal(got[0], want[0]) and 0 < got[1]["rollout_corr_clipfrac"].item() < 1


# --------------------------------------------------------------------------------------------
# validation


def _args(**over):
    batch = with_rollout(make_batch(dtype=torch.float32))
    args = dict(hidden=batch["hidden"], weight=batch["weight"], targets=batch["targets"], old_logprobs=batch["old"],
                advantages=batch["adv"], mask=batch["mask"], rollout_logprobs=batch["rollout"],
                rollout_correction="tis")
    args.update(over)
    return args


@pytest.mark.parametrize("fn", [P.ppo_loss, P.ppo_loss_ref], ids=["ppo_loss", "ppo_loss_ref"])
@pytest.mark.parametrize("over,match", [
    (dict(rollout_correction="is"), "rollout_correction must be None, 'tis' or 'mis', got 'is'"),
    (dict(rollout_correction_cap=1.0), "rollout_correction_cap must be a finite number > 1, got 1.0"),
    (dict(rollout_correction_cap=0.5), "rollout_correction_cap must be a finite number > 1"),
    (dict(rollout_correction_cap=float("inf")), "rollout_correction_cap must be a finite number > 1, got inf"),
    (dict(rollout_correction_cap=float("nan")), "rollout_correction_cap must be a finite number > 1, got nan"),
    (dict(rollout_correction_cap=True), "rollout_correction_cap must be a finite number > 1, got True"),
    (dict(rollout_logprobs=None), "rollout_correction = 'tis' needs rollout_logprobs"),
    (dict(rollout_logprobs=None, rollout_correction="mis"), "rollout_correction = 'mis' needs rollout_logprobs"),
    (dict(rollout_logprobs=torch.zeros(3, 6)), "rollout_logprobs must be \\[B, T\\] = \\[3, 7\\]"),
    (dict(rollout_logprobs=torch.zeros(3, 7, dtype=torch.long)), "rollout_logprobs must be a float tensor"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_ppo_loss_rejects_rollout_arguments(fn, over, match):
    with pytest.raises(ValueError, match=match):
        fn(**_args(**over))


@pytest.mark.parametrize("over,match", [
    (dict(rollout_correction="TIS"), "PPOConfig: rollout_correction must be None, 'tis' or 'mis'"),
    (dict(rollout_correction_cap=1.0), "PPOConfig: rollout_correction_cap must be a finite number > 1"),
    (dict(rollout_correction_cap=float("inf")), "PPOConfig: rollout_correction_cap must be a finite number > 1"),
])
def test_ppo_config_rejects_rollout_fields(over, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**over)
    cfg = PPOConfig()
    for name, value in over.items():
        setattr(cfg, name, value)  # changed after construction: validate() checks again
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def _ppo_batch(**over):
    lengths = (6, 4)
    g = torch.Generator().manual_seed(0)
    kw = dict(input_ids=[torch.randint(0, 50, (n,), generator=g) for n in lengths],
              response_mask=[torch.ones(n - 1) for n in lengths],
              old_logprobs=[-torch.rand(n - 1, generator=g) for n in lengths],
              advantages=[torch.randn(n - 1, generator=g) for n in lengths],
              rollout_logprobs=[-torch.rand(n - 1, generator=g) for n in lengths])
    kw.update(over)
    return kw


def test_ppo_config_check_batch():
    batch = PPOBatch(**_ppo_batch())
    for mode in PL.ROLLOUT_CORRECTIONS:
        PPOConfig(rollout_correction=mode).check_batch(batch)
    no_rollout = PPOBatch(**_ppo_batch(rollout_logprobs=None))
    PPOConfig().check_batch(no_rollout)
    with pytest.raises(ValueError, match="PPOConfig.rollout_correction = 'mis' needs batch.rollout_logprobs"):
        PPOConfig(rollout_correction="mis").check_batch(no_rollout)
    with pytest.raises(ValueError, match="PPOConfig.kl_coef > 0 needs batch.ref_logprobs"):
        PPOConfig(kl_coef=0.1).check_batch(batch)


def test_ppo_batch_validates_rollout_logprobs():
    rows = _ppo_batch()["rollout_logprobs"]
    with pytest.raises(ValueError, match=r"PPOBatch\.rollout_logprobs\[1\] has 4 entries; expected "
                                         r"len\(input_ids\[1\]\) - 1 = 3 \(one per target token\)"):
        PPOBatch(**_ppo_batch(rollout_logprobs=[rows[0], torch.zeros(4)]))
    with pytest.raises(ValueError, match=r"PPOBatch\.rollout_logprobs has 1 sequences, input_ids has 2"):
        PPOBatch(**_ppo_batch(rollout_logprobs=rows[:1]))
    bad = [r.clone() for r in rows]
    bad[0][2] = float("nan")
    with pytest.raises(ValueError, match=r"PPOBatch\.rollout_logprobs\[0\]\[2\] is nan; every entry must be finite"):
        PPOBatch(**_ppo_batch(rollout_logprobs=bad))
    batch = PPOBatch(**_ppo_batch())
    batch.rollout_logprobs[1][0] = float("inf")  # in place, after construction
    with pytest.raises(ValueError, match=r"ppo_step: batch\.rollout_logprobs\[1\]\[0\] is inf"):
        batch.validate(50, op="ppo_step")
    assert batch.padded("rollout_logprobs", [1, 0], 6, "cpu").shape == (2, 6)


# --------------------------------------------------------------------------------------------
# GPU (the lead runs these on the H200): the whole chain with the real kernels


def _gpu_batch(device, **kw):
    batch = with_rollout(make_batch(dtype=torch.bfloat16, **kw))
    return {k: None if v is None else v.to(device) for k, v in batch.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_chosen_logprobs_is_row_invariant(device, dtype):
    logits, tokens, inv_t = (x.to(device) for x in _chosen_inputs(37, 50257, dtype))
    got = _check_row_invariance(logits, tokens, inv_t)
    _check_chosen_against_fp64(got, logits, tokens, inv_t)


@pytest.mark.gpu
def test_gpu_exact_logprobs_are_the_samplers(device):
    """linear_exact's kernel and the logit_stats kernel: token_logprobs(exact=True) at the default chunking and
    at 128-row chunks, placed in another batch, and ppo_loss(exact=True) with the sampler's old log-probs."""
    batch = _gpu_batch(device, B=3, T=60, H=256, V=50257, temperature=0.7)
    want = per_token_chosen(batch["hidden"], batch["weight"], batch["targets"], 0.7)
    got = TL.token_logprobs(batch["hidden"], batch["weight"], batch["targets"], temperature=0.7, exact=True)
    assert_same_bits(got, want, "token_logprobs(exact=True)")
    got, _ = TL._token_logprobs_fused(batch["hidden"], batch["weight"], batch["targets"], bias=None, temperature=0.7,
                                     exact=True, chunk_rows=128)
    assert_same_bits(got, want, "chunk_rows=128")
    other, order = relayout(batch)
    got = TL.token_logprobs(other["hidden"], batch["weight"], other["targets"], temperature=0.7, exact=True)
    for new, old in enumerate(order.tolist()):
        if old >= 0:
            assert_same_bits(got[new, :60], want[old], f"row {old} placed at {new}, padded")
    old = torch.where(batch["mask"], want, 0.0)
    _assert_on_policy(P.ppo_loss, batch, old, 0.7)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", PL.ROLLOUT_CORRECTIONS)
def test_gpu_rollout_correction_matches_fp64(device, mode):
    batch = _gpu_batch(device, B=4, T=250, H=256, V=50257, temperature=0.7)
    check_rollout_correction(batch, mode, fused=P.ppo_loss, kl_coef=0.04, clip_ratio_c=3.0, temperature=0.7,
                             entropy_coef=0.01)  # the public op: the kernels on CUDA
