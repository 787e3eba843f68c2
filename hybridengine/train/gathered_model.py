"""The model on the training view, run on weights gathered one unit at a time.

The training view of the parameters never exists as a whole. `GatheredModel` runs the model's module
structure (a `CausalLM` on the meta device) with explicit weights: each unit (the embedding, a layer, the
head) is all-gathered from the ranks' shards (`ShardedBuffer.gather_unit`, the next one prefetched), used
and dropped. Sequences are packed (no padding token is computed): flat token ids with positions restarting
at 0 per sequence, attention per sequence (`PackedAttention`).

The layers run without autograd, keeping each layer's input for activation checkpointing
(`forward_layers`: the backward gathers a layer again and recomputes it with `layer`), or with autograd
over parameters whose storage is let go of after each layer's forward (`forward_layers_with_graphs`,
`ReleasedParams`: the backward only gathers them again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from hybridengine.model.config import ModelConfig
from hybridengine.model.decoder import CausalLM, rope_cos_sin
from hybridengine.model.family import family_of, layer_prefix
from hybridengine.ops.rms_norm import rms_norm_train
from hybridengine.sharding.switch import ShardedBuffer
from hybridengine.train.batch import PPOBatch
from hybridengine.train.packed_attention import PackedAttention
from hybridengine.train.released_params import ReleasedParams


class GatheredModel:
    """The model of a ShardedBuffer's training view. `fused`: the layers' norms, RoPE and SiLU * up as Triton
    kernels (EngineTuning.fused_training); `exact`: the exact attention (EngineConfig.exact_logprobs)."""

    def __init__(self, sharded: ShardedBuffer, config: ModelConfig, *, fused: bool, exact: bool):
        self.sharded, self.config, self.fused, self.exact = sharded, config, fused, exact
        self.layout, self.device = sharded.layout, sharded.device
        self.dtype = sharded.gen.data.dtype
        # Module structure only (meta device): every call passes the gathered weights explicitly.
        self.skeleton = CausalLM(config, dtype=self.dtype, device="meta")
        self.inv_freq = config.rope.inv_freq(config.head_dim).to(self.device)
        self.units = {u.name: i for i, u in enumerate(self.layout.units)}
        self.tied = config.tie_word_embeddings and not config.value_head
        self.family = family_of(config.model_type)  # the parameters' names: the embedding, final norm, head
        self.head_name = self.family.head_name(tied=self.tied, value_head=config.value_head)

    def layer_params(self, i: int, natural: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
        """Layer i's parameters by their names inside the layer: views of `natural` (leaves with grad)."""
        unit = self.layout.units[self.units[f"layers.{i}"]]
        prefix = layer_prefix(i)
        params = {}
        for s in unit.params:
            p = self.layout.natural_view(natural, s.name)
            params[s.name[len(prefix):]] = p.detach().requires_grad_(True) if grad else p
        return params

    def layer(self, i: int, natural: torch.Tensor, x, cos, sin, attn, grad: bool):
        """(layer i's output, its parameters) on the gathered unit `natural`."""
        params = self.layer_params(i, natural, grad)
        return functional_call(self.skeleton.model.layers[i], params, (x, cos, sin, attn, i)), params

    def norm(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The final norm: the fused kernel (as the rollout's last norm) with fused training, else the module."""
        if self.fused:
            return rms_norm_train(x, weight, self.skeleton.model.norm.eps)
        return functional_call(self.skeleton.model.norm, {"weight": weight}, (x,))

    def pack_inputs(self, batch: PPOBatch, rows: list[int], embedding_rows: bool = False):
        """The micro-batch's packed ids, RoPE tables, attention and cu_seqlens; with `embedding_rows`
        also (distinct ids, each token's index among them) for `add_embedding_grad_`, found on the host
        before the copy: on CUDA `torch.unique` would wait for the device (the count of distinct ids),
        stalling the host at every micro-batch while the previous one's backward is still queued."""
        if not rows:  # an empty micro-batch still takes part in every collective: one dummy sequence
            ids, positions, cu = torch.zeros(2, dtype=torch.long), torch.arange(2), [0, 2]
        else:
            ids = torch.cat([batch.input_ids[b] for b in rows])
            positions = torch.cat([torch.arange(len(batch.input_ids[b])) for b in rows])
            cu = [0]
            for b in rows:
                cu.append(cu[-1] + len(batch.input_ids[b]))
        id_index = None
        if embedding_rows:
            id_index = tuple(t.to(self.device) for t in torch.unique(ids, sorted=True, return_inverse=True))
        ids, positions = ids.to(self.device), positions.to(self.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        attn = PackedAttention(cu, fused=self.fused, exact=self.exact, scale=self.config.head_dim ** -0.5)
        return ids, cos, sin, attn, cu, id_index

    def forward_layers(self, ids, cos, sin, attn, keep_inputs: bool):
        """Embedding and every layer without autograd; returns (final residual stream, layer inputs)."""
        embed_u = self.units["embed"]
        natural = self.sharded.gather_unit(embed_u)
        x = F.embedding(ids, self.layout.natural_view(natural, self.family.embed_name))
        inputs = []
        for i in range(self.config.num_hidden_layers):
            u = self.units[f"layers.{i}"]
            self.sharded.prefetch_unit(u + 1)
            natural = self.sharded.gather_unit(u, own_experts=True)
            if keep_inputs:
                inputs.append(x)
            x, _ = self.layer(i, natural, x, cos, sin, attn, grad=False)
        return x, inputs

    def forward_layers_with_graphs(self, ids, cos, sin, attn):
        """Embedding without autograd, then every layer with autograd on its own detached input
        (backward runs layer by layer); the parameters' storage is released after each layer's
        forward (`ReleasedParams`). Returns (final residual stream, [(input, output, slots)] per layer)."""
        embed_u = self.units["embed"]
        with torch.no_grad():
            x = F.embedding(ids, self.layout.natural_view(self.sharded.gather_unit(embed_u), self.family.embed_name))
        graphs = []
        for i in range(self.config.num_hidden_layers):
            u = self.units[f"layers.{i}"]
            self.sharded.prefetch_unit(u + 1)
            natural = self.sharded.gather_unit(u, own_experts=True)
            xi = x.detach().requires_grad_(True)
            slots = ReleasedParams(self.layer_params(i, natural, grad=True), natural, self.layout, layer_prefix(i))
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(slots.pack, slots.unpack):
                out = functional_call(self.skeleton.model.layers[i], slots.params, (xi, cos, sin, attn, i))
            slots.release()
            graphs.append((xi, out, slots))
            x = out.detach()
        return x, graphs

    def head_weights(self):
        """(the final norm's weight, the head's: the LM head, the tied embedding or the value head), gathered."""
        natural = self.sharded.gather_unit(self.units["head"])
        norm_w = self.layout.natural_view(natural, self.family.norm_name)
        if self.tied:
            head_w = self.layout.natural_view(self.sharded.gather_unit(self.units["embed"]), self.head_name)
        else:
            head_w = self.layout.natural_view(natural, self.head_name)
        return norm_w, head_w
