"""The fused PPO loss (`hybridengine.ops.ppo_loss`, with `ops.policy_loss` and `ops.lm_head`), `token_logprobs`
and `value_loss`: kernels, references, autograd, validation.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (conftest) through the private fused entry
points on tiny shapes, with chunk sizes small enough that every run crosses a partial chunk and a
partial vocabulary block. Truth is `_formulas` (written from the definitions, sharing no code with
the package) evaluated in float64 on the same (rounded) inputs; both the package's reference and
its fused path are held to it.

Tolerance: a result in float32 arithmetic may be off the truth by at most K x what the same
formulas in float32 arithmetic (logits formed in the inputs' dtype, as the package's precision
contract says) are off it on these inputs, plus a floor of a few fp32 ulps of the quantity's scale
(the float32 formulas can be exact by luck on a metric). The float32 formulas measure how well
conditioned each quantity is at these inputs (how many ulps of the logits, the log-sum-exp and the
sums reach it); they never see the package, so an error shared by its reference and its fused path
cannot widen the tolerance. Results computed in float64 by the package's reference are held to the
float64 truth within the rounding of two float64 evaluations.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import _formulas as formulas
from hybridengine.ops import lm_head as LH
from hybridengine.ops import policy_loss as PL
from hybridengine.ops import ppo_loss as P
from hybridengine.ops import token_logprobs as TL
from hybridengine.ops import value_loss as VL

K_SAME_DTYPE = 2.0
"""Error <= K x the float32 formulas' error (see module docstring). Measured on CPU: the ratio is
at most 1.0 for the reference and 1.5 for the fused path in bf16 (its grad_weight is accumulated
in bf16 across chunks); in fp32 the floor decides, and the largest error uses 0.5 of the bound."""
FLOOR_ULPS = 8 * 2.0**-23
"""The floor, relative to the largest magnitude of the quantity in the truth: 8 fp32 ulps."""
U64 = 2.0**-53
CHUNK = 8
CLIPS = [(0.2, 0.2), (0.1, 0.28), (0.3, 0.15)]
"""(clip_low, clip_high): symmetric, DAPO's clip-higher, and the other way round. The planted ratios
of `make_batch` (0.75 and 1.25) fall inside one bound and outside the other for both asymmetric
pairs, so a swap of the two bounds moves the loss."""

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="drives the Triton kernels with CPU tensors under TRITON_INTERPRET=1 (CPU CI); on a GPU machine the "
           "test_gpu_* tests run the same kernels on CUDA")
"""Interpreter tests of the fused entry points: CPU tensors into the Triton kernels."""


def block_v(vocab: int) -> int | None:
    """Several vocabulary blocks and a partial last one: 256 for V = 1000; the default 4096 for V = 50257."""
    return 256 if vocab <= 4096 else None


PLANTED = [(4.5, -1.0), (1.25, 1.0), (0.75, -1.0), (4.5, 1.0), (1.25, -0.7), (0.75, 0.7)]
"""(ratio, advantage) planted on the first tokens of row 0: the dual clip's case (r > c, A < 0); the
upper and the lower clip bound, each on its own side; r > c with A > 0 (no dual clip there); and
ratios past a bound on the side where PPO does not clip."""


def make_batch(*, B=3, T=7, H=16, V=1000, dtype=torch.bfloat16, bias=False, seed=0, mask="ragged",
               zero_advantages="seq", temperature=1.0):
    """A batch with realistic log-ratios (old/ref log-probs are the true ones at `temperature` plus
    noise, so some ratios clip) and the `PLANTED` ratios on row 0; ref at token [0, 2] is 3 nats
    above the policy, so k3's clamp at 10 is active there."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / math.sqrt(H)).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    logp, _ = formulas.token_logprobs(hidden.double(), weight.double(), targets,
                                      bias=None if b is None else b.double(), temperature=temperature)
    old = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(B, T, generator=g)
    for t, (ratio, a) in enumerate(PLANTED[:T]):
        old[0, t], adv[0, t] = logp[0, t] - math.log(ratio), a
    if T > 2:
        ref[0, 2] = logp[0, 2] + 3.0
    if zero_advantages == "seq":  # GRPO: a group whose rewards were all equal
        adv[-1] = 0
    elif zero_advantages == "all":
        adv.zero_()
    if mask == "ragged":  # padded sequences, and one sequence with no response token at all
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = max(int(lengths[0]), min(T, len(PLANTED)))
        m = torch.arange(T)[None] < lengths[:, None]
        m[min(1, B - 1)] = False
    elif mask == "ones":
        m = torch.ones(B, T, dtype=torch.bool)
    else:
        m = torch.zeros(B, T, dtype=torch.bool)
    return dict(hidden=hidden, weight=weight, bias=b, targets=targets, old=old, ref=ref, adv=adv, mask=m)


