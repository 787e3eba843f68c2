"""Exact attention (hybridengine.ops.exact_attention): bitwise contracts and tolerances.

Bitwise (the point of the op, never a tolerance): `exact_decode_attention` at context length i + 1 equals row i
of `exact_attention` over any packing that holds the sequence's first L > i tokens, for both implementations
(the Triton kernels, under TRITON_INTERPRET=1 on CPU with `_launch.use_kernel` patched, and the torch path);
varlen rows do not change with the batch, the packing or the sequence's length past them, nor when only a
sequence's last queries run against all its keys (cu_seqlens_k); two backward runs give the same bits. Caches
are poisoned with NaN outside the stored tokens, so a read past a sequence shows.

Tolerances (STYLE.md habit 3): the exact answer is the naive reference in fp64; an output's error must stay
within K_TOL x the error of the same reference in the input dtype, plus the output's own rounding (and, for
fp32 on the GPU, the error of its approximate exp2).
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from hybridengine.ops import _launch
from hybridengine.ops import exact_attention as EA

K_TOL = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 2.0}
"""Allowed multiple of the reference's own error in the input dtype. bf16/fp16: both paths round P once to the
dtype and the output once, where the reference in that dtype rounds the scores, the softmax and every partial
product; fp32: both compute in fp32 in other orders (base-2 exponent, online rescaling, tile sums)."""
GRAD_TOL = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 4.0}
"""The same multiple for the gradients: FA2's backward in 16-bit rounds P and dS once for its dots (the
reference's autograd in that dtype rounds far more often); fp32 sums dK over heads and tiles in another order."""
IMPLS = ["triton", "torch"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality is bitwise (and NaN == NaN, -0 != +0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch, device) -> str:
    """Which implementation the ops run: the Triton kernels (on CPU under the interpreter) or the torch path."""
    monkeypatch.setattr(_launch, "use_kernel", lambda t: request.param == "triton")
    return request.param


def packed(lens, num_q_heads, num_kv_heads, head_dim, dtype, device):
    """Random q, k, v for sequences of `lens` tokens packed in order, and their cu_seqlens."""
    total = sum(lens)
    q = torch.randn(total, num_q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, device=device).to(dtype)
    return q, k, v, cu_of(lens, device)


def cu_of(lens, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def paged(k, v, cu, block_size):
    """The packed K/V stored in a NaN-poisoned paged cache, each sequence in shuffled blocks; returns
    (k_cache, v_cache, tables) with tables[b] the block ids of sequence b."""
    bounds = cu.tolist()
    need = [-(-(e - s) // block_size) for s, e in zip(bounds[:-1], bounds[1:])]
    num_blocks = sum(need) + 2
    shape = (num_blocks, block_size, *k.shape[1:])
    k_cache = torch.full(shape, float("nan"), dtype=k.dtype, device=k.device)
    v_cache = torch.full(shape, float("nan"), dtype=k.dtype, device=k.device)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for b, n in enumerate(need):
        blocks = [free.pop() for _ in range(n)]
        tables.append(blocks)
        for t in range(bounds[b + 1] - bounds[b]):
            k_cache[blocks[t // block_size], t % block_size] = k[bounds[b] + t]
            v_cache[blocks[t // block_size], t % block_size] = v[bounds[b] + t]
    return k_cache, v_cache, tables


def decode_every_position(q, k_cache, v_cache, tables, cu, *, scale, sliding_window=None):
    """`exact_decode_attention` for every query of the packed batch in one decode batch: the query of sequence
    b at position i as a decode row of context length i + 1 over b's blocks. Returns [total, Hq, D] in packed order."""
    bounds = cu.tolist()
    width = max(len(t) for t in tables) + 1
    rows, lens = [], []
    for b in range(len(bounds) - 1):
        for i in range(bounds[b + 1] - bounds[b]):
            rows.append(tables[b] + [-1] * (width - len(tables[b])))  # unused columns: -1
            lens.append(i + 1)
    block_tables = torch.tensor(rows, dtype=torch.int32, device=q.device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    return EA.exact_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                     sliding_window=sliding_window)


def output_rounding(exact: torch.Tensor, dtype: torch.dtype, interpreted: bool) -> float:
    """The error of rounding the exact output to `dtype` once: half an ulp of the largest value; a whole ulp for bf16
    under the interpreter, whose fp32 -> bf16 cast truncates."""
    top = exact.abs().max().item()
    if top == 0:
        return 0.0
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top))
    return ulp if interpreted and dtype == torch.bfloat16 else 0.5 * ulp


def exp2_error(v: torch.Tensor, max_len: int, block_n: int, dtype: torch.dtype, impl: str) -> float:
    """fp32 only: the exp2 in the output's error where the reference's is correctly rounded: Triton's on the GPU
    (ex2.approx, 2^-22 relative) or the torch path's polynomial (< 1 ulp, 2^-23). A key's weight passes its own
    exp2 and at most T - 1 rescales (T tiles); the output is a ratio of two such sums: 2 x T x that x max |v|."""
    if dtype != torch.float32 or (impl == "triton" and v.device.type != "cuda"):
        return 0.0
    rel = 2.0**-23 if impl == "torch" else 2.0**-22
    return 2 * math.ceil(max_len / block_n) * rel * v.abs().max().item()


def assert_close_to_exact(out, exact, same_dtype, extra=0.0, k_tol=K_TOL, interpreted=False) -> None:
    """max |out - exact| <= k_tol x max |reference in out's dtype - exact| + out's rounding + extra."""
    assert out.shape == exact.shape and out.dtype == same_dtype.dtype
    assert torch.isfinite(out).all(), "a non-finite output: a poisoned slot was read"
    err = (out.double() - exact.double()).abs().max().item()
    ref_err = (same_dtype.double() - exact.double()).abs().max().item()
    bound = k_tol[out.dtype] * ref_err + output_rounding(exact, out.dtype, interpreted) + extra
    assert err <= bound, (f"max error {err:.3g} > {k_tol[out.dtype]} x the reference's {ref_err:.3g} + rounding "
                          f"+ {extra:.3g}")


# --------------------------------------------------------------------------------------------------
# the bitwise contract


DECODE_CASES = [
    # lens (odd, crossing 16-key tiles), block_size, Hq, Hkv, head_dim, window, dtype
    pytest.param([1, 17, 70], 16, 2, 2, 64, None, torch.bfloat16, id="group1-page16-bf16"),
    pytest.param([5, 38], 1, 4, 2, 80, None, torch.float32, id="group2-page1-d80-fp32"),
    pytest.param([2, 69], 12, 6, 2, 64, 20, torch.bfloat16, id="group3-page12-window20-bf16"),
    pytest.param([47, 9], 12, 3, 1, 80, 7, torch.float32, id="group3-page12-d80-window7-fp32"),
    pytest.param([23, 40], 16, 4, 2, 64, 5, torch.float16, id="group2-page16-window5-fp16"),
]


@pytest.mark.parametrize("lens,block_size,num_q_heads,num_kv_heads,head_dim,window,dtype", DECODE_CASES)
def test_decode_equals_varlen_bitwise(device, impl, lens, block_size, num_q_heads, num_kv_heads, head_dim,
                                      window, dtype):
    q, k, v, cu = packed(lens, num_q_heads, num_kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    varlen = EA.exact_attention(q, k, v, cu, scale=scale, max_seqlen=max(lens), sliding_window=window)
    k_cache, v_cache, tables = paged(k, v, cu, block_size)
    decode = decode_every_position(q, k_cache, v_cache, tables, cu, scale=scale, sliding_window=window)
    assert torch.equal(bits(decode), bits(varlen))
    # one sequence's last token alone (batch size 1) has the same bits as in the large batch
    b = len(lens) - 1
    alone = EA.exact_decode_attention(q[-1:], k_cache, v_cache,
                                      torch.tensor([tables[b]], dtype=torch.int32, device=device),
                                      torch.tensor([lens[b]], dtype=torch.int32, device=device),
                                      scale=scale, sliding_window=window)
    assert torch.equal(bits(alone), bits(varlen[-1:]))


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float32, 9)], ids=["bf16", "fp32-window9"])
def test_varlen_rows_do_not_depend_on_the_batch(device, impl, dtype, window):
    """A sequence's rows: alone, packed after and before others (other offsets, another max_seqlen, another batch
    size), and as the prefix of longer or shorter versions of itself."""
    q, k, v, cu = packed([45], 4, 2, 64, dtype, device)
    scale = 0.125
    alone = EA.exact_attention(q, k, v, cu, scale=scale, max_seqlen=45, sliding_window=window)
    oq, ok, ov, _ = packed([13, 60], 4, 2, 64, dtype, device)
    cat = lambda a, o: torch.cat([o[:13], a, o[13:]])  # noqa: E731
    out = EA.exact_attention(cat(q, oq), cat(k, ok), cat(v, ov), cu_of([13, 45, 60], device), scale=scale,
                             max_seqlen=60, sliding_window=window)
    assert torch.equal(bits(out[13:58]), bits(alone))
    for n in (1, 16, 30, 44):  # truncated: the first n rows are the same
        short = EA.exact_attention(q[:n], k[:n], v[:n], cu_of([n], device), scale=scale, max_seqlen=n,
                                   sliding_window=window)
        assert torch.equal(bits(short), bits(alone[:n]))
    lq, lk, lv, _ = packed([20], 4, 2, 64, dtype, device)  # extended by 20 tokens, packed with itself truncated
    longer = EA.exact_attention(torch.cat([q, lq, q[:7]]), torch.cat([k, lk, k[:7]]), torch.cat([v, lv, v[:7]]),
                                cu_of([65, 7], device), scale=scale, max_seqlen=65, sliding_window=window)
    assert torch.equal(bits(longer[:45]), bits(alone))
    assert torch.equal(bits(longer[65:]), bits(alone[:7]))


KEYS_CASES = [
    # (keys, queries) per sequence: the queries are the keys' last tokens (a prefill after a cached prefix)
    pytest.param([(17, 5), (9, 9), (40, 1), (20, 0), (33, 16)], 4, 2, 64, None, torch.bfloat16, id="group2-bf16"),
    pytest.param([(37, 3), (16, 16), (45, 29)], 3, 1, 80, 7, torch.float32, id="group3-d80-window7-fp32"),
    pytest.param([(64, 48), (5, 1)], 2, 2, 64, 20, torch.float16, id="group1-window20-fp16"),
]


@pytest.mark.parametrize("shape,num_q_heads,num_kv_heads,head_dim,window,dtype", KEYS_CASES)
def test_queries_after_a_cached_prefix_have_the_full_rows_bits(device, impl, shape, num_q_heads, num_kv_heads,
                                                               head_dim, window, dtype):
    """cu_seqlens_k: each sequence's last len_q tokens against all its len_k keys give the bits of those rows of
    the whole sequences' self-attention (query tiles starting off the tile grid, empty query sets, len_q = len_k)."""
    lens_k = [n_k for n_k, _ in shape]
    q, k, v, cu_k = packed(lens_k, num_q_heads, num_kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    full = EA.exact_attention(q, k, v, cu_k, scale=scale, max_seqlen=max(lens_k), sliding_window=window)
    rows = torch.tensor([r for e, (_, n) in zip(cu_k[1:].tolist(), shape) for r in range(e - n, e)], device=device)
    lens_q = [n for _, n in shape]
    tail = EA.exact_attention(q[rows], k, v, cu_of(lens_q, device), scale=scale, max_seqlen=max(lens_q),
                              sliding_window=window, cu_seqlens_k=cu_k, max_seqlen_k=max(lens_k))
    assert torch.equal(bits(tail), bits(full[rows]))
    q, k, v = q.double(), k.double(), v.double()  # the reference takes the same offsets (fp64: BLAS rows differ)
    ref = EA.exact_attention_ref(q[rows], k, v, cu_of(lens_q, device), scale=scale, sliding_window=window,
                                 cu_seqlens_k=cu_k)
    torch.testing.assert_close(ref, EA.exact_attention_ref(q, k, v, cu_k, scale=scale, sliding_window=window)[rows],
                               rtol=0, atol=1e-12)


def test_training_forward_equals_no_grad_forward(device, impl):
    q, k, v, cu = packed([19, 34], 4, 2, 64, torch.bfloat16, device)
    with torch.no_grad():
        rollout = EA.exact_attention(q, k, v, cu, scale=0.125, max_seqlen=34)
    train = EA.exact_attention(q.requires_grad_(), k.requires_grad_(), v, cu, scale=0.125, max_seqlen=34)
    assert train.requires_grad and torch.equal(bits(train.detach()), bits(rollout))


def test_decode_padding_rows_are_zero(device, impl):
    """Context 0 (CUDA-graph batch padding) gives zeros, into a preallocated `out`, beside real rows."""
    q, k, v, cu = packed([21], 4, 2, 64, torch.bfloat16, device)
    k_cache, v_cache, tables = paged(k, v, cu, 16)
    table = torch.tensor([tables[0], [-1, -1], tables[0]], dtype=torch.int32, device=device)
    lens = torch.tensor([0, 0, 21], dtype=torch.int32, device=device)
    out = torch.full((3, 4, 64), float("nan"), dtype=torch.bfloat16, device=device)
    qs = torch.stack([q[0], q[5], q[20]])
    res = EA.exact_decode_attention(qs, k_cache, v_cache, table, lens, scale=0.125, out=out)
    assert res is out
    assert torch.equal(bits(out[:2]), bits(torch.zeros_like(out[:2])))
    full = EA.exact_attention(q, k, v, cu, scale=0.125, max_seqlen=21)
    assert torch.equal(bits(out[2]), bits(full[20]))


# --------------------------------------------------------------------------------------------------
# against the naive reference


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float16, 6), (torch.float32, None)],
                         ids=["bf16", "fp16-window6", "fp32"])
def test_forward_matches_reference(device, impl, dtype, window):
    lens = [3, 50, 29]
    q, k, v, cu = packed(lens, 6, 2, 80, dtype, device)
    scale = 80**-0.5
    out = EA.exact_attention(q, k, v, cu, scale=scale, max_seqlen=50, sliding_window=window)
    exact = EA.exact_attention_ref(q.double(), k.double(), v.double(), cu, scale=scale, sliding_window=window)
    same = EA.exact_attention_ref(q, k, v, cu, scale=scale, sliding_window=window, compute_dtype=dtype)
    interpreted = impl == "triton" and device.type != "cuda"
    block_n = EA._forward_config(q)["BLOCK_N"] if impl == "triton" else EA.TORCH_BLOCK_N
    assert_close_to_exact(out, exact, same, exp2_error(v, max(lens), block_n, dtype, impl), interpreted=interpreted)
    k_cache, v_cache, tables = paged(k, v, cu, 16)
    ends = torch.tensor(lens, device=device).cumsum(0) - 1
    table = torch.tensor([t + [-1] * (4 - len(t)) for t in tables], dtype=torch.int32, device=device)
    context = torch.tensor(lens, dtype=torch.int32, device=device)
    decode = EA.exact_decode_attention(q[ends], k_cache, v_cache, table, context, scale=scale, sliding_window=window)
    exact_d = EA.exact_decode_attention_ref(q[ends].double(), k_cache.double(), v_cache.double(), table, context,
                                            scale=scale, sliding_window=window)
    same_d = EA.exact_decode_attention_ref(q[ends], k_cache, v_cache, table, context, scale=scale,
                                           sliding_window=window, compute_dtype=dtype)
    assert_close_to_exact(decode, exact_d, same_d, exp2_error(v, max(lens), block_n, dtype, impl),
                          interpreted=interpreted)


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float32, 11)], ids=["bf16", "fp32-window11"])
def test_backward_matches_reference_and_is_deterministic(device, impl, dtype, window):
    lens = [7, 40, 22]
    q, k, v, cu = packed(lens, 6, 2, 40, dtype, device)
    do = torch.randn_like(q)
    scale = 40**-0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def grads(fn, inputs, **kw):
        out = fn(*inputs, cu, scale=scale, sliding_window=window, **kw)
        return torch.autograd.grad(out, inputs, do.to(out.dtype))

    first = grads(EA.exact_attention, leaves, max_seqlen=40)
    second = grads(EA.exact_attention, leaves, max_seqlen=40)
    for a, b in zip(first, second):
        assert torch.equal(bits(a), bits(b))
    exact = grads(EA.exact_attention_ref, [x.detach().double().requires_grad_() for x in (q, k, v)])
    same = grads(EA.exact_attention_ref, leaves, compute_dtype=dtype)
    interpreted = impl == "triton" and device.type != "cuda"
    for name, g, e, s in zip("qkv", first, exact, same):
        assert g.dtype == dtype, name
        assert_close_to_exact(g, e, s, k_tol=GRAD_TOL, interpreted=interpreted)


