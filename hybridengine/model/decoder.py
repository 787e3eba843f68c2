"""A compact decoder (the Llama family, and with a model family's feed-forward its MoE kin) whose weights are
views of one flat buffer.

gpt-fast / nano-vllm style: one file, plain torch, single device. Module and parameter names are
exactly the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, ...) so safetensors load
by name, and the model family (model/family.py) declares each layer's feed-forward module and the parallel
role of every parameter (`layout.param_specs` reads its plan). Every parameter is an `nn.Parameter` aliasing
a view of `CausalLM.flat_buffer`; sharding and resharding act on that buffer from outside, so
this file never imports `torch.distributed`.

Three forward paths:
- dense, HF-compatible: `forward` / `hidden_states` over [B, T] (eager module code, autograd);
- rollout over the paged KV cache: `hidden_states_paged` with the runner's attention metadata,
  whose `kernels` is `Kernels.ROLLOUT` (the inference kernels of hybridengine.ops: rms_norm, silu_mul, kv_store) on CUDA
  and `Kernels.TORCH` (the module code) elsewhere;
- training over packed sequences: the trainer calls each `DecoderLayer` on flat tokens with its
  `PackedAttention`, whose `kernels` is `Kernels.TRAIN` (the autograd kernels) or `Kernels.TORCH`.
The attention backend declares its kernels when it is built; the model reads nothing else from it
but `attend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridengine.model.config import ModelConfig
from hybridengine.model.family import family_of
from hybridengine.ops.exact_linear import linear_exact
from hybridengine.ops.rms_norm import rms_norm, rms_norm_train
from hybridengine.ops.rope import rope_train
from hybridengine.ops.silu_mul import silu_mul, silu_mul_torch, silu_mul_train
from hybridengine.ops.stacked_rows import stacked_rows
from hybridengine.sharding.buffer import FlatParamBuffer
from hybridengine.sharding.layout import param_specs


class Kernels(Enum):
    """The implementation of the flat-token forward, declared by the attention backend that runs it."""

    TORCH = "torch"
    """The module code in eager torch (autograd-safe; the dense forward's arithmetic)."""
    ROLLOUT = "rollout"
    """Inference (no autograd): the kernels of hybridengine.ops (rms_norm, silu_mul), each residual add inside the
    next norm's kernel, one GEMM for q/k/v and one for gate/up, RoPE inside the KV store."""
    TRAIN = "train"
    """Training: the autograd ops of hybridengine.ops (rms_norm_train, rope_train, silu_mul_train) for the norms,
    RoPE and SiLU * up."""


EXACT_ROW_SPLITS = 2
"""Exact mode: the row-parallel projections (o_proj, down_proj) reduce their input dimension in two halves
whose fp32 sums add once (`linear_exact(k_splits=2)`): the same tree as tensor-parallel generation at tg = 2,
where each rank reduces its half and the all-reduce adds the two. So tg 1 and tg 2 give the same bits."""


class FlatAttention(Protocol):
    """Attention over flat tokens: the rollout's paged KV cache (`rollout.runner.AttentionMetadata`)
    or training's packed sequences (`train.packed_attention.PackedAttention`)."""

    @property
    def kernels(self) -> Kernels: ...

    @property
    def exact(self) -> bool:
        """Exact mode (EngineConfig.exact_logprobs): every projection is `linear_exact` and the attention
        the exact ops, so a token's hidden states have the same bits in rollout and training."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]. A `Kernels.ROLLOUT` backend also takes
        `rope=(cos, sin)`: q and k not rotated yet, rotated in the KV store's kernel."""

    def record_routing(self, layer: int, router_logits: torch.Tensor, experts: torch.Tensor) -> None:
        """An MoE layer's router logits [N, E] (with autograd in training) and chosen experts int64 [N, k]:
        training's load-balancing loss reads them; the rollout ignores them."""


class VocabSlice(Protocol):
    """What the model calls on its vocabulary slice under tensor-parallel generation. The one installed is
    `tensor_parallel.VocabShard` (whose rows the rollout also reads); declared here so that the model does
    not import the code that parallelizes it."""

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's logits [..., rows] -> the whole vocabulary's [..., vocab_size] (a TP collective)."""


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for positions [...], computed in fp32 and rounded to `dtype` (as HF)."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D] (HF half-split layout, not interleaved pairs)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def apply_rope_flat(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [N, Hq, D], k [N, Hkv, D]; cos/sin [N, D]: `apply_rope` on flat tokens."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention over q [B, H, T, D], k/v [B, KVH, T, D]."""
    T = q.shape[-2]
    if sliding_window is None or sliding_window >= T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    i = torch.arange(T, device=q.device)
    dist = i[:, None] - i[None, :]
    mask = (dist >= 0) & (dist < sliding_window)  # True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.empty(dim, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the input dtype: the same rounding as HF in bf16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True, slots=True)
class _FlatOps:
    """The elementwise steps of a layer on flat tokens: rms_norm(x, norm module), rope(q, k, cos, sin),
    silu_mul(gate, up)."""

    rms_norm: Callable
    rope: Callable
    silu_mul: Callable


_FLAT_OPS = {
    Kernels.TORCH: _FlatOps(rms_norm=lambda x, norm: norm(x), rope=apply_rope_flat,
                            silu_mul=silu_mul_torch),
    Kernels.TRAIN: _FlatOps(rms_norm=lambda x, norm: rms_norm_train(x, norm.weight, norm.eps),
                            rope=rope_train,
                            silu_mul=silu_mul_train),
}


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


def project(module: nn.Module, x: torch.Tensor, exact: bool, row_parallel: bool = False,
            fp32_sum: bool = False) -> torch.Tensor:
    """A projection: the module itself, or in exact mode `linear_exact` over its weight (the row-parallel ones
    in `EXACT_ROW_SPLITS` halves). A tensor-parallel wrapper (not an nn.Linear) takes `exact` itself.
    `fp32_sum` (exact mode, row-parallel): return the unrounded fp32 sum, for a consumer that rounds it
    itself (`rms_norm` with a residual, the rollout's next op: one kernel less per projection)."""
    if not exact:
        return module(x)
    out_dtype = torch.float32 if fp32_sum and row_parallel else None
    if isinstance(module, nn.Linear):
        return linear_exact(x, module.weight, module.bias, k_splits=EXACT_ROW_SPLITS if row_parallel else 1,
                            out_dtype=out_dtype)
    return module(x, exact=True, out_dtype=out_dtype) if out_dtype is not None else module(x, exact=True)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.sliding_window = c.layer_window(layer_idx)
        self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim, c.qkv_bias)
        self.k_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.qkv_bias)
        self.v_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.qkv_bias)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size, c.o_bias)
        self.qk_norm_full_width = c.qk_norm_full_width
        if c.qk_norm:
            full = c.qk_norm_full_width
            self.q_norm = RMSNorm(c.num_attention_heads * c.head_dim if full else c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.num_key_value_heads * c.head_dim if full else c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor, norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., Hq, D], k [..., Hkv, D] through `norm(x, module)` (q_norm, k_norm): per head, or over all heads
        of the projection (`qk_norm_full_width`)."""
        if not self.qk_norm_full_width:
            return norm(q, self.q_norm), norm(k, self.k_norm)
        return norm(q.flatten(-2), self.q_norm).view(q.shape), norm(k.flatten(-2), self.k_norm).view(k.shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self._norm_qk(q, k, lambda x, norm: norm(x))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def forward_flat(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: FlatAttention,
                     layer_idx: int, ops: _FlatOps) -> torch.Tensor:
        """Flat tokens x [N, hidden]; cos/sin [N, D]; `attn.attend` attends (and stores K/V in a paged cache)."""
        q, k, v = self._qkv(x, attn.exact)
        if self.q_norm is not None:
            q, k = self._norm_qk(q, k, ops.rms_norm)
        q, k = ops.rope(q, k, cos, sin)
        out = attn.attend(layer_idx, q, k, v, self.sliding_window)
        return project(self.o_proj, out.reshape(x.shape[0], self.num_heads * self.head_dim), attn.exact, True)

    def forward_rollout(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: FlatAttention,
                        layer_idx: int) -> torch.Tensor:
        """`forward_flat` with `Kernels.ROLLOUT`: q, k and v from one GEMM, the q/k norms as the kernels of
        hybridengine.ops, RoPE inside the KV store's kernel (`attend(..., rope=(cos, sin))`)."""
        q, k, v = self._qkv_one_gemm(x, attn.exact)
        if self.q_norm is not None:
            q, k = self._norm_qk(q, k, lambda x, norm: rms_norm(x, norm.weight, norm.eps))
        out = attn.attend(layer_idx, q, k, v, self.sliding_window, rope=(cos, sin))
        # exact: o_proj's fp32 sum, rounded in the caller's rms_norm (the residual add)
        return project(self.o_proj, out.reshape(x.shape[0], self.num_heads * self.head_dim), attn.exact, True,
                       fp32_sum=True)

    def _qkv(self, x: torch.Tensor, exact: bool = False):
        """q [N, Hq, D], k, v [N, Hkv, D] from the three projections."""
        N, D = x.shape[0], self.head_dim
        return (project(self.q_proj, x, exact).view(N, self.num_heads, D),
                project(self.k_proj, x, exact).view(N, self.num_kv_heads, D),
                project(self.v_proj, x, exact).view(N, self.num_kv_heads, D))

    def _qkv_one_gemm(self, x: torch.Tensor, exact: bool = False):
        """`_qkv` as one GEMM over the adjacent q/k/v weights (and biases): strided views of one output;
        three GEMMs where they are not adjacent. (In exact mode each output column has the bits of its own
        projection's: `linear_exact` is independent of the columns computed beside it.)"""
        p = (self.q_proj, self.k_proj, self.v_proj)
        weight = stacked_rows(*(m.weight for m in p))
        bias = None if p[0].bias is None else stacked_rows(*(m.bias for m in p))
        if weight is None or (p[0].bias is not None and bias is None):
            return self._qkv(x, exact)
        N, D = x.shape[0], self.head_dim
        qkv = linear_exact(x, weight, bias) if exact else F.linear(x, weight, bias)
        nq, nk = self.num_heads * D, self.num_kv_heads * D
        return (qkv[:, :nq].view(N, self.num_heads, D), qkv[:, nq:nq + nk].view(N, self.num_kv_heads, D),
                qkv[:, nq + nk:].view(N, self.num_kv_heads, D))


