"""Exact attention: causal attention whose output for a sequence's query position and head has the same bits in
the training forward (packed varlen sequences, autograd), the rollout prefill and the rollout decode (one query
per sequence over the paged KV cache), whatever else is in the batch, however the sequences are packed, and
however long the sequence runs past that position (the engine's exact mode: rollout log-probs equal the
trainer's).

Ops: `exact_attention` (varlen causal self-attention, differentiable, deterministic backward) and
`exact_decode_attention` (the paged decode step, CUDA-graph capturable). Each computes a row with one fixed
tiled algorithm, the same in both ops: keys in tiles at fixed positions from the sequence's start, visited in
increasing order, online softmax in fp32, P rounded once to the input dtype before P.V, one rounding of the
output (`hybridengine/kernels/exact_attention.py` says why a row's bits then depend on nothing else).

Layers per op: a naive reference (`*_ref`: masked softmax per sequence, for tolerance tests and the CPU
backward), the torch path (`*_torch`: the tiled algorithm in torch, the exact mode off CUDA), the Triton
launcher (`*_triton`) and the op, which checks its arguments and runs the launcher where `_launch.use_kernel`
says so (CUDA), the torch path elsewhere. Each path is exact on its own; the two are not bitwise equal to each
other, so a rollout and a trainer that must agree run on one kind of device.

The torch path uses no BLAS and no transcendental library call, since their results may depend on an
element's position in the tensor (matrix kernels' edge tiles, a vector loop's scalar tail, the thread split):
products are elementwise, sums are fixed pairwise trees over power-of-two lengths (`_tree_sum`), 2^x is a
polynomial in IEEE +, * and a bit-built power of two (`_exp2`). Every element then takes the same operations
wherever it sits, on any CPU and thread count.

The values of cu_seqlens, context_lens and block_tables are checked by the torch path and the references only
(reading them on the GPU would synchronise with it).
"""

from __future__ import annotations

import math

import torch

from hybridengine.checks import FLOAT_DTYPES, number, tensor
from hybridengine.ops import _launch
from hybridengine.ops.paged_attention import check_decode_args, paged_decode_attention_ref

TORCH_BLOCK_M = 16
"""Query rows per chunk of the torch path (the decode's GQA heads padded to it, like the kernels)."""
TORCH_BLOCK_N = 16
"""Keys per tile of the torch path: the tile positions, part of its arithmetic (a power of two: the tree sum)."""
TORCH_MAX_ELEMENTS = 1 << 24
"""Elements of one product tensor of the torch path (64 MiB of fp32); larger problems run in slices of rows."""


# --------------------------------------------------------------------------------------------------
# launch configurations


def forward_tile(device: torch.device) -> dict:
    """BLOCK_M, BLOCK_N and num_warps of both forward kernels: they fix the MMA instruction, the layouts and the
    tile positions, so the varlen and the decode kernels must share them. CUDA: 64 x 64 tiles in one warpgroup
    (Hopper's wgmma takes M >= 64 per warpgroup); under the interpreter 16 x 16 tiles, so that the tests'
    short sequences span several tiles."""
    if device.type == "cuda":
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4)
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)


def _forward_config(q: torch.Tensor) -> dict:
    """A forward kernel's launch: `forward_tile` and its pipeline stages (which move loads, not arithmetic):
    3 for 16-bit inputs of head_dim <= 128 (the varlen kernel's best of 2, 3 and 4 on the H200 at Qwen2-7B
    shapes; the decode's are alike); 2 for fp32 or wider heads, whose K/V tiles in more stages pass the H200's
    227 KiB of shared memory (head_dim 256 needs 288 KiB in 3, fp32 head_dim 128 240 KiB in 4)."""
    if q.device.type != "cuda":
        return forward_tile(q.device) | dict(num_stages=1)
    wide = q.dtype == torch.float32 or q.shape[-1] > 128
    return forward_tile(q.device) | dict(num_stages=2 if wide else 3)


