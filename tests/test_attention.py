"""KV store, paged decode attention and prefill attention (hybridengine.ops.kv_store, .paged_attention,
.prefill_attention): Triton kernels against their references.

On CPU the Triton launchers run under TRITON_INTERPRET=1 (conftest) on tiny shapes; the `gpu` tests
run the same comparisons at Qwen2-7B shapes. Unused cache slots and unused block-table columns point
at NaN, so any read past a sequence shows up as a NaN in the output.

Tolerances (STYLE.md habit 3): the exact answer is the reference in fp64 on the same inputs; the
kernel's max error against it must stay within K_TOL x the error of the same reference computed in
the input dtype (torch's own error in that dtype). The store is a copy: bitwise equality.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hybridengine.ops import _launch
from hybridengine.ops import kv_store as KV
from hybridengine.ops import paged_attention as PA
from hybridengine.ops import prefill_attention as PF

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
K_TOL = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 2.0}
"""Allowed multiple of torch's own error, on top of the one rounding of the output (`assert_close_to_exact`).
bf16/fp16: the kernels round once, at the output; before it their error is P's as the P.V dot sees it
(decode: `P_ERROR`; prefill: P rounded once to the dtype) plus fp32 rounding, checked on its own by
`test_paged_decode_partials_within_rounding_bound`, while torch in the input dtype rounds the scores and P
to it (2^-8 for bf16, 2^-11 for fp16) at every step. fp32: both compute in fp32 in a different order
(base-2 exponent, online rescaling); measured max ratio 0.83 under the interpreter."""
P_ERROR = {torch.bfloat16: (2.0**-14 if INTERPRETER else 2.0**-16, 0.0), torch.float16: (2.0**-22, 2.0**-25)}
"""(relative, absolute) error of one p as the decode kernel's P.V dot uses it, by dtype
(hybridengine/kernels/paged_attention.py). bf16: p_hi + p_lo, each cast to 8 significant bits, the residual
p - p_hi exact: 2^-8 x 2^-8 with round-to-nearest (GPU), 2^-7 x 2^-7 with the interpreter's truncating cast.
fp16: 2^-11 x 2^-11, and fp16 subnormals (p_lo, or p below 2^-14) leave half their spacing 2^-24 absolute."""


# --------------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN == NaN in comparisons."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def poisoned_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device,
                   *, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches full of NaN; `interleaved`: views of one [num_blocks, 2, ...] allocation (non-contiguous)."""
    if interleaved:
        kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
        return kv[:, 0], kv[:, 1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def paged_kv(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype, device, *,
             shared_prefix_blocks: int = 0, interleaved: bool = False, spare_blocks: int = 2):
    """Caches holding random K/V for each sequence's tokens in shuffled blocks, NaN elsewhere.

    Returns (k_cache, v_cache, block_tables). Table columns past a sequence's blocks alternate
    between -1 and the id of a NaN block. With `shared_prefix_blocks`, every sequence's first blocks
    are the same physical blocks (the n samples of one prompt)."""
    need = [math.ceil(n / block_size) for n in context_lens]
    own = [max(0, n - shared_prefix_blocks) for n in need]
    num_blocks = shared_prefix_blocks + sum(own) + spare_blocks
    k_cache, v_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                      interleaved=interleaved)
    perm = torch.randperm(num_blocks).tolist()
    prefix, rest, nan_block = perm[:shared_prefix_blocks], perm[shared_prefix_blocks:-spare_blocks], perm[-1]
    width = max(need) + 1
    table = torch.empty(len(context_lens), width, dtype=torch.int32)
    for b, n in enumerate(need):
        blocks = prefix[:n] + [rest.pop() for _ in range(n - min(n, shared_prefix_blocks))]
        garbage = [-1 if c % 2 else nan_block for c in range(width - n)]
        table[b] = torch.tensor(blocks + garbage, dtype=torch.int32)
    written = set()
    for b, n in enumerate(context_lens):
        slots = [int(table[b, t // block_size]) * block_size + t % block_size for t in range(n)]
        slots = [s for s in slots if s not in written]  # a shared prefix is stored once
        written.update(slots)
        key = torch.randn(len(slots), num_kv_heads, head_dim, dtype=dtype, device=device)
        KV.store_kv_ref(key, torch.randn_like(key), k_cache, v_cache, torch.tensor(slots, device=device))
    return k_cache, v_cache, table.to(device)


def output_rounding(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The error of rounding the exact output to `dtype` once: half an ulp of the largest value, a whole
    ulp for bf16 under the interpreter, whose fp32 -> bf16 cast truncates (the GPU rounds to nearest)."""
    top = exact.abs().max().item()
    if top == 0:
        return 0.0
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top))
    return ulp if INTERPRETER and dtype == torch.bfloat16 else 0.5 * ulp


def assert_close_to_exact(out: torch.Tensor, exact: torch.Tensor, torch_same_dtype: torch.Tensor,
                          extra: float = 0.0) -> None:
    """max |out - exact| <= K_TOL x max |torch in out's dtype - exact| + the output's own rounding (+ extra)."""
    assert out.shape == exact.shape and out.dtype == torch_same_dtype.dtype
    assert torch.isfinite(out).all(), "non-finite output: a poisoned slot or block was read"
    err = (out.double() - exact).abs().max().item()
    torch_err = (torch_same_dtype.double() - exact).abs().max().item()
    bound = K_TOL[out.dtype] * torch_err + output_rounding(exact, out.dtype) + extra
    assert err <= bound, (f"max error {err:.3g} > {K_TOL[out.dtype]} x torch's {out.dtype} error {torch_err:.3g} "
                          f"+ output rounding {output_rounding(exact, out.dtype):.3g} + {extra:.3g}")


def gpu_exp2_error(v_cache: torch.Tensor, table: torch.Tensor, lens, block_n: int, dtype: torch.dtype) -> float:
    """fp32 on the GPU: Triton's exp2 is ex2.approx, 2 ulps (2^-23 relative), where the interpreter's numpy
    exp2 (and torch's softmax, whose error K_TOL scales) round correctly. Seen: 8.45e-7 against a bound of
    3.35e-7 without this term (test_paged_decode_fp32_and_shared_prefix on the GPU). A key's
    weight passes through its own exp2, at most T - 1 tile rescales (T tiles in a context) and a
    split-K merge weight: (T + 1) x 2^-23 relative; the output is a ratio of two such weighted sums
    (numerator and denominator), so its error is at most 2 x (T + 1) x 2^-23 x max |v|. bf16/fp16
    outputs round far coarser: 0 for them, and on CPU."""
    if dtype != torch.float32 or v_cache.device.type != "cuda":
        return 0.0
    tiles = math.ceil(max(int(n) for n in lens) / block_n)
    block_size = v_cache.shape[1]
    # visible values only: the rest is poison
    top = max((PA._gather_keys(v_cache, table[b, :math.ceil(n / block_size)], n).abs().max().item()
               for b, n in enumerate(int(n) for n in lens) if n), default=0.0)
    return 2 * (tiles + 1) * 2.0**-23 * top


def decode_inputs(num_q_heads, num_kv_heads, head_dim, block_size, context_lens, dtype, device, **kw):
    k_cache, v_cache, table = paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, device, **kw)
    q = torch.randn(len(context_lens), num_q_heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, table, torch.tensor(context_lens, dtype=torch.int32, device=device)


def check_decode(q, k_cache, v_cache, table, lens, *, sliding_window=None, **kw) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    out = PA.paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale=scale,
                                           sliding_window=sliding_window, **kw)
    exact = PA.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, lens, scale=scale,
                                          sliding_window=sliding_window)
    same = PA.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=scale,
                                         sliding_window=sliding_window, compute_dtype=q.dtype)
    block_n = (kw.get("config") or {}).get("BLOCK_N") or PA._decode_config(q.device, q.shape[-1])["BLOCK_N"]
    assert_close_to_exact(out, exact, same, gpu_exp2_error(v_cache, table, lens.tolist(), block_n, q.dtype))
    return out


# --------------------------------------------------------------------------------------------------
# store_kv


def assert_slots_hold(k_cache, v_cache, slots, key, value) -> None:
    """Each token with a slot (>= 0) has its key/value rows there bit for bit; every other slot is still NaN."""
    block_size = k_cache.shape[1]
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    assert torch.equal(bits(k_cache[blocks, offsets]), bits(key[keep]))
    assert torch.equal(bits(v_cache[blocks, offsets]), bits(value[keep]))
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    untouched[blocks, offsets] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size,dtype,interleaved", [
    pytest.param(2, 64, 16, torch.bfloat16, False, id="bf16-d64-bs16"),
    pytest.param(4, 128, 32, torch.float16, True, id="fp16-d128-bs32-interleaved"),
    pytest.param(3, 80, 5, torch.float32, False, id="fp32-d80-bs5"),
])
def test_store_kv_matches_reference(device, num_kv_heads, head_dim, block_size, dtype, interleaved):
    num_tokens, num_q_heads, num_blocks = 13, 2 * num_kv_heads, 4
    # key/value as views of a fused QKV projection output: token stride != num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    key = (qkv[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim]
           .view(num_tokens, num_kv_heads, head_dim))
    value = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[0, 5, 12]] = -1  # padding tokens, first, middle and last
    slots = slots.to(device)
    k_cache, v_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                      interleaved=interleaved)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    KV.store_kv_triton(key, value, k_cache, v_cache, slots)
    KV.store_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))
    assert_slots_hold(k_cache, v_cache, slots, key, value)


def test_store_kv_no_tokens_and_all_padding(device):
    k_cache, v_cache = poisoned_cache(2, 16, 1, 64, torch.bfloat16, device)
    for n in (0, 3):
        key = torch.randn(n, 1, 64, dtype=torch.bfloat16, device=device)
        KV.store_kv_triton(key, key, k_cache, v_cache, torch.full((n,), -1, dtype=torch.int64, device=device))
    assert k_cache.isnan().all() and v_cache.isnan().all()


def _store_args(device):
    key = torch.randn(5, 2, 64, dtype=torch.bfloat16, device=device)
    k_cache, v_cache = poisoned_cache(2, 16, 2, 64, torch.bfloat16, device)
    return dict(key=key, value=key.clone(), k_cache=k_cache, v_cache=v_cache,
                slot_mapping=torch.arange(5, device=device))


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(key=a["key"][:, :, None]), "store_kv: key must be 3-D"),
    (lambda a: a.update(value=a["value"][:4]), r"value must have shape \(5, 2, 64\)"),
    (lambda a: a.update(value=a["value"].half()), "value must be torch.bfloat16, got torch.float16"),
    (lambda a: a.update(key=a["key"].int(), value=a["value"].int()), "key must be torch.bfloat16 or torch.float16 or"),
    (lambda a: a.update(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()),
     "k_cache must be torch.bfloat16, got torch.float16"),
    (lambda a: a.update(v_cache=a["v_cache"][:1]), r"v_cache must have shape \(2, 16, 2, 64\)"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :32], v_cache=a["v_cache"][..., :32]), "k_cache has head_dim 32"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :1], v_cache=a["v_cache"][:, :, :1]), "k_cache has 1 kv heads"),
    (lambda a: a.update(key=a["key"].transpose(1, 2).contiguous().transpose(1, 2)), "key must have unit stride"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be torch.int64"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:4]), r"slot_mapping must have shape \(5,\)"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].to("meta")), "slot_mapping is on meta"),
    (lambda a: a.update(k_cache=a["k_cache"].to("meta")), "k_cache is on meta"),
])
def test_store_kv_bad_input(device, change, match):
    args = _store_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        KV.store_kv(**args)


@pytest.mark.parametrize("slot,match", [(32, "slot 32 but the cache holds 32 slots"), (1, "one slot twice")])
def test_store_kv_ref_checks_slot_values(device, slot, match):
    args = _store_args(device)
    args["slot_mapping"][4] = slot
    with pytest.raises(ValueError, match=match):
        KV.store_kv_ref(**args)


# --------------------------------------------------------------------------------------------------
# rope_store_kv (the rollout's rotary embedding + KV store in one kernel)


def _rope_store_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, device,
                       seed=0):
    """q, k, v as views of one fused QKV output; cos/sin of random angles; slots with padding (-1) first,
    in the middle and last."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    nq, nk = num_q_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :nq].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, nq:nq + nk].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, nq + nk:].view(num_tokens, num_kv_heads, head_dim)
    angle = torch.rand(num_tokens, head_dim // 2, generator=g) * 1000
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, num_tokens // 2, num_tokens - 1]] = -1
    return qkv, q, k, v, cos, sin, slots.to(device)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,dtype", [
    pytest.param(4, 4, 64, 16, torch.bfloat16, id="bf16-mha-d64-bs16"),
    pytest.param(12, 2, 128, 16, torch.bfloat16, id="bf16-gqa6-d128-bs16"),
    pytest.param(7, 1, 32, 5, torch.float16, id="fp16-gqa7-d32-bs5"),
    pytest.param(6, 3, 80, 3, torch.float32, id="fp32-gqa2-d80-bs3"),
])
def test_rope_store_kv_matches_reference(device, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    """Rotation and store bit for bit the reference's (rope_ref then store_kv_ref): q and k rotated in place,
    the cache holding the rotated k and v at the slots, every other slot still NaN, padding tokens rotated."""
    num_tokens, num_blocks = 11, 4
    qkv, q, k, v, cos, sin, slots = _rope_store_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size,
                                                       num_blocks, dtype, device, seed=num_q_heads * head_dim)
    v_before = v.clone()
    k_cache, v_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = KV.rope_store_kv_ref(q.clone(), k.clone(), v, cos, sin, k_ref_cache, v_ref_cache, slots)
    q_out, k_out = KV.rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(bits(k), bits(k_ref))
    assert torch.equal(bits(v), bits(v_before))
    assert torch.equal(bits(k_cache), bits(k_ref_cache)) and torch.equal(bits(v_cache), bits(v_ref_cache))
    assert_slots_hold(k_cache, v_cache, slots, k_ref, v)


def test_rope_store_kv_equals_rope_then_store(device):
    """The fused kernel against the two kernels it replaces (rope.rope_triton_, store_kv_triton), bit for bit."""
    from hybridengine.ops.rope import rope_triton_

    _, q, k, v, cos, sin, slots = _rope_store_inputs(9, 12, 2, 64, 4, 6, torch.bfloat16, device)
    k_cache, v_cache = poisoned_cache(6, 4, 2, 64, torch.bfloat16, device)
    k_two, v_two = k_cache.clone(), v_cache.clone()
    q2, k2 = rope_triton_(q.clone(), k.clone(), cos, sin)
    KV.store_kv_triton(k2, v, k_two, v_two, slots)
    KV.rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(bits(q), bits(q2)) and torch.equal(bits(k), bits(k2))
    assert torch.equal(bits(k_cache), bits(k_two)) and torch.equal(bits(v_cache), bits(v_two))


def test_rope_store_kv_no_tokens(device):
    k_cache, v_cache = poisoned_cache(2, 4, 1, 16, torch.bfloat16, device)
    q = torch.empty(0, 2, 16, dtype=torch.bfloat16, device=device)
    k = torch.empty(0, 1, 16, dtype=torch.bfloat16, device=device)
    cs = torch.empty(0, 16, dtype=torch.bfloat16, device=device)
    out = KV.rope_store_kv_triton(q, k, k, cs, cs, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert out[0].shape == (0, 2, 16) and k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cos=a["cos"][:, :8]), r"rope_store_kv: cos must have shape \(5, 16\)"),
    (lambda a: a.update(q=a["q"][..., :15], k=a["k"][..., :15], v=a["v"][..., :15]), "head_dim must be even"),
    (lambda a: a.update(k=a["k"].half()), "rope_store_kv: k must be"),
    (lambda a: a.update(v=a["v"][:4]), r"v must have shape \(5, 2, 16\)"),
    (lambda a: a.update(v=a["v"].half()), "v must be torch.bfloat16, got torch.float16"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :1], v_cache=a["v_cache"][:, :, :1]), "k_cache has 1 kv heads"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), r"slot_mapping must have shape \(5,\)"),
])
def test_rope_store_kv_bad_input_changes_nothing(device, change, match):
    """A rejected call (the op checks on every device) names the argument and leaves q, k and the cache as they were."""
    _, q, k, v, cos, sin, slots = _rope_store_inputs(5, 4, 2, 16, 4, 4, torch.bfloat16, device)
    k_cache, v_cache = poisoned_cache(4, 4, 2, 16, torch.bfloat16, device)
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    before = {name: t.clone() for name, t in args.items()}
    change(args)
    with pytest.raises(ValueError, match=match):
        KV.rope_store_kv(**args)
    for name, t in (("q", q), ("k", k), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert torch.equal(bits(t), bits(before[name])), name


# --------------------------------------------------------------------------------------------------
# paged decode attention


DECODE_CASES = [
    pytest.param(2, 2, 64, 16, [1, 17, 45], {}, id="mha-bs16-lens1,17,45"),
    pytest.param(8, 2, 64, 32, [33, 100, 2], {}, id="gqa4-bs32-lens33,100,2"),
    pytest.param(7, 1, 128, 16, [70], {}, id="gqa7-d128-B1"),
    pytest.param(28, 4, 128, 16, [16, 1, 31], {}, id="qwen2-7b-heads"),
    pytest.param(4, 1, 80, 8, [45], {"interleaved": True}, id="gqa4-d80-bs8-strided-cache"),
]


@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-pass", "split"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,lens,kw", DECODE_CASES)
def test_paged_decode_matches_reference(device, num_q_heads, num_kv_heads, head_dim, block_size, lens, kw, num_splits):
    inputs = decode_inputs(num_q_heads, num_kv_heads, head_dim, block_size, lens, torch.bfloat16, device, **kw)
    # 32-token tiles: small contexts split on the GPU too (a split launch takes 128-token tiles there).
    config = dict(BLOCK_N=32)
    if num_splits > 1:  # the split path must really run with more than one partition
        plan = PA.decode_partitions(inputs[3].shape[1] * block_size, num_splits, config["BLOCK_N"])
        assert plan[0] > 1, plan
    check_decode(*inputs, num_splits=num_splits, config=config)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split"])
