"""decode_linear: the split-K Triton kernel against its fp32 reference and exact (fp64) products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridengine import linear as L


def exact(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def assert_within_bound(out, x, w, b):
    """|out - exact| <= delta + half an ulp of the output dtype at |exact| + delta, where delta bounds the
    fp32 summation's error: K * 2^-24 * sum|x_i w_i| (+ |b|, one more fp32 add)."""
    ref = exact(x, w, b)
    k = x.shape[1]
    mag = x.double().abs() @ w.double().abs().t()
    if b is not None:
        mag = mag + b.double().abs()
    delta = (k + 1) * 2.0**-24 * mag
    if out.dtype == torch.float32:
        half_ulp = torch.zeros_like(ref)
    else:
        mant = {torch.bfloat16: 8, torch.float16: 11}[out.dtype]
        top = (ref.abs() + delta).clamp_min(torch.finfo(out.dtype).tiny)
        half_ulp = 2.0 ** (torch.floor(torch.log2(top)) - mant)  # half of 2^(e - mant + 1)
    err = (out.double() - ref).abs()
    bound = delta + half_ulp
    worst = (err - bound).max().item()
    assert worst <= 0, f"error exceeds the bound by {worst:.3g} (max err {err.max().item():.3g})"


CASES = [
    pytest.param(1, 40, 72, True, id="M1-N40-K72-bias"),
    pytest.param(5, 130, 300, False, id="M5-N130-K300"),
    pytest.param(70, 64, 513, True, id="M70-N64-K513-bias"),
    pytest.param(33, 17, 96, False, id="M33-N17-K96"),
]
CONFIGS = [
    pytest.param(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1), id="one-pass"),
    pytest.param(dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3), id="split3"),
    pytest.param(dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, SPLIT_K=4), id="split4"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,n,k,has_bias", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_decode_linear_matches_exact_products(device, m, n, k, has_bias, config, dtype):
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * 0.05).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if has_bias else None
    out = L.decode_linear_triton(x, w, b, config=config)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_within_bound(out, x, w, b)
    assert_within_bound(L.decode_linear_ref(x, w, b), x, w, b)  # the reference meets the same bound


@pytest.mark.parametrize("split", [2, 5])
def test_split_k_is_deterministic_and_leaves_the_counters_at_zero(device, split):
    x = torch.randn(9, 256, device=device).to(torch.bfloat16)
    w = torch.randn(48, 256, device=device).to(torch.bfloat16)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=split)
    first = L.decode_linear_triton(x, w, config=cfg)
    for _ in range(2):  # the partials are merged in split order whichever program arrives last
        assert torch.equal(L.decode_linear_triton(x, w, config=cfg), first)
    assert int(L._counters[x.device].abs().sum()) == 0


def test_out_rows_strided_and_untouched_columns(device):
    # out may be a row-strided view (a slice of a wider buffer): the columns beside it stay as they were.
    x = torch.randn(6, 64, device=device).to(torch.bfloat16)
    w = torch.randn(20, 64, device=device).to(torch.bfloat16)
    buf = torch.full((6, 32), 7.0, device=device).to(torch.bfloat16)
    out = L.decode_linear_triton(x, w, out=buf[:, 4:24], config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=2))
    assert out.data_ptr() == buf[:, 4:24].data_ptr()
    assert torch.equal(buf[:, 4:24], L.decode_linear_triton(x, w, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16,
                                                                               SPLIT_K=2)))
    assert torch.equal(buf[:, :4], torch.full_like(buf[:, :4], 7.0)) and torch.equal(buf[:, 24:], torch.full_like(buf[:, 24:], 7.0))


def test_empty_and_k_zero(device):
    w = torch.randn(5, 0, device=device).to(torch.bfloat16)
    b = torch.randn(5, device=device).to(torch.bfloat16)
    assert torch.equal(L.decode_linear_triton(torch.zeros(3, 0, device=device).to(torch.bfloat16), w, b),
                       b.expand(3, 5))
    assert L.decode_linear_triton(torch.zeros(0, 8, device=device).to(torch.bfloat16),
                                  torch.zeros(5, 8, device=device).to(torch.bfloat16)).shape == (0, 5)


