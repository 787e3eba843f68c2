"""Tensor-parallel generation, applied from outside the model (the model knows nothing of it).

The generation view of TP rank t holds, in G, slice t of every weight (layout.py): q/k/v/gate/up
split by output rows (whole heads), o/down by input columns, embedding and LM head by vocabulary
rows (ceil(V / tg) per rank, zero-padded). A `CausalLM` built for the *local* shapes (heads / tg,
intermediate / tg, vocab rows / tg) has exactly those parameter shapes, so its weights are plain
views of G. What TP adds is three collectives over the TP group, which `parallelize` installs as
modules and a declared field: `RowParallelLinear` (all-reduce after the row-parallel o_proj and
down_proj), `VocabParallelEmbedding` (masked local lookup + all-reduce), and `CausalLM.vocab_shard`
(`VocabShard`): the rollout samples from the vocab-sliced logits vocab-parallel
(`ops.sample_fused(group=)`: each rank reduces its columns, the ranks exchange B x splits x 5
floats) and all-gathers the logits only for a step that truncates.

Mixture of experts (expert parallelism): TP rank t holds the whole experts [t * E / tg, (t + 1) * E / tg)
(the layout's ``expert`` role), the router replicated, the shared expert column/row like a dense MLP.
`ExpertParallelExperts` runs this rank's experts on the tokens routed to them (every rank has every token
after attention, so no token moves) and all-reduces the partial outputs, as the row-parallel down_proj does.

The all-reduces of a decode step are small ([batch, hidden]) and latency-bound, two per layer. On
CUDA they go, by default, through torch's symmetric memory (`SymmAllReduce`): the row-parallel GEMM
writes its output straight into a buffer every TP rank has mapped, and `two_shot_all_reduce_out`
reduces it over NVLink loads and stores (no NCCL proxy, no ring). Messages larger than the buffer
(prefill) take NCCL.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridengine.model.config import ModelConfig
from hybridengine.model.decoder import CausalLM
from hybridengine.model.moe import Experts, SparseMoeBlock
from hybridengine.ops.exact_linear import linear_exact
from hybridengine.ops.grouped_gemm import grouped_mlp
from hybridengine.ops.moe_exact import exact_experts
from hybridengine.options import TP_ALL_REDUCE


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The per-rank shapes of a TP-sliced model."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide {name}={getattr(config, name)}")
    if config.num_experts and (config.num_experts % tp_size or config.shared_expert_intermediate_size % tp_size):
        raise ValueError(f"tp_size={tp_size} (tp_generation) must divide num_experts={config.num_experts} (each TP "
                         "rank holds whole experts) and shared_expert_intermediate_size="
                         f"{config.shared_expert_intermediate_size}")
    if config.expert_slices != 1:
        raise ValueError(f"local_config: config must be a whole model's (expert_slices=1), got expert_slices="
                         f"{config.expert_slices}")
    if tp_size > 1 and config.qk_norm_full_width:
        raise ValueError(f"tp_size={tp_size}: q/k norms over the whole projection (qk_norm_full_width) need every "
                         "head's sum of squares, which one rank's heads do not have: use tp_generation=1")
    if tp_size > 1 and (config.o_bias or config.mlp_bias):
        raise ValueError("tensor-parallel generation does not support o_proj/down_proj biases (they would be "
                         "added once per TP rank by the all-reduce)")
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // tp_size,
        num_key_value_heads=config.num_key_value_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp_size,
        expert_slices=tp_size if config.num_experts else 1,
        vocab_size=math.ceil(config.vocab_size / tp_size))


class GroupAllReduce:
    """A row-parallel linear's and the embedding's all-reduce through the process group (NCCL, gloo):
    `linear` = all_reduce(x @ weight.T), `all_reduce_` in place. `SymmAllReduce` has the same two calls."""

    def __init__(self, group):
        self.group = group

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, weight)
        dist.all_reduce(out, group=self.group)
        return out

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place where x is contiguous, else in a contiguous copy (returned: gloo
        reduces `numel` elements from the data pointer whatever the strides, as `all_reduce_fp32` says)."""
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x


def all_reduce_fp32(part: torch.Tensor, group) -> torch.Tensor:
    """An exact-mode fp32 partial summed over the TP group (one add of two values at tg = 2), in place where
    `part` is contiguous, else in a contiguous copy (returned). gloo reduces `numel` elements from the data
    pointer whatever the strides: a strided partial would have elements outside it summed and some of its own
    left as this rank's, without an error."""
    part = part.contiguous()
    dist.all_reduce(part, group=group)
    return part