@pytest.mark.parametrize("block_n,window", [(32, None), (16, 5), (64, 40)])
def test_paged_decode_prefetch_is_bitwise_the_same(device, block_n, window, num_splits):
    # PREFETCH only moves each K/V tile's load one iteration earlier: the same tiles meet the same math in
    # the same order, so the outputs are equal bit for bit (odd lengths: partial pages and tiles, a length
    # 1 row, and a tile past the partition's end that the prefetch must mask off).
    inputs = decode_inputs(8, 2, 64, 16, [1, 9, 77, 33], torch.bfloat16, device)
    kw = dict(sliding_window=window, num_splits=num_splits)
    cfg = dict(BLOCK_N=block_n)
    plain = check_decode(*inputs, **kw, config=cfg | dict(PREFETCH=False))
    fetched = check_decode(*inputs, **kw, config=cfg | dict(PREFETCH=True))
    assert torch.equal(plain, fetched)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split"])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_paged_decode_sliding_window(device, window, num_splits):
    inputs = decode_inputs(8, 2, 64, 16, [1, 9, 77], torch.bfloat16, device)
    check_decode(*inputs, sliding_window=window, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split"])
def test_paged_decode_fp16(device, num_splits):
    # fp16 runs the 16-bit dots natively under the interpreter too (its bf16 dot is emulated in fp32).
    inputs = decode_inputs(7, 1, 128, 16, [70, 5, 33], torch.float16, device)
    check_decode(*inputs, num_splits=num_splits)


class _CapturePartials:
    """Stands in for the split-K merge kernel: keeps the fp32 (acc, m, l) of the partitions it is launched with."""

    def __getitem__(self, grid):
        def launch(acc_part, m_part, l_part, *args, **kwargs):
            self.acc, self.m, self.l = acc_part.clone(), m_part.clone(), l_part.clone()
        return launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_paged_decode_partials_within_rounding_bound(device, monkeypatch, dtype):
    """The split-K partials, fp32 before the merge and the output rounding (which at 2^-9 for bf16 hides P's
    rounding in the other tests), against fp64 on the kernel's own running max m: acc = sum_j p_j v_j and
    l = sum_j p_j with p_j = 2^(s_j - m), s_j = q.k_j x scale x log2(e). Bound, first order, per p_j: P_ERROR
    plus fp32 roundings in units u = 2^-24: the score's (D products summed, x scale rounded twice) and the
    exponent's arguments (s_j - m at its tile, the rescales' m differences: 4 max|s| in all), times ln 2;
    2 ulps per exp2 (its own and the T - 1 rescales a tile passes through at most); the T rescaling products;
    and the 2N + T fp32 sums at 2u each (tensor cores may truncate)."""
    from hybridengine.kernels import paged_attention as kernels

    capture = _CapturePartials()
    monkeypatch.setattr(kernels, "paged_decode_reduce_kernel", capture)
    num_q_heads, num_kv_heads, head_dim, block_size, lens = 8, 2, 64, 16, [150, 77]
    q, k_cache, v_cache, table, context_lens = decode_inputs(num_q_heads, num_kv_heads, head_dim, block_size, lens,
                                                             dtype, device)
    scale, group = head_dim**-0.5, num_q_heads // num_kv_heads
    PA.paged_decode_attention_triton(q, k_cache, v_cache, table, context_lens, scale=scale, num_splits=2)
    num_parts, size = PA.decode_partition_plan(len(lens), num_kv_heads, head_dim, table.shape[1] * block_size,
                                               device, 2)
    assert num_parts == 2 and capture.m.shape == (len(lens), num_q_heads, num_parts), (num_parts, capture.m.shape)
    block_n = PA._decode_config(device, head_dim)["BLOCK_N"]
    c, u = scale * math.log2(math.e), 2.0**-24
    rel_p, abs_p = P_ERROR[dtype]
    for b, n in enumerate(lens):
        blocks = table[b, :math.ceil(n / block_size)]
        keys, values = (PA._gather_keys(cache, blocks, n).double().repeat_interleave(group, dim=1)
                        for cache in (k_cache, v_cache))
        for part in range(num_parts):
            lo, hi = part * size, n if part == num_parts - 1 else min(n, (part + 1) * size)
            m, l, acc = capture.m[b, :, part], capture.l[b, :, part], capture.acc[b, :, part, :head_dim]
            if lo >= hi:  # an empty partition
                assert (m == float("-inf")).all() and (l == 0).all() and (acc == 0).all()
                continue
            k, v, qb = keys[lo:hi], values[lo:hi], q[b].double()
            s = torch.einsum("hd,nhd->hn", qb, k) * c
            qk_abs = torch.einsum("hd,nhd->hn", qb.abs(), k.abs()) * c
            p = torch.exp2(s - m.double()[:, None])
            num_keys, tiles = hi - lo, math.ceil((hi - lo) / block_n)
            rel = u * (math.log(2) * (head_dim * qk_abs + 2 * s.abs() + 4 * s.abs().amax(1, keepdim=True))
                       + 4 * tiles + tiles + 2 * (2 * num_keys + tiles))
            l_err = (l.double() - p.sum(1)).abs()
            assert (l_err <= (p * rel).sum(1)).all(), (b, part, l_err, (p * rel).sum(1))
            acc_err = (acc.double() - torch.einsum("hn,nhd->hd", p, v)).abs()
            bound = torch.einsum("hn,nhd->hd", p * (rel_p + rel), v.abs()) + abs_p * v.abs().sum(0)
            worst = (acc_err / bound).max().item()
            assert worst <= 1.0, f"sequence {b} partition {part}: acc error {worst:.3g} x its bound"


def test_paged_decode_fp32_and_shared_prefix(device):
    # Two samples of one prompt share 2 prefix blocks; fp32 runs the "ieee" dot.
    inputs = decode_inputs(4, 2, 64, 16, [40, 37], torch.float32, device, shared_prefix_blocks=2)
    assert torch.equal(inputs[3][0, :2], inputs[3][1, :2])
    check_decode(*inputs, num_splits=2)


def test_paged_decode_padding_rows_and_max_context_len(device):
    """context_lens 0 (CUDA-graph padding rows) gives zeros; max_context_len only sizes the partitions."""
    q, k_cache, v_cache, table, lens = decode_inputs(4, 1, 64, 16, [47, 1, 30], torch.bfloat16, device)
    lens[1] = 0
    # Capacity 64 tokens, 32-token tiles: (2, None) and (3, 33) -> 2 partitions of 32; (2, 16) -> one
    # partition of 32 for a hint below the longest context (47): the last partition runs to the end.
    for num_splits, max_context_len in ((1, None), (2, None), (2, 16), (3, 33)):
        out = check_decode(q, k_cache, v_cache, table, lens, num_splits=num_splits, max_context_len=max_context_len)
        assert (out[1] == 0).all()
    out = torch.empty_like(q)
    assert PA.paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale=0.125, out=out) is out


