"""`grouped_gemm` and `grouped_mlp` (hybridengine.ops.grouped_gemm): the Triton kernels (on the GPU, or on CPU
under the interpreter with `_launch.use_kernel` patched) and the torch paths against the plain-torch references,
gradients, batch invariance in exact mode, the deterministic k-sum, and the argument checks.

Tolerance against float64 (the reference evaluated on the same rounded inputs): a 16-bit output is one
rounding of an fp32 sum, as torch's same-dtype GEMM is; the fp32 sums differ in order only, far below the
16-bit ulp, so the kernel's error stays within 2x the reference's own same-dtype error (a rounding may flip
where torch's flips the other way). An fp32 output shows the summation order itself: the kernel adds K
products in k order into one accumulator, so it is held to that order's bound, gamma_n * sum |terms| with
n = K + 1 roundings (Higham, recursive summation; u = 2^-23 on the GPU's 16-bit tensor-core dots, which
truncate, else 2^-24).
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from hybridengine.ops import _launch
from hybridengine.ops import grouped_gemm as GG
from hybridengine.ops.grouped_gemm import (grouped_gemm, grouped_gemm_dw_triton, grouped_gemm_ref,
                                           grouped_gemm_triton, grouped_mlp, grouped_mlp_ref, row_tile_slots)

SHAPES = [
    # group sizes, K, N: empty experts, one-row experts, experts over several 16-row tiles with a partial last
    # one, K over two 32-column steps with a masked last one, a partial 32-column tile, E = 1, one column.
    ([5, 0, 1, 37, 3], 40, 24),
    ([19], 33, 40),
    ([1, 1, 1, 1, 1, 1], 16, 7),
    ([0, 17, 0, 16, 33], 64, 1),
    ([0, 0, 2], 5, 33),
    ([17, 17], 24, 16),  # four tiles: the grid's bound, cdiv(34, 16) + 2 - 1, is met
]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch) -> str:
    """Which implementation runs: the Triton kernels (the interpreter on CPU) or the torch paths (the reference;
    `linear_exact` per expert in exact mode)."""
    monkeypatch.setattr(_launch, "use_kernel", lambda t: request.param == "triton")
    return request.param


def _inputs(sizes, k, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g).to(dtype).to(device)
    w = (torch.randn(len(sizes), n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    return x, w


def _order_bound(n_terms: int, abs_sum: torch.Tensor, device, dtype) -> torch.Tensor:
    """Higham's bound for a recursive fp32 sum of n_terms products (module docstring)."""
    u = 2.0 ** -23 if device.type == "cuda" and dtype != torch.float32 else 2.0 ** -24
    n = n_terms + 1
    return n * u / (1 - n * u) * abs_sum


def _assert_close_to_truth(got, same_dtype_ref, truth, n_terms, abs_sum):
    """16-bit: within 2x the reference's own error; fp32: within the k-order sum's bound."""
    err = (got.double() - truth).abs()
    if got.dtype == torch.float32:
        bound = _order_bound(n_terms, abs_sum, got.device, got.dtype)
        assert (err <= bound).all(), (err / bound).max().item()
    else:
        ref_err = (same_dtype_ref.double() - truth).abs().max().item()
        assert err.max().item() <= 2 * ref_err, (err.max().item(), ref_err)


