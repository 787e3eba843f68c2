"""Per-request sampling settings, validated on construction (vLLM's names)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from hybridengine.checks import is_int

MAX_SEED = 2**63
"""Seeds lie in [0, MAX_SEED)."""


OUTPUT_KINDS = ("cumulative", "delta", "final_only")
"""`SamplingParams.output_kind` values."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request samples; `generate` takes one for every prompt or one for all."""

    n: int = 1
    """Samples per prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """A finite number >= 0; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """-1 = whole vocabulary."""
    max_tokens: int = 16
    """Most tokens generated per sample, an int >= 1."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting one of these (it is included in the output)."""
    seed: int | None = None
    """Per-request seed in [0, 2**63): the samples are then independent of batch composition and
    scheduling."""
    output_kind: str = "cumulative"
    """What `HybridEngine.step()` reports of a request added with `add_request` (vLLM's RequestOutputKind):
    "cumulative" every sample's tokens so far, "delta" only those resolved since its last report (the
    finish reason with the last), "final_only" one output when it finishes. `generate` and
    `generate_async` return the whole completion whatever it is."""

    def __post_init__(self):
        # No silent coercion: 2.5 tokens, a bool for a count or a NaN temperature are errors, not 3, 1 or
        # a temperature that samples as if it were finite.
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 and finite, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"SamplingParams.output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            stop = None
        if stop is None or not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (ints >= 0), got "
                             f"{self.stop_token_ids!r}")
        self.n, self.top_k, self.max_tokens = int(self.n), int(self.top_k), int(self.max_tokens)
        self.seed = None if self.seed is None else int(self.seed)
        self.stop_token_ids = tuple(int(t) for t in stop)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