def test_decode_config_takes_the_prefetch_launch_for_few_programs(monkeypatch):
    # On an H200 (132 SMs): a one-pass launch of <= 264 programs prefetches in registers with 64-token tiles
    # and 8 warps; more programs, or a split launch, keep Triton's pipelined configs.
    monkeypatch.setattr(PA, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    few = PA._decode_config(cuda, 128, programs=2 * 132)
    assert few == dict(BLOCK_N=64, num_warps=8, num_stages=1, PREFETCH=True)
    assert PA._decode_config(cuda, 128, programs=2 * 132 + 1) == dict(BLOCK_N=32, num_warps=4, num_stages=4)
    assert PA._decode_config(cuda, 128, split=True, programs=4) == dict(BLOCK_N=128, num_warps=4, num_stages=3)
    assert PA._decode_config(cuda, 256, programs=4) == dict(BLOCK_N=32, num_warps=4, num_stages=2)
    assert PA._decode_config(torch.device("cpu"), 128, programs=4) == dict(BLOCK_N=32, num_warps=4, num_stages=1)


def test_paged_decode_config_override(device):
    """The tuning override (tile, warps, stages) changes the launch, not the result; partitions follow its tile."""
    inputs = decode_inputs(7, 1, 64, 16, [70, 33, 5], torch.bfloat16, device)
    for config in (dict(BLOCK_N=16, num_warps=2), dict(BLOCK_N=64, num_stages=2)):
        check_decode(*inputs, num_splits=3, config=config)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_paged_decode_merge_over_several_chunks(device, monkeypatch, head_dim):
    """The split-K merge loops over partitions CHUNK_P at a time and splits head_dim over programs:
    with 2-partition chunks, 5 partitions take three loads (the last partly masked)."""
    monkeypatch.setattr(PA, "DECODE_REDUCE_CHUNK", 2)
    monkeypatch.setattr(PA, "DECODE_REDUCE_BLOCK_D", 16)
    inputs = decode_inputs(4, 2, head_dim, 16, [150, 97, 3], torch.bfloat16, device)
    check_decode(*inputs, num_splits=5)


def test_decode_num_splits_rule():
    sms = 132  # H200
    assert PA.decode_num_splits(128, 4, 1024, sms) == 1         # 512 programs fill the GPU
    assert PA.decode_num_splits(17, 4, 1024, sms) == 1          # 68 programs: at least half the SMs
    assert PA.decode_num_splits(64, 2, 1024, sms) == 1          # 1.5B decode batch: 128 programs
    assert PA.decode_num_splits(16, 4, 4096, sms) == 4          # 64 programs -> 264 // 64: two full waves
    assert PA.decode_num_splits(16, 4, 300, sms) == 3           # partitions >= 128 tokens
    assert PA.decode_num_splits(1, 4, 16384, sms) == 66         # 264 // 4
    assert PA.decode_partitions(16384, 66, 128) == (64, 256)    # 249 rounded up to whole 128-token tiles
    assert PA.decode_num_splits(1, 4, 4096, sms) == 32          # 66 wanted, 128 tokens at least
    assert PA.decode_num_splits(1, 1, 10**6, 1024) == 512       # capped at DECODE_MAX_SPLITS
    assert PA.decode_num_splits(1, 4, 100, sms) == 1
    assert PA.decode_partitions(100, 3, 32) == (2, 64)         # 34 rounded up to whole 32-token tiles
    assert PA.decode_partitions(65, 1, 32) == (1, 96)


def _decode_args(device):
    q, k_cache, v_cache, table, lens = decode_inputs(4, 2, 64, 16, [5, 20], torch.bfloat16, device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=lens, scale=0.125)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][None]), "paged_decode_attention: q must be 3-D"),
    (lambda a: a.update(q=a["q"].double()), "q must be torch.bfloat16 or torch.float16 or"),
    (lambda a: a.update(q=a["q"][:, :3]), r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (lambda a: a.update(q=a["q"][..., :32]), "k_cache has head_dim 64, the inputs have head_dim 32"),
    (lambda a: a.update(q=a["q"].half()), "k_cache must be torch.float16, got torch.bfloat16"),
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "q must have unit stride"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :, None]), "k_cache must be 4-D"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :8]), r"v_cache must have shape \(\d+, 16, 2, 64\)"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be torch.int32"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must have one row per sequence"),
    (lambda a: a.update(block_tables=a["block_tables"].to("meta")), "block_tables is on meta"),
    (lambda a: a.update(context_lens=a["context_lens"].long()), "context_lens must be torch.int32"),
    (lambda a: a.update(context_lens=a["context_lens"][:1]), r"context_lens must have shape \(2,\)"),
    (lambda a: a.update(scale=0.0), r"scale must be in \(0, inf\)"),
    (lambda a: a.update(sliding_window=0), r"sliding_window must be in \[1, inf\)"),
    (lambda a: a.update(num_splits=0), r"num_splits must be in \[1, 512\]"),
    (lambda a: a.update(max_context_len=10**6), r"max_context_len must be in \[1, 48\]"),
    (lambda a: a.update(out=a["q"].float()), "out must be torch.bfloat16"),
])
def test_paged_decode_bad_input(device, change, match):
    args = _decode_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        PA.paged_decode_attention(**args)