# --------------------------------------------------------------------------------------------------
# the torch path's building blocks


def test_torch_exp2_is_accurate_and_exact_where_the_contract_needs_it():
    x = torch.cat([-torch.rand(100_000) * 130, -torch.rand(10_000), torch.tensor([-126.4, -300.0])])
    got, want = EA._exp2(x).double(), torch.exp2(x.double())
    # within 1 ulp of fp32 where the result is normal, 2^-126 below (subnormal products, flushed tails)
    assert ((got - want).abs() <= torch.clamp(2.0**-23 * want, min=2.0**-126)).all()
    special = EA._exp2(torch.tensor([0.0, -0.0, float("-inf"), -127.0, -126.0]))
    assert special.tolist() == [1.0, 1.0, 0.0, 0.0, 2.0**-126]
    # elementwise: a value's bits do not depend on where it sits or on the tensor's size
    assert torch.equal(bits(EA._exp2(x[7:8])), bits(EA._exp2(x)[7:8]))
    assert torch.equal(bits(EA._exp2(x.flip(0))), bits(EA._exp2(x).flip(0)))


def test_torch_tree_sum_is_pairwise():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]])
    assert EA._tree_sum(x).item() == (1e8 + -1e8) + (1.0 + 1.0)  # ((x0 + x2) + (x1 + x3))
    y = torch.randn(33, 64)
    assert torch.equal(bits(EA._tree_sum(y)[5:6]), bits(EA._tree_sum(y[5:6])))


