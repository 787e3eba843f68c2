"""A compact Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) whose weights are views of one flat buffer.

gpt-fast / nano-vllm style: one file, plain torch, single device. Module and parameter names are
exactly the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, ...) so safetensors load
by name and `layout.param_specs` assigns TP roles. Every parameter is an `nn.Parameter` aliasing
a view of `CausalLM.flat_buffer`; sharding and resharding act on that buffer from outside, so
this file never imports `torch.distributed`.

The forward is split for later work: `hidden_states()` (positions may be given, for packed
sequences), `compute_logits()` (a fused loss takes the hidden states instead), and the module-level
`attention()` that a paged-attention decode path can replace.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from hybridengine.model.config import ModelConfig
from hybridengine.ops import fused
from hybridengine.sharding.buffer import FlatParamBuffer
from hybridengine.sharding.layout import param_specs


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


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
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, self.sliding_window)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, layer_idx: int) -> torch.Tensor:
        """Flat tokens x [N, hidden]; cos/sin [N, D]; `attn.attend` stores K/V in the paged cache and attends.

        With `attn.fused` (rollout) the q/k norms run as the kernels of hybridengine.ops.fused, q, k and v come
        from one GEMM, and RoPE rides in the KV store's kernel (`attend(..., rope=(cos, sin))`). With
        `attn.fused_train` (training, autograd) the norms and RoPE are the autograd ops of hybridengine.ops.fused."""
        N = x.shape[0]
        if getattr(attn, "fused", False):
            q, k, v = self._qkv_one_gemm(x)
            if self.q_norm is not None:
                q = fused.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
                k = fused.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
            out = attn.attend(layer_idx, q, k, v, self.sliding_window, rope=(cos, sin))
            return self.o_proj(out.reshape(N, self.num_heads * self.head_dim))
        if getattr(attn, "fused_train", False):
            q, k, v = self._qkv(x)
            if self.q_norm is not None:
                q = fused.rms_norm_train(q, self.q_norm.weight, self.q_norm.eps)
                k = fused.rms_norm_train(k, self.k_norm.weight, self.k_norm.eps)
            q, k = fused.rope_train(q, k, cos, sin)
        else:
            q, k, v = self._qkv(x)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        out = attn.attend(layer_idx, q, k, v, self.sliding_window)
        return self.o_proj(out.reshape(N, self.num_heads * self.head_dim))

    def _qkv(self, x: torch.Tensor):
        """q [N, Hq, D], k, v [N, Hkv, D] from the three projections."""
        N, D = x.shape[0], self.head_dim
        return (self.q_proj(x).view(N, self.num_heads, D), self.k_proj(x).view(N, self.num_kv_heads, D),
                self.v_proj(x).view(N, self.num_kv_heads, D))

    def _qkv_one_gemm(self, x: torch.Tensor):
        """`_qkv` as one GEMM over the adjacent q/k/v weights (and biases): strided views of one output;
        three GEMMs where they are not adjacent."""
        p = (self.q_proj, self.k_proj, self.v_proj)
        weight = fused.stacked_rows(*(m.weight for m in p))
        bias = None if p[0].bias is None else fused.stacked_rows(*(m.bias for m in p))
        if weight is None or (p[0].bias is not None and bias is None):
            return self._qkv(x)
        N, D = x.shape[0], self.head_dim
        qkv = F.linear(x, weight, bias)
        nq, nk = self.num_heads * D, self.num_kv_heads * D
        return (qkv[:, :nq].view(N, self.num_heads, D), qkv[:, nq:nq + nk].view(N, self.num_kv_heads, D),
                qkv[:, nq + nk:].view(N, self.num_kv_heads, D))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size, c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn=None, layer_idx: int = 0) -> torch.Tensor:
        """Dense [B, T, H] without `attn`; flat tokens [N, H] through `attn` (paged cache or packed
        sequences) with it (training calls this through torch.func.functional_call)."""
        if attn is not None:
            return self.forward_paged(x, cos, sin, attn, layer_idx)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, layer_idx: int) -> torch.Tensor:
        """Flat tokens through `attn`; with `attn.fused_train` the norms and SiLU * up run as the autograd
        kernels of hybridengine.ops.fused (the rollout chains `forward_fused` from CausalLM.hidden_states_paged)."""
        if getattr(attn, "fused_train", False):
            norm1, norm2, mlp = self.input_layernorm, self.post_attention_layernorm, self.mlp
            x = x + self.self_attn.forward_paged(fused.rms_norm_train(x, norm1.weight, norm1.eps), cos, sin, attn,
                                                 layer_idx)
            h = fused.rms_norm_train(x, norm2.weight, norm2.eps)
            return x + mlp.down_proj(fused.silu_mul_train(mlp.gate_proj(h), mlp.up_proj(h)))
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), cos, sin, attn, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn,
                      layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout layer on (normed input h, residual stream): returns (MLP output, residual after the
        attention), whose sum is the layer's output. The caller adds them inside the next norm kernel
        (`fused.rms_norm(mlp_out, w, eps, residual=...)`), so no layer spends a kernel on that add."""
        norm2, mlp = self.post_attention_layernorm, self.mlp
        a = self.self_attn.forward_paged(h, cos, sin, attn, layer_idx)
        h, residual = fused.rms_norm(a, norm2.weight, norm2.eps, residual=residual)
        gate_up = None if mlp.gate_proj.bias is not None else fused.stacked_rows(mlp.gate_proj.weight,
                                                                                 mlp.up_proj.weight)
        if gate_up is not None:  # one GEMM for both projections (adjacent in the flat buffer)
            gu = F.linear(h, gate_up)
            inter = mlp.gate_proj.weight.shape[0]
            act = fused.silu_mul(gu[..., :inter], gu[..., inter:])
        else:
            act = fused.silu_mul(mlp.gate_proj(h), mlp.up_proj(h))
        return mlp.down_proj(act), residual