@pytest.mark.parametrize("config,match", [
    (dict(BLOCK_M=16), r"config keys must be among \['BLOCK_N', 'PREFETCH', 'num_stages', 'num_warps'\]"),
    (dict(PREFETCH=1), "config PREFETCH must be a bool, got 1"),
])
def test_paged_decode_bad_config(device, config, match):
    with pytest.raises(ValueError, match=match):
        PA.paged_decode_attention_triton(**_decode_args(device), config=config)


@pytest.mark.parametrize("change,match", [
    (lambda a: a["context_lens"].fill_(49), r"context_lens\[0\] = 49 is outside \[0, 48\]"),
    (lambda a: a["block_tables"].fill_(-1), r"block_tables\[0\] has block ids \[-1\]"),
])
def test_paged_decode_ref_checks_index_values(device, change, match):
    args = _decode_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        PA.paged_decode_attention_ref(**args)


# --------------------------------------------------------------------------------------------------
# prefill attention


def prefill_inputs(num_q_heads, num_kv_heads, head_dim, lens_q, lens_k, dtype, device):
    """q, packed k/v and their cu_seqlens."""
    q = torch.randn(sum(lens_q), num_q_heads, head_dim, dtype=dtype, device=device)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    k = torch.randn(sum(lens_k), num_kv_heads, head_dim, dtype=dtype, device=device)
    return dict(q=q, k=k, v=torch.randn_like(k), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k))


