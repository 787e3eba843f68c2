"""The mixture-of-experts feed-forward (Qwen2-MoE / Qwen3-MoE): a top-k softmax router over stacked experts,
with an optional shared expert.

Parameter names are transformers' (5.x in-memory names): `mlp.gate.weight` [E, H] (the router),
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (the stacked experts),
`mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight` [1, H].

Routing, as transformers: router logits in the model dtype, softmax in fp32, top-k of the probabilities,
renormalised when `norm_topk_prob`, rounded to the model dtype. The experts run as the grouped SwiGLU
MLP of `ops.grouped_gemm` (tokens sorted by expert, one GEMM per expert). The flat-token forwards tell the
attention backend each layer's router logits and choices (`FlatAttention.record_routing`): training adds the
load-balancing loss from them.

Expert parallelism (generation at tg > 1, `tensor_parallel.parallelize`): a TP rank's `Experts` holds the whole
experts [first, first + E / tg) and the router, replicated, still scores all E. The rank runs only the
assignments to its own experts (`expert_partial`: every rank has every token after attention, so no token
moves) and the ranks' partial outputs are summed by an all-reduce. Exact mode fixes that sum's tree on a
single device too: the routed output is `EXACT_EXPERT_SPLITS` partials over consecutive halves of the experts,
each summed in fp32, added once and rounded once, so tg 1 and tg 2 give the same bits (as the row-parallel
projections' `EXACT_ROW_SPLITS`).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridengine.model.config import ModelConfig
from hybridengine.model.decoder import EXACT_ROW_SPLITS, MLP, FlatAttention, _FlatOps, _linear, project
from hybridengine.ops.exact_linear import linear_exact
from hybridengine.ops.grouped_gemm import Routing, grouped_gemm_ref, grouped_mlp_ref
from hybridengine.ops.silu_mul import silu_mul

EXACT_EXPERT_SPLITS = EXACT_ROW_SPLITS
"""Exact mode: the routed output is the fp32 sum of this many partials over consecutive ranges of the experts
(the expert-parallel all-reduce's tree at tg = 2), rounded once."""


# -- expert parallelism: the contribution of a range of the experts -----------------------------------------------


def local_routing(experts: torch.Tensor, first: int, num_local: int) -> Routing:
    """The assignments of experts int64 [N, k] to the experts [first, first + num_local), sorted by expert
    (stable: one expert's rows keep token order), with `group_sizes` over those experts. With every expert
    local it is `grouped_gemm.route_tokens`."""
    flat = experts.reshape(-1) - first
    kept = torch.nonzero((flat >= 0) & (flat < num_local)).squeeze(1)
    local = flat[kept]
    order = kept[torch.argsort(local, stable=True)]
    sizes = torch.bincount(local, minlength=num_local)
    return Routing(order=order, tokens=order // experts.shape[-1], group_sizes=sizes.tolist())


def _grouped_exact(x: torch.Tensor, weight: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """`grouped_gemm_ref` with each expert's GEMM as `linear_exact` (batch-invariant bits)."""
    outs, start = [x.new_zeros(0, weight.shape[1])], 0
    for e, n in enumerate(group_sizes):
        if n:
            outs.append(linear_exact(x[start:start + n], weight[e]))
        start += n
    return torch.cat(outs)


def expert_outputs(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, group_sizes: list[int],
                   activation=None, exact: bool = False) -> torch.Tensor:
    """The SwiGLU MLP of each expert on its rows: rows [M, H] grouped by expert (group_sizes[e] rows of expert
    e, in order), gate_up [E', 2I, H], down [E', H, I] -> [M, H], unweighted. Exact: the GEMMs as
    `linear_exact`. `activation(gate, up)`: the SiLU * up (default torch's)."""
    inter = gate_up.shape[1] // 2
    gemm = _grouped_exact if exact else grouped_gemm_ref
    gu = gemm(rows, gate_up, group_sizes)
    gate, up = gu[:, :inter], gu[:, inter:]
    act = activation(gate, up) if activation is not None else torch.nn.functional.silu(gate) * up
    return gemm(act, down, group_sizes)


def slot_sum_fp32(values: torch.Tensor, order: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Exact mode's combine: values [M, H] of the assignments `order` (flat index token * k + slot) -> [N, H]
    fp32, each token's assignments added in slot order (an absent slot adds a zero): a fixed order on every
    device, where an index_add_ of floats is atomic on CUDA."""
    slots = torch.zeros(num_tokens * top_k, values.shape[1], dtype=torch.float32, device=values.device)
    slots = slots.index_copy(0, order, values.float()).view(num_tokens, top_k, -1)
    out = slots[:, 0]
    for j in range(1, top_k):
        out = out + slots[:, j]
    return out


def expert_partial(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                   weights: torch.Tensor, *, first: int = 0, activation=None, exact: bool = False) -> torch.Tensor:
    """The routed SwiGLU MLP over the experts [first, first + gate_up.shape[0]) only: x [N, H], their stacked
    weights gate_up [E', 2I, H] and down [E', H, I], the router's choices experts int64 [N, k] (over all
    experts) and weights [N, k] -> [N, H], the sum over each token's assignments to these experts (zero for a
    token routed to none of them).

    Not exact: in x's dtype, assignments added in expert order (with every expert, `grouped_mlp_ref`'s bits).
    Exact: the GEMMs as `linear_exact`, each assignment's output times its weight in fp32, and a token's
    assignments added in fp32 in slot order (`slot_sum_fp32`): the unrounded fp32 partial (the caller adds the
    partials and rounds once)."""
    routing = local_routing(experts, first, gate_up.shape[0])
    y = expert_outputs(x[routing.tokens], gate_up, down, routing.group_sizes, activation, exact)
    w = weights.reshape(-1)[routing.order].unsqueeze(1)
    if not exact:
        return torch.zeros_like(x).index_add_(0, routing.tokens, y * w)
    return slot_sum_fp32(y.float() * w.float(), routing.order, *experts.shape)


def exact_split_bounds(num_experts: int) -> list[int]:
    """Exact mode: the expert ranges [b[s], b[s + 1]) of the `EXACT_EXPERT_SPLITS` fp32 partials."""
    return [num_experts * s // EXACT_EXPERT_SPLITS for s in range(EXACT_EXPERT_SPLITS + 1)]


class Experts(nn.Module):
    """The routed experts' stacked weights (declared on the meta device, rebound to buffer views): all
    `num_experts` of the router, or under expert-parallel generation `num_local` of them, the experts
    [first, first + num_local) (`first` set by `tensor_parallel.parallelize`, which also sums the ranks' parts)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, num_local: int | None = None):
        super().__init__()
        self.num_experts, self.first = num_experts, 0
        num_local = num_experts if num_local is None else num_local
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * inter, hidden, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, inter, device="meta"))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, activation=None,
                exact: bool = False) -> torch.Tensor:
        """The routed experts' output [N, H] in x's dtype (of this module's experts alone when it holds a slice).
        Exact: the fp32 partials of `exact_split_bounds`, added in order and rounded once."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if not exact:
            if gate_up.shape[0] == self.num_experts:
                return grouped_mlp_ref(x, gate_up, down, experts, weights, activation)
            return expert_partial(x, gate_up, down, experts, weights, first=self.first, activation=activation)
        bounds = exact_split_bounds(gate_up.shape[0])
        out = None
        for lo, hi in zip(bounds, bounds[1:]):
            part = expert_partial(x, gate_up[lo:hi], down[lo:hi], experts, weights, first=self.first + lo,
                                  activation=activation, exact=True)
            out = part if out is None else out + part
        return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (+ the shared expert when the config has one)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_experts, self.top_k, self.norm_topk_prob = c.num_experts, c.num_experts_per_tok, c.norm_topk_prob
        self.gate = _linear(c.hidden_size, c.num_experts, False)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.num_local_experts)
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c, intermediate_size=c.shared_expert_intermediate_size)
            self.shared_expert_gate = _linear(c.hidden_size, 1, False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (router logits [N, E], routing weights [N, k], both in x's dtype; experts int64 [N, k])."""
        logits = project(self.gate, x, exact)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), experts

    def _moe(self, x: torch.Tensor, exact: bool, silu_mul=None, attn: FlatAttention | None = None,
             layer_idx: int = 0) -> torch.Tensor:
        logits, weights, experts = self.route(x, exact)
        if attn is not None:
            attn.record_routing(layer_idx, logits, experts)
        act = None if silu_mul is None else (lambda g, u: silu_mul(g.contiguous(), u.contiguous()))
        out = self.experts(x, experts, weights, act, exact)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x) if silu_mul is None else self._shared_flat(x, silu_mul, exact)
            out = out + torch.sigmoid(project(self.shared_expert_gate, x, exact)) * shared
        return out

    def _shared_flat(self, x, silu_mul, exact):
        s = self.shared_expert
        return project(s.down_proj, silu_mul(project(s.gate_proj, x, exact), project(s.up_proj, x, exact)), exact,
                       True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dense [B, T, H] (the HF-compatible forward)."""
        return self._moe(x.reshape(-1, x.shape[-1]), False).view(x.shape)

    def forward_flat(self, h: torch.Tensor, ops: _FlatOps, exact: bool, attn: FlatAttention,
                     layer_idx: int) -> torch.Tensor:
        """Flat tokens h [N, H] (normed), with the SiLU * up of `attn.kernels`; records the routing in `attn`."""
        return self._moe(h, exact, ops.silu_mul, attn, layer_idx)

    def forward_rollout(self, h: torch.Tensor, exact: bool, attn: FlatAttention, layer_idx: int) -> torch.Tensor:
        """`Kernels.ROLLOUT`: the same computation (SiLU * up in torch; the experts' kernels come with the
        grouped GEMM); records the routing in `attn`."""
        return self._moe(h, exact, silu_mul, attn, layer_idx)
