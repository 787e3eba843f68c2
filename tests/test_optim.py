"""FlatAdamW (`hybridengine.train.optimizer`) and its fused Triton step (`hybridengine.kernels.adamw`).

Truth is `torch.optim.AdamW` (single-tensor path, two param groups: weight_decay and 0). Our
reference performs torch's operations in torch's order but each rounded once to fp32 (no FMAs,
IEEE sqrt), while torch's CPU lerp is an FMA in its vector loop and its fp32 sqrt is off by an
ulp on some inputs (7.5k of 1M random values on an AVX512 build). Each of those differs by at most an ulp or so of the
quantity it produces, which gives the tolerances below (unit roundoff u = 2**-24):

- weights: per step one rounding of `p + update` can go the other way (<= 2u |p|) and the update
  (magnitude <~ lr) can differ by a couple of its ulps (<= 2u lr); over S steps
  |ours - torch| <= 2 S u (|p| + lr). Measured: <= 9u at S = 8 over 18 seeds/hyperparameters.
- exp_avg: a convex mix of the grads, errors shrink by beta1 each step: <= 2u max|g| (measured 0.9u).
- exp_avg_sq: relative, one rounding per step: <= S u relative (measured 3.7u at S = 8).

The Triton kernel runs the reference's exact operation order with the same fp32 scalars, so under
the interpreter (and, by construction, on the GPU: IEEE div/sqrt, no fp contraction) it must match
the reference bit for bit, and the weights it writes must equal `master.to(dtype)` bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridengine.train.optimizer import FlatAdamW, _use_kernel, adamw_step_ref, mask_ranges

U = 2.0**-24
SIZES = (1, 17, 300, 1000)
"""Unit sizes: one element, odd, and several partial blocks at BLOCK = 256."""
BLOCK = 256


def kernel():
    from hybridengine.kernels import adamw

    return adamw.adamw_step_


def make_units(sizes=SIZES, *, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(n, generator=g) * 2).to(dtype).to(device) for n in sizes]
    masks = [(torch.rand(n, generator=g) < 0.6).to(device) for n in sizes]
    masks = [m if i % 2 else m.to(torch.uint8) for i, m in enumerate(masks)]  # both mask dtypes
    return params, masks


def make_grads(sizes=SIZES, *, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(device) for n in sizes]


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns mapped to integers in the order of the values (-0 == +0): ulp distance."""
    i = x.float().view(torch.int32).long()
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((ordered_bits(a) - ordered_bits(b)).abs().max()) if a.numel() else 0


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32)), \
        f"{what}: {int((a != b).sum())} elements differ, max {max_ulps(a, b)} ulps"


# --------------------------------------------------------------------------------------------
# the reference (FlatAdamW's CPU path) against torch.optim.AdamW


@pytest.mark.parametrize("lr,betas,wd,schedule,grad_scale", [
    (1e-2, (0.9, 0.999), 0.1, False, 1.0),
    (1e-3, (0.9, 0.95), 0.01, True, 0.37),   # lr schedule and a clipping factor
    (0.3, (0.2, 0.5), 0.5, False, 1.0),      # beta1 < 0.5: lerp's other form; big steps
])
def test_reference_matches_torch_adamw(lr, betas, wd, schedule, grad_scale):
    steps = 5
    params, masks = make_units()
    sched = (lambda step: lr * (1 + step) / (2 * step)) if schedule else None  # warm-down: changes every step
    torch_decay = [p[m.bool()].clone().requires_grad_() for p, m in zip(params, masks)]
    torch_plain = [p[~m.bool()].clone().requires_grad_() for p, m in zip(params, masks)]
    ref = torch.optim.AdamW([{"params": torch_decay, "weight_decay": wd},
                             {"params": torch_plain, "weight_decay": 0.0}], lr=lr, betas=betas, eps=1e-8)
    opt = FlatAdamW(params, masks, lr=sched or lr, betas=betas, eps=1e-8, weight_decay=wd)
    assert opt.master is None  # fp32 params are their own master
    gmax = 0.0
    for step in range(1, steps + 1):
        grads = make_grads(seed=step)
        gmax = max(gmax, max(g.abs().max().item() for g in grads))
        for pd, pn, g, m in zip(torch_decay, torch_plain, grads, masks):
            scaled = g * grad_scale
            pd.grad, pn.grad = scaled[m.bool()].clone(), scaled[~m.bool()].clone()
        if sched:
            for group in ref.param_groups:
                group["lr"] = sched(step)
        ref.step()
        opt.step(grads, grad_scale=grad_scale)
    assert opt.num_steps == steps
    for i, m in enumerate(masks):
        m = m.bool()

        def torch_flat(get):
            out = torch.empty(m.numel())
            out[m], out[~m] = get(torch_decay[i]), get(torch_plain[i])
            return out

        lr_max = max(sched(s) for s in range(1, steps + 1)) if sched else lr
        torch.testing.assert_close(opt.params[i], torch_flat(lambda p: p.detach()), rtol=2 * steps * U,
                                   atol=2 * steps * U * lr_max)
        torch.testing.assert_close(opt.exp_avg[i], torch_flat(lambda p: ref.state[p]["exp_avg"]), rtol=0,
                                   atol=2 * U * gmax * grad_scale)
        torch.testing.assert_close(opt.exp_avg_sq[i], torch_flat(lambda p: ref.state[p]["exp_avg_sq"]),
                                   rtol=steps * U, atol=0)