class SymmAllReduce(GroupAllReduce):
    """Sum all-reduce over a TP group through torch symmetric memory (CUDA, one node).

    Two buffers of `capacity` elements, rendezvoused once over the group; consecutive calls alternate
    between them, so a rank never writes the buffer a slower peer may still be reading from the call
    before (each call's kernel starts with a barrier over the group). `linear` computes x @ w.T into
    the buffer and reduces from there into a fresh tensor; `all_reduce_` reduces a tensor in place (one
    copy in). Either takes the group's own all-reduce (NCCL) for a message over `capacity` elements.
    Every rank must make the same sequence of calls (true of a TP forward). Bitwise equal to NCCL's sum
    at tg = 2 (one add of two values, rounded once); at tg > 2 the order of the adds may differ from
    NCCL's ring.
    """

    def __init__(self, group, *, capacity: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        if device.type != "cuda":
            raise ValueError(f"SymmAllReduce needs a CUDA device, got {device}")
        super().__init__(group)
        self.capacity = capacity
        self.group_name = group.group_name
        self.buffers = [symm_mem.empty(capacity, dtype=dtype, device=device) for _ in range(2)]
        for buf in self.buffers:
            symm_mem.rendezvous(buf, group=self.group_name)
        self._next = 0
        self.calls = 0  # symmetric-memory all-reduces issued (captured ones count once)

    def _buffer(self, shape) -> torch.Tensor:
        buf = self.buffers[self._next]
        self._next ^= 1
        return buf[:math.prod(shape)].view(shape)

    def _reduce(self, buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, out)
        self.calls += 1
        return out

    def fits(self, numel: int) -> bool:
        """Within the buffer and a multiple of 16 bytes (the kernels' vector width)."""
        return numel <= self.capacity and numel * self.buffers[0].element_size() % 16 == 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """all_reduce(x @ weight.T) for a row-parallel linear without bias."""
        shape = (*x.shape[:-1], weight.shape[0])
        if not self.fits(math.prod(shape)) or x.dtype != self.buffers[0].dtype:
            return super().linear(x, weight)
        buf = self._buffer((math.prod(shape[:-1]), shape[-1]))
        torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out=buf)
        return self._reduce(buf, torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)).view(shape)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x.numel()) or not x.is_contiguous() or x.dtype != self.buffers[0].dtype:
            return super().all_reduce_(x)
        buf = self._buffer(x.shape)
        buf.copy_(x)
        return self._reduce(buf, x)


def make_all_reduce(mode: str, group, *, capacity: int, dtype: torch.dtype,
                    device: torch.device) -> SymmAllReduce | None:
    """The symmetric-memory all-reduce for `mode` ('auto': on CUDA when torch's symmetric memory sets
    up; 'symm_mem': required; 'nccl': None, plain dist.all_reduce)."""
    if mode not in TP_ALL_REDUCE:
        raise ValueError(f"tp_all_reduce must be one of {TP_ALL_REDUCE}, got {mode!r}")
    if mode == "nccl" or (mode == "auto" and device.type != "cuda"):
        return None
    try:
        return SymmAllReduce(group, capacity=capacity, dtype=dtype, device=device)
    except Exception as e:  # noqa: BLE001 - 'auto' falls back to NCCL, saying why
        if mode == "symm_mem":
            raise RuntimeError(f"tp_all_reduce='symm_mem': torch symmetric memory did not set up on {device}: "
                               f"{type(e).__name__}: {e}") from e
        import warnings

        warnings.warn(f"tp_all_reduce='auto': torch symmetric memory did not set up ({type(e).__name__}: {e}); "
                      "TP generation all-reduces through NCCL", stacklevel=2)
        return None


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """A TP rank's slice of the vocabulary: LM-head rows [first, first + rows), the first `valid` of
    them real (the rest zero padding). `CausalLM.local_logits` gives this rank's logits [..., rows];
    the rollout samples from them vocab-parallel (`ops.sample_fused(group=)`) and gathers the whole
    vocabulary (`gather`) only for a step that truncates (top-k/top-p)."""

    first: int
    rows: int
    valid: int
    vocab_size: int
    group: object
    tp_size: int

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The vocab-sliced logits [..., rows] of every TP rank -> [..., vocab_size] (padding dropped)."""
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.tp_size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


class RowParallelLinear(nn.Module):
    """A row-parallel linear without bias: x @ weight.T over this rank's input columns, summed over
    the TP group. Holds the replaced nn.Linear's parameter itself (a view of the flat buffer).

    Exact mode (`forward(x, exact=True)`, tg = 2): this rank's fp32 partial (`linear_exact(out_dtype=fp32)`,
    the sum over its half of the input columns), all-reduced in fp32 (one add of two values, the same on
    every rank and in either order) and rounded once: the bits of the single-device `linear_exact(k_splits=2)`."""

    def __init__(self, linear: nn.Linear, reduce: GroupAllReduce):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("RowParallelLinear: a bias would be added once per TP rank by the all-reduce")
        self.weight = linear.weight
        self.reduce = reduce

    def forward(self, x: torch.Tensor, exact: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype (exact mode): the sum's dtype, default x's (torch.float32: unrounded, as `linear_exact`)."""
        if not exact:
            return self.reduce.linear(x, self.weight)
        part = all_reduce_fp32(linear_exact(x, self.weight, out_dtype=torch.float32), self.reduce.group)
        return part.to(out_dtype or x.dtype)