# --------------------------------------------------------------------------------------------------
# errors


def _varlen_args(device):
    q, k, v, cu = packed([5, 12], 4, 2, 32, torch.bfloat16, device)
    return dict(q=q, k=k, v=v, cu_seqlens=cu, scale=0.125, max_seqlen=12)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][None]), "exact_attention: q must be 3-D"),
    (lambda a: a.update(q=a["q"].double()), "exact_attention: q must be torch.bfloat16 or torch.float16 or"),
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "q must have unit stride"),
    (lambda a: a.update(k=a["k"].half()), "k must be torch.bfloat16, got torch.float16"),
    (lambda a: a.update(k=a["k"][:-1]), r"k must be \[total = 17, num_kv_heads, head_dim = 32\] like q"),
    (lambda a: a.update(k=a["k"][..., :16]), r"k must be \[total = 17, .* got shape \(17, 2, 16\)"),
    (lambda a: a.update(v=a["v"][:, :1]), r"v must have shape \(17, 2, 32\)"),
    (lambda a: a.update(q=a["q"][:, :3]), r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), "cu_seqlens must be torch.int32"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"][None]), "cu_seqlens must be 1-D"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"][:0]), "cu_seqlens must have B \\+ 1 >= 1 entries"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].to("meta")), "cu_seqlens is on meta"),
    (lambda a: a.update(max_seqlen=-1), r"max_seqlen must be in \[0, inf\)"),
    (lambda a: a.update(max_seqlen=12.0), "max_seqlen must be a finite integer"),
    (lambda a: a.update(scale=float("nan")), "scale must be a finite number"),
    (lambda a: a.update(sliding_window=0), r"sliding_window must be in \[1, inf\)"),
])
def test_exact_attention_bad_input(device, change, match):
    args = _varlen_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention(**args)


