"""One prompt or one sample as the scheduler sees it: its tokens, its block table, where it is."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hybridengine.rollout.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PLACEHOLDER = -1
"""A sequence's last token id while the step that sampled it has not reached the host (async decode)."""

_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One prompt or one sample: its tokens, its block table, and where it is."""

    request: int | str
    """The request's key: its id (`HybridEngine.add_request`, `generate_async`) or, for `generate`'s
    requests, the prompt's index in the call."""
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    sample: int = 0
    """Which of the request's n samples; a prompt awaiting its fork has `fork` > 1."""
    fork: int = 1
    """> 1 for a request's prompt sequence until its prefill: then it becomes `fork` samples."""
    generator: torch.Generator | None = None
    """The torch sampler's generator of a seeded sample (its state survives preemption)."""
    draws: int = 0
    """Tokens drawn for this sequence by the fused sampler (the Philox counter of a seeded sample)."""
    seq_id: int = field(default_factory=lambda: next(_ids))
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Leading tokens whose KV the prefill reads from cached blocks instead of computing: a multiple of the
    block size, at most num_tokens - 1 (`BlockManager.allocate` sets it, `free` resets it)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of the leading full blocks of token_ids (`block_manager.block_hash`), filled by the
    block manager as blocks fill; a function of the tokens alone, so they outlive a preemption."""
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    routed_experts: torch.Tensor | None = None
    """EngineConfig.return_routed_experts: the routed experts of every token the model ran, read when the
    sequence finishes (`routing.RoutingRecord.read`; on the device until its output moves it to the host)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        return -(-(self.num_tokens if num_tokens is None else num_tokens) // block_size)
