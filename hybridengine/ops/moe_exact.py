"""Exact mode for the mixture of experts: routing and the routed experts' MLP with bits that depend on each token
alone, never on the batch (the rollout's few rows per step against the trainer's thousands of packed rows).

The rule (what the rollout and the trainer both compute, for each token):

1. Router logits: `linear_exact` (the caller's `project(gate, x, exact=True)`), softmax in fp32 over the row.
   torch's softmax reads a row alone on one code path (CPU: one vectorized pass per row; CUDA: one warp or one
   block per row, sized by the number of experts), so the probabilities are batch-invariant too.
2. Choice: the k largest probabilities, in descending order; equal probabilities are taken lowest expert id
   first (a stable descending sort: `torch.topk` documents no order for ties). Slot j of a token is its j-th
   choice.
3. Weights: the chosen probabilities in fp32; with `norm_topk_prob` divided by their sum, added in slot order
   (((p0 + p1) + p2) ...). Kept in fp32 (transformers rounds them to the model dtype).
4. Each expert's rows: gate/up by `linear_exact` rounded to the model dtype, the caller's SiLU * up, down by
   `linear_exact` to its unrounded fp32 sum (one K range: expert parallelism keeps experts whole, so no rank
   holds part of an expert's K).
5. Combination: the experts in `EXACT_EXPERT_SPLITS` consecutive ranges (halves); per range, the sum over slots in
   slot order of weight * expert output in fp32 (w0 * y0 + w1 * y1, then + w2 * y2, ...; a slot routed to the
   other range adds zero), no atomics; the ranges' partials added in order. That is the sum's tree when each
   of two expert-parallel ranks holds one range (tp_generation = 2), so the single device computes it alike.
   The caller adds further fp32 terms (the shared expert) and rounds once to the model dtype (round to
   nearest even).

Layers: `exact_routing` and `exact_experts` (differentiable: training runs it too; steps 4-5 run as
`ops.grouped_gemm.grouped_mlp(exact=True)`), `exact_experts_ref` (float64 math: the value the path
approximates, for tests), and the checked op `moe_experts_exact`.
"""

from __future__ import annotations

import torch

from hybridengine.checks import FLOAT_DTYPES, tensor
from hybridengine.ops.grouped_gemm import grouped_mlp

EXACT_EXPERT_SPLITS = 2
"""Step 5's expert ranges: the expert-parallel degree exact mode supports (tp_generation 1 or 2, as the dense
row-parallel projections' `EXACT_ROW_SPLITS`)."""

LANE_PAD = 64
"""`sigmoid_exact` pads its flat run to a multiple of this (as `silu_mul.silu_mul_torch`): no element falls in
the scalar tail of torch's vectorized CPU loops, whose exp rounds some values the other way."""


def exact_splits(num_experts: int) -> int:
    """Step 5's number of expert ranges for a layer of `num_experts` (a single expert is one range)."""
    return min(EXACT_EXPERT_SPLITS, num_experts)


def exact_routing(probs: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """probs fp32 [N, E] -> (weights fp32 [N, k], experts int64 [N, k]): steps 2-3 of the module's rule."""
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :top_k], experts[:, :top_k]
    if norm_topk_prob:
        total = top[:, 0]
        for j in range(1, top_k):
            total = total + top[:, j]
        top = top / total.unsqueeze(1)
    return top, experts


def exact_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor, silu_mul=None, *, first: int = 0,
                  num_experts: int | None = None) -> torch.Tensor:
    """The routed experts' SwiGLU MLP by steps 4-5 of the module's rule: x [N, H] (model dtype), gate_up
    [E, 2I, H], down [E, H, I], experts int64 [N, k], weights fp32 [N, k] -> the unrounded fp32 sum [N, H].
    `silu_mul(gate, up)`: the activation (default silu(gate) * up in the model dtype). `ops.grouped_gemm`'s
    `grouped_mlp` keeps these steps: its exact GEMMs are batch-invariant (Triton on CUDA, `linear_exact` per
    expert elsewhere) and it adds the slots in order. `first`/`num_experts`: gate_up and down hold the experts
    [first, first + E') of num_experts (an expert-parallel rank's range: its one partial, `grouped_mlp`'s)."""
    num_experts = gate_up.shape[0] if num_experts is None else num_experts
    whole = first == 0 and gate_up.shape[0] == num_experts
    splits = exact_splits(num_experts) if whole else 1
    return grouped_mlp(x, gate_up, down, experts, weights, silu_mul, exact=True, out_dtype=torch.float32,
                       first=first, num_experts=num_experts, expert_splits=splits)


def exact_experts_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """`exact_experts` in float64 without intermediate roundings, per token and slot: the value it approximates
    (float64 [N, H])."""
    inter = gate_up.shape[1] // 2
    g, d = gate_up.double()[experts], down.double()[experts]  # [N, k, 2I, H], [N, k, H, I]
    gu = torch.einsum("nkoh,nh->nko", g, x.double())
    act = torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]
    y = torch.einsum("nkhi,nki->nkh", d, act)
    return (weights.double().unsqueeze(-1) * y).sum(1)


def sigmoid_exact(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) with each element's bits independent of x's length (differentiable): one zero-padded flat run,
    so every element takes the same vectorized exp on CPU (CUDA applies one scalar function to every element)."""
    n = x.numel()
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -n % LANE_PAD))
    return torch.sigmoid(flat)[:n].view(x.shape)


def moe_experts_exact(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """`exact_experts` behind argument checks: x [N, H] (bf16, fp16 or fp32), gate_up [E, 2I, H] and down
    [E, H, I] of x's dtype and device, experts int64 [N, k] in [0, E), weights fp32 [N, k] -> fp32 [N, H]."""
    op = "moe_experts_exact"
    tensor(op, "x", x, dim=2, dtypes=FLOAT_DTYPES)
    N, H = x.shape
    tensor(op, "gate_up", gate_up, dim=3, dtypes=(x.dtype,), device=x.device, contiguous_last=True)
    E, two_inter = gate_up.shape[0], gate_up.shape[1]
    if gate_up.shape[2] != H or two_inter % 2:
        raise ValueError(f"{op}: gate_up must be [E, 2I, H={H}] (each expert's gate rows, then its up rows), "
                         f"got shape {tuple(gate_up.shape)}")
    tensor(op, "down", down, shape=(E, H, two_inter // 2), dtypes=(x.dtype,), device=x.device, contiguous_last=True)
    tensor(op, "experts", experts, dim=2, dtypes=(torch.int64,), device=x.device)
    if experts.shape[0] != N or experts.shape[1] < 1:
        raise ValueError(f"{op}: experts must be [N={N}, k >= 1], got shape {tuple(experts.shape)}")
    if N and (int(experts.min()) < 0 or int(experts.max()) >= E):
        raise ValueError(f"{op}: experts must hold ids in [0, {E}), got {int(experts.min())}..{int(experts.max())}")
    tensor(op, "weights", weights, shape=experts.shape, dtypes=(torch.float32,), device=x.device)
    return exact_experts(x, gate_up, down, experts, weights)