def test_schedule_sees_steps_from_one():
    params, masks = make_units((5,))
    seen = []
    opt = FlatAdamW(params, masks, lr=lambda step: seen.append(step) or 1e-3)
    for _ in range(3):
        opt.step(make_grads((5,)))
    assert seen == [1, 2, 3] and opt.num_steps == 3


def test_grad_scale_equals_scaled_grads():
    params, masks = make_units()
    a = FlatAdamW([p.clone() for p in params], masks, lr=1e-2, weight_decay=0.1)
    b = FlatAdamW([p.clone() for p in params], masks, lr=1e-2, weight_decay=0.1)
    for step in range(1, 4):
        grads = make_grads(seed=step)
        a.step(grads, grad_scale=0.25)
        b.step([g * 0.25 for g in grads])
    for x, y in zip(a.params + a.exp_avg + a.exp_avg_sq, b.params + b.exp_avg + b.exp_avg_sq):
        assert_bitwise(x, y, "grad_scale=0.25 vs grads * 0.25")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_use_fp32_master(dtype):
    """bf16/fp16 params: the fp32 master evolves exactly like fp32 params started from the same
    values, and the params are its round-to-nearest-even after every step."""
    params, masks = make_units(dtype=dtype)
    opt = FlatAdamW(params, masks, lr=1e-2, weight_decay=0.1)
    twin = FlatAdamW([p.float() for p in params], masks, lr=1e-2, weight_decay=0.1)
    assert opt.master_weights and not twin.master_weights
    for step in range(1, 4):
        grads = make_grads(seed=step)
        opt.step(grads)
        twin.step(grads)
        for p, master, q in zip(opt.params, opt.master, twin.params):
            assert_bitwise(master, q, "master vs fp32 twin")
            assert_bitwise(p, master.to(dtype), "params vs master.to(dtype)")


def test_zero_padding_stays_zero_and_empty_units_are_skipped():
    """Padding (weight, grad, moments all zero) stays exactly zero, decayed or not; empty units are fine."""
    params, masks = make_units((40, 0, 33))
    for p, m in zip(params, masks):
        p[-7:] = 0
        m[-7:] = 1  # decay on: 0 * (1 - lr * wd) is still 0
        m[-3:] = 0
    opt = FlatAdamW(params, masks, lr=1e-2, weight_decay=0.1)
    for step in range(1, 4):
        grads = make_grads((40, 0, 33), seed=step)
        for g in grads:
            g[-7:] = 0
        opt.step(grads)
    for p, m, v in zip(opt.params, opt.exp_avg, opt.exp_avg_sq):
        for t in (p, m, v):
            assert torch.equal(t[-7:], torch.zeros_like(t[-7:]))
    assert opt.params[1].numel() == 0 and opt.num_steps == 3


# --------------------------------------------------------------------------------------------
# the Triton kernel against the reference, on the test device (the interpreter on CPU)


def step_units(opt: FlatAdamW, launch, grads, step: int, **kw) -> None:
    """What `FlatAdamW.step` does for every unit, with a chosen launcher (the reference or the kernel at
    a small block), so both run on the test device."""
    for i, p in enumerate(opt.params):
        if opt.master_lo is not None:
            master, param = opt.master_lo[i], p
        else:
            master, param = (opt.master[i], p) if opt.master is not None else (p, None)
        launch(master, opt.exp_avg[i], opt.exp_avg_sq[i], grads[i], opt.decay_masks[i], param, step=step, **kw)


