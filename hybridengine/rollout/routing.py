"""The rollout's record of each token's routed experts (`EngineConfig.return_routed_experts`).

Routing is kept per KV-cache slot, beside the token's K and V: an MoE layer's forward writes its top-k expert
ids at the slots of the step's tokens (`AttentionMetadata.record_routing`), so a prefix served from cached
blocks, the samples of one prompt (which share its blocks) and a sequence recomputed after a preemption all
find their tokens' routing where their KV is. A copy-on-write of a block copies its routing too. When a sample
finishes, before its blocks are freed, its slots are read into a tensor of its own (`read`, on the device:
later steps that reuse the blocks run after that read on the stream); the output moves it to the host.

Layout of a sample's `routed_experts`: int16 (int32 past 32,767 experts) [num_tokens - 1, num_hidden_layers, k]
on the host. Row t is the token at position t of prompt + completion (every token the model ran: all but the
last sampled one), slot j of a layer its j-th choice (descending router probability); the rows of dense layers
(`mlp_only_layers`, `decoder_sparse_step`) hold -1. This is the convention of SGLang's and vLLM's routed-expert
capture (tokens x layers x top-k, -1 where a layer has no routed experts).
"""

from __future__ import annotations

import torch

from hybridengine.rollout.sequence import Sequence


class RoutingRecord:
    """Routed expert ids per KV-cache slot: int [capacity * block_size + 1, num_layers, k], -1 where none was
    written; the last row takes the writes of padding rows (slot -1)."""

    def __init__(self, *, num_slots: int, block_size: int, num_layers: int, top_k: int, num_experts: int,
                 device: torch.device):
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.block_size = block_size
        self.table = torch.full((num_slots + 1, num_layers, top_k), -1, dtype=dtype, device=device)
        self._pad_row = num_slots

    def write(self, slot_mapping: torch.Tensor, layer: int, experts: torch.Tensor) -> None:
        """experts int [N, k] of the step's tokens (slot_mapping [N]; -1: a padding row) -> their slots.
        No host sync (CUDA graphs capture it)."""
        rows = torch.where(slot_mapping < 0, self._pad_row, slot_mapping)
        self.table[rows, layer] = experts.to(self.table.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst's slots get block src's routing (as `KVCache.copy_blocks`)."""
        bs = self.block_size
        for src, dst in copies:
            self.table[dst * bs:(dst + 1) * bs] = self.table[src * bs:(src + 1) * bs]

    def read(self, seq: Sequence) -> torch.Tensor:
        """The routing of every token of `seq` the model ran (positions 0 .. num_tokens - 2), as a new device
        tensor [num_tokens - 1, num_layers, k]: call it before the sequence's blocks are freed."""
        bs, table = self.block_size, seq.block_table
        slots = [table[p // bs] * bs + p % bs for p in range(seq.num_tokens - 1)]
        index = torch.tensor(slots, dtype=torch.int64)
        return self.table[index.to(self.table.device, non_blocking=True)]
