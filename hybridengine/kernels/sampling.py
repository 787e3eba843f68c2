"""Triton kernels of the fused sampler: two passes over a split of the logits (max, then sum and race)
give each row's sampled token (the exponential race with Philox noise drawn in the kernel), its
log-prob and its greedy argmax; a combine kernel merges the splits.

The launcher, its checks and the plain-torch reference (the same Philox in int64 arithmetic) are in
`hybridengine.rollout.sampler` (`sample_fused`, `sample_fused_ref`).
"""

import triton
import triton.language as tl


@triton.jit
def race_exp(key, draw, c0, BLOCK: tl.constexpr):
    """E ~ Exp(1) for columns c0 .. c0 + BLOCK (c0 a multiple of 4): one Philox4x32-10 call per 4
    columns, keyed by `key` (int64) at counter (c0 / 4 + n, draw, 0, 0); column 4n + j takes output
    word j. v = (x + 1/2) 2^-32 in (0, 1); E = -log(1 - v), taken as v + v^2/2 below 2^-12 (where
    1 - v would lose v's digits). E is never 0."""
    n = (c0 // 4 + tl.arange(0, BLOCK // 4)).to(tl.int64) + (draw.to(tl.int64) << 32)
    r0, r1, r2, r3 = tl.randint4x(key, n)
    x = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])  # x[4n + j] = r_j[n]
    xf = x.to(tl.uint32, bitcast=True).to(tl.float32)
    v = (xf + 0.5) * 2.3283064365386963e-10
    return tl.where(v < 0.000244140625, v + 0.5 * v * v, -tl.log(1.0 - v))


@triton.jit
def sample_partial_kernel(
    Logits, stride_l, InvTemp, Keys, Draws, Out,
    n_cols, chunk, col_offset, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, split) over columns [split * chunk, (split + 1) * chunk), s = logit * inv_temp
    in fp32, in two passes: the split's max M of s, then e = exp(s - M), their sum, and the race
    winner argmax e / E, compared as e * E_best > e_best * E (no division; the first column wins a
    tie in each lane). A greedy row (key < 0) takes argmax s instead. Column c of these logits is
    column col_offset + c of the vocabulary (a TP rank's shard; col_offset % 4 == 0): its noise and
    the reported column are the vocabulary's. Writes Out[:, row, split] (fp32 [5, B, SPLITS]): M, sum,
    the winning score in the log domain (s - log E; s when greedy), its column (exact in fp32 below
    2^24), its s."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_t = tl.load(InvTemp + row)
    key = tl.load(Keys + row)
    draw = tl.load(Draws + row)
    lanes = tl.arange(0, BLOCK)
    start = split * chunk
    end = tl.minimum(start + chunk, n_cols)
    base = Logits + row * stride_l
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lanes
        s = tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * inv_t
        mx = tl.maximum(mx, s)
    M = tl.max(mx, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    l = tl.zeros([BLOCK], tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    if key < 0:  # greedy: the first maximal s
        for c0 in range(start, end, BLOCK):
            cols = c0 + lanes
            s = tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * inv_t
            l += tl.exp(s - M_safe)
            win = s > best_val
            best_idx = tl.where(win, col_offset + cols, best_idx)
            best_val = tl.where(win, s, best_val)
        score = best_val
    else:
        best_e = tl.zeros([BLOCK], tl.float32)
        best_E = tl.full([BLOCK], 1.0, tl.float32)
        for c0 in range(start, end, BLOCK):
            cols = c0 + lanes
            s = tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * inv_t
            e = tl.exp(s - M_safe)
            l += e
            E = race_exp(key, draw, col_offset + c0, BLOCK)
            win = e * best_E > best_e * E
            best_e = tl.where(win, e, best_e)
            best_E = tl.where(win, E, best_E)
            best_idx = tl.where(win, col_offset + cols, best_idx)
            best_val = tl.where(win, s, best_val)
        score = tl.where(best_e > 0, tl.log(tl.maximum(best_e, 1e-30)) - tl.log(best_E) + M_safe, float("-inf"))
    top = tl.max(score, 0)
    first = tl.min(tl.where(score == top, best_idx, 2147483647), 0)
    val = tl.sum(tl.where(best_idx == first, best_val, 0.0), 0)
    out = row * SPLITS + split
    plane = tl.num_programs(0).to(tl.int64) * SPLITS
    tl.store(Out + out, M)
    tl.store(Out + plane + out, tl.sum(l, 0))
    tl.store(Out + 2 * plane + out, top)
    tl.store(Out + 3 * plane + out, first.to(tl.float32))
    tl.store(Out + 4 * plane + out, val)


@triton.jit
def sample_combine_kernel(Part, Tokens, Logprobs, n_rows, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per row over Part (fp32 [5, rows, SPLITS], the partial kernel's planes, the splits
    of every TP rank side by side): lse = M + log sum of sum * exp(max - M); the token is the best
    score's column (the smallest column on ties); log-prob = s - lse."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    ok = sp < SPLITS
    plane = n_rows * SPLITS
    base = Part + row * SPLITS + sp
    mx = tl.load(base, mask=ok, other=float("-inf"))
    sm = tl.load(base + plane, mask=ok, other=0.0)
    bs = tl.load(base + 2 * plane, mask=ok, other=float("-inf"))
    idx = tl.load(base + 3 * plane, mask=ok, other=4294967296.0)
    val = tl.load(base + 4 * plane, mask=ok, other=0.0)
    M = tl.max(mx, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    total = tl.sum(tl.where(mx == float("-inf"), 0.0, sm * tl.exp(mx - M_safe)), 0)
    lse = M_safe + tl.log(total)
    top = tl.max(bs, 0)
    token = tl.min(tl.where(bs == top, idx, 4294967296.0), 0)
    s = tl.sum(tl.where(idx == token, val, 0.0), 0)
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, s - lse)