class ExpertParallelExperts(nn.Module):
    """A TP rank's routed experts: the whole experts [first, first + E / tg), their outputs for the tokens
    routed to them (`grouped_mlp(first=...)`), summed over the TP group. Holds the replaced `moe.Experts`'
    parameters themselves (views of the flat buffer), under their names.

    Exact mode (tg = 2): this rank's fp32 partial, all-reduced in fp32 (one add of two values), unrounded:
    the bits of the single-device `Experts(exact=True)`, whose two partials are these two halves (the block
    adds the shared expert and rounds once)."""

    def __init__(self, experts: Experts, first: int, reduce: GroupAllReduce):
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.num_experts, self.first = experts.num_experts, first
        self.reduce = reduce

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, activation=None,
                exact: bool = False) -> torch.Tensor:
        """`moe.Experts.forward` over the TP group: x's dtype, or in exact mode the unrounded fp32 sum."""
        if not exact:
            part = grouped_mlp(x, self.gate_up_proj, self.down_proj, experts, weights, activation,
                               first=self.first, num_experts=self.num_experts)
            return self.reduce.all_reduce_(part)
        part = exact_experts(x, self.gate_up_proj, self.down_proj, experts, weights, activation, first=self.first,
                             num_experts=self.num_experts)
        return all_reduce_fp32(part, self.reduce.group)


class VocabParallelEmbedding(nn.Module):
    """An embedding over this rank's vocabulary rows [first, first + rows): ids outside them look up
    zeros, and the all-reduce over the TP group sums in the rank that holds each id."""

    def __init__(self, embedding: nn.Embedding, first: int, reduce: GroupAllReduce):
        super().__init__()
        self.weight = embedding.weight
        self.first, self.rows = first, embedding.weight.shape[0]
        self.reduce = reduce

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.reduce.all_reduce_(out)


def parallelize(model: CausalLM, *, vocab_size: int, tp_rank: int, tp_size: int, group,
                all_reduce: SymmAllReduce | None = None) -> CausalLM:
    """Install the TP collectives in a model built with `local_config` over its slice of G (through
    `all_reduce` when given, else NCCL/gloo's dist.all_reduce): the row-parallel o_proj and down_proj,
    the expert-parallel experts of an MoE layer (and its shared expert's row-parallel down_proj), the
    vocab-parallel embedding, and `model.vocab_shard`. Parameter names stay those of the model."""
    if tp_size == 1:
        return model
    reduce = all_reduce if all_reduce is not None else GroupAllReduce(group)
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, reduce)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            mlp.experts = ExpertParallelExperts(mlp.experts, tp_rank * mlp.experts.gate_up_proj.shape[0], reduce)
            mlp = mlp.shared_expert  # None without one
        if mlp is not None:
            mlp.down_proj = RowParallelLinear(mlp.down_proj, reduce)
    rows = model.config.vocab_size  # local rows per rank (padded)
    first = tp_rank * rows
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, first, reduce)
    model.vocab_shard = VocabShard(first=first, rows=rows, valid=max(0, min(rows, vocab_size - first)),
                                   vocab_size=vocab_size, group=group, tp_size=tp_size)
    return model