def _backward_config(q: torch.Tensor) -> dict:
    """The backward kernels' launch (no exactness contract: any tiles): 64 x 64 tiles, 4 warps, 2 stages on CUDA
    (the best of a small sweep on the H200 at Qwen2-7B shapes: 8 warps, 32-row or 32-key tiles and 3 stages were
    slower), 32 x 32 for heads over 128 (the dK and dV accumulators live in registers); 16 x 16 under the
    interpreter."""
    if q.device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if q.shape[-1] > 128:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def _dot_flags(q: torch.Tensor) -> dict:
    """The kernels' dot constexprs: DOT_16BIT (bf16/fp16: `tl.dot` on the 16-bit tiles; fp32: "ieee" fp32 dots)
    and ROWWISE_DOT (the interpreter, whose `tl.dot` is a BLAS call that sums a row in an order that depends on
    the row's index: elementwise products and sums instead; see the kernel's `_dot_in`)."""
    return dict(DOT_16BIT=q.dtype != torch.float32, ROWWISE_DOT=q.device.type != "cuda")


def _window(sliding_window: int | None) -> int:
    return _launch.NO_WINDOW if sliding_window is None else sliding_window


# --------------------------------------------------------------------------------------------------
# checks


def _check_varlen(q, k, v, cu_seqlens, scale, max_seqlen, sliding_window, cu_seqlens_k=None,
                  max_seqlen_k=None) -> None:
    op = "exact_attention"
    tensor(op, "q", q, dim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    total, num_q_heads, head_dim = q.shape
    tensor(op, "k", k, dim=3, dtypes=(q.dtype,), device=q.device, contiguous_last=True)
    if cu_seqlens_k is None and (k.shape[0] != total or k.shape[2] != head_dim):
        raise ValueError(f"{op}: k must be [total = {total}, num_kv_heads, head_dim = {head_dim}] like q, "
                         f"got shape {tuple(k.shape)}")
    if cu_seqlens_k is not None and k.shape[2] != head_dim:
        raise ValueError(f"{op}: k must be [total_k, num_kv_heads, head_dim = {head_dim}] (cu_seqlens_k given), "
                         f"got shape {tuple(k.shape)}")
    tensor(op, "v", v, shape=k.shape, dtypes=(q.dtype,), device=q.device, contiguous_last=True)
    tensor(op, "cu_seqlens", cu_seqlens, dim=1, dtypes=(torch.int32,), device=q.device)
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{op}: cu_seqlens must have B + 1 >= 1 entries, got an empty tensor")
    number(op, "max_seqlen", max_seqlen, low=0, integer=True)
    if cu_seqlens_k is not None:
        tensor(op, "cu_seqlens_k", cu_seqlens_k, shape=cu_seqlens.shape, dtypes=(torch.int32,), device=q.device)
    if max_seqlen_k is not None:
        number(op, "max_seqlen_k", max_seqlen_k, low=0, integer=True)
    _launch.check_attention(op, scale, sliding_window, num_q_heads, k.shape[1])


def _check_cu_values(cu: list[int], total: int, max_seqlen: int | None) -> list[int]:
    """The sequence lengths of host cu_seqlens values: from 0 to total, non-decreasing, within max_seqlen."""
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to total = {total}, got {cu}")
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if max_seqlen is not None and max(lens, default=0) > max_seqlen:
        raise ValueError(f"cu_seqlens has a sequence of {max(lens)} tokens, over max_seqlen = {max_seqlen}")
    return lens


def _check_key_values(cu_k: list[int], total_k: int, lens: list[int], max_seqlen_k: int | None) -> list[int]:
    """The key lengths of host cu_seqlens_k values: from 0 to total_k, each at least its sequence's queries,
    within max_seqlen_k."""
    if cu_k[0] != 0 or cu_k[-1] != total_k:
        raise ValueError(f"cu_seqlens_k must run from 0 to total_k = {total_k}, got {cu_k}")
    lens_k = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
    short = next((b for b, (n, n_k) in enumerate(zip(lens, lens_k)) if n_k < n), None)
    if short is not None:
        raise ValueError(f"cu_seqlens_k: sequence {short} has {lens_k[short]} keys for {lens[short]} queries; "
                         f"the queries are its last tokens, so it needs at least as many keys")
    if max_seqlen_k is not None and max(lens_k, default=0) > max_seqlen_k:
        raise ValueError(f"cu_seqlens_k has a sequence of {max(lens_k)} keys, over max_seqlen_k = {max_seqlen_k}")
    return lens_k


# --------------------------------------------------------------------------------------------------
# naive references


def exact_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                        scale: float, sliding_window: int | None = None, max_seqlen: int | None = None,
                        cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None,
                        compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Naive reference of `exact_attention`: one masked softmax attention per sequence in `compute_dtype`
    (default fp32; fp64 for fp64 inputs), differentiable. Checks the cu_seqlens values."""
    dtype = _launch.reference_dtype(q.dtype, compute_dtype)
    group = q.shape[1] // k.shape[1]
    cu = cu_seqlens.tolist()
    lens = _check_cu_values(cu, q.shape[0], max_seqlen)
    cu_k = cu if cu_seqlens_k is None else cu_seqlens_k.tolist()
    lens_k = lens if cu_seqlens_k is None else _check_key_values(cu_k, k.shape[0], lens, max_seqlen_k)
    window = _window(sliding_window)
    outs = [q.new_zeros((0, *q.shape[1:]), dtype=dtype)]
    for b, (n, n_k) in enumerate(zip(lens, lens_k)):
        keys = k[cu_k[b]:cu_k[b + 1]].to(dtype).repeat_interleave(group, dim=1)
        values = v[cu_k[b]:cu_k[b + 1]].to(dtype).repeat_interleave(group, dim=1)
        i = torch.arange(n, device=q.device)[:, None] + (n_k - n)  # the queries' key positions
        j = torch.arange(n_k, device=q.device)[None, :]
        visible = (j <= i) & (j > i - window)
        scores = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].to(dtype), keys) * scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outs).to(q.dtype)


def exact_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                               sliding_window: int | None = None,
                               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Naive reference of `exact_decode_attention`: the paged decode's reference (gather each sequence's K/V,
    softmax attention in `compute_dtype`); checks the index values."""
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                      sliding_window=sliding_window, compute_dtype=compute_dtype)