def run_policy(fn, batch, dtype=None, **loss_kw):
    """(loss, metrics, grads) of fn with the batch's hidden/weight/bias (cast to dtype) as leaves."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    leaves = {k: cast(batch[k]).clone().requires_grad_() for k in ("hidden", "weight", "bias") if batch[k] is not None}
    loss, metrics = fn(leaves["hidden"], leaves["weight"], batch["targets"], batch["old"], batch["adv"], batch["mask"],
                       bias=leaves.get("bias"), **loss_kw)
    loss.backward()
    return loss.detach(), metrics, {k: v.grad for k, v in leaves.items()}


def fused_policy(hidden, weight, targets, old, adv, mask, *, bias=None, temperature=1.0, ref_logprobs=None,
                 rollout_logprobs=None, exact=False, chunk_rows=CHUNK, **cfg_kw):
    """The Triton path, forced on CPU (the public op dispatches CPU tensors to the reference). exact: the
    vocabulary block is the default one (from V alone), as `chosen_logprobs` takes it."""
    cfg = PL.LossConfig(**cfg_kw)
    mask_bool, num_tokens = P._check_policy("test", hidden, weight, bias, targets, old, adv, mask, ref_logprobs,
                                            temperature, cfg, rollout_logprobs)
    return P._ppo_loss_fused(hidden, weight, targets, old, adv, mask_bool, num_tokens, bias=bias,
                             temperature=temperature, ref_logprobs=ref_logprobs, cfg=cfg,
                             rollout_logprobs=rollout_logprobs, exact=exact, chunk_rows=chunk_rows,
                             block_v=None if exact else block_v(weight.shape[0]))


def max_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    return (x.double() - truth.double()).abs().max().item()


def assert_close_to_truth(name, got, same_dtype, truth, k=K_SAME_DTYPE):
    """|got - truth| <= k x |same_dtype - truth| + the floor (maxima over the tensor)."""
    err, ref_err = max_err(got, truth), max_err(same_dtype, truth)
    floor = FLOOR_ULPS * max(truth.double().abs().max().item(), 1e-3)
    assert err <= k * ref_err + floor, (f"{name}: {err:.3g} off the fp64 truth; the float32 formulas are "
                                        f"{ref_err:.3g} off (allowed {k} x that + {floor:.2g})")


def assert_fp64_close(name, got, truth, scale_terms):
    """Two float64 evaluations of one quantity: each within ~scale_terms x u64 of the exact value
    (a sum over up to scale_terms terms), times the quantity's magnitude."""
    bound = 2 * scale_terms * U64 * max(truth.abs().max().item(), 1.0)
    assert max_err(got, truth) <= bound, f"{name}: {max_err(got, truth):.3g} off the fp64 truth (allowed {bound:.2g})"


ROLLOUT_METRICS = ("rollout_corr_weight", "rollout_corr_clipfrac", "rollout_corr_logprob_diff")
"""The rollout correction's metrics (tests/test_rollout_correction.py); the formulas have the others."""


def assert_rollout_metrics_off(metrics, mask):
    """Without rollout_logprobs: weight 1 (0 when no token is masked in), clipfrac and diff 0, exactly."""
    any_token = float(mask.any())
    assert [metrics[k].item() for k in ROLLOUT_METRICS] == [any_token, 0.0, 0.0]


def check_against_truth(batch, *, fused=fused_policy, **loss_kw):
    """The package's reference and `fused` against the formulas' float64 truth: loss, metrics, gradients."""
    kw = dict(loss_kw)
    if kw.pop("use_ref", True):
        kw["ref_logprobs"] = batch["ref"]
    truth = run_policy(formulas.ppo_loss, batch, torch.float64, **kw)
    same = run_policy(formulas.ppo_loss, batch, **kw)
    results = {}
    for label, fn in (("reference", P.ppo_loss_ref), ("fused", fused)):
        got = results[label] = run_policy(fn, batch, **kw)
        assert_close_to_truth(f"{label} loss", got[0], same[0], truth[0])
        assert set(got[1]) == set(PL.METRICS) == set(truth[1]) | set(ROLLOUT_METRICS)
        for name in PL.METRICS:
            assert got[1][name].shape == () and not got[1][name].requires_grad
        for name in truth[1]:
            assert_close_to_truth(f"{label} {name}", got[1][name], same[1][name], truth[1][name])
        assert_rollout_metrics_off(got[1], batch["mask"])
        for name in truth[2]:
            assert got[2][name].dtype == batch[name].dtype
            assert_close_to_truth(f"{label} grad {name}", got[2][name], same[2][name], truth[2][name])
    return truth, results["fused"]


