"""The fused sampler: tokens and log-probs of one exponential race over the logits, in two launches.

`sample_fused` runs one Triton kernel over column splits of the logits (two passes each, the second
from L2) and a combine kernel (kernels in hybridengine.kernels.sampling). It is the exponential race
of `rollout.sampler.sample`, with its noise drawn inside the kernel from Philox4x32-10 keyed per row
instead of torch's generator over a [B, V] noise tensor: two launches instead of `sample`'s eight
kernels (fp32 copy, softmax, noise, divide, argmax, log_softmax, gather). No truncation (top-k/top-p
need a sort: the rollout samples a truncating row with `sample`). The two samplers draw different
random streams, so seeded outputs are reproducible within one sampler, not across them.

Layers: the plain references (`philox_ref`, `race_exp_ref`, `sample_fused_ref`), the split plan
(`fused_splits`, `fused_chunks`), and the checked launcher `sample_fused` (vocab-parallel under TP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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
                             f"{logits.device}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
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
    rollout's convention (temperature applied, no truncation). Returns `sample_fused_ref`'s result up to
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
    sample_partial_kernel[(B, splits)](logits, logits.stride(0), inv_temp, keys, draws, part, n_valid, chunk,
                                       col_offset, SPLITS=splits, BLOCK=block, num_warps=4)
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