class Decoder(nn.Module):
    """HF's `model.` prefix: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
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
        # Parameters are declared on the meta device (shapes only), then rebound to buffer views.
        self.model = Decoder(config)
        self.lm_head = None if config.tie_word_embeddings or config.value_head else \
            _linear(config.hidden_size, config.vocab_size, False)
        self.score = _linear(config.hidden_size, 1, False) if config.value_head else None
        specs = param_specs([(name, tuple(p.shape)) for name, p in self.named_parameters()], config.head_dim)
        shapes = [(s.name, s.shape) for s in specs]  # the flat buffer's order (see param_specs)
        if buffer is None:
            buffer = FlatParamBuffer(specs, dtype=dtype, device=device)
        elif [(n, tuple(buffer.view(n).shape)) for n in buffer.names] != shapes:
            # (a TP-sliced buffer matches the config of the local shapes: see tp.local_config)
            raise ValueError("CausalLM: the given buffer's parameters (names, shapes, order) do not match "
                             f"this config's; expected {shapes}")
        self.flat_buffer = buffer
        for name in buffer.names:
            owner, attr = name.rsplit(".", 1)
            setattr(self.get_submodule(owner), attr, nn.Parameter(buffer.view(name)))
        self.register_buffer("inv_freq", config.rope.inv_freq(config.head_dim).to(buffer.device), persistent=False)

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

    def hidden_states_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """Generation forward over flat tokens: input_ids/positions [N] -> final-normed hidden [N, H].

        `attn` (the engine's attention metadata) owns the paged KV cache and the attention kernels;
        the model only calls `attn.attend(layer_idx, q, k, v, sliding_window)`.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if getattr(attn, "fused", False):  # rollout: each residual add rides in the next norm's kernel
            layers = self.model.layers
            first = layers[0].input_layernorm if len(layers) else self.model.norm
            h, residual = fused.rms_norm(x, first.weight, first.eps), x
            for i, layer in enumerate(layers):
                out, residual = layer.forward_fused(h, residual, cos, sin, attn, i)
                norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                h, residual = fused.rms_norm(out, norm.weight, norm.eps, residual=residual)
            return h
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_paged(x, cos, sin, attn, i)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] in the model dtype (as HF)."""
        if self.config.value_head:
            raise RuntimeError("this model is a critic (value_head=True): it has no LM head; use compute_values")
        return F.linear(hidden, self.lm_head_weight)

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
