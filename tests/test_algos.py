"""`hybridengine.train.advantages` against the straightforward per-element loops of `_formulas`
(written from the definitions, sharing no code with the package).

The loops run on Python floats (fp64: the truth) or on 0-dim fp32 tensors (the same-dtype
reference: every operation rounded to fp32, in textbook order). fp32 results may be off the truth
by at most 2x the fp32 loop's own error plus a floor of 8 fp32 ulps of the data's scale; fp64
results must match the fp64 loop to 1e-12.
"""

from __future__ import annotations

import pytest
import torch

import _formulas as formulas
from hybridengine.train.advantages import broadcast_to_tokens, gae, grpo_advantages, whiten

U32 = 2.0**-24


def assert_close_to_truth(ours, truth, same_dtype, scale):
    """|ours - truth| <= 2 |same_dtype - truth| + 8 ulps of the scale, element by element (all fp64)."""
    ours, truth, same_dtype = ours.double(), truth.double(), same_dtype.double()
    bound = 2 * (same_dtype - truth).abs() + 16 * U32 * scale
    excess = (ours - truth).abs() - bound
    assert excess.max() <= 0, f"max error {float((ours - truth).abs().max()):.3g} exceeds its bound"


# --------------------------------------------------------------------------------------------
# GAE


def make_rollout(B=6, T=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g) * 0.1
    values = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7  # gaps everywhere
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask[0] = torch.arange(T) < lengths[0]  # a contiguous response followed by padding
    mask[1] = (torch.arange(T) >= 5) & (torch.arange(T) < 5 + lengths[1] // 2)  # prompt, response, padding
    mask[2] = False  # no response token at all
    mask[3, -1] = True  # a response that runs to the end of the row
    rewards[0, lengths[0] - 1] += 1.0  # an outcome reward on the last token
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 1.0), (1.0, 0.5)])
def test_gae_matches_loop(gamma, lam):
    rewards, values, mask = make_rollout()
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    assert adv.dtype == ret.dtype == torch.float32
    truth_adv, truth_ret = formulas.gae(rewards, values, mask, gamma, lam)
    same_adv, same_ret = formulas.gae(rewards, values, mask, gamma, lam, dtype=torch.float32)
    scale = rewards.abs().sum(1).max() + 2 * values.abs().max()
    assert_close_to_truth(adv, truth_adv, same_adv, scale)
    assert_close_to_truth(ret, truth_ret, same_ret, scale)
    adv64, ret64 = gae(rewards.double(), values.double(), mask.long(), gamma=gamma, lam=lam)
    assert adv64.dtype == torch.float64
    torch.testing.assert_close(adv64, truth_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret64, truth_ret, rtol=1e-12, atol=1e-12)


def test_gae_monte_carlo_case_and_masked_zeros():
    """gamma = lam = 1 on a contiguous response: returns are the reward-to-go, advantages minus V.
    Masked positions are 0, and whatever they held (NaN here) never leaks into valid ones."""
    rewards, values, mask = make_rollout()
    rewards = torch.where(mask, rewards, float("nan"))
    values = torch.where(mask, values, float("nan"))
    adv, ret = gae(rewards, values, mask)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    for out in (adv, ret):
        assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    assert torch.equal(adv[2], torch.zeros_like(adv[2]))  # the all-masked row
    r0 = torch.where(mask[0], rewards[0], 0.0).double()
    to_go = r0.flip(0).cumsum(0).flip(0)
    torch.testing.assert_close(ret[0][mask[0]].double(), to_go[mask[0]], rtol=0, atol=16 * U32 * r0.abs().sum())
    sel = mask[0]
    # returns = adv + V rounds once; subtracting V again is exact up to that rounding
    torch.testing.assert_close(adv[0][sel], (ret[0] - values[0])[sel], rtol=0,
                               atol=2 * U32 * float(ret[0][sel].abs().max() + values[0][sel].abs().max()))