@pytest.mark.parametrize("dtype,master_weights", [
    (torch.float32, None),      # params are the master
    (torch.float32, True),      # separate fp32 master, fp32 param copy
    (torch.bfloat16, None),     # fp32 master, bf16 writes
    (torch.float16, None),
    (torch.bfloat16, False),    # no master: update in fp32, rounded back into the bf16 params
])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.6)])
def test_kernel_matches_reference_bitwise(device, dtype, master_weights, betas):
    """The kernel (on the test device: the interpreter on CPU) against the reference on the same tensors."""
    params, masks = make_units(dtype=dtype, device=device)
    by_ref = FlatAdamW([p.clone() for p in params], masks, lr=3e-3, betas=betas, weight_decay=0.1,
                       master_weights=master_weights)
    by_kernel = copy.deepcopy(by_ref)
    kw = dict(lr=3e-3, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    for step in range(1, 4):
        grads = make_grads(seed=step, device=device)
        step_units(by_ref, adamw_step_ref, grads, step, **kw)
        step_units(by_kernel, kernel(), grads, step, block_size=BLOCK, **kw)
        for i in range(len(SIZES)):
            for name in ("params", "exp_avg", "exp_avg_sq") + (("master",) if by_ref.master else ()):
                assert_bitwise(getattr(by_kernel, name)[i], getattr(by_ref, name)[i], f"step {step} {name}[{i}]")
            if by_kernel.master is not None:
                assert_bitwise(by_kernel.params[i], by_kernel.master[i].to(dtype), "params vs master.to(dtype)")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on the NaNs
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy: fp16 overflow to inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_rounds_like_tensor_to(device, dtype):
    """With lr = 0 and zero grads the step only writes round(master): ties, subnormals, signed zeros,
    overflow and NaN must come out as `master.to(dtype)` does."""
    info = torch.finfo(dtype)
    mant = 8 if dtype == torch.bfloat16 else 11  # significand bits incl. the implicit one
    ties = [(1 + (2 * k + 1) * 2.0**-mant) * 2.0**e for k in range(4) for e in (-3, 0, 5)]  # halfway cases
    special = [0.0, -0.0, info.tiny * 0.75, -info.tiny * 0.3, info.max, -info.max * 1.001, 1 / 3, -2 / 3]
    if dtype == torch.bfloat16:
        special += [float("inf"), float("-inf"), float("nan"), -float("nan"), 3.4e38]
    master = torch.tensor(ties + [-t for t in ties] + special, dtype=torch.float32)
    # NaNs whose payload carries into the sign/exponent if rounded naively
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)
    master = torch.cat([master, nans if dtype == torch.bfloat16 else nans[:0], torch.randn(300) * 100]).to(device)
    n = master.numel()
    param = torch.empty(n, dtype=dtype, device=device)
    zeros = torch.zeros(n, device=device)
    kernel()(master.clone(), zeros.clone(), zeros.clone(), zeros.clone(),
             torch.ones(n, dtype=torch.uint8, device=device), param,
             lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, block_size=BLOCK)
    expected = master.to(dtype)  # torch's cast on the same device
    nan = expected.isnan()
    assert torch.equal(param.isnan(), nan)  # NaN payloads differ between torch's own CPU and CUDA casts
    assert_bitwise(param[~nan], expected[~nan], f"fp32 -> {dtype}")


def test_kernel_padding_stays_zero(device):
    n = 70
    master, grad = torch.randn(n, device=device), torch.randn(n, device=device)
    master[-9:], grad[-9:] = 0, 0
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    for step in range(1, 3):
        kernel()(master, m, v, grad, torch.ones(n, dtype=torch.bool, device=device), lr=1e-2, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.1, step=step, block_size=64)
    for t in (master, m, v):
        assert torch.equal(t[-9:], torch.zeros(9, device=device))


