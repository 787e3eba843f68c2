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
import torch.distributed as dist


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


# --------------------------------------------------------------------------------------------
# The fused sampler: one Triton kernel over column splits of the logits (two passes each, the second
# from L2) and a combine kernel (kernels in hybridengine.kernels.sampling).
#
# The same exponential race as `sample`, with its noise drawn inside the kernel from Philox4x32-10
# keyed per row, instead of torch's generator over a [B, V] noise tensor: a decode step at B = 256 of
# a 152k vocabulary spent ~0.6 ms in `sample`'s eight kernels (fp32 copy, softmax, noise, divide,
# argmax, log_softmax, gather) against two launches here. No truncation (top-k/top-p
# need a sort: the engine takes `sample` for a step where any row truncates). The two samplers draw
# different random streams, so seeded outputs are reproducible within one sampler, not across them.

_PHILOX_A, _PHILOX_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_M32 = 0xFFFFFFFF


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * b for a < 2^32 and b in [0, 2^32) (int64), without overflow:
    a = ah 2^16 + al, so a b = (ah b) 2^16 + al b with both products under 2^48."""
    t, u = (a >> 16) * b, (a & 0xFFFF) * b
    return (t + (u >> 16)) >> 16, (((t & 0xFFFF) << 16) + u) & _M32


def philox_ref(key: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 (Triton's `tl.randint4x`) at counter (c0, c1, 0, 0)
    under the 64-bit key, in int64 arithmetic on 32-bit values. Shapes broadcast."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    c0, c1 = torch.broadcast_tensors(c0 & _M32, c1 & _M32)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul32(_PHILOX_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def race_exp_ref(keys: torch.Tensor, draws: torch.Tensor, n_cols: int) -> torch.Tensor:
    """E ~ Exp(1) per (row, column), the kernel's `race_exp` written plainly [B, n_cols]: column
    4n + j is word j of Philox at counter (n, draw)."""
    cols = torch.arange(n_cols, dtype=torch.int64, device=keys.device)
    words = philox_ref(keys[:, None], (cols // 4)[None, :], draws.to(torch.int64)[:, None])
    x = torch.stack(words, -1).gather(-1, (cols % 4).expand(len(keys), n_cols)[..., None]).squeeze(-1)
    v = (x.float() + 0.5) * 2.0**-32
    return torch.where(v < 2.0**-12, v + 0.5 * v * v, -torch.log(1.0 - v))


def sample_fused_ref(logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor,
                     draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference of `sample_fused`: s = logits * inv_temp (fp32); token = argmax(s - log E)
    (argmax s for a greedy row, key < 0); log-prob = s[token] - logsumexp(s). (The kernel takes the
    argmax of exp(s - max) / E, the same race.)"""
    s = logits.float() * inv_temp.float()[:, None]
    score = torch.where((keys < 0)[:, None], s, s - torch.log(race_exp_ref(keys.clamp(min=0), draws, s.shape[1])))
    tokens = score.argmax(-1)
    return tokens, s.gather(-1, tokens[:, None]).squeeze(1) - torch.logsumexp(s, -1)