def test_estimators_by_hand():
    """GAE across a masked gap and GRPO on one group, worked out by hand: the loops and the package."""
    rewards = torch.tensor([[1.0, 9.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.25]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]])
    # gamma = lam = 0.5; step 2 ends the response: A = 2 - 0.25 = 1.75; step 0 bootstraps from step 2
    # (step 1 does not exist): delta = 1 + 0.5 * 0.25 - 0.5 = 0.625, A = 0.625 + 0.25 * 1.75 = 1.0625
    want_adv = torch.tensor([[1.0625, 0.0, 1.75]], dtype=torch.float64)
    for adv, ret in (formulas.gae(rewards, values, mask, 0.5, 0.5), gae(rewards, values, mask, gamma=0.5, lam=0.5)):
        torch.testing.assert_close(adv, want_adv, rtol=0, atol=1e-15)
        torch.testing.assert_close(ret, torch.tensor([[1.5625, 0.0, 2.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    # rewards 0, 1, 1, 1: mean 0.75, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    want = torch.tensor([-1.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    torch.testing.assert_close(formulas.grpo(scores, [0] * 4, 0.0, True), want, rtol=0, atol=1e-15)
    torch.testing.assert_close(grpo_advantages(scores, 4, eps=0.0), want, rtol=0, atol=1e-15)
    torch.testing.assert_close(grpo_advantages(scores, 4, norm_by_std=False), want / 2, rtol=0, atol=1e-15)


@pytest.mark.parametrize("call,match", [
    (lambda r, v, m: gae(r[0], v, m), r"gae: rewards must be \[B, T\]"),
    (lambda r, v, m: gae(r.long(), v, m), "gae: rewards must be a float tensor"),
    (lambda r, v, m: gae(r, v[:, :-1], m), r"gae: values must have shape \(6, 37\)"),
    (lambda r, v, m: gae(r, v, m[:-1]), r"gae: mask must have shape \(6, 37\)"),
    (lambda r, v, m: gae(r, v, m.float() * 2), "gae: mask must hold only 0 and 1"),
    (lambda r, v, m: gae(r, v, m, gamma=1.5), r"gae: gamma must be a number in \[0, 1\]"),
    (lambda r, v, m: gae(r, v, m, lam=-0.1), r"gae: lam must be a number in \[0, 1\]"),
    (lambda r, v, m: gae(r, v, m, lam=float("nan")), "gae: lam must be"),
])
def test_gae_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(*make_rollout())


# --------------------------------------------------------------------------------------------
# GRPO


def assert_rounded_from(ours: torch.Tensor, truth: torch.Tensor):
    """ours is the fp32 rounding of (an fp64 value within 1e-12 of) the truth: 1 fp32 ulp."""
    torch.testing.assert_close(ours, truth.float(), rtol=2 * U32, atol=1e-12)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("group_size", [1, 2, 5, 8])
def test_grpo_consecutive_groups_match_loop(group_size, norm_by_std):
    g = torch.Generator().manual_seed(group_size)
    scores = torch.randn(6 * group_size, generator=g)
    scores[:group_size] = torch.randint(0, 2, (group_size,), generator=g).float()  # a 0/1 reward group
    adv = grpo_advantages(scores, group_size, norm_by_std=norm_by_std)
    assert adv.dtype == torch.float32 and adv.shape == scores.shape
    truth = formulas.grpo(scores, [i // group_size for i in range(scores.numel())], 1e-6, norm_by_std)
    assert_rounded_from(adv, truth)
    if group_size == 1:
        assert torch.equal(adv, torch.zeros_like(adv))
    adv64 = grpo_advantages(scores.double(), group_size, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv64, truth, rtol=1e-12, atol=1e-12)


def test_grpo_group_ids_any_order_and_labels():
    g = torch.Generator().manual_seed(3)
    sizes = [4, 1, 3, 6, 2]  # includes a lone sample
    groups = [label for label, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(len(groups), generator=g)
    groups = [groups[i] for i in perm]
    scores = torch.randn(len(groups), generator=g) * 3 + 1
    truth = formulas.grpo(scores, groups, 1e-6, True)
    assert_rounded_from(grpo_advantages(scores, group_ids=torch.tensor(groups) * 7 - 3), truth)
    assert_rounded_from(grpo_advantages(scores, group_ids=[f"uid-{k}" for k in groups]), truth)
    lone = groups.index(1)
    assert grpo_advantages(scores, group_ids=groups)[lone] == 0


def test_grpo_constant_groups_are_exactly_zero():
    """Equal rewards in a group carry no signal: exactly 0, not rounding noise divided by eps."""
    scores = torch.tensor([0.1] * 5 + [0.7] * 5 + [1 / 3] * 5 + [0.0, 1.0, 1.0, 0.0, 1.0])
    adv = grpo_advantages(scores, 5)
    assert torch.equal(adv[:15], torch.zeros(15))
    assert (adv[15:] != 0).all()
    assert torch.equal(grpo_advantages(torch.full((6,), 0.3), group_ids=[0, 1, 0, 1, 0, 1]), torch.zeros(6))
    assert torch.equal(grpo_advantages(torch.tensor([1, 1, 0, 0]), 2), torch.zeros(4))  # integer scores


@pytest.mark.parametrize("call,match", [
    (lambda s: grpo_advantages(s.view(2, 4), 4), r"grpo_advantages: scores must be a 1-D tensor"),
    (lambda s: grpo_advantages(s > 0, 4), "grpo_advantages: scores must be a float or integer tensor"),
    (lambda s: grpo_advantages(s), "pass exactly one of group_size and group_ids"),
    (lambda s: grpo_advantages(s, 4, group_ids=[0] * 8), "pass exactly one of group_size and group_ids"),
    (lambda s: grpo_advantages(s, 3), "group_size = 3 does not divide the 8 samples"),
    (lambda s: grpo_advantages(s, 0), "group_size must be an int >= 1, got 0"),
    (lambda s: grpo_advantages(s, 2.0), "group_size must be an int >= 1"),
    (lambda s: grpo_advantages(s, group_ids=[0] * 7), "group_ids has 7 entries, scores 8"),
    (lambda s: grpo_advantages(s, group_ids=torch.zeros(8)), r"group_ids must be an integer tensor \[8\]"),
    (lambda s: grpo_advantages(s, group_ids="abcdefgh"), "group_ids must be an integer tensor or a sequence"),
    (lambda s: grpo_advantages(s, group_ids=[[0]] * 8), "group_ids labels must be hashable"),
    (lambda s: grpo_advantages(s, 4, eps=-1.0), "eps must be a finite number >= 0"),
])
def test_grpo_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(8))


# --------------------------------------------------------------------------------------------
# whitening and broadcasting


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_loop(shift_mean):
    _, values, mask = make_rollout()
    x = values * 3 + 2
    ours = whiten(x, mask, shift_mean=shift_mean)
    truth = formulas.whiten(x, mask, shift_mean, 1e-8)
    # Sums over ~150 elements in fp32: a few ulps of the scale; the normalised values are O(1).
    torch.testing.assert_close(ours.double(), truth, rtol=0, atol=64 * U32 * (1 + (0 if shift_mean else 2)))
    assert torch.equal(ours[~mask], torch.zeros_like(ours[~mask]))
    if shift_mean:
        sel = ours[mask].double()
        assert abs(sel.mean()) < 1e-6 and abs(sel.var() - 1) < 1e-5
    torch.testing.assert_close(whiten(x.double(), mask.float(), shift_mean=shift_mean), truth, rtol=1e-12, atol=1e-12)


def test_whiten_degenerate_masks():
    x = torch.randn(3, 5)
    none = torch.zeros(3, 5, dtype=torch.bool)
    assert torch.equal(whiten(x, none), torch.zeros(3, 5))
    one = none.clone()
    one[1, 2] = True
    assert torch.equal(whiten(x, one), torch.zeros(3, 5))
    kept = whiten(x, one, shift_mean=False)
    assert kept[1, 2] == x[1, 2] and torch.count_nonzero(kept) == (x[1, 2] != 0)


@pytest.mark.parametrize("call,match", [
    (lambda x, m: whiten(x.long(), m), "whiten: x must be a float tensor"),
    (lambda x, m: whiten(x, m[:, :-1]), r"whiten: mask must have shape \(6, 37\)"),
    (lambda x, m: whiten(x, m.long() * 3), "whiten: mask must hold only 0 and 1"),
    (lambda x, m: whiten(x, m, eps=0.0), "whiten: eps must be a finite number > 0"),
])
def test_whiten_errors(call, match):
    _, values, mask = make_rollout()
    with pytest.raises(ValueError, match=match):
        call(values, mask)


def test_broadcast_to_tokens():
    _, _, mask = make_rollout()
    per_sample = torch.randn(mask.shape[0], dtype=torch.float64)
    out = broadcast_to_tokens(per_sample, mask.to(torch.uint8))
    assert out.dtype == torch.float64
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                expected[b, t] = per_sample[b]
    assert torch.equal(out, expected)
    grpo = grpo_advantages(torch.randn(6), 3)
    torch.testing.assert_close(broadcast_to_tokens(grpo, mask).sum(1), grpo * mask.sum(1))


@pytest.mark.parametrize("call,match", [
    (lambda p, m: broadcast_to_tokens(p[:, None], m), r"broadcast_to_tokens: per_sample must be \[B\]"),
    (lambda p, m: broadcast_to_tokens(p.long(), m), "broadcast_to_tokens: per_sample must be a float tensor"),
    (lambda p, m: broadcast_to_tokens(p[:-1], m), r"broadcast_to_tokens: mask must have shape \(5, 37\)"),
    (lambda p, m: broadcast_to_tokens(p, m[0]), r"broadcast_to_tokens: mask must be a \[B, T\] tensor"),
])
def test_broadcast_errors(call, match):
    _, _, mask = make_rollout()
    with pytest.raises(ValueError, match=match):
        call(torch.randn(mask.shape[0]), mask)
