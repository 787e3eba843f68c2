"""Expert parallelism in training: each MoE layer's routed experts run on the ranks that own them, and the
tokens travel to them (EngineTuning.expert_parallel_training).

The EP group is the TP group of the generation view (`ShardedBuffer.tp_group`: the tg ranks t * m + j that
share the index j inside their slice): EP rank t owns the experts [t * E / tg, (t + 1) * E / tg), the experts
of TP slice t, which the layout already keeps together (role ``expert``, whole experts per slice). In a
layer's forward every rank routes its own tokens (the router is replicated), sends each (token, expert)
assignment's row to the expert's owner (`all_to_all_single` over the EP group), runs its own experts on
the rows it receives (`ops.grouped_gemm.expert_mlp`, grouped by expert), and sends the fp32 outputs back;
the token's rank weights and adds them by `grouped_mlp`'s sum (`combine_slots`: slot order, one rounding;
exact mode: the fp32 halves of `Experts`, so the bits are the rollout's). The all-to-alls are differentiable
(`AllToAll`): the backward sends the output gradients to the owners and the input gradients back.

`enable` applies it from outside, as `tensor_parallel.parallelize` does for generation: it installs
`ExpertParallelTraining` in the trainer's module skeleton (`apply_expert_parallel`) and `ExpertComm` in the
ShardedBuffer, so that a layer's gather brings this rank's own experts only (the slice-major layout keeps
them in slice t, spread over the micro-DP group's shards) and the experts' gradients are reduced among their
owners (sharding/expert_comm.py). The module reads its experts' slice of the stacked parameter: the gradient
of every other expert is zero on this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridengine.model.moe import Experts, SparseMoeBlock
from hybridengine.ops.grouped_gemm import combine_slots, expert_mlp
from hybridengine.ops.moe_exact import exact_splits
from hybridengine.sharding.expert_comm import ExpertComm


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows over a group (send[r] rows to rank r, recv[r] from it); the backward is the
    reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class ExpertParallelTraining(nn.Module):
    """A layer's routed experts under expert-parallel training (see the module docstring). Holds the replaced
    `moe.Experts`' parameters (the skeleton's meta tensors, replaced by the gathered weights per call)."""

    def __init__(self, experts: Experts, group, ep_rank: int, ep_size: int):
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.num_experts = experts.num_experts
        if self.num_experts % ep_size:
            raise ValueError(f"expert-parallel training: the EP group's {ep_size} ranks (tp_generation) must divide "
                             f"num_experts={self.num_experts} (each rank owns whole experts)")
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.num_local = self.num_experts // ep_size
        self.first = ep_rank * self.num_local

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, activation=None,
                exact: bool = False) -> torch.Tensor:
        """x [N, H] (this rank's tokens), experts int64 [N, k], weights [N, k] -> the routed output [N, H] in
        x's dtype (exact mode: the unrounded fp32 sum, as `moe.Experts`)."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by owner: each owner's rows are one run
        send = torch.bincount(flat // self.num_local, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send, recv = send.tolist(), recv.tolist()
        rows = AllToAll.apply(x[order // top_k], send, recv, self.group)
        with torch.no_grad():  # each received row's expert, grouped by expert for the GEMMs
            local = torch.empty(sum(recv), dtype=flat.dtype, device=flat.device)
            dist.all_to_all_single(local, flat[order].contiguous(), recv, send, group=self.group)
            local -= self.first
            by_expert = torch.argsort(local, stable=True)
            sizes = torch.bincount(local, minlength=self.num_local).tolist()
        lo, hi = self.first, self.first + self.num_local
        y = expert_mlp(rows[by_expert], self.gate_up_proj[lo:hi], self.down_proj[lo:hi], sizes, activation,
                       exact=exact)
        y = torch.empty_like(y).index_copy(0, by_expert, y)  # back to the order received
        back = AllToAll.apply(y, recv, send, self.group)  # this rank's assignments, in `order`: fp32
        slots = torch.empty_like(back).index_copy(0, order, back).view(num_tokens, top_k, -1)
        if not exact:  # grouped_mlp's sum: slot order, rounded once
            return combine_slots(slots, experts, weights, self.num_experts).to(x.dtype)
        # the halves of `Experts(exact=True)`: the same fp32 partials, added once, unrounded
        return combine_slots(slots, experts, weights, self.num_experts, exact_splits(self.num_experts))


def apply_expert_parallel(skeleton: nn.Module, group, ep_rank: int, ep_size: int) -> int:
    """Install `ExpertParallelTraining` in every MoE layer of the trainer's module skeleton (a `CausalLM` on
    the meta device); returns how many layers it changed. ep_size 1 changes nothing."""
    if ep_size == 1:
        return 0
    changed = 0
    for layer in skeleton.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.experts = ExpertParallelTraining(layer.mlp.experts, group, ep_rank, ep_size)
            changed += 1
    return changed


def enable(trainer, sharded) -> None:
    """Expert-parallel training for `trainer` (a `train.trainer.Trainer`) over `sharded` (its ShardedBuffer):
    the EP module in every MoE layer of its skeleton, the two-step gather and reduce of those layers' units.
    A model without experts, or tg = 1, is left as it is."""
    tg = sharded.layout.tp_size
    if apply_expert_parallel(trainer.model.skeleton, sharded.tp_group, sharded.tp_rank, tg):
        sharded.expert_comm = ExpertComm(sharded)