def test_cpu_dispatches_to_reference():
    assert not _use_kernel(torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(dtype):
    params, masks = make_units(dtype=dtype)
    a = FlatAdamW([p.clone() for p in params], masks, lr=lambda s: 1e-2 / s, weight_decay=0.1)
    for step in range(1, 3):
        a.step(make_grads(seed=step))
    saved = copy.deepcopy(a.state_dict())
    assert saved["step"] == 2 and (saved["master"] is None) == (dtype == torch.float32)
    # A fresh optimizer on the same weights (fp32: saved with the model; bf16: garbage, rewritten from masters).
    weights = [p.clone() if dtype == torch.float32 else torch.full_like(p, 7.0) for p in a.params]
    b = FlatAdamW(weights, masks, lr=lambda s: 1e-2 / s, weight_decay=0.1)
    b.load_state_dict(saved)
    assert b.num_steps == 2
    for x, y in zip(b.params, a.params):
        assert_bitwise(x, y, "params after load")
    for step in range(3, 5):
        grads = make_grads(seed=step)
        a.step(grads)
        b.step(grads)
    for name in ("params", "exp_avg", "exp_avg_sq") + (("master",) if a.master else ()):
        for x, y in zip(getattr(b, name), getattr(a, name)):
            assert_bitwise(x, y, f"{name} after resuming")


def test_load_state_dict_errors():
    params, masks = make_units((4, 5))
    opt = FlatAdamW(params, masks, lr=1e-3)
    good = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="keys step, exp_avg"):
        opt.load_state_dict({"step": 0})
    with pytest.raises(ValueError, match=r"state\['step'\] must be an int"):
        opt.load_state_dict({**good, "step": -1})
    with pytest.raises(ValueError, match=r"state\['master'\] must be None"):
        opt.load_state_dict({**good, "master": [torch.zeros(4), torch.zeros(5)]})
    with pytest.raises(ValueError, match=r"state\['exp_avg'\] must be a list of 2"):
        opt.load_state_dict({**good, "exp_avg": good["exp_avg"][:1]})
    with pytest.raises(ValueError, match=r"state\['exp_avg_sq'\]\[1\] must be an fp32 tensor of shape \(5,\)"):
        opt.load_state_dict({**good, "exp_avg_sq": [torch.zeros(4), torch.zeros(6)]})


# --------------------------------------------------------------------------------------------
# validation


def _units():
    return [torch.zeros(4), torch.zeros(3)], [torch.ones(4, dtype=torch.bool), torch.ones(3, dtype=torch.uint8)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(params=[]), "params must be a non-empty list"),
    (dict(decay_masks=[torch.ones(4, dtype=torch.bool)]), r"decay_masks must be a list of 2 masks"),
    (dict(decay_masks=[torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)]),
     r"decay_masks\[1\] must have the shape of params\[1\], \(3,\)"),
    (dict(decay_masks=[torch.ones(4), torch.ones(3)]), r"decay_masks\[0\] must be uint8 or bool"),
    (dict(params=[torch.zeros(4, dtype=torch.float64), torch.zeros(3)]), r"params\[0\] must be bf16, fp16 or fp32"),
    (dict(params=[torch.zeros(2, 2), torch.zeros(3)]), r"params\[0\] must be a contiguous 1-D tensor"),
    (dict(params=[torch.zeros(8)[::2], torch.zeros(3)]), r"params\[0\] must be a contiguous 1-D tensor"),
    (dict(lr=-1e-3), "lr must be a finite number >= 0"),
    (dict(lr=float("nan")), "lr must be a finite number"),
    (dict(betas=(0.9, 1.0)), r"betas must be a pair of numbers in \[0, 1\)"),
    (dict(betas=(-0.1, 0.9)), "betas must be a pair"),
    (dict(betas=(0.9,)), "betas must be a pair"),
    (dict(eps=-1e-8), "eps must be a finite number >= 0"),
    (dict(eps=float("inf")), "eps must be a finite number"),
    (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
    (dict(master_weights="yes"), "master_weights must be None, True, False or .split."),
])
def test_constructor_errors(kwargs, match):
    params, masks = _units()
    args = dict(params=params, decay_masks=masks, lr=1e-3) | kwargs
    with pytest.raises(ValueError, match=match):
        FlatAdamW(args.pop("params"), args.pop("decay_masks"), **args)


