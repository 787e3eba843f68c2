"""The rollout's samplers (temperature, top-k, top-p, per-request seeds, log-probs) and the choice between them.

Log-prob convention: the log-prob returned for a chosen token is `log_softmax(logits / T)` at that
token, i.e. under the temperature-scaled distribution *before* top-k/top-p truncation: the same
quantity a trainer recomputes with `he.token_logprobs(..., temperature=T)` / `ppo_loss(temperature=T)`.
Greedy decoding (temperature 0) reports `log_softmax(logits)` (T = 1).

`sample` runs once per decode step, so it never waits for the GPU: which branches run (all greedy,
truncation, per-row temperatures, seeded rows) is decided on the host from the `SamplingParams`,
and the per-row parameters reach the device in one pinned, non-blocking copy (none at all when
every row samples at T = 1 without truncation). `sample_ref` is the same computation written
plainly, with every decision taken on the device; `sample` returns exactly what it returns.

`Sampler` is what the rollout loop calls each step: it gives each row to `sample` or to the fused
sampler (`hybridengine.ops.sample_fused`, EngineTuning.sampler) and keys the fused sampler's rows.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from hybridengine.ops.chosen_logprobs import chosen_logprobs
from hybridengine.ops.sample_fused import sample_fused
from hybridengine.rollout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridengine.model.tensor_parallel import VocabShard
    from hybridengine.rollout.sequence import Sequence


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


class Sampler:
    """One step's tokens and log-probs: each row's sampler follows from its own request.

    With the fused sampler on (`mode` 'fused', or 'auto' on CUDA), rows without top-k/top-p take
    `sample_fused` and the others `sample` (a mixed step runs both on their rows), so a seeded
    sample's tokens do not depend on what else is in the batch. Fused keys: a greedy row -1; a seeded
    sample its own key and its draw count (independent of the batch and of preemption); an unseeded
    row a key drawn for this step from the sampler's RNG (seeded with EngineConfig.seed).

    Under TP (`vocab_shard`), logits are this rank's vocabulary slice: the fused sampler runs
    vocab-parallel; a step that needs `sample` gathers the whole vocabulary first.

    `exact` (EngineConfig.exact_logprobs): the reported log-probs are `ops.chosen_logprobs` of the
    whole logits row, the row-wise reduction the trainer's exact log-prob pass runs over the same logits,
    whichever sampler chose the tokens (under TP the logits are gathered for it).
    """

    def __init__(self, seed: int, vocab_shard: VocabShard | None = None, exact: bool = False):
        self.rng = random.Random(seed)
        self.vocab_shard = vocab_shard
        self.exact = exact

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logprobs = self._sample(logits, seqs, mode)
        if not self.exact:
            return tokens, logprobs
        if self.vocab_shard is not None and logits.shape[-1] != self.vocab_shard.vocab_size:
            logits = self.vocab_shard.gather(logits)
        inv = [1.0 / s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs]
        inv_t = inv[0] if len(set(inv)) == 1 else _to_device(inv, torch.float32, logits.device)
        return tokens, chosen_logprobs(logits, tokens, inv_t)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        params = [s.params for s in seqs]
        truncates = [p.top_k > 0 or p.top_p < 1 for p in params]
        fused = mode == "fused" or (mode == "auto" and logits.is_cuda)
        shard = self.vocab_shard
        if shard is not None:  # TP: logits are this rank's vocabulary slice
            if fused and not any(truncates) and shard.rows % 4 == 0:  # every rank's first column a multiple of 4
                return self._fused(logits, seqs, shard)
            logits = shard.gather(logits)
        if not fused or all(truncates):
            return sample(logits, params, [s.generator for s in seqs])
        if not any(truncates):
            return self._fused(logits, seqs)
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        for truncating in (False, True):  # the fused rows, then the truncating ones
            rows = [i for i, t in enumerate(truncates) if t == truncating]
            index = _to_device(rows, torch.int64, logits.device)  # pinned, non-blocking: no wait for the GPU
            part = logits.index_select(0, index)
            tok, lp = (sample(part, [params[i] for i in rows], [seqs[i].generator for i in rows]) if truncating
                       else self._fused(part, [seqs[i] for i in rows]))
            tokens.index_copy_(0, index, tok)
            logprobs.index_copy_(0, index, lp.float())
        return tokens, logprobs

    def _fused(self, logits: torch.Tensor, seqs: list[Sequence], shard: VocabShard | None = None):
        step_key = self.rng.getrandbits(62)
        keys, draws, inv_temp = [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.temperature == 0:
                keys.append(-1)
                draws.append(0)
                inv_temp.append(1.0)
                continue
            keys.append(_race_key(p.seed, seq.sample) if p.seed is not None
                        else (step_key + i * 0x9E3779B97F4A7C15) & (2**62 - 1))
            draws.append(seq.draws)
            inv_temp.append(1.0 / p.temperature)
            seq.draws += 1
        ints = _to_device([keys, draws], torch.int64, logits.device)
        vocab = {} if shard is None else dict(col_offset=shard.first, n_valid=shard.valid, group=shard.group)
        return sample_fused(logits, _to_device(inv_temp, torch.float32, logits.device), ints[0], ints[1], **vocab)


def _race_key(seed: int, sample: int) -> int:
    """A seeded sample's 62-bit Philox key (a splitmix64 finaliser of (seed, sample index))."""
    x = (seed * 0x9E3779B97F4A7C15 + sample * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 2
