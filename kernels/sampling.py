"""Triton kernels of the fused sampler: one pass over the logits gives each row's sampled token (the
exponential race with Philox noise drawn in the kernel), its log-prob and its greedy argmax.

The launcher, its checks and the plain-torch reference (the same Philox in int64 arithmetic) are in
`hybridengine.sampling` (`sample_fused`, `sample_fused_ref`).
"""

import triton
import triton.language as tl


@triton.jit
def race_noise(key, draw, cols):
    """-log(E) for E ~ Exp(1) at each column: Philox4x32-10 keyed by `key` (int64) at counter
    (col, draw, 0, 0); v = (x + 1/2) 2^-32 in (0, 1); E = -log(1 - v), taken as v + v^2/2 below 2^-12
    (where 1 - v would lose v's digits). E is never 0, so no column wins by an infinite score."""
    offsets = cols.to(tl.int64) + (draw.to(tl.int64) << 32)
    x = tl.randint(key, offsets)  # uint32 bits in an int32/uint32 tensor
    xf = x.to(tl.uint32, bitcast=True).to(tl.float32)
    v = (xf + 0.5) * 2.3283064365386963e-10
    e = tl.where(v < 0.000244140625, v + 0.5 * v * v, -tl.log(1.0 - v))
    return -tl.log(e)


@triton.jit
def sample_partial_kernel(
    Logits, stride_l, InvTemp, Keys, Draws,
    OutMax, OutSum, OutBest, OutIdx, OutVal,
    n_cols, chunk, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, split) over columns [split * chunk, (split + 1) * chunk): s = logit * inv_temp
    in fp32; online max and sum of exp(s - max) per lane; the race score s - log(E) (s alone for a
    greedy row, key < 0) and its best column per lane (the first on ties); reduced over lanes at the end.
    Writes the split's (max, sum, best score, best column, s at that column)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_t = tl.load(InvTemp + row)
    key = tl.load(Keys + row)
    draw = tl.load(Draws + row)
    greedy = key < 0
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    best_val = tl.zeros([BLOCK], tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, n_cols)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lanes
        ok = cols < end
        s = tl.load(Logits + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
        if greedy:
            score = s
        else:
            score = s + race_noise(key, draw, cols)
        score = tl.where(ok, score, float("-inf"))
        win = score > best  # strict: a lane keeps its first column on ties
        best = tl.where(win, score, best)
        best_idx = tl.where(win, cols, best_idx)
        best_val = tl.where(win, s, best_val)
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, l * tl.exp(m - mx_safe)), 0)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    val = tl.sum(tl.where(best_idx == first, best_val, 0.0), 0)
    out = row * SPLITS + split
    tl.store(OutMax + out, mx)
    tl.store(OutSum + out, total)
    tl.store(OutBest + out, top)
    tl.store(OutIdx + out, first)
    tl.store(OutVal + out, val)


@triton.jit
def sample_combine_kernel(
    InMax, InSum, InBest, InIdx, InVal, Tokens, Logprobs,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per row: lse = log sum over splits of sum * exp(max - M) + M; the token is the
    best score's column (the first split on ties, so the first column overall); log-prob = s - lse."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    ok = sp < SPLITS
    mx = tl.load(InMax + row * SPLITS + sp, mask=ok, other=float("-inf"))
    sm = tl.load(InSum + row * SPLITS + sp, mask=ok, other=0.0)
    bs = tl.load(InBest + row * SPLITS + sp, mask=ok, other=float("-inf"))
    idx = tl.load(InIdx + row * SPLITS + sp, mask=ok, other=2147483647)
    val = tl.load(InVal + row * SPLITS + sp, mask=ok, other=0.0)
    M = tl.max(mx, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    total = tl.sum(tl.where(mx == float("-inf"), 0.0, sm * tl.exp(mx - M_safe)), 0)
    lse = M_safe + tl.log(total)
    top = tl.max(bs, 0)
    token = tl.min(tl.where(bs == top, idx, 2147483647), 0)
    s = tl.sum(tl.where(idx == token, val, 0.0), 0)
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, s - lse)