def _keys_args(device):
    q, k, v, cu_k = packed([9, 20], 4, 2, 32, torch.bfloat16, device)
    return dict(q=q[[6, 7, 8, 25, 26, 27, 28]], k=k, v=v, cu_seqlens=cu_of([3, 4], device), scale=0.125,
                max_seqlen=4, cu_seqlens_k=cu_k, max_seqlen_k=20)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].long()), "cu_seqlens_k must be torch.int32"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:2]), r"cu_seqlens_k must have shape \(3,\)"),
    (lambda a: a.update(k=a["k"][..., :16], v=a["v"][..., :16]),
     r"k must be \[total_k, num_kv_heads, head_dim = 32\] \(cu_seqlens_k given\), got shape \(29, 2, 16\)"),
    (lambda a: a.update(max_seqlen_k=-2), r"max_seqlen_k must be in \[0, inf\)"),
    (lambda a: a.update(q=a["q"].requires_grad_()), "cu_seqlens_k .* is forward only, but an input requires grad"),
])
def test_exact_attention_with_keys_bad_input(device, change, match):
    args = _keys_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention(**args)


@pytest.mark.parametrize("cu_k,max_seqlen_k,match", [
    ([0, 9, 28], 20, r"cu_seqlens_k must run from 0 to total_k = 29, got \[0, 9, 28\]"),
    ([0, 27, 29], 27, "cu_seqlens_k: sequence 1 has 2 keys for 4 queries"),
    ([0, 9, 29], 19, "cu_seqlens_k has a sequence of 20 keys, over max_seqlen_k = 19"),
])
def test_torch_path_checks_cu_seqlens_k_values(device, cu_k, max_seqlen_k, match, monkeypatch):
    monkeypatch.setattr(_launch, "use_kernel", lambda t: False)
    args = _keys_args(device) | dict(cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                                     max_seqlen_k=max_seqlen_k)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention(**args)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention_ref(**args)