def check_prefill(args: dict, sliding_window=None) -> torch.Tensor:
    """The kernel (16-bit dots with P rounded once to the dtype, as flash-attention) within K_TOL of torch's
    own error."""
    args = dict(args, scale=args["q"].shape[-1] ** -0.5, sliding_window=sliding_window)
    out = PF.prefill_attention_triton(**args)
    wide = {name: (t.double() if t.is_floating_point() else t) for name, t in args.items()
            if isinstance(t, torch.Tensor)}
    exact = PF.prefill_attention_ref(**{**args, **wide})
    same = PF.prefill_attention_ref(**args, compute_dtype=args["q"].dtype)
    assert_close_to_exact(out, exact, same)
    return out


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window4"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,lens_q,lens_k", [
    pytest.param(2, 2, 64, [1, 5, 19], [1, 5, 19], id="mha-self"),
    pytest.param(4, 1, 64, [16, 32], [16, 33], id="gqa4-tile-edges"),
    pytest.param(8, 2, 64, [3, 1, 17], [10, 7, 17], id="gqa4-bottom-right"),
    pytest.param(7, 1, 128, [18], [18], id="gqa7-d128"),
])
def test_prefill_dense_matches_reference(device, num_q_heads, num_kv_heads, head_dim, lens_q, lens_k, window):
    check_prefill(prefill_inputs(num_q_heads, num_kv_heads, head_dim, lens_q, lens_k, torch.bfloat16, device), window)