# --------------------------------------------------------------------------------------------
# kernels


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,block_v", [(1000, 256), (50257, None), (17, 16)])
def test_row_kernels_match_fp64(dtype, V, block_v):
    from hybridengine.kernels import ppo_loss as K

    rows, temperature = 5, 0.7
    x = (torch.randn(rows, V) * 3).to(dtype)
    x[0, :3] = -float("inf")  # a masked-out vocabulary entry must not poison the row
    t = torch.randint(3, V, (rows,))
    lse, logp, ent = K.logit_stats(x, t, inv_temperature=1 / temperature, block_v=block_v)
    # -inf as -1e4 in the truth: the same probabilities (exactly 0), with no 0 * inf in autograd.
    z = (x.double().clamp_min(-1e4) / temperature).requires_grad_()
    log_probs = z.log_softmax(-1)
    ent64 = -(log_probs.exp() * log_probs).sum(-1)
    logp64 = log_probs.gather(1, t[:, None])[:, 0]
    for got, want in ((lse, z.logsumexp(-1)), (logp, logp64), (ent, ent64)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
    g_logp, g_ent = torch.randn(rows), torch.randn(rows)
    (x64,) = torch.autograd.grad((g_logp.double() * logp64 + g_ent.double() * ent64).sum(), z)
    x64 = x64 / temperature
    K.logit_grad_(x, t, lse, ent, g_logp, g_ent, inv_temperature=1 / temperature, block_v=block_v)
    assert not x.isnan().any()
    # The gradient is computed in fp32 and rounded once to the logits' dtype: what torch's own
    # rounding of the exact value gives, to fp32 precision.
    torch.testing.assert_close(x.double(), x64.to(dtype).double(), rtol=2e-6, atol=2e-6)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridengine.kernels import ppo_loss as K

for dtype in ("bf16", "fp16", "fp32"):
    row = {"logits_ptr": f"*{dtype}", "stride_row": "i64", "targets_ptr": "*i64"}
    tail = {"num_cols": "i32", "inv_temperature": "fp32", "BLOCK_V": "constexpr"}
    stats = {**row, "lse_ptr": "*fp32", "logp_ptr": "*fp32", "entropy_ptr": "*fp32", **tail,
             "PER_ROW_TEMPERATURE": "constexpr"}
    grad = {**row, "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32", "grad_entropy_ptr": "*fp32",
            **tail}
    for kernel, signature, constexprs in (
            (K._logit_stats_kernel, stats, {"PER_ROW_TEMPERATURE": False}),
            (K._logit_stats_kernel, {**stats, "inv_temperature": "*fp32"}, {"PER_ROW_TEMPERATURE": True}),
            (K._logit_grad_kernel, grad, {})):
        src = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK_V": K.MAX_BLOCK_V, **constexprs})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": K.NUM_WARPS})
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real in the gpu tests")
def test_kernels_compile_for_sm90():
    """The compiler checks what the interpreter does not (e.g. a kernel reading a non-constexpr global)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_row_kernels_reject_bad_shapes():
    from hybridengine.kernels import ppo_loss as K

    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="targets must be int32/int64"):
        K.logit_stats(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="unit column stride"):
        K.logit_stats(x.t(), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="grad_logp must be a contiguous fp32"):
        K.logit_grad_(x, torch.zeros(4, dtype=torch.long), *[torch.zeros(4)] * 2, torch.zeros(4, dtype=torch.float64),
                      torch.zeros(4))
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        K.logit_stats(x, torch.zeros(4, dtype=torch.long), block_v=100)


# --------------------------------------------------------------------------------------------
# the reference


def test_reference_gradcheck_fp64():
    batch = make_batch(B=2, T=3, H=4, V=7, dtype=torch.float64, bias=True, seed=1)
    batch["mask"][0, 2] = False
    for kw in (dict(clip_ratio_c=2.0, kl_coef=0.3, kl_estimator="k3", entropy_coef=0.05,
                    loss_agg="seq-mean-token-mean"),
               dict(kl_coef=0.2, kl_estimator="k2", entropy_coef=-0.1, loss_agg="seq-mean-token-sum", temperature=0.6)):
        def loss(h, w, b, kw=kw):
            return P.ppo_loss_ref(h, w, batch["targets"], batch["old"], batch["adv"], batch["mask"], bias=b,
                                  ref_logprobs=batch["ref"], **kw)[0]

        leaves = [batch[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
        assert torch.autograd.gradcheck(loss, leaves)


@pytest.mark.parametrize("estimator", PL.KL_ESTIMATORS)
@pytest.mark.parametrize("loss_agg", PL.LOSS_AGGS)
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_grad_coefficients_match_autograd(estimator, loss_agg, clip_ratio_c):
    """The hand-written dloss/dlogp equals torch autograd of the same expressions, ties included."""
    B, T = 4, 9
    logp = -torch.rand(B, T, dtype=torch.float64) * 5
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.5
    old[0, :3] = logp[0, :3]  # ratio exactly 1: pg1 == pg2, the maximum's tie
    old[0, 3] = logp[0, 3] + 25  # d clamped at -20
    adv = torch.randn(B, T, dtype=torch.float64)
    adv[1] = 0  # every term ties at zero
    ref = logp + torch.randn(B, T, dtype=torch.float64)
    ref[2, 0] = logp[2, 0] + 30  # k3 clamped
    mask = torch.rand(B, T) > 0.2
    mask[3] = False
    old[3] = float("nan")  # masked-out garbage must not leak
    cfg = PL.LossConfig(clip_low=0.1, clip_high=0.28, clip_ratio_c=clip_ratio_c, kl_coef=0.7, kl_estimator=estimator,
                        entropy_coef=0.0, loss_agg=loss_agg)
    lp = logp.clone().requires_grad_()
    loss, _ = PL.policy_loss(lp, torch.zeros_like(lp), old, adv, mask, ref, cfg)
    (expected,) = torch.autograd.grad(loss, lp)
    got = PL.policy_grad_logp(logp, old, adv, ref, PL.agg_weights(mask, loss_agg, torch.float64), cfg)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def test_aggregations_by_hand():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]]).bool()
    assert PL.aggregate(L, mask, "token-mean").item() == pytest.approx((1 + 2 + 7 + 8 + 9) / 5)
    assert PL.aggregate(L, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 8) / 2)
    assert PL.aggregate(L, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 24) / 2)
    for agg in PL.LOSS_AGGS:
        assert PL.aggregate(L, torch.zeros_like(mask), agg).item() == 0
        assert (PL.agg_weights(mask, agg, torch.float32) * L).sum().item() == pytest.approx(
            PL.aggregate(L, mask, agg).item())


def test_formulas_by_hand():
    """The independent formulas on values worked out by hand (the truth's own check)."""
    r = torch.tensor([1.25, 1.5, 0.8, 0.95, 4.0, 4.0, 0.5, 1.5, 2.0], dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    logp = torch.zeros(9, dtype=torch.float64, requires_grad=True)
    loss, clipped, dual = formulas.surrogate(logp, -r.log(), adv, clip_low=0.1, clip_high=0.28, clip_ratio_c=3.0)
    # ratio range [0.9, 1.28]; dual cap at r = 3 for A < 0
    want = [-2.5, -2 * 1.28, 0.9, 0.95, 3.0, -1.28, -0.5, 1.5, 0.0]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=1e-15)
    assert clipped.tolist() == [False, True, True, False, False, True, False, False, False]
    assert dual.tolist() == [False, False, False, False, True, False, False, False, False]
    (grad,) = torch.autograd.grad(loss.sum(), logp)  # d(-A r)/dlogp = -A r where the ratio is free, else 0
    torch.testing.assert_close(grad, torch.tensor([-2.5, 0, 0, 0.95, 0, 0, -0.5, 1.5, 0], dtype=torch.float64))

    lp, ref = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-1.5], dtype=torch.float64)
    assert formulas.kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5, rel=1e-15)
    assert formulas.kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125, rel=1e-15)
    assert formulas.kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-15)
    assert formulas.kl_estimate(lp, lp + 30, "k3").item() == 10.0

    # logits [0, log 3]: p = [1/4, 3/4]
    logp1, ent = formulas.token_logprobs(torch.ones(1, 1, 1, dtype=torch.float64),
                                         torch.tensor([[0.0], [math.log(3)]], dtype=torch.float64),
                                         torch.tensor([[1]]))
    assert logp1.item() == pytest.approx(math.log(0.75), rel=1e-15)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel=1e-15)

    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert formulas.aggregate(L, mask, "token-mean").item() == pytest.approx((1 + 2 + 7 + 8 + 9) / 5)
    assert formulas.aggregate(L, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 8) / 2)
    assert formulas.aggregate(L, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 24) / 2)
    assert formulas.aggregate(L, torch.zeros_like(mask), "seq-mean-token-mean").item() == 0