@pytest.mark.parametrize("cu,max_seqlen,match", [
    ([1, 5, 17], 12, r"cu_seqlens must run from 0 to total = 17, got \[1, 5, 17\]"),
    ([0, 5, 16], 12, "cu_seqlens must run from 0 to total = 17"),
    ([0, 12, 5, 17], 12, "cu_seqlens must be non-decreasing"),
    ([0, 5, 17], 11, "cu_seqlens has a sequence of 12 tokens, over max_seqlen = 11"),
])
def test_torch_path_checks_cu_seqlens_values(device, cu, max_seqlen, match, monkeypatch):
    monkeypatch.setattr(_launch, "use_kernel", lambda t: False)
    args = _varlen_args(device) | dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                                       max_seqlen=max_seqlen)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention(**args)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention_ref(**args)


def _decode_args(device):
    q, k, v, cu = packed([5, 20], 4, 2, 32, torch.bfloat16, device)
    k_cache, v_cache, tables = paged(k, v, cu, 16)
    table = torch.tensor([tables[0] + [-1], tables[1]], dtype=torch.int32, device=device)
    return dict(q=q[[4, 24]], k_cache=k_cache, v_cache=v_cache, block_tables=table,
                context_lens=torch.tensor([5, 20], dtype=torch.int32, device=device), scale=0.125)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][None]), "exact_decode_attention: q must be 3-D"),
    (lambda a: a.update(q=a["q"].double()), "q must be torch.bfloat16 or torch.float16 or"),
    (lambda a: a.update(q=a["q"][:, :3]), r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (lambda a: a.update(q=a["q"][..., :16]), "k_cache has head_dim 32, the inputs have head_dim 16"),
    (lambda a: a.update(q=a["q"].half()), "k_cache must be torch.float16, got torch.bfloat16"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :, None]), "k_cache must be 4-D"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :8]), r"v_cache must have shape \(\d+, 16, 2, 32\)"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be torch.int32"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must have one row per sequence"),
    (lambda a: a.update(context_lens=a["context_lens"].long()), "context_lens must be torch.int32"),
    (lambda a: a.update(context_lens=a["context_lens"][:1]), r"context_lens must have shape \(2,\)"),
    (lambda a: a.update(scale=-1.0), r"scale must be in \(0, inf\)"),
    (lambda a: a.update(sliding_window=2.5), "sliding_window must be a finite integer"),
    (lambda a: a.update(out=a["q"].float()), "out must be torch.bfloat16"),
    (lambda a: a.update(out=a["q"][:1]), r"out must have shape \(2, 4, 32\)"),
])
def test_exact_decode_attention_bad_input(device, change, match):
    args = _decode_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        EA.exact_decode_attention(**args)