def test_prefill_fp16(device):
    check_prefill(prefill_inputs(8, 2, 64, [3, 1, 17], [10, 7, 17], torch.float16, device), None)


def test_prefill_rows_without_keys_are_zero(device):
    # len_k < len_q: the first len_q - len_k queries see nothing (flash-attn gives zeros too).
    out = check_prefill(prefill_inputs(4, 2, 64, [5], [2], torch.bfloat16, device))
    assert (out[:3] == 0).all() and (out[3:] != 0).any()


def test_prefill_bad_config(device):
    args = dict(prefill_inputs(4, 2, 64, [3], [3], torch.bfloat16, device), scale=0.125)
    with pytest.raises(ValueError, match=r"config keys must be among .*, got \['BLOCK_K'\]"):
        PF.prefill_attention_triton(**args, config={"BLOCK_K": 32})


def test_prefill_fp32(device):
    check_prefill(prefill_inputs(4, 2, 64, [6, 17], [6, 20], torch.float32, device))


def _prefill_args(device):
    return dict(prefill_inputs(4, 2, 64, [3, 5], [3, 20], torch.bfloat16, device), scale=0.125)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][0]), "prefill_attention: q must be 3-D"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be torch.int32"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:2]), r"cu_seqlens_k must have shape \(3,\)"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].to("meta")), "cu_seqlens_k is on meta"),
    (lambda a: a.update(max_seqlen_q=None), "max_seqlen_q must be a finite integer"),
    (lambda a: a.update(k=a["k"].half()), "k must be torch.bfloat16, got torch.float16"),
    (lambda a: a.update(v=a["v"][:4]), r"v must have shape \(23, 2, 64\)"),
    (lambda a: a.update(k=a["k"][:, :, :32], v=a["v"][:, :, :32]), "k has head_dim 32, q has head_dim 64"),
    (lambda a: a.update(q=a["q"][:, :3]), r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    (lambda a: a.update(k=None), "k must be a torch.Tensor"),
    (lambda a: a.update(sliding_window=-1), r"sliding_window must be in \[1, inf\)"),
])
def test_prefill_bad_input(device, change, match):
    args = _prefill_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        PF.prefill_attention(**args)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(max_seqlen_k=19), "sequence 1 has 5 queries and 20 keys, over"),
    (lambda a: a["cu_seqlens_q"].__setitem__(2, 7), r"cu_seqlens_q must run from 0 to total_q = 8"),
])
def test_prefill_ref_checks_index_values(device, change, match):
    args = _prefill_args(device)
    change(args)
    with pytest.raises(ValueError, match=match):
        PF.prefill_attention_ref(**args)