# --------------------------------------------------------------------------------------------------
# torch path

_EXP2_TAYLOR = [math.log(2.0) ** i / math.factorial(i) for i in range(8)]
"""2^f = sum (f ln 2)^i / i!: degree 7 on |f| <= 1/2 leaves 5e-9 relative, below fp32's rounding."""


def _exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x in fp32 for x <= 0 or -inf (the online softmax's arguments), from IEEE round, -, *, + and a power of two
    built from its bits: the same bits for an element wherever it sits (a library exp2 may take another code
    path in a vector loop's scalar tail). x = n + f with n = round(x) and f = x - n (exact, |f| <= 1/2);
    2^f by Horner. Results below 2^-126 flush to zero (as the GPU's ex2.approx.ftz); exp2(0) = 1 exactly."""
    x = x.clamp(min=-127.0)
    n = torch.round(x)
    f = x - n
    poly = torch.full_like(f, _EXP2_TAYLOR[-1])
    for c in reversed(_EXP2_TAYLOR[:-1]):
        poly = poly * f + c
    two_n = ((n.to(torch.int32) + 127).clamp(min=0) << 23).view(torch.float32)  # 2^n, n = -127 -> 0
    return poly * two_n


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) as a fixed pairwise tree of elementwise adds."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _tiled_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, *, scale: float,
                window: int, dtype: torch.dtype, block_n: int) -> torch.Tensor:
    """The tiled online softmax of the torch path for query rows q [P, M, R, BD] at positions pos [P, M, R] over
    keys k, v [P, T * block_n, BD] (key j at position j), all fp32 (BD a power of two, zero-padded). Returns the
    normalised output [P, M, R, BD] in fp32, -0 mapped to +0 (see hybridengine/kernels/exact_attention.py). Rows are
    independent: the caller may pass any rows in any order and slice P freely."""
    num_p, num_m, num_r, block_d = q.shape
    scale_log2 = scale * math.log2(math.e)
    m = torch.full((num_p, num_m, num_r), float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    pos = pos[..., None]
    for t0 in range(0, k.shape[1], block_n):
        t = torch.arange(t0, t0 + block_n, device=q.device)
        k_tile = k[:, None, None, t0:t0 + block_n]                       # [P, 1, 1, BN, BD]
        v_tile = v[:, None, None, t0:t0 + block_n].transpose(-1, -2)     # [P, 1, 1, BD, BN]
        s = _tree_sum(q[..., None, :] * k_tile)                          # [P, M, R, BN]
        s = torch.where((t <= pos) & (t > pos - window), s * scale_log2, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp2(m - m_safe)
        p = _exp2(s - m_safe[..., None])
        l = l * alpha + _tree_sum(p)
        p = p.to(dtype).float()
        acc = acc * alpha[..., None] + _tree_sum(p[..., None, :] * v_tile)
        m = m_new
    out = acc / torch.where(l == 0.0, 1.0, l)[..., None]
    return torch.where(out == 0.0, 0.0, out)


def _rows_in_slices(q, k, v, pos, **kw) -> torch.Tensor:
    """`_tiled_rows` over slices of P, each product tensor within TORCH_MAX_ELEMENTS."""
    per_p = q[0].numel() * kw["block_n"]
    step = max(1, TORCH_MAX_ELEMENTS // max(per_p, 1))
    return torch.cat([_tiled_rows(q[i:i + step], k[i:i + step], v[i:i + step], pos[i:i + step], **kw)
                      for i in range(0, q.shape[0], step)])


def _padded(x: torch.Tensor, rows: int, block_d: int) -> torch.Tensor:
    """x [n, ...heads, D] as fp32 [rows, ...heads, block_d], zero-padded."""
    out = x.new_zeros((rows, *x.shape[1:-1], block_d), dtype=torch.float32)
    out[:x.shape[0], ..., :x.shape[-1]] = x
    return out


def exact_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                          scale: float, sliding_window: int | None = None, max_seqlen: int | None = None,
                          cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """`exact_attention`'s forward in torch ops (the tiled algorithm; no autograd of its own). Each sequence's
    queries in chunks of TORCH_BLOCK_M rows at their key positions, its keys in tiles of TORCH_BLOCK_N from its
    start; every tile of the longest sequence is visited (a tile a row does not see leaves it unchanged)."""
    total, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    cu = cu_seqlens.tolist()
    lens = _check_cu_values(cu, total, max_seqlen)
    cu_k = cu if cu_seqlens_k is None else cu_seqlens_k.tolist()
    lens_k = lens if cu_seqlens_k is None else _check_key_values(cu_k, k.shape[0], lens, max_seqlen_k)
    out = torch.empty_like(q)
    longest = max(lens, default=0)
    if longest == 0:
        return out
    batch, block_d = len(lens), 1 << (head_dim - 1).bit_length()
    num_chunks = -(-longest // TORCH_BLOCK_M)
    num_keys = -(-max(lens_k) // TORCH_BLOCK_N) * TORCH_BLOCK_N
    qs = torch.stack([_padded(q[cu[b]:cu[b + 1]], num_chunks * TORCH_BLOCK_M, block_d) for b in range(batch)])
    ks = torch.stack([_padded(k[cu_k[b]:cu_k[b + 1]], num_keys, block_d) for b in range(batch)])
    vs = torch.stack([_padded(v[cu_k[b]:cu_k[b + 1]], num_keys, block_d) for b in range(batch)])
    # rows [B * Hkv, group * chunks, BLOCK_M]: (sequence, kv head) x (query head of the group, chunk) x position
    rows = qs.view(batch, num_chunks * TORCH_BLOCK_M, num_kv_heads, group, block_d).permute(0, 2, 3, 1, 4)
    rows = rows.reshape(batch * num_kv_heads, group * num_chunks, TORCH_BLOCK_M, block_d)
    pos = torch.arange(num_chunks * TORCH_BLOCK_M, device=q.device).view(1, num_chunks, TORCH_BLOCK_M)
    pos = pos.repeat(group, 1, 1).view(1, 1, group * num_chunks, TORCH_BLOCK_M)
    first = torch.tensor([n_k - n for n, n_k in zip(lens, lens_k)], device=q.device).view(batch, 1, 1, 1)
    pos = (pos + first).expand(batch, num_kv_heads, -1, -1).reshape(rows.shape[:3])
    ks = ks.permute(0, 2, 1, 3).reshape(batch * num_kv_heads, num_keys, block_d)
    vs = vs.permute(0, 2, 1, 3).reshape(batch * num_kv_heads, num_keys, block_d)
    res = _rows_in_slices(rows, ks, vs, pos, scale=scale, window=_window(sliding_window), dtype=q.dtype,
                          block_n=TORCH_BLOCK_N)
    res = res.view(batch, num_kv_heads, group, num_chunks * TORCH_BLOCK_M, block_d).permute(0, 3, 1, 2, 4)
    res = res.reshape(batch, num_chunks * TORCH_BLOCK_M, num_q_heads, block_d)
    for b, n in enumerate(lens):
        out[cu[b]:cu[b + 1]] = res[b, :n, :, :head_dim]
    return out


def exact_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                                 sliding_window: int | None = None) -> torch.Tensor:
    """`exact_decode_attention` in torch ops (the tiled algorithm): each sequence's GQA group of query heads as
    rows (padded to TORCH_BLOCK_M) at position context_lens[b] - 1, its keys gathered from the pages in tiles of
    TORCH_BLOCK_N from its start. Checks the index values (as the reference)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    lens = context_lens.tolist()
    capacity = block_tables.shape[1] * block_size
    for b, n in enumerate(lens):
        if n < 0 or n > capacity:
            raise ValueError(f"context_lens[{b}] = {n} is outside [0, {capacity}] (block_tables width x block_size)")
        used = block_tables[b, :-(-n // block_size)]
        if n and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[0]):
            raise ValueError(f"block_tables[{b}] has block ids {used.tolist()} outside [0, {k_cache.shape[0]}) "
                             f"among the used blocks")
    longest = max(lens, default=0)
    if longest == 0:
        return torch.zeros_like(q)
    block_d = 1 << (head_dim - 1).bit_length()
    num_keys = -(-longest // TORCH_BLOCK_N) * TORCH_BLOCK_N
    j = torch.arange(num_keys, device=q.device)
    valid = j[None, :] < context_lens[:, None].long()                                   # [B, keys]
    col = torch.clamp(j // block_size, max=block_tables.shape[1] - 1)
    page = torch.where(valid, block_tables[:, col].long(), 0)
    slot = (j % block_size)[None, :].expand_as(page)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B * Hkv, keys, BD]; NaN-poisoned free slots never read
        x = torch.where(valid[..., None, None], cache[page, slot].float(), 0.0)
        x = torch.nn.functional.pad(x, (0, block_d - head_dim))
        return x.permute(0, 2, 1, 3).reshape(batch * num_kv_heads, num_keys, block_d)

    num_blocks_g = -(-group // TORCH_BLOCK_M)
    rows = q.new_zeros((batch, num_kv_heads, num_blocks_g * TORCH_BLOCK_M, block_d), dtype=torch.float32)
    rows[:, :, :group, :head_dim] = q.view(batch, num_kv_heads, group, head_dim)
    rows = rows.view(batch * num_kv_heads, num_blocks_g, TORCH_BLOCK_M, block_d)
    pos = (context_lens.long() - 1).view(batch, 1, 1, 1).expand(batch, num_kv_heads, num_blocks_g, TORCH_BLOCK_M)
    res = _rows_in_slices(rows, gather(k_cache), gather(v_cache), pos.reshape(rows.shape[:3]), scale=scale,
                          window=_window(sliding_window), dtype=q.dtype, block_n=TORCH_BLOCK_N)
    res = res.view(batch, num_kv_heads, num_blocks_g * TORCH_BLOCK_M, block_d)[:, :, :group, :head_dim]
    return res.reshape(batch, num_q_heads, head_dim).to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Triton launchers


def exact_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                           scale: float, max_seqlen: int, sliding_window: int | None = None,
                           cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None,
                           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact_attention`'s forward with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); returns the
    output and each row's base-2 logsumexp, fp32 [num_q_heads, total]. `config` overrides `_forward_config`
    (BLOCK_M, BLOCK_N, num_warps, num_stages); exactness against the decode needs its BLOCK_M, BLOCK_N and
    num_warps there too. The grid spans the queries, so max_seqlen_k is not needed (accepted for symmetry)."""
    import triton

    from hybridengine.kernels.exact_attention import exact_varlen_kernel

    total, num_q_heads, head_dim = q.shape
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    assert k.shape == v.shape and k.dtype == v.dtype == q.dtype and num_q_heads % k.shape[1] == 0
    assert cu_seqlens.dtype == cu_seqlens_k.dtype == torch.int32 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    out = torch.empty_like(q)
    lse = torch.empty(num_q_heads, total, dtype=torch.float32, device=q.device)
    batch = cu_seqlens.numel() - 1
    if batch == 0 or total == 0 or max_seqlen == 0:
        return out, lse
    cfg = _launch.launch_config(_forward_config(q), config)
    grid = (triton.cdiv(max_seqlen, cfg["BLOCK_M"]), batch, num_q_heads)
    exact_varlen_kernel[grid](
        q, k, v, cu_seqlens, cu_seqlens_k, out, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), scale * math.log2(math.e), _window(sliding_window),
        GROUP=num_q_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        **_dot_flags(q), **cfg,
    )
    return out, lse


def exact_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                                  sliding_window: int | None = None, out: torch.Tensor | None = None,
                                  config: dict | None = None) -> torch.Tensor:
    """`exact_decode_attention` with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1): one program per
    (sequence, kv head, BLOCK_M query heads of the group), no split-K. No host sync and no allocation that
    depends on device values (CUDA-graph capturable). `config` overrides `_forward_config` (BLOCK_M, BLOCK_N,
    num_warps, num_stages); exactness against the varlen kernel needs its BLOCK_M, BLOCK_N and num_warps there too."""
    import triton

    from hybridengine.kernels.exact_attention import exact_decode_kernel

    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and k_cache.dtype == q.dtype and num_q_heads % num_kv_heads == 0
    assert block_tables.dtype == context_lens.dtype == torch.int32 and q.stride(-1) == k_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    cfg = _launch.launch_config(_forward_config(q), config)
    group = num_q_heads // num_kv_heads
    exact_decode_kernel[(batch, num_kv_heads, triton.cdiv(group, cfg["BLOCK_M"]))](
        q, k_cache, v_cache, block_tables, context_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * math.log2(math.e), _window(sliding_window), block_tables.shape[1],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=block_size,
        **_dot_flags(q), **cfg,
    )
    return out


def exact_attention_backward_triton(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
                                    max_seqlen: int, sliding_window: int | None = None,
                                    config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `exact_attention` with the Triton backward kernels, deterministic (no atomics): dK/dV
    programs sum over the group's heads and the query tiles in a fixed order, dQ programs over the key tiles.
    `config` overrides `_backward_config` (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    import triton

    from hybridengine.kernels.exact_attention import exact_bwd_dkdv_kernel, exact_bwd_dq_kernel

    total, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    do = do if do.stride(-1) == 1 else do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    batch = cu_seqlens.numel() - 1
    if batch == 0 or total == 0 or max_seqlen == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = (do.float() * out.float()).sum(-1).t().contiguous()  # [num_q_heads, total], as lse
    cfg = _launch.launch_config(_backward_config(q), config)
    common = dict(GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                  **_dot_flags(q), **cfg)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1))
    scales = (scale, scale * math.log2(math.e), _window(sliding_window))
    exact_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, cfg["BLOCK_N"]), batch, num_kv_heads)](
        q, k, v, do, lse, delta, cu_seqlens, dk, dv, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), *scales, **common)
    exact_bwd_dq_kernel[(triton.cdiv(max_seqlen, cfg["BLOCK_M"]), batch, num_q_heads)](
        q, k, v, do, lse, delta, cu_seqlens, dq, *strides,
        dq.stride(0), dq.stride(1), lse.stride(0), *scales, **common)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# autograd and the ops