class MLP(nn.Module):
    """The dense SwiGLU feed-forward (of intermediate_size, or `intermediate_size` when given: a shared expert)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        c, inter = config, intermediate_size or config.intermediate_size
        self.gate_proj = _linear(c.hidden_size, inter, c.mlp_bias)
        self.up_proj = _linear(c.hidden_size, inter, c.mlp_bias)
        self.down_proj = _linear(inter, c.hidden_size, c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_flat(self, h: torch.Tensor, ops: _FlatOps, exact: bool, attn: FlatAttention,
                     layer_idx: int) -> torch.Tensor:
        """Flat tokens h [N, hidden] (normed) with the ops of `attn.kernels` (`Kernels.TORCH` or `TRAIN`)."""
        act = ops.silu_mul(project(self.gate_proj, h, exact), project(self.up_proj, h, exact))
        return project(self.down_proj, act, exact, True)

    def forward_rollout(self, h: torch.Tensor, exact: bool, attn: FlatAttention, layer_idx: int) -> torch.Tensor:
        """`Kernels.ROLLOUT`: one GEMM for gate and up where they are adjacent; in exact mode down_proj's
        unrounded fp32 sum (the caller's next norm rounds it)."""
        gate_up = None if self.gate_proj.bias is not None else stacked_rows(self.gate_proj.weight,
                                                                            self.up_proj.weight)
        if gate_up is not None:  # one GEMM for both projections (adjacent in the flat buffer)
            gu = linear_exact(h, gate_up) if exact else F.linear(h, gate_up)
            inter = self.gate_proj.weight.shape[0]
            act = silu_mul(gu[..., :inter], gu[..., inter:])
        else:
            act = silu_mul(project(self.gate_proj, h, exact), project(self.up_proj, h, exact))
        return project(self.down_proj, act, exact, True, fp32_sum=True)


class DecoderLayer(nn.Module):
    """Attention and the feed-forward module of the model family (`mlp`: the dense `MLP` or an MoE block)."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: FlatAttention | None = None,
                layer_idx: int = 0) -> torch.Tensor:
        """Dense [B, T, H] without `attn`; flat tokens [N, H] through `attn` (its kernels: `Kernels.TORCH`
        or `Kernels.TRAIN`) with it. The trainer calls this through torch.func.functional_call; the
        rollout's `Kernels.ROLLOUT` layers are chained by `CausalLM.hidden_states_paged` (`forward_rollout`)."""
        if attn is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))
        ops, exact = _FLAT_OPS[attn.kernels], attn.exact
        x = x + self.self_attn.forward_flat(ops.rms_norm(x, self.input_layernorm), cos, sin, attn, layer_idx, ops)
        h = ops.rms_norm(x, self.post_attention_layernorm)
        return x + self.mlp.forward_flat(h, ops, exact, attn, layer_idx)

    def forward_rollout(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        attn: FlatAttention, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `Kernels.ROLLOUT` layer on (normed input h, residual stream): returns (MLP output, residual
        after the attention), whose sum is the layer's output. The caller adds them inside the next norm
        kernel (`rms_norm(mlp_out, w, eps, residual=...)`), so no layer spends a kernel on that add."""
        norm2 = self.post_attention_layernorm
        a = self.self_attn.forward_rollout(h, cos, sin, attn, layer_idx)
        h, residual = rms_norm(a, norm2.weight, norm2.eps, residual=residual)
        return self.mlp.forward_rollout(h, attn.exact, attn, layer_idx), residual  # rounded in the next norm


class Decoder(nn.Module):
    """HF's `model.` prefix: embedding, layers (each with its family's feed-forward), final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        build_mlp = family_of(config.model_type).build_mlp
        # _weight skips reset_parameters: its normal_ on a meta tensor imports torch._dynamo (seconds).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, device="meta"))
        self.layers = nn.ModuleList(DecoderLayer(config, i, build_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus LM head; every weight is a view of `self.flat_buffer`.

    Build it with `he.load_model` (weights from HF / a checkpoint / seeded init). Constructing it
    directly gives zero weights, in a fresh buffer or in `buffer` if one with exactly this model's
    parameters is given. Move it by loading again with `dtype=` / `device=`: `.to()` would replace
    the parameters with copies outside the buffer, so it raises unless it is a no-op.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", buffer: FlatParamBuffer | None = None):
        super().__init__()
        self.config = config
        self.family = family_of(config.model_type)
        # Parameters are declared on the meta device (shapes only), then rebound to buffer views.
        self.model = Decoder(config)
        self.lm_head = None if config.tie_word_embeddings or config.value_head else \
            _linear(config.hidden_size, config.vocab_size, False)
        self.score = _linear(config.hidden_size, 1, False) if config.value_head else None
        specs = param_specs([(name, tuple(p.shape)) for name, p in self.named_parameters()], config.head_dim,
                            plan=self.family.plan)
        shapes = [(s.name, s.shape) for s in specs]  # the flat buffer's order (see param_specs)
        if buffer is None:
            buffer = FlatParamBuffer(specs, dtype=dtype, device=device)
        elif [(n, tuple(buffer.view(n).shape)) for n in buffer.names] != shapes:
            # (a TP-sliced buffer matches the config of the local shapes: see tensor_parallel.local_config)
            raise ValueError("CausalLM: the given buffer's parameters (names, shapes, order) do not match "
                             f"this config's; expected {shapes}")
        self.flat_buffer = buffer
        for name in buffer.names:
            owner, attr = name.rsplit(".", 1)
            setattr(self.get_submodule(owner), attr, nn.Parameter(buffer.view(name)))
        self.register_buffer("inv_freq", config.rope.inv_freq(config.head_dim).to(buffer.device), persistent=False)
        self.vocab_shard: VocabSlice | None = None
        """Under tensor-parallel generation, this rank's slice of the vocabulary (set by
        `tensor_parallel.parallelize`): the LM head's rows, and how to gather the logits."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the LM head, or the embedding when tied (for fused losses over the head)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim], computed in fp32 and rounded to `dtype` (as HF)."""
        return rope_cos_sin(self.inv_freq, position_ids, dtype)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H] (positions default to 0..T-1)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        elif position_ids.shape[-1] != T:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} does not match input_ids [B={B}, T={T}]")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids.expand(B, T), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def hidden_states_paged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            attn: FlatAttention) -> torch.Tensor:
        """The rollout's forward over flat tokens: input_ids/positions [N] -> final-normed hidden [N, H].

        `attn` (the runner's attention metadata) owns the paged KV cache and the attention kernels and
        declares the layers' kernels; the model only calls `attn.attend`.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        layers = self.model.layers
        if attn.kernels is not Kernels.ROLLOUT:
            for i, layer in enumerate(layers):
                x = layer(x, cos, sin, attn, i)
            return self.model.norm(x)
        # Each residual add rides in the next norm's kernel.
        first = layers[0].input_layernorm if len(layers) else self.model.norm
        h, residual = rms_norm(x, first.weight, first.eps), x
        for i, layer in enumerate(layers):
            out, residual = layer.forward_rollout(h, residual, cos, sin, attn, i)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = rms_norm(out, norm.weight, norm.eps, residual=residual)
        return h

    def local_logits(self, hidden: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """hidden [..., H] -> this rank's logits [..., V] in the model dtype (as HF): under TP the
        vocabulary slice of `vocab_shard` (the rollout samples from it), else all of it. `exact`: through
        `linear_exact`, the bits the trainer's exact log-prob pass computes for the same hidden row."""
        if self.config.value_head:
            raise RuntimeError("this model is a critic (value_head=True): it has no LM head; use compute_values")
        return linear_exact(hidden, self.lm_head_weight) if exact else F.linear(hidden, self.lm_head_weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] over the whole vocabulary (under TP gathered through `vocab_shard`)."""
        logits = self.local_logits(hidden)
        return logits if self.vocab_shard is None else self.vocab_shard.gather(logits)

    def compute_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> values [...] (critic models)."""
        return F.linear(hidden, self.score.weight).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, position_ids))

    def _apply(self, fn, recurse=True):
        # .to()/.cuda()/.half() rebind parameters to converted copies, silently cutting them loose
        # from flat_buffer (and so from the resharding machinery): allow only no-op conversions.
        if fn(self.flat_buffer.data) is not self.flat_buffer.data:
            raise RuntimeError("CausalLM weights are views of flat_buffer and cannot be moved or cast; "
                               "load the model again with he.load_model(..., dtype=, device=)")
        return self
