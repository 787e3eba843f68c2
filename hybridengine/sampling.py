"""Sampling parameters and the sampler (temperature, top-k, top-p, per-request seeds, log-probs).

Log-prob convention: the log-prob returned for a chosen token is `log_softmax(logits / T)` at that
token, i.e. under the temperature-scaled distribution *before* top-k/top-p truncation: the same
quantity a trainer recomputes with `he.token_logprobs(..., temperature=T)` / `ppo_loss(temperature=T)`.
Greedy decoding (temperature 0) reports `log_softmax(logits)` (T = 1).

`sample` runs once per decode step, so it never waits for the GPU: which branches run (all greedy,
truncation, per-row temperatures, seeded rows) is decided on the host from the `SamplingParams`,
and the per-row parameters reach the device in one pinned, non-blocking copy (none at all when
every row samples at T = 1 without truncation). `sample_ref` is the same computation written
plainly, with every decision taken on the device; `sample` returns exactly what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names)."""

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
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude; per-row k (-1 = all) and p."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device)
    k = torch.where(top_k < 1, V, top_k).clamp(max=V)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # keep the smallest prefix whose mass reaches p (the first token is always kept)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _to_device(rows: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a stream sync (a pageable copy would wait for the
    GPU to finish the step): pinned staging, non-blocking copy. The caching host allocator keeps the
    pinned block until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(rows, dtype=dtype, device=device)
    return torch.tensor(rows, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise [B, V]: rows with a generator draw from it, the others share one default draw."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.empty_like(probs).exponential_()
    noise = torch.empty_like(probs)
    if len(seeded) < len(generators):
        shared = [i for i, g in enumerate(generators) if g is None]
        index = _to_device(shared, torch.int64, probs.device)
        noise[index] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_()
    for i in seeded:  # in place: the same numbers as a fresh [V] draw, without the copy
        noise[i].exponential_(generator=generators[i])
    return noise


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row of logits [B, V]; returns (token ids [B], log-probs [B]).

    Rows with a generator draw their noise from it (seeded requests); the others share one draw.
    Sampling is by the exponential race (argmax p / E, E ~ Exp(1)), exact for any distribution.
    No device-to-host synchronisation: every branch is chosen from `params` on the host.
    """
    logits = logits.float()  # no copy when already fp32
    temps = [p.temperature for p in params]
    if not any(temps):  # all greedy
        tokens = logits.argmax(-1)
        return tokens, _chosen_logprobs(logits, tokens)
    any_greedy = not all(temps)
    truncate = any(p.top_k > 0 or p.top_p < 1 for p in params)
    rows = None
    if any_greedy or truncate or any(t != 1.0 for t in temps):
        # One copy for every per-row parameter: divisor (1 for greedy rows), greedy flag, top-k, top-p.
        rows = _to_device([[t if t > 0 else 1.0 for t in temps], [float(t == 0) for t in temps],
                           [float(p.top_k) for p in params], [p.top_p for p in params]], torch.float64, logits.device)
        scaled = logits / rows[0].float()[:, None]
    else:
        scaled = logits  # T = 1 everywhere: logits / 1 is logits, bit for bit
    probs = (_truncate(scaled, rows[2].long(), rows[3].float()) if truncate else scaled).softmax(-1)
    noise = _noise(probs, generators)
    tokens = torch.div(probs, noise, out=noise).argmax(-1)
    if any_greedy:
        tokens = torch.where(rows[1] != 0, scaled.argmax(-1), tokens)
    return tokens, _chosen_logprobs(scaled, tokens)


def _chosen_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # The full log_softmax, then a gather: one fused kernel (two reads and one write of [B, V]); an
    # eager `scaled[token] - logsumexp(scaled)` is four kernels (amax, sub, exp, sum) that move more
    # bytes, and a different rounding.
    return scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(1)


def sample_ref(logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference of `sample` (one tensor per parameter, every branch decided on the device).

    `sample` returns exactly what this returns, for the same generator states.
    """
    logits = logits.float()
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    logprobs_all = scaled.log_softmax(-1)
    tokens = scaled.argmax(-1)
    if not bool(greedy.all()):
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device)
        needs_trunc = bool(((top_k > 0) | (top_p < 1)).any())
        probs = (_truncate(scaled, top_k, top_p) if needs_trunc else scaled).softmax(-1)
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
        drawn = (probs / noise).argmax(-1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(1)