@pytest.mark.parametrize("loss_agg", PL.LOSS_AGGS)
@pytest.mark.parametrize("estimator", PL.KL_ESTIMATORS)
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
@pytest.mark.parametrize("clip_low,clip_high", CLIPS)
def test_reference_fp64_matches_formulas(clip_low, clip_high, clip_ratio_c, estimator, loss_agg):
    """`ppo_loss_ref` in float64 equals the float64 formulas up to float64 rounding: loss, metrics, gradients."""
    H, V = 8, 64
    batch = make_batch(H=H, V=V, dtype=torch.float64, bias=True, seed=2, temperature=0.8)
    kw = dict(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, ref_logprobs=batch["ref"],
              kl_coef=0.3, kl_estimator=estimator, entropy_coef=0.05, loss_agg=loss_agg, temperature=0.8)
    truth = run_policy(formulas.ppo_loss, batch, **kw)
    got = run_policy(P.ppo_loss_ref, batch, **kw)
    terms = V + H + batch["mask"].numel()  # the longest sum behind any of the results
    assert_fp64_close("loss", got[0], truth[0], terms)
    for name in truth[1]:
        assert_fp64_close(name, got[1][name], truth[1][name], terms)
    assert_rollout_metrics_off(got[1], batch["mask"])
    for name in truth[2]:
        assert_fp64_close(f"grad {name}", got[2][name], truth[2][name], terms)


# --------------------------------------------------------------------------------------------
# the fused path against the fp64 truth

CASES = [
    # (id, batch kwargs, loss kwargs)
    ("fp32-v1000-token-mean-k3-cliphigher", dict(dtype=torch.float32),
     dict(kl_coef=0.1, kl_estimator="k3", clip_low=0.1, clip_high=0.28)),
    ("bf16-v1000-seqmean-k1-dual-bias-T0.7", dict(bias=True),
     dict(kl_coef=0.2, kl_estimator="k1", clip_ratio_c=3.0, loss_agg="seq-mean-token-mean", temperature=0.7,
          entropy_coef=0.01, clip_low=0.3, clip_high=0.15)),
    ("bf16-v1000-seqsum-k2-allones", dict(mask="ones"),
     dict(kl_coef=0.05, kl_estimator="k2", loss_agg="seq-mean-token-sum", clip_low=0.1, clip_high=0.28)),
    ("fp32-v1000-seqsum-k3-dual-cliphigher", dict(dtype=torch.float32, bias=True),
     dict(kl_coef=0.1, kl_estimator="k3", loss_agg="seq-mean-token-sum", clip_ratio_c=3.0, clip_low=0.1,
          clip_high=0.28, entropy_coef=0.02)),
    ("fp32-v1000-A0-entropy-T1.5", dict(dtype=torch.float32, zero_advantages="all", bias=True),
     dict(entropy_coef=0.1, kl_coef=0.1, temperature=1.5, clip_ratio_c=2.0)),
    ("bf16-v50257-token-mean-dual-noref", dict(V=50257, B=2, T=5),
     dict(clip_ratio_c=3.0, entropy_coef=0.02, use_ref=False, clip_low=0.3, clip_high=0.15)),
    ("fp32-v50257-seqmean-k3-T0.5", dict(V=50257, B=2, T=5, dtype=torch.float32, mask="ones"),
     dict(kl_coef=0.1, loss_agg="seq-mean-token-mean", temperature=0.5)),
]