# --------------------------------------------------------------------------------------------------
# dispatch


def test_ops_run_the_reference_on_cpu():
    dev = torch.device("cpu")
    args = _decode_args(dev)
    torch.testing.assert_close(PA.paged_decode_attention(**args), PA.paged_decode_attention_ref(**args),
                               rtol=0, atol=0)
    pargs = _prefill_args(dev)
    torch.testing.assert_close(PF.prefill_attention(**pargs), PF.prefill_attention_ref(**pargs), rtol=0, atol=0)
    sargs, ref = _store_args(dev), _store_args(dev)
    ref["key"], ref["value"] = sargs["key"], sargs["value"]
    KV.store_kv(**sargs)
    KV.store_kv_ref(**ref)
    assert torch.equal(bits(sargs["k_cache"]), bits(ref["k_cache"]))
    ops = KV.implementations("cpu") | PA.implementations("cpu") | PF.implementations("cpu")
    assert ops == {op: "torch reference" for op in
                   ("store_kv", "rope_store_kv", "paged_decode_attention", "prefill_attention")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton launchers on CPU tensors: only the "
                    "interpreter (CPU CI) can; on a GPU the ops take the kernels without a patch")
def test_ops_take_the_kernels_where_use_kernel_says(monkeypatch):
    """The ops dispatch through `_launch.use_kernel` (looked up per call): patched, they run the launchers on CPU."""
    dev = torch.device("cpu")
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    args = _decode_args(dev)
    assert torch.equal(PA.paged_decode_attention(**args), PA.paged_decode_attention_triton(**args))
    pargs = _prefill_args(dev)
    assert torch.equal(PF.prefill_attention(**pargs), PF.prefill_attention_triton(**pargs))


