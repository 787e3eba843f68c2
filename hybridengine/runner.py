"""The model runner of rollout: the paged KV cache, batch preparation, one model step, CUDA graphs.

Block bookkeeping stays in plain Python (scheduler.py); tensors appear only here, where a batch
is turned into flat token ids, positions, slot mappings and block tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import attention as attn_ops
from .scheduler import Batch, Sequence


class KVCache:
    """One allocation [layers, 2, num_blocks, block_size, kv_heads, head_dim], per-layer views."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.empty(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: dst block := src block, in every layer, K and V."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.data.device)
            dst = torch.tensor([c[1] for c in copies], device=self.data.device)
            self.data[:, :, dst] = self.data[:, :, src]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer of one step needs; `attend` is what the model calls."""

    kv: KVCache
    is_prefill: bool
    slot_mapping: torch.Tensor
    scale: float
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None) -> torch.Tensor:
        k_cache, v_cache = self.kv.layers[layer]
        attn_ops.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.is_prefill:
            return attn_ops.prefill_attention(q, k, v, self.cu_seqlens, self.cu_seqlens, scale=self.scale,
                                              sliding_window=sliding_window, max_seqlen_q=self.max_seqlen,
                                              max_seqlen_k=self.max_seqlen)
        return attn_ops.paged_decode_attention(q, k_cache, v_cache, self.block_tables, self.context_lens,
                                               scale=self.scale, sliding_window=sliding_window)


class ModelRunner:
    """Runs prefill and decode steps of a CausalLM against a paged KV cache."""

    def __init__(self, model, kv: KVCache, *, max_num_seqs: int, max_model_len: int, use_cuda_graphs: bool):
        self.model, self.kv = model, kv
        self.device = kv.data.device
        self.block_size = kv.block_size
        self.max_blocks = math.ceil(max_model_len / self.block_size)
        self.scale = model.config.head_dim ** -0.5
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}
        self.graph_capture_s = 0.0
        if use_cuda_graphs and self.device.type == "cuda":
            self._capture(max_num_seqs)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device="cpu").to(self.device, non_blocking=True)

    @torch.inference_mode()
    def step(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.seqs), V] (fp32) of the last token of every sequence of the batch."""
        self.kv.copy_blocks(batch.block_copies)
        if batch.is_prefill:
            return self._prefill(batch.seqs)
        return self._decode(batch.seqs)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        ids, positions, slots, cu, last = [], [], [], [0], []
        for seq in seqs:
            n = seq.num_tokens
            ids.extend(seq.token_ids)
            positions.extend(range(n))
            slots.extend(self._slots(seq, 0, n))
            cu.append(cu[-1] + n)
            last.append(cu[-1] - 1)
        meta = AttentionMetadata(self.kv, True, self._tensor(slots), self.scale, cu_seqlens=self._tensor(cu, torch.int32),
                                 max_seqlen=max(s.num_tokens for s in seqs))
        hidden = self.model.hidden_states_paged(self._tensor(ids), self._tensor(positions), meta)
        return self.model.compute_logits(hidden[self._tensor(last)]).float()

    def _decode_inputs(self, seqs: list[Sequence], pad_to: int) -> dict[str, torch.Tensor]:
        B = len(seqs)
        ids = [s.token_ids[-1] for s in seqs] + [0] * (pad_to - B)
        positions = [s.num_tokens - 1 for s in seqs] + [0] * (pad_to - B)
        slots = [self._slots(s, s.num_tokens - 1, s.num_tokens)[0] for s in seqs] + [-1] * (pad_to - B)
        lens = [s.num_tokens for s in seqs] + [0] * (pad_to - B)  # 0: a padding row, output zeros
        tables = torch.full((pad_to, self.max_blocks), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        return dict(ids=self._tensor(ids), positions=self._tensor(positions), slots=self._tensor(slots),
                    lens=self._tensor(lens, torch.int32), tables=tables.to(self.device, non_blocking=True))

    def _decode_forward(self, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata(self.kv, False, inp["slots"], self.scale, context_lens=inp["lens"],
                                 block_tables=inp["tables"])
        return self.model.compute_logits(self.model.hidden_states_paged(inp["ids"], inp["positions"], meta))

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        B = len(seqs)
        size = next((s for s in sorted(self.graphs) if s >= B), None)
        if size is None:
            return self._decode_forward(self._decode_inputs(seqs, B)).float()
        graph, static = self.graphs[size]
        for name, value in self._decode_inputs(seqs, size).items():
            static[name].copy_(value)
        graph.replay()
        return static["logits"][:B].float()

    def _capture(self, max_num_seqs: int) -> None:
        """One CUDA graph per decode batch size bucket (1, 2, 4, 8, then multiples of 16)."""
        with torch.inference_mode():
            self._capture_sizes(max_num_seqs)

    def _capture_sizes(self, max_num_seqs: int) -> None:
        import time

        sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)] if s <= max(max_num_seqs, 1)}
                       | {max_num_seqs})
        t0 = time.perf_counter()
        pool = None
        for size in reversed(sizes):  # largest first: the smaller graphs reuse its memory pool
            fake = Sequence(request=-1, token_ids=[0], num_prompt_tokens=1, params=None, block_table=[0])
            static = self._decode_inputs([fake] * size, size)
            static["slots"].fill_(-1)  # capture writes nothing into the cache
            self._decode_forward(static)  # warm-up: Triton compilation and autotuning outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                static["logits"] = self._decode_forward(static)
            pool = graph.pool()
            self.graphs[size] = (graph, static)
        torch.cuda.synchronize(self.device)
        self.graph_capture_s = time.perf_counter() - t0
