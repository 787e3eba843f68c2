"""The mixture-of-experts feed-forward (Qwen2-MoE / Qwen3-MoE): a top-k softmax router over stacked experts,
with an optional shared expert.

Parameter names are transformers' (5.x in-memory names): `mlp.gate.weight` [E, H] (the router),
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (the stacked experts),
`mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight` [1, H].

Routing, as transformers: router logits in the model dtype, softmax in fp32, top-k of the probabilities,
renormalised when `norm_topk_prob`, rounded to the model dtype. The experts run as the grouped SwiGLU
MLP of `ops.grouped_gemm` (tokens sorted by expert on the device; Triton grouped GEMMs on CUDA, one GEMM per
expert in torch elsewhere; each token's k rows added in slot order). The flat-token forwards tell the
attention backend each layer's router logits and choices (`FlatAttention.record_routing`): training adds the
load-balancing loss from them, the rollout reports the choices when asked (`EngineConfig.return_routed_experts`).

Exact mode (`EngineConfig.exact_logprobs`) routes and combines by `ops.moe_exact`'s rule: batch-invariant
routing (ties to the lowest expert id), the batch-invariant grouped GEMMs, each token's slots added in slot
order in fp32 within each half of the experts, the two halves added, the shared expert's fp32 term added, and
one rounding, so that the rollout and the trainer compute a token's bits alike.

Expert parallelism (generation at tg > 1, `tensor_parallel.parallelize`; training with
`EngineTuning.expert_parallel_training`, `train.expert_parallel`): a rank's `Experts` holds the whole experts
[first, first + E / tg) and the router, replicated, still scores all E. The rank runs only the assignments to
its own experts (`grouped_mlp(first=...)`: every rank has every token after attention, so no token moves in
generation) and the ranks' partial outputs are summed by an all-reduce. In exact mode that sum's tree is the
one the single device computes (two fp32 halves), so tg 1 and tg 2 give the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridengine.model.config import ModelConfig
from hybridengine.model.decoder import MLP, FlatAttention, _FlatOps, _linear, project
from hybridengine.ops.grouped_gemm import grouped_mlp
from hybridengine.ops.moe_exact import exact_experts, exact_routing, sigmoid_exact
from hybridengine.ops.silu_mul import silu_mul

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
        """The routed experts' output [N, H] (of this module's experts alone when it holds a slice): in x's
        dtype; exact mode, the unrounded fp32 sum of `ops.moe_exact` (the caller adds the shared expert and
        rounds once)."""
        if exact:
            return exact_experts(x, self.gate_up_proj, self.down_proj, experts, weights, activation,
                                 first=self.first, num_experts=self.num_experts)
        return grouped_mlp(x, self.gate_up_proj, self.down_proj, experts, weights, activation, first=self.first,
                           num_experts=self.num_experts)


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
        """x [N, H] -> (router logits [N, E] in x's dtype, routing weights [N, k] in x's dtype (exact: fp32),
        experts int64 [N, k]). Exact mode: `ops.moe_exact`'s rule (ties to the lowest expert id)."""
        logits = project(self.gate, x, exact)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if exact:
            return (logits, *exact_routing(probs, self.top_k, self.norm_topk_prob))
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
        if exact:
            return self._exact_total(x, out, act)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x) if silu_mul is None else self._shared_flat(x, silu_mul, exact)
            out = out + torch.sigmoid(project(self.shared_expert_gate, x, exact)) * shared
        return out

    def _exact_total(self, x, routed, act) -> torch.Tensor:
        """`ops.moe_exact`'s rule: the routed experts' fp32 sum, plus sigmoid(shared gate) * the shared expert's
        fp32 down_proj sum (its `EXACT_ROW_SPLITS` halves, as a dense MLP; the row-parallel all-reduce under
        tp_generation = 2), rounded once to x's dtype. `act(gate, up)`: the caller's SiLU * up (exact mode runs
        only the flat-token forwards, which give one)."""
        if self.shared_expert is not None:
            s = self.shared_expert
            shared = project(s.down_proj, act(project(s.gate_proj, x, True), project(s.up_proj, x, True)),
                             True, True, fp32_sum=True)
            routed = routed + sigmoid_exact(project(self.shared_expert_gate, x, True)).float() * shared
        return routed.to(x.dtype)

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
        """`Kernels.ROLLOUT`: the same computation (SiLU * up in torch, the experts' grouped GEMMs); records
        the routing in `attn`."""
        return self._moe(h, exact, silu_mul, attn, layer_idx)
