"""Per-request sampling settings, validated on construction (vLLM's names)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request samples; `generate` takes one for every prompt or one for all."""

    n: int = 1
    """Samples per prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """-1 = whole vocabulary."""
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting one of these (it is included in the output)."""
    seed: int | None = None
    """Per-request seed: the samples are then independent of batch composition and scheduling."""

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed must be None or an int, got {self.seed!r}")
        try:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError) as e:
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids, got {self.stop_token_ids!r}") from e


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