@pytest.mark.parametrize("grads,kwargs,match", [
    ([torch.zeros(4)], {}, r"grads must be a list of 2 tensors"),
    ([torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16)], {}, r"grads\[1\] must be fp32, got torch.bfloat16"),
    ([torch.zeros(5), torch.zeros(3)], {}, r"grads\[0\] must be a contiguous 1-D tensor of shape \(4,\)"),
    ([torch.zeros(4), torch.zeros(3)], dict(grad_scale=float("nan")), "grad_scale must be a finite number"),
    ([torch.zeros(4), torch.zeros(3)], dict(grad_scale=-1.0), "grad_scale must be a finite number >= 0"),
])
def test_step_errors(grads, kwargs, match):
    params, masks = _units()
    opt = FlatAdamW(params, masks, lr=1e-3)
    with pytest.raises(ValueError, match=match):
        opt.step(grads, **kwargs)
    assert opt.num_steps == 0


@pytest.mark.parametrize("attr,value,match", [
    ("lr", -1.0, "lr must be a finite number >= 0"),
    ("betas", (0.9, 1.5), "betas must be a pair"),
    ("eps", float("nan"), "eps must be a finite number"),
    ("weight_decay", -1.0, "weight_decay must be a finite number >= 0"),
])
def test_reassigned_hyperparameters_are_validated_at_step(attr, value, match):
    """A trainer sets lr/betas/eps/weight_decay from its step config; a bad one fails before any update."""
    params, masks = _units()
    opt = FlatAdamW(params, masks, lr=1e-3)
    setattr(opt, attr, value)
    with pytest.raises(ValueError, match=match):
        opt.step([torch.ones(4), torch.ones(3)])
    assert opt.num_steps == 0 and all(torch.equal(m, torch.zeros_like(m)) for m in opt.exp_avg)


def test_bad_schedule_value_changes_nothing():
    params, masks = _units()
    opt = FlatAdamW(params, masks, lr=lambda step: float("nan"))
    with pytest.raises(ValueError, match=r"lr\(1\) \(the schedule's value\) must be a finite number"):
        opt.step([torch.ones(4), torch.ones(3)])
    assert opt.num_steps == 0 and all(torch.equal(m, torch.zeros_like(m)) for m in opt.exp_avg)


@pytest.mark.parametrize("launcher", ["reference", "kernel"])
def test_unit_errors(launcher):
    """The public reference names the bad argument (ValueError); the kernel's launcher, internal
    (FlatAdamW validates), rejects the same calls with an assert."""
    step = adamw_step_ref if launcher == "reference" else kernel()
    name = "adamw_step_ref" if launcher == "reference" else "adamw_step_"

    def rejects(match):
        if launcher == "kernel":
            return pytest.raises(AssertionError, match=f"{name}: ")
        return pytest.raises(ValueError, match=f"{name}: {match}")

    n = 8
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    master, m, v, g = (torch.zeros(n) for _ in range(4))
    mask = torch.ones(n, dtype=torch.bool)
    with rejects("exp_avg must be torch.float32, got torch.bfloat16"):
        step(master, m.bfloat16(), v, g, mask, **kw)
    with rejects("grad must be a contiguous 1-D tensor of 8 elements"):
        step(master, m, v, torch.zeros(9), mask, **kw)
    with rejects("decay_mask must be torch.uint8 or torch.bool"):
        step(master, m, v, g, mask.float(), **kw)
    with rejects("master must be bf16, fp16, fp32 or int16"):
        step(master.double(), m, v, g, mask, **kw)
    with rejects("param must be"):
        step(master, m, v, g, mask, torch.zeros(n, dtype=torch.int32), **kw)
    if launcher == "kernel":
        with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
            step(master, m, v, g, mask, **kw, block_size=100)


# --------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_matches_reference(dtype):
    """FlatAdamW on CUDA (the Triton kernel at the default block) against the reference on CPU copies,
    each step from the same state so a difference cannot compound. Expected bitwise (IEEE div/sqrt, no
    contraction); the assertion allows 1 ulp, and the weights must be exactly round(master)."""
    sizes = (1, 4099, 70000)
    params, masks = make_units(sizes, dtype=dtype, device="cuda")
    gpu = FlatAdamW(params, masks, lr=1e-3, weight_decay=0.1)
    assert _use_kernel(torch.device("cuda"))
    cpu = FlatAdamW([p.cpu() for p in params], [m.cpu() for m in masks], lr=1e-3, weight_decay=0.1)
    for step in range(1, 4):
        grads = make_grads(sizes, seed=step)
        gpu.step([g.cuda() for g in grads], grad_scale=0.8)
        cpu.step(grads, grad_scale=0.8)
        names = ("exp_avg", "exp_avg_sq") + (("master",) if cpu.master else ("params",))
        for name in names:
            for i, (x, y) in enumerate(zip(getattr(gpu, name), getattr(cpu, name))):
                assert max_ulps(x.cpu(), y) <= 1, f"step {step} {name}[{i}]: {max_ulps(x.cpu(), y)} ulps"
                y.copy_(x.cpu())  # continue both from the GPU's state
        if cpu.master:
            for p, master, q in zip(gpu.params, gpu.master, cpu.params):
                assert_bitwise(p, master.to(dtype), "params vs master.to(dtype)")
                q.copy_(p.cpu())