@interpreter
@pytest.mark.parametrize("batch_kw,loss_kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fused_matches_fp64(batch_kw, loss_kw):
    batch = make_batch(temperature=loss_kw.get("temperature", 1.0), **batch_kw)
    check_against_truth(batch, **loss_kw)


@interpreter
def test_fused_identity_of_metrics():
    batch = make_batch(dtype=torch.float32, bias=True)
    kw = dict(kl_coef=0.3, entropy_coef=0.05, clip_ratio_c=3.0, ref_logprobs=batch["ref"], temperature=0.9)
    loss, m, _ = run_policy(fused_policy, batch, **kw)
    m = {k: v.item() for k, v in m.items()}
    assert loss.item() == pytest.approx(m["pg_loss"] - 0.05 * m["entropy"] + 0.3 * m["kl_loss"], rel=1e-6)
    assert 0 <= m["pg_clipfrac"] <= 1 and 0 <= m["pg_clipfrac_lower"] <= 1


def test_all_masked_gives_zero_loss_and_grads():
    batch = make_batch(mask="none", bias=True)
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, entropy_coef=0.1, clip_ratio_c=3.0)
    for fn in (P.ppo_loss_ref, fused_policy):
        for agg in PL.LOSS_AGGS:
            loss, metrics, grads = run_policy(fn, batch, loss_agg=agg, **kw)
            assert loss.item() == 0 and all(v.item() == 0 for v in metrics.values()), (fn, agg)
            for name, g in grads.items():
                assert torch.equal(g, torch.zeros_like(g)), (fn, agg, name)


@interpreter
def test_masked_garbage_is_ignored():
    """Padding may hold NaN log-probs and out-of-vocabulary targets (-100): loss and grads are as without it."""
    batch = make_batch(dtype=torch.float32)
    clean = run_policy(fused_policy, batch, ref_logprobs=batch["ref"], kl_coef=0.1)
    dirty = dict(batch)
    off = ~batch["mask"]
    dirty["targets"] = batch["targets"].masked_fill(off, -100)
    dirty["old"] = batch["old"].masked_fill(off, float("nan"))
    dirty["adv"] = batch["adv"].masked_fill(off, float("inf"))
    ref = batch["ref"].masked_fill(off, float("nan"))
    for fn in (fused_policy, P.ppo_loss_ref):
        got = run_policy(fn, dirty, ref_logprobs=ref, kl_coef=0.1)
        torch.testing.assert_close(got[0], clean[0], rtol=1e-5, atol=1e-6)
        for name in got[2]:
            assert got[2][name].isfinite().all()
            torch.testing.assert_close(got[2][name], clean[2][name], rtol=1e-4, atol=1e-6)


@interpreter
def test_grad_output_scales_and_accumulates():
    batch = make_batch(dtype=torch.float32)
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1)
    _, _, once = run_policy(fused_policy, batch, **kw)
    h = batch["hidden"].clone().requires_grad_()
    w = batch["weight"].clone().requires_grad_()
    for scale in (2.0, -0.5):  # two calls, gradients accumulate into .grad
        loss, _ = fused_policy(h, w, batch["targets"], batch["old"], batch["adv"], batch["mask"], **kw)
        (scale * loss).backward()
    torch.testing.assert_close(h.grad, 1.5 * once["hidden"])
    torch.testing.assert_close(w.grad, 1.5 * once["weight"])


@interpreter
def test_fused_without_grad_and_partial_requires_grad():
    batch = make_batch(dtype=torch.float32)
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1)
    args = (batch["targets"], batch["old"], batch["adv"], batch["mask"])
    loss_ref, _ = P.ppo_loss_ref(batch["hidden"], batch["weight"], *args, **kw)
    with torch.no_grad():
        loss, _ = fused_policy(batch["hidden"], batch["weight"], *args, **kw)
    torch.testing.assert_close(loss, loss_ref)
    w = batch["weight"].clone().requires_grad_()
    loss, _ = fused_policy(batch["hidden"], w, *args, **kw)
    loss.backward()
    _, _, grads = run_policy(fused_policy, batch, **kw)
    torch.testing.assert_close(w.grad, grads["weight"])
    with pytest.raises(RuntimeError, match="second backward"):
        loss, _ = fused_policy(batch["hidden"], w, *args, **kw)
        loss.backward(retain_graph=True)
        loss.backward()


@interpreter
@pytest.mark.parametrize("mask", ["ones", "ragged"])
def test_strided_hidden_is_read_in_place(mask):
    """Response states sliced out of the prompt+response states ([:, P:]) give the same loss and gradients."""
    batch = make_batch(dtype=torch.float32, mask=mask)
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, entropy_coef=0.01)
    want = run_policy(fused_policy, batch, **kw)
    full = torch.randn(3, 4 + 7, 16).requires_grad_()
    with torch.no_grad():
        full[:, 4:] = batch["hidden"]
    sliced = full[:, 4:]
    assert not sliced.is_contiguous()
    loss, _ = fused_policy(sliced, batch["weight"], batch["targets"], batch["old"], batch["adv"], batch["mask"], **kw)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want[0])
    torch.testing.assert_close(full.grad[:, 4:], want[2]["hidden"])
    assert torch.equal(full.grad[:, :4], torch.zeros_like(full.grad[:, :4]))


