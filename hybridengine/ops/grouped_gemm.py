"""Grouped GEMM over experts, and the routed-experts MLP built on it: the plain-torch references.

A mixture-of-experts layer routes each token to k of E experts. `route_tokens` sorts the N * k
(token, expert) assignments by expert, so that each expert's rows are contiguous; `grouped_gemm_ref`
multiplies each expert's rows by that expert's weight (one GEMM per expert); `grouped_mlp_ref` is the whole
routed SwiGLU MLP: sort, gate/up grouped GEMM, SiLU * up, down grouped GEMM, scale by the routing weight and
sum each token's k rows back. Every step is differentiable (autograd through indexing and matmuls), so
training runs the same function. A Triton grouped GEMM takes `grouped_gemm_ref`'s signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Routing:
    """A batch's (token, expert) assignments sorted by expert."""

    order: torch.Tensor
    """int64 [N * k]: the flat assignment index (token * k + slot) of each sorted row."""
    tokens: torch.Tensor
    """int64 [N * k]: the token of each sorted row."""
    group_sizes: list[int]
    """Rows per expert, in expert order (host ints: the GEMM loop's bounds)."""


def route_tokens(experts: torch.Tensor, num_experts: int) -> Routing:
    """experts int64 [N, k] (each token's experts) -> the assignments sorted by expert (stable: rows of one
    expert keep token order)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sizes = torch.bincount(flat, minlength=num_experts)
    return Routing(order=order, tokens=order // experts.shape[-1], group_sizes=sizes.tolist())


def grouped_gemm_ref(x: torch.Tensor, weight: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """x [M, K] with rows grouped by expert (group_sizes[e] rows of expert e, in order), weight [E, N, K]
    -> [M, N]: each group times its expert's weight transposed (as `F.linear`)."""
    assert x.dim() == 2 and weight.dim() == 3 and x.shape[1] == weight.shape[2], (x.shape, weight.shape)
    assert len(group_sizes) == weight.shape[0] and sum(group_sizes) == x.shape[0], (group_sizes, x.shape)
    outs, start = [], 0
    for e, n in enumerate(group_sizes):
        if n:
            outs.append(torch.nn.functional.linear(x[start:start + n], weight[e]))
        start += n
    if not outs:
        return x.new_zeros(0, weight.shape[1])
    return torch.cat(outs)


def grouped_mlp_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                    weights: torch.Tensor, silu_mul=None) -> torch.Tensor:
    """The routed experts' SwiGLU MLP: x [N, H], gate_up [E, 2I, H] (each expert's gate rows, then its up
    rows), down [E, H, I], experts int64 [N, k], weights [N, k] (the routing weights) -> [N, H]:
    sum_j weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = experts[n, j].
    `silu_mul(gate, up)`: the activation (default silu(gate) * up)."""
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    routing = route_tokens(experts, num_experts)
    rows = x[routing.tokens]
    gu = grouped_gemm_ref(rows, gate_up, routing.group_sizes)
    gate, up = gu[:, :inter], gu[:, inter:]
    act = silu_mul(gate, up) if silu_mul is not None else torch.nn.functional.silu(gate) * up
    y = grouped_gemm_ref(act, down, routing.group_sizes)
    y = y * weights.reshape(-1)[routing.order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, routing.tokens, y)