@pytest.mark.parametrize("change,match", [
    (lambda a: a["context_lens"].fill_(33), r"context_lens\[0\] = 33 is outside \[0, 32\]"),
    (lambda a: a["block_tables"].fill_(-1), r"block_tables\[0\] has block ids \[-1\]"),
])
def test_torch_decode_checks_index_values(device, change, match, monkeypatch):
    monkeypatch.setattr(_launch, "use_kernel", lambda t: False)
    args = _decode_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        EA.exact_decode_attention(**args)
    with pytest.raises(ValueError, match=match):
        EA.exact_decode_attention_ref(**args)


@pytest.mark.parametrize("config,match", [
    (dict(BLOCK_K=16), r"config keys must be among \['BLOCK_M', 'BLOCK_N', 'num_stages', 'num_warps'\]"),
])
def test_launchers_reject_unknown_config(device, config, match):
    args = _varlen_args(device)
    with pytest.raises(ValueError, match=match):
        EA.exact_attention_triton(**args, config=config)
    with pytest.raises(ValueError, match=match):
        EA.exact_decode_attention_triton(**_decode_args(device), config=config)


def test_forward_kernels_share_their_tile():
    """The varlen and the decode launches take one BLOCK_M, BLOCK_N and num_warps (the contract's arithmetic)."""
    for dev in ("cpu", "cuda"):
        for dtype, head_dim in ((torch.bfloat16, 128), (torch.float32, 64), (torch.bfloat16, 256)):
            q = SimpleNamespace(device=torch.device(dev), dtype=dtype, shape=(1, 1, head_dim))  # no GPU needed
            cfg = EA._forward_config(q)
            assert {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps")} == EA.forward_tile(q.device)


def test_kernels_import_as_package_and_implementations():
    from hybridengine.kernels import exact_attention

    for kernel in (exact_attention.exact_varlen_kernel, exact_attention.exact_decode_kernel,
                   exact_attention.exact_bwd_dkdv_kernel, exact_attention.exact_bwd_dq_kernel):
        assert hasattr(kernel, "run"), kernel
    assert EA.implementations("cuda") == {"exact_attention": "Triton", "exact_decode_attention": "Triton"}


# --------------------------------------------------------------------------------------------------
# GPU: Qwen2-7B shapes per GPU (28 q heads, 4 kv heads, head_dim 128), long contexts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_decode_equals_varlen_qwen2_7b(device, dtype):
    lens = [1, 63, 64, 65, 700, 1500]
    q, k, v, cu = packed(lens, 28, 4, 128, dtype, device)
    varlen = EA.exact_attention(q, k, v, cu, scale=128**-0.5, max_seqlen=max(lens))
    k_cache, v_cache, tables = paged(k, v, cu, 16)
    decode = decode_every_position(q, k_cache, v_cache, tables, cu, scale=128**-0.5)
    assert torch.equal(bits(decode), bits(varlen))