@interpreter
def test_chunk_sizes_agree():
    """One chunk, a chunk per token, and the default chunking give the same loss and gradients."""
    batch = make_batch(dtype=torch.float32, mask="ones")
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, entropy_coef=0.01)
    results = [run_policy(lambda *a, c=c, **k: fused_policy(*a, chunk_rows=c, **k), batch, **kw)
               for c in (None, 1, 1000)]
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0])
        for name in other[2]:
            torch.testing.assert_close(other[2][name], results[0][2][name], rtol=1e-5, atol=1e-6)


def test_chunk_rows_policy():
    assert LH.rows_per_chunk(5, 152064, 2) == 5
    for M in (3457, 8192, 32768, 131072):
        c = LH.rows_per_chunk(M, 152064, 2)
        assert c * 152064 * 2 <= LH.LOGITS_CHUNK_BYTES and c % LH.CHUNK_ALIGN == 0
        assert M - (math.ceil(M / c) - 1) * c >= c // 2  # the last chunk is not a sliver
    assert LH.rows_per_chunk(10**6, 10**7, 4) == LH.CHUNK_ALIGN


def test_chunk_rows_fit_the_memory_target():
    """Qwen2-7B head, bf16, both gradients: gradients + chunk + O(M) stay within LOSS_MEMORY_BYTES
    while the gradients leave at least MIN_CHUNK_ROWS rows; beyond that the chunk stays at that floor."""
    H, V = 3584, 152064
    for M in (8192, 32768, 131072):
        grads = (M * H + V * H) * 2
        c = LH.rows_per_chunk(M, V, 2, grads)
        assert c % LH.CHUNK_ALIGN == 0 and c >= LH.MIN_CHUNK_ROWS
        assert grads + c * V * 2 + LH.WORKSPACE_BYTES_PER_ROW * M <= LH.LOSS_MEMORY_BYTES, M
    assert LH.rows_per_chunk(32768, V, 2, 0) > LH.rows_per_chunk(32768, V, 2, (32768 * H + V * H) * 2)
    assert LH.rows_per_chunk(10**6, V, 2, 4 * LH.LOSS_MEMORY_BYTES) == LH.MIN_CHUNK_ROWS


# --------------------------------------------------------------------------------------------
# token_logprobs


@interpreter
@pytest.mark.parametrize("dtype,V,bias,temperature",
                         [(torch.float32, 1000, True, 0.8), (torch.bfloat16, 50257, False, 1.0)])