def test_split_master_is_exact():
    """split_master / join_master: every fp32 bit pattern back exactly (signs, zeros, subnormals, inf);
    the high half is round-to-nearest (ties away from zero: only exact ties differ from `.to`)."""
    from hybridengine.train.optimizer import join_master, split_master

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(50_000, generator=g) * torch.logspace(-44, 37, 50_000),
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, float("inf"), float("-inf"), 65504.0])])
    ties = torch.tensor([1 + 2**-8, -(1 + 2**-8), 3 * 2**-9 + 2**-16])  # low halves exactly 0x8000
    x = torch.cat([x, ties])
    hi, lo = split_master(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert_bitwise(join_master(hi, lo), x, "join(split(x))")
    exact = (x.view(torch.int32) & 0xFFFF) != 0x8000
    assert_bitwise(hi[exact], x[exact].to(torch.bfloat16), "high half vs .to(bf16) off ties")
    assert torch.equal(hi[-3:].float().abs(), x[-3:].to(torch.bfloat16).float().abs() + torch.tensor(
        [2**-7, 2**-7, 2**-15]))  # ties: away from zero, one bf16 ulp above the even choice


def test_split_master_nan_stays_nan():
    """Every NaN pattern (the GPU's canonical 0x7FFFFFFF, x86's 0xFFC00000, ...) splits into the
    canonical bf16 NaN and a zero low half: rounding a NaN's bits must not wrap the weight to 0."""
    from hybridengine.train.optimizer import join_master, split_master

    bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, -0x400000, 0x7F800001, 0x7FFF8000], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    assert bool(x.isnan().all())
    hi, lo = split_master(x)
    assert torch.equal(hi.view(torch.int16), torch.full((6,), 0x7FC0, dtype=torch.int16)) and not lo.any()
    assert bool(join_master(hi, lo).isnan().all())


def test_split_master_follows_the_fp32_master():
    """master_weights='split' keeps the fp32 master exactly: after steps it equals master_weights=True's
    masters bit for bit, the moments too, and the bf16 weights are its high half."""
    from hybridengine.train.optimizer import split_master

    params, masks = make_units(dtype=torch.bfloat16)
    full = FlatAdamW([p.clone() for p in params], masks, lr=3e-3, weight_decay=0.1, master_weights=True)
    split = FlatAdamW([p.clone() for p in params], masks, lr=3e-3, weight_decay=0.1, master_weights="split")
    assert split.master is None and [t.dtype for t in split.master_lo] == [torch.int16] * len(SIZES)
    for step in range(1, 6):
        grads = make_grads(seed=step)
        full.step(grads, grad_scale=0.7)
        split.step(grads, grad_scale=0.7)
        for i, master in enumerate(split.masters()):
            assert_bitwise(master, full.master[i], f"step {step} master[{i}]")
            assert_bitwise(split.exp_avg[i], full.exp_avg[i], f"step {step} exp_avg[{i}]")
            assert_bitwise(split.params[i], split_master(full.master[i])[0], f"step {step} params[{i}]")
    # The state dict holds fp32 masters (the same as master_weights=True) and loads back exactly.
    state = copy.deepcopy(split.state_dict())
    again = FlatAdamW([torch.zeros_like(p) for p in params], masks, lr=3e-3, master_weights="split")
    again.load_state_dict(state)
    for a, b, pa, pb in zip(again.masters(), split.masters(), again.params, split.params):
        assert_bitwise(a, b, "loaded master")
        assert_bitwise(pa, pb, "loaded params")
    with pytest.raises(ValueError, match="master_weights='split' needs bf16 params"):
        FlatAdamW(make_units(dtype=torch.float32)[0], masks, lr=1e-3, master_weights="split")