def test_kernels_import_as_package():
    from hybridengine.kernels import kv_cache, paged_attention, prefill_attention

    for kernel in (kv_cache.store_kv_kernel, kv_cache.rope_store_kv_kernel, paged_attention.paged_decode_kernel,
                   paged_attention.paged_decode_reduce_kernel, prefill_attention.prefill_attention_kernel):
        assert hasattr(kernel, "run"), kernel


# --------------------------------------------------------------------------------------------------
# GPU: Qwen2-7B shapes per GPU (28 q heads, 4 kv heads, head_dim 128), bf16, block_size 16


QWEN2_7B = dict(num_q_heads=28, num_kv_heads=4, head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_paged_decode_qwen2_7b(device, num_splits):
    lens = torch.randint(900, 1100, (64,)).tolist()
    check_decode(*decode_inputs(block_size=16, context_lens=lens, dtype=torch.bfloat16, device=device, **QWEN2_7B),
                 num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_paged_decode_long_context_split(device):
    inputs = decode_inputs(block_size=16, context_lens=[16000], dtype=torch.bfloat16, device=device, **QWEN2_7B)
    check_decode(*inputs)  # auto: split-K over ~64 partitions
    check_decode(*inputs, sliding_window=4096)


@pytest.mark.gpu
def test_gpu_store_kv_qwen2_7b(device):
    k_cache, v_cache = poisoned_cache(4096, 16, 4, 128, torch.bfloat16, device)
    key = torch.randn(2000, 4, 128, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(4096 * 16, device=device)[:2000]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    KV.store_kv(key, -key, k_cache, v_cache, slots)
    KV.store_kv_ref(key, -key, k_ref, v_ref, slots)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))


@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [0, 256], ids=["self", "prefix256"])
def test_gpu_prefill_qwen2_7b(device, prefix):
    lens_q = torch.randint(100, 500, (8,)).tolist()
    lens_k = [n + prefix for n in lens_q]
    args = prefill_inputs(28, 4, 128, lens_q, lens_k, torch.bfloat16, device)
    check_prefill(args)
    check_prefill(args, sliding_window=128)


@pytest.mark.gpu
def test_gpu_prefill_dispatch(device):
    """The op as the engine calls it: flash-attn's varlen kernel when installed, else Triton."""
    args = prefill_inputs(28, 4, 128, [300, 17, 129], [300, 17, 129], torch.bfloat16, device)
    args = dict(args, scale=128**-0.5)
    out = PF.prefill_attention(**args)
    wide = {k: v.double() for k, v in args.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    exact = PF.prefill_attention_ref(**{**args, **wide})
    # flash-attn rounds P to bf16 before P @ V: allow torch's bf16 error twice over
    same = PF.prefill_attention_ref(**args, compute_dtype=torch.bfloat16)
    err, torch_err = ((t.double() - exact).abs().max().item() for t in (out, same))
    assert err <= 2 * torch_err + output_rounding(exact, torch.bfloat16)
