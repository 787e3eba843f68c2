"""What the rollout returns: one RequestOutput per request (prompt), one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class CompletionOutput:
    """One sample of one request: its tokens so far (all of them once finished)."""

    index: int
    """Which of the request's n samples."""
    token_ids: list[int]
    logprobs: list[float]
    """log_softmax(logits / temperature) at each chosen token (temperature 0: T = 1); see rollout/sampler.py."""
    finish_reason: str | None
    """'stop' (a stop token was emitted), 'length' (max_tokens), 'abort' (`HybridEngine.abort`, or a
    rollout left with the request unfinished), or None while the sample is unfinished."""
    policy_versions: list[int] = field(default_factory=list)
    """`HybridEngine.policy_version` of the weights that sampled each token (one per token): a request
    kept across a weight update (`rollout(keep_unfinished=True)`) mixes versions."""
    routed_experts: torch.Tensor | None = None
    """With `EngineConfig.return_routed_experts`, once the sample finished (stop or length): the experts each
    MoE layer routed every token to that the model ran, int16 [len(prompt) + len(token_ids) - 1,
    num_hidden_layers, num_experts_per_tok] on the host (row t: position t of prompt + completion; -1 in
    dense layers); see rollout/routing.py. None otherwise."""


@dataclass(slots=True)
class RequestOutput:
    """The samples of one request, in index order; cumulative (each step's output holds every token so far)."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    request_id: str | None = None
    """The id given to `add_request` (`generate_async`: its generated id); None for `generate`'s outputs."""
    finished: bool = True
    """Every sample has finished (or the request was aborted)."""