def test_kernel_split_master_matches_reference_bitwise(device):
    params, masks = make_units(dtype=torch.bfloat16, device=device)
    by_ref = FlatAdamW([p.clone() for p in params], masks, lr=3e-3, weight_decay=0.1, master_weights="split")
    by_kernel = copy.deepcopy(by_ref)
    launch = kernel()
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    for step in range(1, 4):
        grads = make_grads(seed=step, device=device)
        grads[2][7] = float("nan")  # a NaN gradient: both sides keep the weight NaN, not 0
        step_units(by_ref, adamw_step_ref, grads, step, **kw)
        step_units(by_kernel, launch, grads, step, block_size=BLOCK, **kw)
        for i in range(len(SIZES)):
            for name in ("params", "master_lo", "exp_avg", "exp_avg_sq"):
                assert_bitwise(getattr(by_kernel, name)[i], getattr(by_ref, name)[i], f"step {step} {name}[{i}]")
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    unit = (by_kernel.master_lo[0], by_kernel.exp_avg[0], by_kernel.exp_avg_sq[0], make_grads(device=device)[0],
            by_kernel.decay_masks[0], None)
    with pytest.raises(ValueError, match="an int16 master \\(split\\) needs the bf16 param"):
        adamw_step_ref(*unit, **kw)
    with pytest.raises(AssertionError, match="an int16 low half with its bf16 param"):
        launch(*unit, **kw)


@pytest.mark.gpu
def test_cuda_kernel_split_master_matches_reference():
    sizes = (1, 4099, 70000)
    params, masks = make_units(sizes, dtype=torch.bfloat16, device="cuda")
    gpu = FlatAdamW(params, masks, lr=1e-3, weight_decay=0.1, master_weights="split")
    cpu = FlatAdamW([p.cpu() for p in params], [m.cpu() for m in masks], lr=1e-3, weight_decay=0.1,
                    master_weights="split")
    for step in range(1, 4):
        grads = make_grads(sizes, seed=step)
        gpu.step([g.cuda() for g in grads], grad_scale=0.8)
        cpu.step(grads, grad_scale=0.8)
        for name in ("exp_avg", "exp_avg_sq"):
            for i, (x, y) in enumerate(zip(getattr(gpu, name), getattr(cpu, name))):
                assert max_ulps(x.cpu(), y) <= 1, f"step {step} {name}[{i}]: {max_ulps(x.cpu(), y)} ulps"
                y.copy_(x.cpu())
        for i, (x, y) in enumerate(zip(gpu.masters(), cpu.masters())):
            assert max_ulps(x.cpu(), y) <= 1, f"step {step} master[{i}]"
        for pg, lg, pc, lc in zip(gpu.params, gpu.master_lo, cpu.params, cpu.master_lo):
            pc.copy_(pg.cpu())
            lc.copy_(lg.cpu())


# --------------------------------------------------------------------------------------------
# decay ranges: the trainer's form (no per-element mask on the device)