def test_token_logprobs_fused_matches_fp64(dtype, V, bias, temperature):
    batch = make_batch(dtype=dtype, V=V, bias=bias, B=2, T=5)
    g_logp, g_ent = torch.randn(2, 5), torch.randn(2, 5)

    def run(fn, cast):
        leaves = {k: cast(batch[k]).clone().requires_grad_() for k in ("hidden", "weight", "bias")
                  if batch[k] is not None}
        logp, ent = fn(leaves["hidden"], leaves["weight"], batch["targets"], bias=leaves.get("bias"),
                       temperature=temperature)
        ((logp * g_logp.to(logp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()).backward()
        return logp.detach(), ent.detach(), {k: v.grad for k, v in leaves.items()}

    fused = lambda *a, **k: TL._token_logprobs_fused(*a, chunk_rows=4, block_v=block_v(V), **k)  # noqa: E731
    truth = run(formulas.token_logprobs, lambda x: x.double())
    same = run(formulas.token_logprobs, lambda x: x)
    for label, fn in (("reference", lambda *a, **k: TL.token_logprobs_ref(*a, return_entropy=True, **k)),
                      ("fused", fused)):
        got = run(fn, lambda x: x)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert_close_to_truth(f"{label} logp", got[0], same[0], truth[0])
        assert_close_to_truth(f"{label} entropy", got[1], same[1], truth[1])
        for name in truth[2]:
            assert_close_to_truth(f"{label} grad {name}", got[2][name], same[2][name], truth[2][name])
    with torch.no_grad():
        logp, ent = TL._token_logprobs_fused(batch["hidden"], batch["weight"], batch["targets"], bias=batch["bias"],
                                            temperature=temperature, chunk_rows=3, block_v=block_v(V))
    torch.testing.assert_close(logp, got[0])
    torch.testing.assert_close(ent, got[1])


def test_token_logprobs_public_on_cpu():
    batch = make_batch(dtype=torch.float32)
    logp = TL.token_logprobs(batch["hidden"], batch["weight"], batch["targets"])
    logp2, ent = TL.token_logprobs(batch["hidden"], batch["weight"], batch["targets"], return_entropy=True)
    want, want_ent = LH.logprobs_ref(batch["hidden"], batch["weight"], batch["targets"], None, 1.0)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(logp2, want)
    torch.testing.assert_close(ent, want_ent)
    assert logp.shape == batch["targets"].shape and (logp <= 0).all() and (ent >= 0).all()


# --------------------------------------------------------------------------------------------
# dispatch


def test_cpu_dispatches_to_reference_without_warning():
    batch = make_batch()
    kw = dict(ref_logprobs=batch["ref"], kl_coef=0.1, clip_ratio_c=3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_policy(P.ppo_loss, batch, **kw)
    want = run_policy(P.ppo_loss_ref, batch, **kw)
    assert torch.equal(got[0], want[0])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name])


def test_package_exports():
    import hybridengine as he

    assert he.ppo_loss is P.ppo_loss and he.token_logprobs is TL.token_logprobs and he.value_loss is VL.value_loss


def test_bench_rows_on_cpu():
    """hybridengine_bench/ppo_loss.py at its CPU shapes: every provider gives rows or a not_run row with its reason."""
    from hybridengine_bench.common import Ctx, Recorder
    from hybridengine_bench.ppo_loss import ppo_loss as bench_ppo_loss

    rec = Recorder(path=None, run_id="test", gpu="cpu", num_gpus=0, commit="test", versions={})
    bench_ppo_loss(Ctx(rec=rec, device=torch.device("cpu"), rank=0, world=1, models=[], scale=0.1))
    measured = {(r["provider"], r["case"]["tokens"]) for r in rec.rows if r["metric"] == "TFLOP_per_s"}
    for provider in ("hybridengine", "torch_ref", "torch_chunked"):
        assert {(provider, m) for m in (256, 1024)} <= measured, measured
    for row in rec.rows:
        if row["metric"] == "not_run":
            assert row["provider"] == "liger" and row["case"]["reason"], row
        else:
            assert row["value"] > 0 and row["p20"] <= row["value"] <= row["p80"], row


# --------------------------------------------------------------------------------------------
# value_loss


@pytest.mark.parametrize("loss_agg", PL.LOSS_AGGS)
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_formula(loss_agg, clip):
    """Value and gradient w.r.t. the values against the formula: fp64 to rounding; fp32 within 2x the
    float32 formula's error + 8 ulps. Two of the nine masked-in values take the clipped term."""
    B, T = 3, 6
    g = torch.Generator().manual_seed(5)
    v = torch.randn(B, T, dtype=torch.float64, generator=g)
    old = v + torch.randn(B, T, dtype=torch.float64, generator=g) * 0.3
    returns = torch.randn(B, T, dtype=torch.float64, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False

    def run(fn, dtype):
        x = v.to(dtype).requires_grad_()
        loss = fn(x, old.to(dtype), returns.to(dtype), mask.float(), clip=clip, loss_agg=loss_agg)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad

    truth = run(formulas.value_loss, torch.float64)
    got = run(VL.value_loss, torch.float64)
    for name, a, b in (("loss", got[0], truth[0]), ("grad", got[1], truth[1])):
        assert_fp64_close(name, a, b, mask.numel())
    same = run(formulas.value_loss, torch.float32)
    got = run(VL.value_loss, torch.float32)
    assert_close_to_truth("fp32 loss", got[0], same[0], truth[0])
    assert_close_to_truth("fp32 grad", got[1], same[1], truth[1])
    assert torch.autograd.gradcheck(lambda x: VL.value_loss(x, old, returns, mask, clip=clip, loss_agg=loss_agg),
                                    (v.clone().requires_grad_(),))


def test_value_loss_dtypes_and_all_masked():
    v = torch.randn(2, 3, dtype=torch.bfloat16, requires_grad=True)
    loss = VL.value_loss(v, v.detach(), torch.zeros(2, 3), torch.zeros(2, 3))
    assert loss.dtype == torch.float32 and loss.item() == 0
    loss.backward()
    assert torch.equal(v.grad, torch.zeros_like(v.grad))


# --------------------------------------------------------------------------------------------
# validation


def _policy_args(**over):
    batch = make_batch(dtype=torch.float32)
    args = dict(hidden=batch["hidden"], weight=batch["weight"], targets=batch["targets"], old_logprobs=batch["old"],
                advantages=batch["adv"], mask=batch["mask"])
    kw = {}
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return args, kw


B_, T_, H_, V_ = 3, 7, 16, 1000
POLICY_ERRORS = [
    (dict(hidden=torch.randn(B_ * T_, H_)), "hidden must be a float \\[B, T, H\\]"),
    (dict(hidden=torch.randn(B_, T_, H_).half().to(torch.int32)), "hidden must be a float"),
    (dict(weight=torch.randn(V_, H_ + 1)), "weight must be \\[V, H\\] with H = 16"),
    (dict(weight=torch.randn(V_, H_, dtype=torch.float64)), "weight dtype torch.float64 differs from hidden"),
    (dict(bias=torch.randn(V_ + 1)), "bias must be \\[V\\] = \\[1000\\]"),
    (dict(bias=torch.randn(V_, dtype=torch.bfloat16)), "bias must be torch.float32"),
    (dict(targets=torch.zeros(B_, T_ + 1, dtype=torch.long)), "targets must be \\[B, T\\] = \\[3, 7\\]"),
    (dict(targets=torch.zeros(B_, T_)), "targets must be an integer tensor"),
    (dict(targets=torch.full((B_, T_), V_)), "targets must lie in \\[0, 1000\\) where mask is set"),
    (dict(old_logprobs=torch.zeros(B_, T_ - 1)), "old_logprobs must be \\[B, T\\]"),
    (dict(advantages=torch.zeros(B_, T_, dtype=torch.long)), "advantages must be a float tensor"),
    (dict(ref_logprobs=torch.zeros(T_)), "ref_logprobs must be \\[B, T\\]"),
    (dict(mask=torch.ones(B_)), "mask must be \\[B, T\\]"),
    (dict(mask=torch.full((B_, T_), 2.0)), "mask must hold only 0 and 1"),
    (dict(kl_estimator="k4"), "kl_estimator must be one of"),
    (dict(loss_agg="seq-sum"), "loss_agg must be one of"),
    (dict(kl_coef=0.1), "kl_coef = 0.1 needs ref_logprobs"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c must be > 1"),
    (dict(clip_low=1.0), "clip_low must be in \\[0, 1\\)"),
    (dict(clip_high=-0.1), "clip_high must be >= 0"),
    (dict(temperature=0.0), "temperature must be a finite number > 0"),
    (dict(entropy_coef=float("nan")), "entropy_coef must be finite"),
]


@pytest.mark.parametrize("fn", [P.ppo_loss, P.ppo_loss_ref], ids=["ppo_loss", "ppo_loss_ref"])
@pytest.mark.parametrize("over,match", POLICY_ERRORS, ids=[m for _, m in POLICY_ERRORS])
def test_ppo_loss_rejects(fn, over, match):
    args, kw = _policy_args(**over)
    with pytest.raises(ValueError, match=match):
        fn(**args, **kw)


def test_ppo_loss_rejects_mixed_devices():
    args, kw = _policy_args(weight=torch.randn(V_, H_, device="meta"))
    with pytest.raises(ValueError, match="weight is on meta"):
        P.ppo_loss(**args, **kw)
    args, kw = _policy_args(advantages=torch.zeros(B_, T_, device="meta"))
    with pytest.raises(ValueError, match="advantages is on meta"):
        P.ppo_loss(**args, **kw)


def test_token_logprobs_rejects():
    h, w = torch.randn(2, 3, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="targets must lie in \\[0, 10\\)"):
        TL.token_logprobs(h, w, torch.full((2, 3), -1))
    with pytest.raises(ValueError, match="weight must be \\[V, H\\] with H = 4"):
        TL.token_logprobs(h, torch.randn(10, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be"):
        TL.token_logprobs(h, w, torch.zeros(2, 3, dtype=torch.long), temperature=-1.0)


@pytest.mark.parametrize("args,kw,match", [
    ((torch.randn(6), torch.randn(6), torch.randn(6), torch.ones(6)), {}, "values must be a float \\[B, T\\]"),
    ((torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 3), torch.ones(2, 3)), {}, "old_values must be \\[B, T\\]"),
    ((torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3)), {},
     "returns must be a float tensor"),
    ((torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(3, 2)), {}, "mask must be \\[B, T\\]"),
    ((torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)), {"loss_agg": "mean"},
     "loss_agg must be one of"),
    ((torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)), {"clip": -1.0}, "clip must be"),
])
def test_value_loss_rejects(args, kw, match):
    with pytest.raises(ValueError, match=match):
        VL.value_loss(*args, **kw)


# --------------------------------------------------------------------------------------------
# GPU (the lead runs these on the H200)


def _gpu_batch(device, *, B=4, T=250, H=256, V=50257, seed=0, temperature=1.0):
    batch = make_batch(B=B, T=T, H=H, V=V, dtype=torch.bfloat16, bias=False, seed=seed, temperature=temperature)
    return {k: None if v is None else v.to(device) for k, v in batch.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("loss_kw", [
    dict(kl_coef=0.04, kl_estimator="k3"),
    dict(kl_coef=0.1, kl_estimator="k2", clip_ratio_c=3.0, loss_agg="seq-mean-token-mean", entropy_coef=0.01,
         temperature=0.7),
], ids=["grpo", "dual-seqmean-T0.7"])
def test_gpu_ppo_loss_matches_fp64(device, loss_kw):
    batch = _gpu_batch(device, temperature=loss_kw.get("temperature", 1.0))
    check_against_truth(batch, fused=P.ppo_loss, **loss_kw)  # the public op: the kernels on CUDA


@pytest.mark.gpu
def test_gpu_token_logprobs_matches_fp64(device):
    batch = _gpu_batch(device)
    with torch.no_grad():
        got, got_ent = TL.token_logprobs(batch["hidden"], batch["weight"], batch["targets"], return_entropy=True)
        same, same_ent = formulas.token_logprobs(batch["hidden"], batch["weight"], batch["targets"])
        truth, truth_ent = formulas.token_logprobs(batch["hidden"].double(), batch["weight"].double(), batch["targets"])
    assert_close_to_truth("logp", got, same, truth)
    assert_close_to_truth("entropy", got_ent, same_ent, truth_ent)


@pytest.mark.gpu
def test_gpu_memory_is_one_chunk(device):
    """Extra memory of fwd + bwd: one [C, V] chunk + the gradients + O(M), far below the full logits."""
    B, T, H, V = 16, 1024, 256, 50257
    M = B * T
    h = torch.randn(B, T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device=device) / H**0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (B, T), device=device)
    old, ref = -10 + torch.randn(B, T, device=device), -10 + torch.randn(B, T, device=device)
    adv, mask = torch.randn(B, T, device=device), torch.ones(B, T, device=device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, _ = P.ppo_loss(h, w, targets, old, adv, mask, ref_logprobs=ref, kl_coef=0.04)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = (M * H + V * H) * 2
    chunk = LH.rows_per_chunk(M, V, 2, grads) * V * 2
    assert extra <= chunk + grads + 64 * 2**20, (extra, chunk, grads)
    assert extra < 0.6 * M * V * 2  # less than the bf16 logits alone


@pytest.mark.gpu
def test_gpu_fp64_warns_and_runs_reference(device):
    batch = _gpu_batch(device, B=1, T=8, V=1000)
    with pytest.warns(RuntimeWarning, match="no fused kernel for torch.float64"):
        TL.token_logprobs(batch["hidden"].double(), batch["weight"].double(), batch["targets"])