class _ExactAttention(torch.autograd.Function):
    """The exact forward (the kernel, or the torch path) and a deterministic backward: the Triton backward
    kernels, or on the torch path the autograd of the fp32 reference (deterministic on CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, max_seqlen, sliding_window, kernel):
        ctx.args = dict(scale=scale, max_seqlen=max_seqlen, sliding_window=sliding_window)
        ctx.kernel = kernel
        if kernel:
            out, lse = exact_attention_triton(q, k, v, cu_seqlens, **ctx.args)
            ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
        else:
            out = exact_attention_torch(q, k, v, cu_seqlens, **ctx.args)
            ctx.save_for_backward(q, k, v, cu_seqlens)
        return out

    @staticmethod
    def backward(ctx, do):
        if ctx.kernel:
            q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
            grads = exact_attention_backward_triton(do, q, k, v, out, lse, cu_seqlens, **ctx.args)
        else:
            q, k, v, cu_seqlens = ctx.saved_tensors
            with torch.enable_grad():
                leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
                out = exact_attention_ref(*leaves, cu_seqlens, scale=ctx.args["scale"],
                                          sliding_window=ctx.args["sliding_window"])
                grads = torch.autograd.grad(out, leaves, do.float())
            grads = [g.to(x.dtype) for g, x in zip(grads, (q, k, v))]
        return (*grads, None, None, None, None, None)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                    scale: float, max_seqlen: int, sliding_window: int | None = None,
                    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> torch.Tensor:
    """Causal self-attention per sequence over packed tokens, exact: row i of a sequence has the bits of
    `exact_decode_attention` at context length i + 1 over the same K/V, whatever the rest of the batch, the
    packing and the sequence's length past i.

    With cu_seqlens_k the queries are the last tokens of longer contexts (a prefill after a cached prefix):
    query i of sequence b sits at key position len_k - len_q + i, and the key tiles stay at fixed positions
    from the context's start, so its row has the bits of that position's row of the whole context's
    self-attention.

    Args:
        q: [total, num_q_heads, head_dim], fp16/bf16/fp32, last dim contiguous.
        k, v: [total, num_kv_heads, head_dim], q's dtype, last dim contiguous; num_q_heads a multiple of
            num_kv_heads (GQA).
        cu_seqlens: int32 [B + 1] on q's device, from 0 to total: sequence b owns rows cu_seqlens[b] ..
            cu_seqlens[b+1].
        scale: softmax scale.
        max_seqlen: a host int >= the longest sequence (it sizes the grid; on CUDA the values of cu_seqlens
            are not read back, so a smaller one leaves rows unwritten).
        sliding_window: query i sees keys i - window < j <= i; None: all j <= i.
        cu_seqlens_k: optional int32 [B + 1] on q's device: k and v are [total_k, ...] and sequence b's keys
            are their rows cu_seqlens_k[b] .. cu_seqlens_k[b+1], at least its queries. None: k and v are the
            queries' own tokens (cu_seqlens). Forward only.
        max_seqlen_k: a host int >= the longest key sequence, checked by the torch path (the kernel's grid
            spans the queries). None: max_seqlen without cu_seqlens_k, unchecked with it.

    Returns [total, num_q_heads, head_dim] in q's dtype. Differentiable in q, k and v with a deterministic
    backward (two runs give the same bits) when cu_seqlens_k is None. CUDA: the Triton kernels; elsewhere: the
    torch path (its backward the autograd of the fp32 reference).
    """
    _check_varlen(q, k, v, cu_seqlens, scale, max_seqlen, sliding_window, cu_seqlens_k, max_seqlen_k)
    kernel = _launch.use_kernel(q)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        if cu_seqlens_k is not None:
            raise ValueError("exact_attention: cu_seqlens_k (keys longer than the queries) is forward only, but an "
                             "input requires grad; call it under torch.no_grad() or without cu_seqlens_k")
        return _ExactAttention.apply(q, k, v, cu_seqlens, scale, max_seqlen, sliding_window, kernel)
    keys = dict(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    if kernel:
        return exact_attention_triton(q, k, v, cu_seqlens, scale=scale, max_seqlen=max_seqlen,
                                      sliding_window=sliding_window, **keys)[0]
    return exact_attention_torch(q, k, v, cu_seqlens, scale=scale, sliding_window=sliding_window,
                                 max_seqlen=max_seqlen, **keys)


def exact_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                           sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of one new token per sequence over its paged K/V (the decode step): the bits of row
    context_lens[b] - 1 of `exact_attention` over the sequence's tokens. Returns out.

    Args:
        q: [B, num_q_heads, head_dim], fp16/bf16/fp32, last dim contiguous; the token's own K/V already stored.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (`kv_store`'s layout), q's dtype;
            num_q_heads a multiple of num_kv_heads. Any block_size >= 1.
        block_tables: int32 [B, max_blocks]; only the first ceil(context_lens[b] / block_size) entries of
            row b are read.
        context_lens: int32 [B], keys per sequence including the new token; 0 marks a padding row (zeros).
        scale: softmax scale.
        sliding_window: the query at position n - 1 sees keys n - window .. n - 1; None: all n.
        out: optional preallocated [B, num_q_heads, head_dim] output in q's dtype.

    CUDA: the Triton kernel (no host sync: CUDA-graph capturable); elsewhere: the torch path.
    """
    check_decode_args("exact_decode_attention", q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                      out)
    if _launch.use_kernel(q):
        return exact_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                             sliding_window=sliding_window, out=out)
    result = exact_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                          sliding_window=sliding_window)
    return result if out is None else out.copy_(result)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    kind = "Triton" if device_type == "cuda" else "torch tiled (exact)"
    return {"exact_attention": kind, "exact_decode_attention": kind}