def _check_fused_args(logits, inv_temp, keys, draws) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"sample_fused: logits must be a non-empty 2-D [rows, vocab] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32) or logits.stride(1) != 1:
        raise ValueError(f"sample_fused: logits must be bf16/fp16/fp32 with unit stride in the vocab dim, got "
                         f"{logits.dtype}, strides {logits.stride()}")
    if logits.shape[1] >= 2**31:
        raise ValueError(f"sample_fused: vocab {logits.shape[1]} must be < 2^31")
    B = logits.shape[0]
    for name, t, dtypes in (("inv_temp", inv_temp, (torch.float32,)), ("keys", keys, (torch.int64,)),
                            ("draws", draws, (torch.int32, torch.int64))):
        if not isinstance(t, torch.Tensor) or t.shape != (B,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(f"sample_fused: {name} must be a [{B}] {' or '.join(map(str, dtypes))} tensor on "
                             f"{logits.device}, got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                             f"{' ' + str(t.dtype) + ' on ' + str(t.device) if isinstance(t, torch.Tensor) else ''}")
        if not t.is_contiguous():
            raise ValueError(f"sample_fused: {name} must be contiguous")


def fused_splits(rows: int, n_cols: int, block: int, device: torch.device) -> int:
    """Column splits per row: about 4 programs per SM (one program streams its columns at a fraction
    of an SM's bandwidth), at least one block of columns each, at most 64."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(64, -(-4 * sms // rows), -(-n_cols // block)))


def fused_chunks(n_cols: int, splits: int, block: int) -> tuple[int, int]:
    """(columns per split, a whole number of blocks; splits once the empty ones are dropped)."""
    chunk = -(-(-(-n_cols // splits)) // block) * block
    return chunk, -(-n_cols // chunk)


def sample_fused(logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor, draws: torch.Tensor, *,
                 splits: int | None = None, block: int = 1024, col_offset: int = 0, n_valid: int | None = None,
                 group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V] in two launches: (tokens int64 [B], log-probs fp32 [B]).

    inv_temp [B] fp32: 1 / temperature (1 for a greedy row); keys [B] int64: the row's Philox key, < 0
    for a greedy row (argmax, log-prob at T = 1); draws [B]: the row's draw counter (the Philox counter's
    high word: a seeded sequence's step). Log-prob = log_softmax(logits * inv_temp) at the token, the
    module's convention (temperature applied, no truncation). Returns `sample_fused_ref`'s result up to
    the rounding of exp/log (the tokens differ only where two race scores tie within that rounding).
    Runs the Triton kernels (on CPU: under TRITON_INTERPRET=1).

    Vocab-parallel (TP): with `group`, logits are this rank's columns [col_offset, col_offset + V) of
    the vocabulary (col_offset % 4 == 0), of which the first `n_valid` are real (the last rank's shard
    is zero-padded); every rank calls with the same V, rows and keys, so all split alike. Each rank
    reduces its columns, the partials are all-gathered (B x splits x 5 floats per rank, instead of the
    logits) and every rank combines them into the same tokens: those of one rank holding the whole
    vocabulary (the noise is drawn per vocabulary column), up to the order of the sum's adds.
    """
    from hybridengine.kernels.sampling import sample_combine_kernel, sample_partial_kernel

    _check_fused_args(logits, inv_temp, keys, draws)
    B, V = logits.shape
    if not isinstance(col_offset, int) or col_offset < 0 or col_offset % 4:
        raise ValueError(f"sample_fused: col_offset must be a non-negative multiple of 4, got {col_offset!r}")
    if col_offset + V >= 2**24:
        raise ValueError(f"sample_fused: columns up to {col_offset + V} must be < 2^24 (kept exactly in fp32)")
    if n_valid is None:
        n_valid = V
    if not isinstance(n_valid, int) or not 0 <= n_valid <= V:
        raise ValueError(f"sample_fused: n_valid must be an int in [0, {V}], got {n_valid!r}")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"sample_fused: block must be a power of 2 >= 16, got {block!r}")
    if splits is None:
        splits = fused_splits(B, V, block, logits.device)
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"sample_fused: splits must be an int >= 1, got {splits!r}")
    chunk, splits = fused_chunks(V, splits, block)
    part = torch.empty(5, B, splits, dtype=torch.float32, device=logits.device)  # max, sum, best, column, s
    sample_partial_kernel[(B, splits)](logits, logits.stride(0), inv_temp, keys, draws, part, n_valid, chunk, col_offset,
                                       SPLITS=splits, BLOCK=block, num_warps=4)
    if group is not None and dist.get_world_size(group) > 1:
        n = dist.get_world_size(group)
        parts = [torch.empty_like(part) for _ in range(n)]
        dist.all_gather(parts, part, group=group)
        part = torch.cat(parts, dim=2)
        splits *= n
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    sample_combine_kernel[(B,)](part, tokens, logprobs, B, SPLITS=splits, BLOCK_S=max(2, _next_pow2(splits)),
                                num_warps=1)
    return tokens, logprobs


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
