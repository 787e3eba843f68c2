"""What `HybridEngine.generate` returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sample of one prompt."""

    index: int
    """Which of the prompt's n samples."""
    token_ids: list[int]
    logprobs: list[float]
    """log_softmax(logits / temperature) at each chosen token (temperature 0: T = 1); see rollout/sampler.py."""
    finish_reason: str
    """'stop' (a stop token was emitted) or 'length' (max_tokens)."""


@dataclass(slots=True)
class RequestOutput:
    """The samples of one prompt, in index order."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