def test_decode_linear_off_cuda_is_f_linear():
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    assert torch.equal(L.decode_linear(x, w, b), F.linear(x, w, b))
    out = torch.empty(4, 3)
    assert L.decode_linear(x, w, b, out=out) is out and torch.equal(out, F.linear(x, w, b))
    assert torch.equal(L.decode_linear(x, w, out=out), F.linear(x, w))


def test_plan_splits_k_to_fill_the_gpu():
    # Qwen2.5-1.5B at B = 128 on 132 SMs: qkv [2048, 1536] has 32 tiles -> 4 splits (256 programs of 384 of K);
    # gate_up [17920, 1536] has 280 tiles: no split; o [1536, 1536] 24 tiles -> 4 (K >= 256 per split: at most 6).
    assert L.decode_linear_plan(128, 2048, 1536, 132)["SPLIT_K"] == 4
    assert L.decode_linear_plan(128, 17920, 1536, 132)["SPLIT_K"] == 1
    assert L.decode_linear_plan(128, 1536, 1536, 132)["SPLIT_K"] == 4
    assert L.decode_linear_plan(64, 1536, 8960, 132) == dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8,
                                                              num_warps=4, num_stages=4)
    assert L.decode_linear_plan(256, 8, 64, 132)["SPLIT_K"] == 1  # K too short to split


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(x=a["x"][0]), r"x must be a 2-D \[rows, in_features\] tensor, got \(16,\)"),
    (lambda a: a.update(x=a["x"].to(torch.int32)), "x must be bf16, fp16 or fp32, got torch.int32"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x must have unit stride in its last dim"),
    (lambda a: a.update(weight=a["weight"][:, :8]), r"weight must be \[out_features, 16\], got \(6, 8\)"),
    (lambda a: a.update(weight=a["weight"].float()), "weight must be a contiguous torch.bfloat16 tensor"),
    (lambda a: a.update(bias=a["bias"][:3]), r"bias must be None or a contiguous \[6\] torch.bfloat16 tensor"),
    (lambda a: a.update(out=torch.empty(3, 7, dtype=torch.bfloat16)), r"out must be a \[4, 6\] torch.bfloat16"),
    (lambda a: a.update(config=dict(BLOCK_Q=16)), "config keys must be among"),
    (lambda a: a.update(config=dict(BLOCK_N=24)), "config BLOCK_N must be a power of two >= 16, got 24"),
    (lambda a: a.update(config=dict(SPLIT_K=0)), r"config SPLIT_K must be an int in \[1, 64\], got 0"),
])
def test_bad_input(change, match):
    args = dict(x=torch.randn(4, 16).to(torch.bfloat16), weight=torch.randn(6, 16).to(torch.bfloat16),
                bias=torch.randn(6).to(torch.bfloat16), out=None, config=None)
    change(args)
    before = None if args["out"] is None else args["out"].clone()
    with pytest.raises(ValueError, match=match):
        L.decode_linear_triton(args["x"], args["weight"], args["bias"], out=args["out"], config=args["config"])
    if before is not None:
        assert torch.equal(args["out"], before)


def test_out_sharing_x_is_refused():
    x = torch.randn(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out must not share memory with x"):
        L.decode_linear_triton(x, torch.randn(4, 4).to(torch.bfloat16), out=x)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,has_bias", [(128, 2048, 1536, True), (64, 1536, 8960, False), (256, 3584, 1792, False)])
def test_decode_linear_plan_on_cuda_and_in_a_cuda_graph(m, n, k, has_bias):
    # The automatic plan at the decode shapes (split-K 4-8): the exact-product bound, then replays of a captured
    # call give the eager result bit for bit (the counters are back at zero after every launch).
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device=dev).to(torch.bfloat16) if has_bias else None
    assert L.decode_linear_plan(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)["SPLIT_K"] > 1
    eager = L.decode_linear(x, w, b)
    assert_within_bound(eager, x, w, b)
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        L.decode_linear(x, w, b, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        L.decode_linear(x, w, b, out=out)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(L._counters[dev].abs().sum()) == 0