# -- forward -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exact", [False, True])
def test_matches_the_reference(device, path, sizes, k, n, dtype, exact):
    x, w = _inputs(sizes, k, n, dtype, device)
    truth = grouped_gemm_ref(x.double(), w.double(), sizes)
    abs_sum = grouped_gemm_ref(x.double().abs(), w.double().abs(), sizes)
    y = grouped_gemm(x, w, sizes, exact=exact)
    assert y.dtype == dtype and y.shape == (sum(sizes), n)
    _assert_close_to_truth(y, grouped_gemm_ref(x, w, sizes), truth, k, abs_sum)
    y32 = grouped_gemm(x, w, sizes, exact=exact, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert (y32.double() - truth).abs().le(_order_bound(k, abs_sum, device, dtype)).all()
    if dtype == torch.bfloat16 and (exact or path == "triton"):
        assert torch.equal(y32.to(dtype), y)  # the 16-bit output is the fp32 sum rounded once


def test_group_sizes_as_a_tensor_and_a_strided_weight(device, path):
    """group_sizes as a list or an integer tensor (CPU or the device); a weight that is a view into a wider
    buffer, or a transposed copy's transpose, gives the contiguous weight's bits."""
    sizes, k, n = SHAPES[0]
    x, w = _inputs(sizes, k, n, torch.bfloat16, device)
    y = grouped_gemm(x, w, sizes)
    assert torch.equal(grouped_gemm(x, w, torch.tensor(sizes)), y)
    assert torch.equal(grouped_gemm(x, w, torch.tensor(sizes, dtype=torch.int32, device=device)), y)
    wide = torch.zeros(len(sizes), n, k + 8, dtype=w.dtype, device=device)
    wide[..., 3:3 + k] = w
    assert torch.equal(grouped_gemm(x, wide[..., 3:3 + k], sizes), y)
    assert torch.equal(grouped_gemm(x, w.transpose(1, 2).contiguous().transpose(1, 2), sizes), y)
    assert torch.equal(grouped_gemm(x.t().contiguous().t(), w, sizes), y)


def test_row_tile_slots_cover_every_routing():
    """The forward grid's axis 0 is at least the row tiles of every routing of M rows to E experts (all of them,
    for small M and E), and no more than the worst routing needs where the bound is tight."""
    for block_m, M, E in itertools.product((1, 2, 3, 16), range(10), range(1, 5)):
        routings = [c for c in itertools.product(range(M + 1), repeat=E) if sum(c) == M]
        worst = max(sum(-(-m // block_m) for m in c) for c in routings)
        assert worst <= row_tile_slots(M, E, block_m), (block_m, M, E)
        if block_m == 16 or M <= E:  # one row per expert, or one partial tile per expert: the bound is met
            assert worst == row_tile_slots(M, E, block_m), (block_m, M, E)


def test_no_rows(device, path):
    x = torch.empty(0, 8, device=device, requires_grad=True)
    w = torch.randn(3, 5, 8, device=device, requires_grad=True)
    y = grouped_gemm(x, w, [0, 0, 0])
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad is None or x.grad.shape == (0, 8)


def test_kernel_tiles_keep_the_order(device):
    """BLOCK_M and BLOCK_N (with BLOCK_K fixed) leave every output's bits as they are: a row's sum does not
    depend on the tile it lands in. On the GPU this is the probe of the tensor-core dots."""
    sizes, k, n = [5, 0, 1, 37, 3], 160, 72
    x, w = _inputs(sizes, k, n, torch.bfloat16, device)
    offsets = torch.tensor([0, 5, 5, 6, 43, 46], dtype=torch.int32, device=device)
    if device.type == "cuda":
        configs = [dict(GG.EXACT_CONFIG), dict(BLOCK_M=16, BLOCK_N=64), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8),
                   dict(BLOCK_M=32, BLOCK_N=128)]
    else:
        configs = [dict(BLOCK_M=16, BLOCK_N=32), dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=64)]
    outs = [grouped_gemm_triton(x, w, offsets, exact=True, config=dict(c, BLOCK_K=64)) for c in configs]
    for c, out in zip(configs[1:], outs[1:]):
        assert torch.equal(out, outs[0]), c


# -- backward ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,k,n", SHAPES[:3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_gradients_match_the_reference(device, path, sizes, k, n, dtype, out_dtype):
    """dX and dW against autograd through `grouped_gemm_ref` in float64 on the same rounded inputs and output
    gradient, within the tolerance of the forward (dX sums N products per element, dW an expert's rows); two
    runs give the same bits."""
    x, w = _inputs(sizes, k, n, dtype, device)
    g = torch.Generator().manual_seed(1)
    grad_y = torch.randn(sum(sizes), n, generator=g).to(dtype).to(device)

    def grads(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(grad_y.to(out.dtype))
        return [t.grad for t in leaves]

    runs = [grads(lambda a, b: grouped_gemm(a, b, sizes, out_dtype=out_dtype), x, w) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    truth = grads(lambda a, b: grouped_gemm_ref(a, b, sizes), x.double(), w.double())
    same = grads(lambda a, b: grouped_gemm_ref(a, b, sizes), x, w)
    gd = grad_y.double()
    abs_dx = grouped_gemm_ref(gd.abs(), w.double().abs().transpose(1, 2), sizes)
    abs_dw, start = torch.zeros_like(w, dtype=torch.float64), 0
    for e, m in enumerate(sizes):
        abs_dw[e] = gd[start:start + m].abs().t() @ x.double()[start:start + m].abs()
        start += m
    dx, dw = runs[0]
    assert dx.dtype == dtype and dw.dtype == dtype
    _assert_close_to_truth(dx, same[0], truth[0], n, abs_dx)
    _assert_close_to_truth(dw, same[1], truth[1], max(sizes), abs_dw)


def test_weight_gradient_of_an_expert_without_rows_is_zero(device):
    x, w = _inputs([3, 0, 4], 20, 9, torch.float32, device)
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=device)
    dw = grouped_gemm_dw_triton(torch.ones(7, 9, device=device), x, offsets, 3)
    assert torch.equal(dw[1], torch.zeros(9, 20, device=device))
    torch.testing.assert_close(dw[2], torch.ones(9, 4, device=device) @ x[3:])


# -- batch invariance (exact mode) --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_rows_are_batch_invariant(device, path, dtype):
    """The same rows inside two different batches give the same bits in exact mode: each expert's rows with
    unrelated rows of that expert before and after them (other tile positions, other group sizes), and each
    row alone (a decode step's one-row groups)."""
    sizes, k, n = [5, 0, 1, 21, 3], 72, 40
    x, w = _inputs(sizes, k, n, dtype, device)
    y = grouped_gemm(x, w, sizes, exact=True)
    g = torch.Generator().manual_seed(2)
    parts, big_sizes, where, start = [], [], [], 0
    for m in sizes:
        before, after = int(torch.randint(0, 19, (), generator=g)), int(torch.randint(0, 5, (), generator=g))
        other = torch.randn(before + after, k, generator=g).to(dtype).to(device)
        parts += [other[:before], x[start:start + m], other[before:]]
        where.append(sum(big_sizes) + before)
        big_sizes.append(before + m + after)
        start += m
    big = grouped_gemm(torch.cat(parts), w, big_sizes, exact=True)
    start = 0
    for e, m in enumerate(sizes):
        assert torch.equal(big[where[e]:where[e] + m], y[start:start + m]), e
        start += m
    expert_of_row = [e for e, m in enumerate(sizes) for _ in range(m)]
    for row in (0, 5, 10, 28):
        one = [int(e == expert_of_row[row]) for e in range(len(sizes))]
        assert torch.equal(grouped_gemm(x[row:row + 1], w, one, exact=True), y[row:row + 1]), row


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_rows_are_batch_invariant_at_model_sizes(dtype):
    """On the GPU at an MoE layer's sizes (Qwen3-MoE-like: H = 2048, 2I = 1536, 16 experts here): a decode
    step's rows (one token, k = 8) give the bits of the same rows inside a 4096-row training batch."""
    device = torch.device("cuda")
    E, k, n = 16, 2048, 1536
    g = torch.Generator().manual_seed(3)
    experts = torch.randint(0, E, (512, 8), generator=g)
    sizes = torch.bincount(experts.reshape(-1), minlength=E).tolist()
    x = torch.randn(sum(sizes), k, generator=g).to(dtype).to(device)
    w = (torch.randn(E, n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    y = grouped_gemm(x, w, sizes, exact=True)
    starts = [sum(sizes[:e]) for e in range(E)]
    rows = [starts[e] + sizes[e] // 2 for e in range(0, E, 2)]  # one row of every other expert, in expert order
    small = grouped_gemm(x[rows], w, [int(e % 2 == 0) for e in range(E)], exact=True)
    assert torch.equal(small, y[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
def test_model_sizes_match_the_reference(exact):
    """On the GPU at an MoE layer's sizes, with the launches the shapes pick (a training batch and a decode
    step): the forward and both gradients in bf16 against float64, within the tolerances of the small shapes."""
    device = torch.device("cuda")
    E, k, n = 16, 2048, 1536
    g = torch.Generator().manual_seed(4)
    for tokens in (512, 1):
        experts = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(tokens)])
        sizes = torch.bincount(experts.reshape(-1), minlength=E).tolist()
        x = torch.randn(sum(sizes), k, generator=g).to(torch.bfloat16).to(device).requires_grad_()
        w = (torch.randn(E, n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(device).requires_grad_()
        grad_y = torch.randn(sum(sizes), n, generator=g).to(torch.bfloat16).to(device)
        y = grouped_gemm(x, w, sizes, exact=exact)
        y.backward(grad_y)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        truth = grouped_gemm_ref(x64, w64, sizes)
        truth.backward(grad_y.double())
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        same = grouped_gemm_ref(xs, ws, sizes)
        same.backward(grad_y)
        for got, ref, want in ((y, same, truth), (x.grad, xs.grad, x64.grad), (w.grad, ws.grad, w64.grad)):
            err = (got.double() - want).abs().max().item()
            ref_err = (ref.double() - want).abs().max().item()
            assert err <= 2 * ref_err, (tokens, err, ref_err)


@pytest.mark.gpu
def test_grouped_mlp_needs_no_host_sync():
    """The CUDA path routes, runs both grouped GEMMs and sums the k rows without a host sync (what a CUDA
    graph capture of a decode step needs): torch's sync debug mode turns any sync into an error."""
    x, gate_up, down, experts, weights = _mlp_inputs(4, 8, 2, torch.bfloat16, torch.device("cuda"))
    grouped_mlp(x, gate_up, down, experts, weights, exact=True)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_mlp(x, gate_up, down, experts, weights, exact=True)
        grouped_gemm(x, gate_up, torch.tensor([4, 0, 0, 0, 0, 0, 0, 0], device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- grouped_mlp ---------------------------------------------------------------------------------------------------


def _mlp_inputs(tokens, num_experts, top_k, dtype, device, hidden=24, inter=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    down = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(device)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(dtype).to(device)
    return x, gate_up, down, experts.to(device), weights


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 3, 1), (7, 5, 2), (13, 4, 4), (0, 2, 1), (9, 6, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exact", [False, True])
def test_grouped_mlp_matches_the_reference(device, path, tokens, num_experts, top_k, dtype, exact):
    """Against `grouped_mlp_ref` in float64 on the same rounded inputs: within 2x the reference's own
    same-dtype error (it rounds the down projection, the weighting and every add of the k-sum; the op rounds
    once), plus a floor of a few fp32 ulps of the output's scale (the references can agree by luck)."""
    args = _mlp_inputs(tokens, num_experts, top_k, dtype, device)
    got = grouped_mlp(*args, exact=exact)
    assert got.dtype == dtype and got.shape == args[0].shape
    truth = grouped_mlp_ref(*(a.double() if a.is_floating_point() else a for a in args))
    ref_err = (grouped_mlp_ref(*args).double() - truth).abs().max() if tokens else 0.0
    err = (got.double() - truth).abs().max() if tokens else 0.0
    floor = 8 * torch.finfo(torch.float32).eps * (truth.abs().max() if tokens else 0.0)
    assert err <= 2 * ref_err + floor, (err, ref_err)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mlp_gradients_match_the_reference(device, path, dtype):
    """Gradients in x, both expert weights and the routing weights against autograd through `grouped_mlp_ref`
    in float64, within 2x the reference's own same-dtype error plus the floor; two runs give the same bits."""
    args = _mlp_inputs(11, 5, 2, dtype, device, seed=4)
    g = torch.Generator().manual_seed(5)
    grad_out = torch.randn(11, 24, generator=g).to(dtype).to(device)
    float_idx = (0, 1, 2, 4)

    def grads(fn, cast):
        leaves = [a.detach().to(cast).clone().requires_grad_() if i in float_idx else a for i, a in enumerate(args)]
        fn(*leaves).backward(grad_out.to(cast))
        return [leaves[i].grad for i in float_idx]

    runs = [grads(grouped_mlp, dtype) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    truth, same = grads(grouped_mlp_ref, torch.float64), grads(grouped_mlp_ref, dtype)
    for got, s, t in zip(runs[0], same, truth):
        err, ref_err = (got.double() - t).abs().max(), (s.double() - t).abs().max()
        assert err <= 2 * ref_err + 8 * torch.finfo(torch.float32).eps * t.abs().max(), (err, ref_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_k_sum_is_fixed_order_and_rounded_once(device, path, dtype):
    """grouped_mlp is the same bits on every call, and equals the fixed-order sum written out here: each slot's
    down projection in fp32 (one grouped GEMM per slot's rows), scaled in fp32, slots added 0, 1, 2 in order,
    rounded once. Exact mode on both sides: a row's GEMM outputs are then the same bits in either batch."""
    x, gate_up, down, experts, weights = _mlp_inputs(10, 4, 3, dtype, device, seed=6)
    out = grouped_mlp(x, gate_up, down, experts, weights, exact=True)
    assert torch.equal(grouped_mlp(x, gate_up, down, experts, weights, exact=True), out)
    inter = gate_up.shape[1] // 2
    total = None
    for j in range(3):
        e = experts[:, j]
        order = torch.argsort(e, stable=True)
        sizes = torch.bincount(e, minlength=4).tolist()
        gu = grouped_gemm(x[order], gate_up, sizes, exact=True)
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        slot = torch.empty(10, x.shape[1], dtype=torch.float32, device=device)
        slot[order] = grouped_gemm(act, down, sizes, exact=True, out_dtype=torch.float32)
        slot = slot * weights[:, j:j + 1].float()
        total = slot if total is None else total + slot
    assert torch.equal(out, total.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mlp_tokens_are_batch_invariant_in_exact_mode(device, path, dtype):
    """A token's output in exact mode is the same bits alone (a decode step) and inside a batch."""
    x, gate_up, down, experts, weights = _mlp_inputs(9, 6, 3, dtype, device, seed=7)
    out = grouped_mlp(x, gate_up, down, experts, weights, exact=True)
    for t in (0, 4, 8):
        one = grouped_mlp(x[t:t + 1], gate_up, down, experts[t:t + 1], weights[t:t + 1], exact=True)
        assert torch.equal(one, out[t:t + 1]), t
    part = grouped_mlp(x[2:7], gate_up, down, experts[2:7], weights[2:7], exact=True)
    assert torch.equal(part, out[2:7])


def test_grouped_mlp_takes_the_activation(device, path):
    args = _mlp_inputs(5, 3, 2, torch.float32, device)
    doubled = grouped_mlp(*args, lambda g, u: 2 * torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(doubled, 2 * grouped_mlp(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_rollout_logprobs_equal_the_trainers_on_a_moe_model(device, path, dtype):
    """The MoE layer in the engine's exact mode: log-probs of sampled completions from the rollout (decode steps
    of one token per sequence) equal the trainer's (packed sequences, micro-batches) bit for bit. Needs the
    batch-invariant expert GEMMs and the fixed-order k-sum (with `grouped_mlp_ref`, fp32 missed by an ulp)."""
    import hybridengine as he
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if path == "triton" and dtype == torch.float32 and device.type == "cpu":
        pytest.skip("the interpreter runs one dtype here: its kernels are slow on CPU")
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=67, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=5, num_experts_per_tok=2,
        max_position_embeddings=64, norm_topk_prob=True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    engine = he.HybridEngine(hf, he.EngineConfig(
        dtype=dtype, device=str(device), block_size=4, max_model_len=48, max_num_seqs=8, max_num_batched_tokens=64,
        exact_logprobs=True, tuning=he.EngineTuning(sampler="torch")))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 67, (n,), generator=g).tolist() for n in (3, 9, 1)]
    with engine.rollout():
        outs = engine.generate(prompts, he.SamplingParams(n=2, temperature=0.8, max_tokens=5, seed=5))
    seqs = [(o.prompt_token_ids, c.token_ids, c.logprobs) for o in outs for c in o.outputs]
    for micro_batch_tokens in (16384, 20):
        batch = he.PPOBatch(input_ids=[torch.tensor(p + c) for p, c, _ in seqs])
        logp = engine.trainer.log_probs(batch, temperature=0.8, micro_batch_tokens=micro_batch_tokens)
        for b, (p, c, rollout) in enumerate(seqs):
            got = logp[b, len(p) - 1:len(p) - 1 + len(c)].cpu()
            assert torch.equal(got, torch.tensor(rollout, dtype=torch.float32)), (b, micro_batch_tokens)


COMPILE_FOR_SM90 = """
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridengine.kernels import grouped_gemm as K
from hybridengine.ops import grouped_gemm as G

cuda = torch.device("cuda")  # a device object only: nothing runs on it
ints = lambda names: {n: "i32" for n in names}
for dtype, out, torch_dtype in (("bf16", "bf16", torch.bfloat16), ("bf16", "fp32", torch.bfloat16),
                                ("fp32", "fp32", torch.float32)):
    shapes = [(8, 8, 1536, True), (8, 8, 1536, False), (384, 8, 1536, False), (4096, 8, 1536, False)]
    for M, E, N, exact in shapes if out == "bf16" else shapes[:1] + shapes[-1:]:
        cfg = G._config(M, E, N, cuda, torch_dtype, exact)
        sig = {"X": f"*{dtype}", "W": f"*{dtype}", "Y": f"*{out}", "Offsets": "*i32",
               **ints(["M", "N", "K", "E", "stride_xm", "stride_we", "stride_wn", "stride_wk", "stride_ym"]),
               **{c: "constexpr" for c in ("SUM_DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_E")}}
        src = ASTSource(fn=K.grouped_gemm_kernel, signature=sig, constexprs=dict(
            SUM_DOT=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_E=16))
        triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    if out == "fp32" and dtype == "bf16":
        continue
    cfg = G.DW_CONFIG
    sig = {"DY": f"*{dtype}", "X": f"*{dtype}", "DW": f"*{dtype}", "Offsets": "*i32",
           **ints(["N", "K", "stride_dym", "stride_xm", "stride_dwe", "stride_dwn"]),
           **{c: "constexpr" for c in ("SUM_DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    src = ASTSource(fn=K.grouped_gemm_dw_kernel, signature=sig, constexprs=dict(
        SUM_DOT=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"]))
    triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real in the tests above")
def test_kernels_compile_for_sm90():
    """The compiler checks what the interpreter does not (the early return, the block cumsum, `tl.dot` tile
    shapes): the forward at the exact launch and at each shape-picked launch, and the weight-gradient kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


# -- argument checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda x, w: grouped_gemm(x[0], w, [2, 2]), r"grouped_gemm: x must be 2-D, got shape \(8,\)"),
    (lambda x, w: grouped_gemm(x.tolist(), w, [2, 2]), "grouped_gemm: x must be a torch.Tensor, got list"),
    (lambda x, w: grouped_gemm(x.int(), w, [2, 2]), "x must be .*torch.float32.*, got torch.int32"),
    (lambda x, w: grouped_gemm(x.double(), w.double(), [2, 2], exact=True), "x must be .*, got torch.float64"),
    (lambda x, w: grouped_gemm(x, w[0], [2, 2]), r"weight must be 3-D, got shape \(6, 8\)"),
    (lambda x, w: grouped_gemm(x, w.half(), [2, 2]), "weight must be torch.float32, got torch.float16"),
    (lambda x, w: grouped_gemm(x, w.to("meta"), [2, 2]), "weight is on meta, expected cpu"),
    (lambda x, w: grouped_gemm(x, w[..., :7], [2, 2]), r"weight must be \[E, N, K\] with K = x.shape\[1\] = 8, "
                                                       r"got shape \(2, 6, 7\)"),
    (lambda x, w: grouped_gemm(x, w, [4]), r"group_sizes must have one entry per expert \(weight.shape\[0\] = 2\), "
                                           "got 1"),
    (lambda x, w: grouped_gemm(x, w, [2, 1]), r"group_sizes must be >= 0 and sum to x.shape\[0\] = 4, got \[2, 1\]"),
    (lambda x, w: grouped_gemm(x, w, [5, -1]), r"must be >= 0 and sum to x.shape\[0\] = 4, got \[5, -1\]"),
    (lambda x, w: grouped_gemm(x, w, torch.tensor([3, 2])), r"sum to x.shape\[0\] = 4, got \[3, 2\]"),
    (lambda x, w: grouped_gemm(x, w, [2.0, 2.0]), "group_sizes must be a 1-D integer tensor or a list of ints"),
    (lambda x, w: grouped_gemm(x, w, torch.tensor([2.0, 2.0])), "group_sizes must be a 1-D integer tensor"),
    (lambda x, w: grouped_gemm(x, w, torch.tensor([[2, 2]])), "group_sizes must be a 1-D integer tensor"),
    (lambda x, w: grouped_gemm(x, w, 4), "group_sizes must be a 1-D integer tensor or a list of ints, got int 4"),
    (lambda x, w: grouped_gemm(x, w, [2, 2], exact=1), "exact must be a bool, got int 1"),
    (lambda x, w: grouped_gemm(x, w, [2, 2], out_dtype=torch.int8), "out_dtype must be None or one of"),
])
def test_bad_input(call, match):
    """The op checks its arguments (on CPU tensors; the launchers only assert)."""
    x, w = torch.randn(4, 8), torch.randn(2, 6, 8)
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_float64_is_for_the_reference_path(monkeypatch):
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    with pytest.raises(ValueError, match="x must be one of .* for the Triton kernel, got torch.float64"):
        grouped_gemm(torch.randn(2, 8, dtype=torch.float64), torch.randn(1, 3, 8, dtype=torch.float64), [2])


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.randn(5)), r"grouped_mlp: x must be 2-D, got shape \(5,\)"),
    (dict(gate_up=torch.randn(3, 9, 6)), r"gate_up must be \[E, 2I, H\] with H = x.shape\[1\] = 6, got shape "
                                         r"\(3, 9, 6\)"),
    (dict(gate_up=torch.randn(3, 8, 5)), r"gate_up must be \[E, 2I, H\]"),
    (dict(gate_up=torch.randn(3, 8, 6).double()), "gate_up must be torch.float32, got torch.float64"),
    (dict(down=torch.randn(3, 6, 5)), r"down must have shape \(3, 6, 4\), got \(3, 6, 5\)"),
    (dict(experts=torch.zeros(4, 2, dtype=torch.int32)), "experts must be torch.int64, got torch.int32"),
    (dict(experts=torch.zeros(3, 2, dtype=torch.long)), r"experts must be \[N, k\] with N = x.shape\[0\] = 4"),
    (dict(experts=torch.zeros(4, 0, dtype=torch.long), weights=torch.rand(4, 0)), r"k >= 1, got shape \(4, 0\)"),
    (dict(experts=torch.full((4, 2), 3)), r"experts must be in \[0, 3\), got values in \[3, 3\]"),
    (dict(weights=torch.rand(4, 3)), r"weights must have shape \(4, 2\), got \(4, 3\)"),
    (dict(weights=torch.ones(4, 2, dtype=torch.long)), "weights must be a float tensor"),
    (dict(exact="yes"), "exact must be a bool, got str 'yes'"),
    (dict(out_dtype=torch.float16), "out_dtype must be None, x's dtype or torch.float32, got torch.float16"),
])
def test_grouped_mlp_bad_input(change, match):
    args = dict(x=torch.randn(4, 6), gate_up=torch.randn(3, 8, 6), down=torch.randn(3, 6, 4),
                experts=torch.zeros(4, 2, dtype=torch.long), weights=torch.rand(4, 2))
    args |= change
    exact, out_dtype = args.pop("exact", False), args.pop("out_dtype", None)
    with pytest.raises(ValueError, match=match):
        grouped_mlp(*args.values(), exact=exact, out_dtype=out_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mlp_fp32_out_is_the_sum_before_its_rounding(dtype):
    torch.manual_seed(0)
    x, gate_up, down = torch.randn(7, 16, dtype=dtype), torch.randn(4, 10, 16, dtype=dtype), torch.randn(
        4, 16, 5, dtype=dtype)
    experts = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    weights = torch.rand(7, 2)
    for exact in (False, True):
        wide = grouped_mlp(x, gate_up, down, experts, weights, exact=exact, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide.to(dtype), grouped_mlp(x, gate_up, down, experts, weights, exact=exact))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mlp_expert_ranges_add_up_to_the_whole(dtype):
    """Two expert-parallel ranks, each with half of the experts: their fp32 partials, added, are the whole
    layer's two-range sum bit for bit in exact mode (the tree `expert_splits=2` fixes), and the reference's
    result within its own rounding otherwise."""
    torch.manual_seed(1)
    E, N, H, inter, k = 6, 9, 16, 5, 3
    x = torch.randn(N, H, dtype=dtype)
    gate_up, down = torch.randn(E, 2 * inter, H, dtype=dtype), torch.randn(E, H, inter, dtype=dtype)
    experts = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    experts[0] = torch.tensor([0, 1, 2])  # a token routed to the first rank's experts only
    weights = torch.rand(N, k)
    for exact in (True, False):
        parts = [grouped_mlp(x, gate_up[lo:lo + E // 2], down[lo:lo + E // 2], experts, weights, exact=exact,
                             out_dtype=torch.float32, first=lo, num_experts=E) for lo in (0, E // 2)]
        assert torch.equal(parts[1][0], torch.zeros(H))  # no slot of token 0 on the second rank
        whole = grouped_mlp(x, gate_up, down, experts, weights, exact=exact, out_dtype=torch.float32,
                            expert_splits=2)
        ref = grouped_mlp_ref(x.double(), gate_up.double(), down.double(), experts, weights.double())
        own = (grouped_mlp_ref(x, gate_up, down, experts, weights.to(dtype)).double() - ref).abs().max()
        bound = own + 64 * torch.finfo(torch.float32).eps * ref.abs().max()
        if exact:
            assert torch.equal(parts[0] + parts[1], whole)
        else:  # torch's GEMMs may round a row differently in a batch of other rows
            assert ((parts[0] + parts[1]).double() - ref).abs().max() <= bound
        assert (whole.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("change,match", [
    (dict(first=-1), r"first=-1 and num_experts=3 must be ints with 0 <= first and first \+ gate_up.shape\[0\] "
                     r"\(3\) <= num_experts"),
    (dict(first=1), r"first=1 and num_experts=3"),
    (dict(num_experts=2), r"first=0 and num_experts=2"),
    (dict(expert_splits=0), r"expert_splits must be an int in \[1, num_experts=3\], got int 0"),
    (dict(expert_splits=4), r"expert_splits must be an int in \[1, num_experts=3\], got int 4"),
])
def test_grouped_mlp_bad_expert_range(change, match):
    args = dict(x=torch.randn(4, 6), gate_up=torch.randn(3, 8, 6), down=torch.randn(3, 6, 4),
                experts=torch.zeros(4, 2, dtype=torch.long), weights=torch.rand(4, 2))
    with pytest.raises(ValueError, match=match):
        grouped_mlp(*args.values(), **change)
