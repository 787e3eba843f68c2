"""AdamW on one rank's flat training shard: fp32 master weights and moments as flat buffers, one
fused pass per unit that also writes the rounded weights straight into the shared buffer.

Three layers, as for every op: `adamw_step_ref` (plain torch, the spec; the CPU path and the tests
use it), the Triton kernel and its launcher in `hybridengine.kernels.adamw` (CUDA), and
`FlatAdamW`, which validates once, keeps the state and picks a path per device.

The math is `torch.optim.AdamW`'s single-tensor path, operation for operation:

    p  = p * (1 - lr * wd)                  only where the decay mask is set
    m  = lerp(m, g, 1 - beta1)              torch's lerp: m + w * (g - m) for w < 0.5, else g - (g - m) * (1 - w)
    v  = v * beta2 + (1 - beta2) * g * g
    p  = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)      bc_i = 1 - beta_i ** step

with every scalar rounded to fp32 once on the host and every operation rounded to fp32 in that
order (no fused multiply-adds). The reference and the kernel therefore agree bit for bit (the
kernel uses IEEE `div_rn` / `sqrt_rn` and is compiled without fp contraction), and both stay
within a few fp32 ulps of torch (its CPU lerp is an FMA in the vector loop, and its fp32 sqrt is
not correctly rounded on every input; tests/test_optim.py derives the bound).

Bytes per element and step, bf16 weights with fp32 master: 4 (g) + 2 x 4 (m) + 2 x 4 (v) + 2 x 4
(master) + 2 (param) = 30 B, plus 1 with a per-element decay mask, against 84 B for the eight
elementwise passes of torch's single-tensor AdamW on fp32 params (mul_, lerp_, mul_, addcmul_, sqrt, div,
add_, addcdiv_).

Weight decay is given per unit as a per-element mask or as the ranges of elements that decay
(`mask_ranges`): a model's matrices and its norms and biases sit in a few long runs of each unit, so
the trainer passes ranges, and each run is one launch with one decay flag. A mask costs a byte per
parameter on the device for as long as the optimizer lives (7 GiB for a 7B model).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch

from hybridengine import checks
from hybridengine.ops._ext import warn_once
from hybridengine.train.offload import MODES, StateOffload

PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MASK_DTYPES = (torch.uint8, torch.bool)


def _f32(x: float) -> float:
    """x rounded to the nearest fp32, as a Python float (how torch and Triton see a host scalar)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def adamw_scalars(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: int) -> dict[str, float]:
    """The per-step scalars of the update, in fp32 (shared by the reference and the launcher).

    Bias corrections are computed in double from the step, as torch does, then rounded once."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return {
        "decay_factor": _f32(1 - lr * weight_decay),
        "lerp_weight": _f32(1 - beta1),
        "beta2": _f32(beta2),
        "one_minus_beta2": _f32(1 - beta2),
        "neg_step_size": _f32(-(lr / bias_correction1)),
        "bias_correction2_sqrt": _f32(bias_correction2**0.5),
        "eps": _f32(eps),
    }


def split_master(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (hi bf16, lo int16) with bits(x) = (bits(hi) << 16) + lo exactly: hi rounds half away
    from zero (round to nearest; only an exact tie differs from `.to(torch.bfloat16)`), lo in
    [-2^15, 2^15). The "split" master: the bf16 weights plus 2 bytes hold the fp32 master exactly
    (a NaN becomes the canonical NaN: hi 0x7FC0, lo 0)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (bits + 0x8000) >> 16
    lo = bits - (hi << 16)
    # NaN: the canonical bf16 NaN, nothing below. Rounding a NaN's bits could carry into the sign or
    # wrap to zero (the GPU's canonical fp32 NaN 0x7FFFFFFF would become -0.0): weights would turn 0.
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = torch.where(nan, 0x7FC0, hi & 0xFFFF)
    lo = torch.where(nan, 0, lo)
    return (torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16).view(x.shape),
            lo.to(torch.int16).view(x.shape))


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master held by bf16 `hi` and int16 `lo` (`split_master`'s inverse)."""
    bits = ((hi.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + lo.to(torch.int64)
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32).view(hi.shape)


def mask_ranges(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of set elements of a 1-D mask, as sorted, disjoint [start, end) pairs (FlatAdamW's
    decay ranges)."""
    m = mask.reshape(-1).to(device="cpu", dtype=torch.int8)
    zero = torch.zeros(1, dtype=torch.int8)
    edges = torch.diff(m, prepend=zero, append=zero).nonzero().squeeze(1).tolist()
    return list(zip(edges[0::2], edges[1::2]))


def decay_segments(op: str, ranges, numel: int) -> list[tuple[int, int, bool]]:
    """Decay `ranges` (sorted, disjoint [start, end) pairs inside [0, numel)) -> (start, end, decays)
    runs covering [0, numel), adjacent ranges merged; raises ValueError naming `op` on bad ranges."""
    if not isinstance(ranges, (list, tuple)):
        raise ValueError(f"{op} must be a mask tensor, a bool or a list of (start, end) ranges, got "
                         f"{checks.describe(ranges)}")
    runs, end = [], 0
    for r in ranges:
        ok = (isinstance(r, (list, tuple)) and len(r) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in r))
        if not ok or not end <= r[0] < r[1] <= numel:
            raise ValueError(f"{op} must hold sorted, disjoint, non-empty (start, end) int ranges inside [0, {numel}), "
                             f"got {r!r} after end {end}")
        if runs and runs[-1][1] == r[0] and runs[-1][2]:
            runs[-1] = (runs[-1][0], r[1], True)
        else:
            if r[0] > end:
                runs.append((end, r[0], False))
            runs.append((r[0], r[1], True))
        end = r[1]
    if end < numel:
        runs.append((end, numel, False))
    return runs


def check_unit(op: str, master, exp_avg, exp_avg_sq, grad, decay_mask, param) -> None:
    """One unit's tensors: 1-D, contiguous, same numel and device; moments and grad fp32; master
    and param bf16/fp16/fp32, or master int16 (the low half of a split master) with param bf16;
    mask uint8/bool, or a bool (decay for every element or none). The checks of the public
    reference; the kernel's launcher asserts the same."""
    if not isinstance(master, torch.Tensor) or master.dim() != 1 or master.stride(0) != 1:
        raise ValueError(f"{op}: master must be a contiguous 1-D tensor, got {checks.describe(master)}")
    if master.dtype == torch.int16:
        if not isinstance(param, torch.Tensor) or param.dtype != torch.bfloat16:
            raise ValueError(f"{op}: an int16 master (split) needs the bf16 param it completes, got "
                             f"{checks.describe(param)}")
    elif master.dtype not in PARAM_DTYPES:
        raise ValueError(f"{op}: master must be bf16, fp16, fp32 or int16 (split), got {master.dtype}")
    n, device = master.numel(), master.device
    named = [("exp_avg", exp_avg, (torch.float32,)), ("exp_avg_sq", exp_avg_sq, (torch.float32,)),
             ("grad", grad, (torch.float32,))]
    if not isinstance(decay_mask, bool):
        named.append(("decay_mask", decay_mask, MASK_DTYPES))
    if param is not None:
        named.append(("param", param, PARAM_DTYPES))
    for name, t, dtypes in named:
        if not isinstance(t, torch.Tensor) or t.shape != (n,) or (n and t.stride(0) != 1):
            raise ValueError(f"{op}: {name} must be a contiguous 1-D tensor of {n} elements (master's), "
                             f"got {checks.describe(t)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{op}: {name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, master on {device}")


def adamw_step_ref(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                   decay_mask: torch.Tensor | bool, param: torch.Tensor | None = None, *, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """One AdamW step of one unit, in place, in plain torch (the spec of the fused kernel).

    master [n] (fp32; or the bf16/fp16 params themselves when there is no master copy, then the
    update runs in fp32 and is rounded back; or int16, the low half of a split master whose high
    half is the bf16 `param`: `join_master` / `split_master`), exp_avg / exp_avg_sq / grad [n] fp32,
    decay_mask [n] (nonzero: decay) or a bool (every element or none), param [n] or None: receives
    `master` rounded to its dtype (round to nearest even, as `Tensor.to`; split: `split_master`'s high
    half). `grad` is read as
    `grad * grad_scale`; `step` counts from 1."""
    check_unit("adamw_step_ref", master, exp_avg, exp_avg_sq, grad, decay_mask, param)
    s = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    split = master.dtype == torch.int16
    with torch.no_grad():
        g = grad * _f32(grad_scale)
        p = join_master(param, master) if split else master.float()
        if isinstance(decay_mask, bool):
            p = p * s["decay_factor"] if decay_mask else p
        else:
            p = torch.where(decay_mask.bool(), p * s["decay_factor"], p)
        m, v, w = exp_avg, exp_avg_sq, s["lerp_weight"]
        if w < 0.5:
            m_new = m + w * (g - m)
        else:
            m_new = g - (g - m) * (1 - w)  # 1 - w is exact in fp32 for w in [0.5, 1] (Sterbenz)
        v_new = v * s["beta2"] + (s["one_minus_beta2"] * g) * g
        # A 0-dim device tensor, not a Python scalar: CUDA torch turns division by a host scalar
        # into multiplication by its reciprocal, which is not the same rounding.
        bc2_sqrt = torch.full((), s["bias_correction2_sqrt"], dtype=torch.float32, device=master.device)
        # sqrt through fp64, which rounds to the correctly rounded fp32 sqrt (53 >= 2 * 24 + 2 bits):
        # torch's own CPU fp32 sqrt is not (7.5k of 1M random values off by one ulp, AVX512 build).
        denom = v_new.double().sqrt().float() / bc2_sqrt + s["eps"]
        p = p + (s["neg_step_size"] * m_new) / denom
        exp_avg.copy_(m_new)
        exp_avg_sq.copy_(v_new)
        if split:
            hi, lo = split_master(p)
            param.copy_(hi)
            master.copy_(lo)
            return
        master.copy_(p)
        if param is not None:
            param.copy_(p)


def _check_finite(name: str, value) -> float:
    """A finite number >= 0, as a float."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if not callable(lr):
        _check_finite("lr", lr)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
    _check_finite("eps", eps)
    _check_finite("weight_decay", weight_decay)


def _kernel_launcher():
    from hybridengine.kernels import adamw  # Triton imported on first use, after TRITON_INTERPRET is set

    return adamw.adamw_step_


def _use_kernel(device: torch.device) -> bool:
    """The Triton kernel on CUDA; the reference on CPU, or on CUDA when Triton does not import (warned once)."""
    if device.type != "cuda":
        return False
    try:
        _kernel_launcher()
    except Exception as e:  # noqa: BLE001 - any import failure means: no kernel here
        warn_once(f"FlatAdamW: the Triton kernel does not import ({type(e).__name__}: {e}); running the "
                  f"unfused torch reference")
        return False
    return True


class FlatAdamW:
    """AdamW over one rank's flat shard: one 1-D view per unit into the shared parameter buffer.

    `params[i]` are the model weights (bf16/fp16/fp32) and are overwritten by every `step`.
    `decay_masks[i]` says which elements take weight decay (not norms and biases): a uint8/bool mask of
    the same numel, a bool for all or none, or the sorted, disjoint (start, end) ranges that decay
    (`mask_ranges`; no device memory, one launch per run). `lr` is a float or a schedule `step -> lr`
    (step counts from 1). With
    `master_weights` (default: when params are not fp32) the optimizer keeps fp32 copies, updates
    them and writes their round-to-nearest-even into the params; without, an fp32 param is its own
    master and a bf16/fp16 one is updated in fp32 and rounded back each step. `master_weights="split"`
    (bf16 params) keeps the same fp32 master in 2 bytes, not 4: the param is its high half (rounded
    half away from zero instead of to even: only exact ties differ) and `master_lo` (int16) the low
    half. State per unit: `exp_avg`, `exp_avg_sq` (fp32), `master` (fp32 or None), `master_lo`
    (int16 or None); `num_steps` counts the steps taken.
    Elements whose grad, moments and weight are zero (padding) stay exactly zero.

    `offload` (`hybridengine.train.offload`): 'rollout' lets the state move to host memory and back
    (`self.offload.to_host()` / `to_device()`; `step`, `state_dict` and `load_state_dict` join a
    transfer in flight, and `step` brings the state back first); 'optimizer' allocates it in host memory
    and streams it through the device in chunks for each step. `host_limit_bytes` bounds the host
    allocation. Either way the results are bit for bit those of 'none'.
    """

    def __init__(self, params: list[torch.Tensor], decay_masks: list[torch.Tensor], *,
                 lr: float | Callable[[int], float], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, master_weights: bool | None = None, offload: str = "none",
                 host_limit_bytes: int | None = None, rank: int = 0):
        if not isinstance(params, (list, tuple)) or not params:
            raise ValueError(f"params must be a non-empty list of 1-D tensors, got {checks.describe(params)}")
        if not isinstance(decay_masks, (list, tuple)) or len(decay_masks) != len(params):
            got = len(decay_masks) if isinstance(decay_masks, (list, tuple)) else checks.describe(decay_masks)
            raise ValueError(f"decay_masks must be a list of {len(params)} masks (one per param), got {got}")
        device = params[0].device if isinstance(params[0], torch.Tensor) else None
        for i, (p, mask) in enumerate(zip(params, decay_masks)):
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or (p.numel() and p.stride(0) != 1):
                raise ValueError(f"params[{i}] must be a contiguous 1-D tensor, got {checks.describe(p)}")
            if p.dtype not in PARAM_DTYPES:
                raise ValueError(f"params[{i}] must be bf16, fp16 or fp32, got {p.dtype}")
            if p.device != device:
                raise ValueError(f"params[{i}] is on {p.device}, params[0] on {device}")
            if not isinstance(mask, torch.Tensor):
                continue  # a bool or ranges: decay_segments checks them below
            if mask.shape != p.shape:
                raise ValueError(f"decay_masks[{i}] must have the shape of params[{i}], {tuple(p.shape)}, got "
                                 f"{checks.describe(mask)}")
            if mask.dtype not in MASK_DTYPES:
                raise ValueError(f"decay_masks[{i}] must be uint8 or bool, got {mask.dtype}")
            if mask.device != device:
                raise ValueError(f"decay_masks[{i}] is on {mask.device}, params on {device}")
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if master_weights not in (None, True, False, "split"):
            raise ValueError(f"master_weights must be None, True, False or 'split', got {master_weights!r}")
        if master_weights is None:
            master_weights = any(p.dtype != torch.float32 for p in params)
        if master_weights == "split" and any(p.dtype != torch.bfloat16 for p in params):
            raise ValueError("master_weights='split' needs bf16 params (the master's high half), got "
                             f"{sorted({str(p.dtype) for p in params})}")
        if offload not in MODES:
            raise ValueError(f"offload must be one of {MODES}, got {offload!r}")

        self.params = list(params)
        self.decay_masks = [m.view(torch.uint8) if isinstance(m, torch.Tensor) and m.dtype == torch.bool else m
                            for m in decay_masks]
        # Per unit: (start, end, decay) runs covering it, decay a bool or the mask (sliced per chunk).
        self._decay_runs = []
        for i, (p, m) in enumerate(zip(self.params, self.decay_masks)):
            if isinstance(m, (torch.Tensor, bool)):
                self._decay_runs.append([(0, p.numel(), m)] if p.numel() else [])
            else:
                self._decay_runs.append(decay_segments(f"decay_masks[{i}]", m, p.numel()))
        # Plain attributes: a trainer may reassign them between steps; `step` validates them again.
        self.lr = lr
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.master_weights = master_weights
        self.num_steps = 0
        self.device = device
        self.offload_mode = offload
        # 'rollout' / 'optimizer': the state can move to host memory (StateOffload); 'optimizer' allocates
        # it there, never on the device.
        self.offload = (StateOffload(self, host_limit_bytes=host_limit_bytes, host_resident=offload == "optimizer",
                                     rank=rank) if offload != "none" else None)
        if offload == "optimizer":
            shapes = {"exp_avg": (torch.float32, [p.numel() for p in params]),
                      "exp_avg_sq": (torch.float32, [p.numel() for p in params])}
            if master_weights is True:
                shapes["master"] = (torch.float32, [p.numel() for p in params])
            elif master_weights == "split":
                shapes["master_lo"] = (torch.int16, [p.numel() for p in params])
            self.offload.prepare_host(shapes)  # raises before anything is allocated on the device
            state = {kind: self.offload.host_views(kind, len(params)) for kind in shapes}
            for ts in state.values():
                for t in ts:
                    t.zero_()
            for p, t in zip(params, state.get("master", [])):
                t.copy_(p.detach())
            self.exp_avg, self.exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            self.master, self.master_lo = state.get("master"), state.get("master_lo")
            self.offload.location = "host"
            return
        self.exp_avg = [torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in params]
        self.exp_avg_sq = [torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in params]
        self.master = [p.detach().float().clone() for p in params] if master_weights is True else None
        # split: the fp32 master is the bf16 param (high half) + these int16 low halves; a bf16 param is
        # exactly its own fp32 value, so the low halves start at zero.
        self.master_lo = ([torch.zeros(p.numel(), dtype=torch.int16, device=device) for p in params]
                          if master_weights == "split" else None)

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (from 1), validated."""
        if not callable(self.lr):
            return _check_finite("lr", self.lr)
        return _check_finite(f"lr({step}) (the schedule's value)", self.lr(step))

    def step(self, grads: list[torch.Tensor], *, grad_scale: float = 1.0) -> None:
        """One AdamW step with `grads[i] * grad_scale` (fp32 [numel of params[i]], already reduced
        over ranks; grad_scale carries the clipping factor). Writes the new weights into `params`."""
        if not isinstance(grads, (list, tuple)) or len(grads) != len(self.params):
            got = len(grads) if isinstance(grads, (list, tuple)) else checks.describe(grads)
            raise ValueError(f"grads must be a list of {len(self.params)} tensors (one per param), got {got}")
        for i, (g, p) in enumerate(zip(grads, self.params)):
            if not isinstance(g, torch.Tensor) or g.shape != p.shape or (g.numel() and g.stride(0) != 1):
                raise ValueError(f"grads[{i}] must be a contiguous 1-D tensor of shape {tuple(p.shape)} "
                                 f"(params[{i}]'s), got {checks.describe(g)}")
            if g.dtype != torch.float32:
                raise ValueError(f"grads[{i}] must be fp32, got {g.dtype}")
            if g.device != self.device:
                raise ValueError(f"grads[{i}] is on {g.device}, params on {self.device}")
        grad_scale = _check_finite("grad_scale", grad_scale)
        _check_hyperparameters(self.lr, self.betas, self.eps, self.weight_decay)
        step = self.num_steps + 1
        lr = self.lr_at(step)  # validated before any state changes
        update = _kernel_launcher() if _use_kernel(self.device) else adamw_step_ref
        beta1, beta2 = (float(b) for b in self.betas)
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=float(self.eps), weight_decay=float(self.weight_decay),
                     step=step, grad_scale=grad_scale)
        if self.offload is not None:
            if self.offload.host_resident:  # 'optimizer': streamed through the device, chunk by chunk
                self.offload.step(update, grads, **hyper)
                self.num_steps = step
                return
            self.offload.to_device(wait=True)  # 'rollout': joins the transfer started by the first training call
        for i, p in enumerate(self.params):
            if p.numel() == 0:
                continue
            state = {"exp_avg": self.exp_avg[i], "exp_avg_sq": self.exp_avg_sq[i],
                     "master": self.master[i] if self.master is not None else None,
                     "master_lo": self.master_lo[i] if self.master_lo is not None else None}
            self.update_range(update, i, 0, p.numel(), state, grads[i], hyper)
        self.num_steps = step

    def decay_runs(self, i: int, start: int, end: int):
        """(start, end, decay) runs of elements [start, end) of unit i: decay a bool, or the mask's slice."""
        for a, b, decay in self._decay_runs[i]:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                yield lo, hi, decay if isinstance(decay, bool) else decay[lo:hi]

    def update_range(self, update: Callable, i: int, start: int, end: int, state: dict, grad: torch.Tensor,
                     hyper: dict) -> None:
        """The AdamW update of elements [start, end) of unit i, one call of `update` per decay run: `state`
        holds that range's state tensors by kind (views indexed from 0 at `start`), `grad` its gradient."""
        p = self.params[i][start:end]
        for a, b, decay in self.decay_runs(i, start, end):
            part = {k: (t[a - start:b - start] if t is not None else None) for k, t in state.items()}
            master, param = self.master_and_param(part, p[a - start:b - start])
            update(master, part["exp_avg"], part["exp_avg_sq"], grad[a - start:b - start], decay, param, **hyper)

    def master_and_param(self, state: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (master, param) arguments of one unit's (or chunk's) update: the int16 low half and the
        bf16 param (split), the fp32 master and the param, or the param alone (its own master)."""
        if self.master_lo is not None:
            return state["master_lo"], p
        if self.master is not None:
            return state["master"], p
        return p, None

    def state_lists(self) -> dict[str, list[torch.Tensor]]:
        """The optimizer's state kept between steps, by kind: the live lists (StateOffload rewrites their
        entries when the state moves)."""
        lists = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            lists["master"] = self.master
        if self.master_lo is not None:
            lists["master_lo"] = self.master_lo
        return lists

    def state_location(self) -> str:
        """'device' or 'host': where the live state is (a transfer in flight is finished first)."""
        if self.offload is None:
            return "device"
        self.offload.join()
        return self.offload.location

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the optimizer's state (moments, masters or their low halves), for memory
        accounting; the live tensors, not to be written."""
        return [*self.exp_avg, *self.exp_avg_sq, *(self.master or []), *(self.master_lo or [])]

    def masters(self) -> list[torch.Tensor] | None:
        """The fp32 masters (split: joined, new tensors), or None without master weights."""
        if self.offload is not None:
            self.offload.join()
        if self.master_lo is not None:  # joined where the low halves are (host memory when offloaded)
            return [join_master(p.to(lo.device), lo) for p, lo in zip(self.params, self.master_lo)]
        return None if self.master is None else list(self.master)

    def state_dict(self) -> dict:
        """{"step": int, "exp_avg": [fp32], "exp_avg_sq": [fp32], "master": [fp32] or None}: the live
        tensors, not copies (like torch optimizers; `torch.save` copies), except split masters, which
        are joined into fp32 (the same state as master_weights=True). Hyperparameters and the params
        themselves are not included: the weights are checkpointed with the model."""
        masters = self.masters()  # joins a transfer in flight: the lists below are the live tensors
        return {"step": self.num_steps, "exp_avg": list(self.exp_avg), "exp_avg_sq": list(self.exp_avg_sq),
                "master": masters}

    def load_state_dict(self, state: dict) -> None:
        """Copy a `state_dict()` into this optimizer's buffers (in place); with master weights the
        params are rewritten from the loaded masters, so params == round(master) holds again."""
        if not isinstance(state, dict) or set(state) != {"step", "exp_avg", "exp_avg_sq", "master"}:
            raise ValueError(f"state must be a dict with keys step, exp_avg, exp_avg_sq, master, got "
                             f"{sorted(state) if isinstance(state, dict) else checks.describe(state)}")
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {step!r}")
        has_master = self.master_weights is not False
        if (state["master"] is None) == has_master:
            raise ValueError(f"state['master'] must be {'a list of tensors' if has_master else 'None'} "
                             f"(this optimizer has master_weights={self.master_weights!r})")
        keys = ["exp_avg", "exp_avg_sq"] + (["master"] if has_master else [])
        for key in keys:
            tensors = state[key]
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self.params):
                raise ValueError(f"state['{key}'] must be a list of {len(self.params)} tensors")
            for i, (t, p) in enumerate(zip(tensors, self.params)):
                if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != torch.float32:
                    raise ValueError(f"state['{key}'][{i}] must be an fp32 tensor of shape {tuple(p.shape)}, "
                                     f"got {checks.describe(t)}")
        if self.offload is not None:
            self.offload.join()  # written wherever the state is now (device or host memory)
        with torch.no_grad():
            for key in ("exp_avg", "exp_avg_sq"):
                for dst, src in zip(getattr(self, key), state[key]):
                    dst.copy_(src)
            if self.master is not None:
                for p, dst, src in zip(self.params, self.master, state["master"]):
                    dst.copy_(src)
                    p.copy_(dst)
            elif self.master_lo is not None:
                for p, lo, src in zip(self.params, self.master_lo, state["master"]):
                    hi, low = split_master(src.to(lo.device))
                    p.copy_(hi)
                    lo.copy_(low)
        self.num_steps = step