def run_masks(sizes=SIZES, seed=3):
    """Masks made of runs (as a model's matrices, norms and biases lie in a unit), each starting set or not."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for n in sizes:
        m = torch.zeros(n, dtype=torch.bool)
        cuts = sorted(torch.randint(0, n + 1, (6,), generator=g).tolist())
        for a, b in zip(cuts[0::2], cuts[1::2]):
            m[a:b] = True
        masks.append(m)
    return masks


@pytest.mark.parametrize("mask", [
    [], [0], [1], [1, 1, 1], [0, 0, 1], [1, 0, 0], [1, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0],
])
def test_mask_ranges_are_the_runs_of_the_mask(mask):
    m = torch.tensor(mask, dtype=torch.bool)
    ranges = mask_ranges(m)
    back = torch.zeros(len(mask), dtype=torch.bool)
    for a, b in ranges:
        assert a < b
        back[a:b] = True
    assert torch.equal(back, m)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))  # disjoint, not touching: maximal runs


@pytest.mark.parametrize("launcher", ["reference", "kernel"])
@pytest.mark.parametrize("dtype,master_weights", [
    (torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "split"), (torch.bfloat16, False),
])
def test_decay_ranges_and_bools_equal_the_mask_bitwise(monkeypatch, device, launcher, dtype, master_weights):
    """FlatAdamW with each unit's decay as ranges (or a bool where the mask is uniform) against the same
    optimizer with per-element masks: the same bits, through the reference and through the kernel (the
    interpreter on CPU), where each run is its own launch with one decay flag."""
    import hybridengine.train.optimizer as optim

    monkeypatch.setattr(optim, "_use_kernel", lambda _: launcher == "kernel")
    params, _ = make_units(dtype=dtype, device=device)
    masks = [m.to(device) for m in run_masks()]
    masks[0] = torch.ones(SIZES[0], dtype=torch.bool, device=device)  # uniform units: given as bools below
    masks[1] = torch.zeros(SIZES[1], dtype=torch.bool, device=device)
    by_mask = FlatAdamW([p.clone() for p in params], masks, lr=3e-3, weight_decay=0.2, master_weights=master_weights)
    compact = [True, False] + [mask_ranges(m) for m in masks[2:]]
    by_ranges = FlatAdamW([p.clone() for p in params], compact, lr=3e-3, weight_decay=0.2,
                          master_weights=master_weights)
    assert len(list(by_ranges.decay_runs(3, 0, SIZES[3]))) > 1
    for step in range(3):
        grads = make_grads(seed=step, device=device)
        by_mask.step(grads, grad_scale=0.7)
        by_ranges.step(grads, grad_scale=0.7)
        for kind, ts in by_mask.state_lists().items():
            for i, (x, y) in enumerate(zip(by_ranges.state_lists()[kind], ts)):
                assert_bitwise(x, y, f"step {step} {kind}[{i}]")
        for i, (x, y) in enumerate(zip(by_ranges.params, by_mask.params)):
            assert_bitwise(x, y, f"step {step} params[{i}]")


def test_decay_ranges_through_the_streamed_offload_step_equal_the_mask_bitwise():
    """Offload 'optimizer': chunks of the streamed step cut across the decay runs."""
    params, _ = make_units(dtype=torch.bfloat16)
    masks = run_masks()
    ref = FlatAdamW([p.clone() for p in params], masks, lr=1e-2, weight_decay=0.1, master_weights="split")
    streamed = FlatAdamW([p.clone() for p in params], [mask_ranges(m) for m in masks], lr=1e-2, weight_decay=0.1,
                         master_weights="split", offload="optimizer")
    streamed.offload.step_chunk_numel = 37
    for step in range(2):
        grads = make_grads(seed=10 + step)
        ref.step(grads)
        streamed.step(grads)
    for kind, ts in ref.state_lists().items():
        for i, (x, y) in enumerate(zip(streamed.state_lists()[kind], ts)):
            assert_bitwise(x, y, f"{kind}[{i}]")
    for i, (x, y) in enumerate(zip(streamed.params, ref.params)):
        assert_bitwise(x, y, f"params[{i}]")


def test_reference_takes_a_bool_for_the_whole_unit():
    params, _ = make_units((300,))
    g = make_grads((300,))[0]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.3, step=1)
    for flag in (True, False):
        a = [params[0].clone(), torch.zeros(300), torch.zeros(300)]
        b = [params[0].clone(), torch.zeros(300), torch.zeros(300)]
        adamw_step_ref(a[0], a[1], a[2], g, flag, **kw)
        adamw_step_ref(b[0], b[1], b[2], g, torch.full((300,), flag), **kw)
        for x, y in zip(a, b):
            assert_bitwise(x, y, f"decay={flag}")


@pytest.mark.parametrize("ranges,match", [
    ([(0, 2), (1, 3)], r"decay_masks\[1\] must hold sorted, disjoint, non-empty \(start, end\) int ranges inside "
                       r"\[0, 3\), got \(1, 3\) after end 2"),
    ([(2, 3), (0, 1)], r"got \(0, 1\) after end 3"),
    ([(0, 4)], r"inside \[0, 3\), got \(0, 4\)"),
    ([(1, 1)], r"non-empty .* got \(1, 1\)"),
    ([(-1, 2)], r"got \(-1, 2\)"),
    ([(0.0, 2)], r"int ranges .* got \(0.0, 2\)"),
    ([(0, 1, 2)], r"got \(0, 1, 2\)"),
    ("all", r"decay_masks\[1\] must be a mask tensor, a bool or a list of \(start, end\) ranges, got"),
])
def test_decay_range_errors(ranges, match):
    params, masks = _units()
    with pytest.raises(ValueError, match=match):
        FlatAdamW(params, [masks[0], ranges], lr=1e-3)
