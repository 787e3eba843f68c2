"""The elementwise ops (hybridengine.ops.rms_norm, .silu_mul, .rope) against their plain-torch references,
under the Triton interpreter on CPU and on the GPU; the training variants' gradients; the model's fused
paged forward against the eager one; stacked_rows.

Tolerances: the kernels round where eager torch rounds, so they differ only where one fp32
operation differs in the last bit (RMSNorm's sum of squares in another order, SiLU's exp): after
rounding to the dtype that is at most one unit in the last place of the output, so the bound is
one ulp of the dtype at that point; where a second rounding follows (RMSNorm's scale by the weight,
the product with up), the output may differ by one more, so those ops are held to 2 ulp of the
output's magnitude (|x| * eps bounds one ulp at x). Copies and single roundings are exact.
"""

import pytest
import torch

from hybridengine.ops import _launch
from hybridengine.ops.rms_norm import rms_norm, rms_norm_ref, rms_norm_train, rms_norm_triton
from hybridengine.ops.rope import rope_ref, rope_train, rope_triton_
from hybridengine.ops.silu_mul import silu_mul, silu_mul_ref, silu_mul_train, silu_mul_triton
from hybridengine.ops.stacked_rows import stacked_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Every test here runs on the GPU (marked `gpu`) and, on a machine without one, on CPU under the
# Triton interpreter; on a GPU machine the CPU variant is left out (Triton needs the interpreter there).
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] + ([] if torch.cuda.is_available() else ["cpu"])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)
RMS_FP32_ULPS = 8.0
"""fp32 RMSNorm has no coarse rounding to absorb the sum of squares taken in another order and
1/sqrt against rsqrt: a few fp32 ulps each."""


def ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of x's dtype at |x| (fp32 tensor)."""
    eps = torch.finfo(x.dtype).eps
    tiny = torch.finfo(x.dtype).tiny
    return (x.float().abs() * eps).clamp_min(tiny)


def assert_within_ulp(out: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs()
    bound = ulps * ulp(ref) * 1.001
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds {ulps} ulp (worst ratio {worst:.3g})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 96), (5, 1536)])
def test_rms_norm_kernel(device, dtype, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype).to(device)
    r = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype).to(device)
    ulps = RMS_FP32_ULPS if dtype == torch.float32 else 2.0
    assert_within_ulp(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), ulps=ulps)
    y, h = rms_norm_triton(x, w, 1e-6, residual=r)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, residual=r)
    assert torch.equal(h, h_ref)  # the residual sum is one rounding, as in torch
    assert_within_ulp(y, y_ref, ulps=ulps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_rounds_an_fp32_x_as_to_would(device, dtype):
    """An fp32 x beside a 16-bit residual (exact mode's row-parallel sums) is rounded to the residual's dtype
    inside the op: y and the new residual are bit for bit those of rms_norm(x.to(dtype), ...), kernel and
    reference alike; values at rounding ties included."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 96, generator=g) * 3
    half = torch.finfo(dtype).eps / 2  # half an ulp at 1: the ties
    big = 3e38 if dtype == torch.bfloat16 else 65519.0  # finite after rounding, where the dtype ends
    x[0, :8] = torch.tensor([1 + half, 1 + 3 * half, -1 - half, 2.0 ** -130, big, -0.0, 1 - half / 2, 1e-8])
    r = torch.randn(6, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    x, r, w = x.to(device), r.to(device), w.to(device)
    for op in (rms_norm, rms_norm_ref, rms_norm_triton):  # rms_norm: the kernel on CUDA, the reference on CPU
        y, h = op(x, w, 1e-6, residual=r)
        y_want, h_want = op(x.to(dtype), w, 1e-6, residual=r)
        assert y.dtype == dtype and h.dtype == dtype
        assert torch.equal(h, h_want) and torch.equal(y, y_want), op.__name__


def test_rms_norm_fp32_x_needs_a_residual_and_a_matching_weight():
    x = torch.randn(2, 8)
    r, w = torch.randn(2, 8).bfloat16(), torch.ones(8).bfloat16()
    with pytest.raises(ValueError, match="rms_norm: weight"):
        rms_norm(x, w, 1e-6)  # no residual: the weight is x's dtype
    with pytest.raises(ValueError, match="rms_norm: weight"):
        rms_norm(x, w.float(), 1e-6, residual=r)  # the weight is the residual's dtype
    with pytest.raises(ValueError, match="rms_norm: residual"):
        rms_norm(x.bfloat16(), w, 1e-6, residual=r.float())  # a 16-bit x takes a residual of its dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 4, 2, 64), (9, 7, 1, 32), (5, 12, 2, 128)])
def test_rope_kernel_is_exact(device, dtype, tokens, hq, hk, d):
    """Each product and the sum round once, as eager: the rotation is bit for bit the reference's."""
    g = torch.Generator().manual_seed(tokens * hq)
    q = torch.randn(tokens, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(tokens, hk, d, generator=g).to(dtype).to(device)
    angle = torch.rand(tokens, d // 2, generator=g) * 100
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype).to(device)
    q_ref, k_ref = rope_ref(q, k, cos, sin)
    q_out, k_out = rope_triton_(q.clone(), k.clone(), cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (6, 200), (3, 8960)])
def test_silu_mul_kernel(device, dtype, rows, cols):
    g = torch.Generator().manual_seed(rows + cols)
    gate = (torch.randn(rows, cols, generator=g) * 4).to(dtype).to(device)
    up = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    # bf16/fp16: silu rounds once and the product once, 1 ulp from each. fp32 has no coarse rounding
    # to absorb the exp's own error: two exp implementations differ by up to 2 fp32 ulp, and 1 + e and
    # the division add one each, so 4.
    ulps = 4.0 if dtype == torch.float32 else 2.0
    if dtype == torch.float32 and gate.is_cuda:
        # On the GPU tl.exp is ex2.approx(g * log2 e): the product's rounding (2^-24 relative) scales by
        # |g| ln 2 log2 e = |g| in the exponent, so exp(-g) is off by up to |g| ulp more; the 4-ulp bound
        # failed there. bf16/fp16 absorb that in their rounding.
        ulps += gate.abs().max().item()
    assert_within_ulp(silu_mul_triton(gate, up), silu_mul_ref(gate, up), ulps=ulps)


def test_zero_rows(device):
    x = torch.empty(0, 64, device=device)
    w = torch.ones(64, device=device)
    assert rms_norm_triton(x, w, 1e-6).shape == (0, 64)
    assert silu_mul_triton(x, x).shape == (0, 64)


@pytest.mark.parametrize("call,match", [
    (lambda x, w: rms_norm(x[0, 0], w, 1e-6), r"rms_norm: x must be \[..., hidden\], got a 0-D tensor"),
    (lambda x, w: rms_norm(x.double(), w, 1e-6), "x must be torch.bfloat16 or torch.float16 or torch.float32"),
    (lambda x, w: rms_norm(x.t(), w, 1e-6), "x must have unit stride"),
    (lambda x, w: rms_norm(x, w[:3], 1e-6), r"weight must have shape \(8,\)"),
    (lambda x, w: rms_norm(x, w, 0.0), r"eps must be in \(0, inf\)"),
    (lambda x, w: rms_norm(x, w, 1e-6, residual=x[:2]), r"residual must have shape \(8, 8\)"),
    (lambda x, w: rms_norm_train(x.double(), w, 1e-6), "rms_norm_train: x must be torch.bfloat16 or"),
    (lambda x, w: silu_mul(x, x[:, :4]), r"up must have shape \(8, 8\), got \(8, 4\)"),
    (lambda x, w: silu_mul_train(x, x.half()), "silu_mul_train: up must be torch.float32"),
    (lambda x, w: rope_train(x[None], x[None], w, w), r"cos must have shape \(1, 8\)"),
    (lambda x, w: rope_train(x[None, :, :7], x[None, :, :7], x[:1, :7], x[:1, :7]), "head_dim must be even"),
])
def test_bad_input(device, call, match):
    """The ops check their arguments on every device (the launchers only assert)."""
    x = torch.randn(8, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_model_fused_paged_forward_matches_eager(device, monkeypatch):
    """The model's paged forward with the fused path (fused=True, the Triton kernels, RoPE inside the KV
    store's: under the interpreter on CPU) against the eager module code, on a tiny Qwen3 (q/k norms) and
    Qwen2 (q/k/v biases), fp32: logits within a few fp32 ulps of accumulated elementwise differences. Both
    runs store and attend with the same kernels (every op takes its kernel here, also on CPU)."""
    import hybridengine as he
    from hybridengine.rollout.runner import AttentionMetadata, KVCache

    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    for name in ("tiny-qwen3", "tiny-qwen2"):
        torch.manual_seed(0)
        model = he.load_model(he.model_config(name), dtype=torch.float32, device=device)
        c = model.config
        kv = KVCache(num_layers=c.num_hidden_layers, num_blocks=8, block_size=4, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, dtype=torch.float32, device=device)
        ids = torch.randint(0, c.vocab_size, (11,), device=device)
        cu = torch.tensor([0, 5, 11], dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(5), torch.arange(6)]).to(device)
        slots = torch.cat([torch.arange(5), 8 + torch.arange(6)]).to(device)
        outs = []
        for use_fused in (False, True):
            meta = AttentionMetadata(kv, True, slots, c.head_dim ** -0.5, cu_seqlens=cu, max_seqlen=6, fused=use_fused)
            with torch.inference_mode():
                outs.append(model.compute_logits(model.hidden_states_paged(ids, positions, meta)))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_exact_rollout_rounds_row_parallel_sums_in_the_norm(monkeypatch):
    """Exact mode's fused rollout forward hands o_proj's and down_proj's fp32 sums to the next rms_norm, which
    rounds them: the logits are bit for bit those of rounding each sum first (`project` without fp32_sum),
    on a tiny Qwen3 in bf16 with the kernels under the interpreter (on CUDA the engine's exact tests hold the
    rollout to the trainer)."""
    import hybridengine as he
    from hybridengine.model import decoder
    from hybridengine.rollout.runner import AttentionMetadata, KVCache

    if torch.cuda.is_available():
        pytest.skip("the interpreter's variant; on CUDA tests/test_exact.py covers the rollout")
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    torch.manual_seed(0)
    model = he.load_model(he.model_config("tiny-qwen3"), dtype=torch.bfloat16, device="cpu")
    c = model.config
    ids = torch.randint(0, c.vocab_size, (7,))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    positions = torch.cat([torch.arange(3), torch.arange(4)])
    slots = torch.cat([torch.arange(3), 8 + torch.arange(4)])
    project, norm, seen = decoder.project, decoder.rms_norm, []
    monkeypatch.setattr(decoder, "rms_norm", lambda x, *a, **k: seen.append(x.dtype) or norm(x, *a, **k))
    outs = []
    for fp32_sum in (True, False):
        if not fp32_sum:  # every projection rounded by itself, as before the fusion
            monkeypatch.setattr(decoder, "project", lambda *a, fp32_sum=False: project(*a))
        kv = KVCache(num_layers=c.num_hidden_layers, num_blocks=8, block_size=4, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, dtype=torch.bfloat16, device="cpu")
        meta = AttentionMetadata(kv, True, slots, c.head_dim ** -0.5, cu_seqlens=cu, max_seqlen=4, fused=True,
                                 exact=True)
        with torch.inference_mode():
            outs.append(model.local_logits(model.hidden_states_paged(ids, positions, meta), exact=True))
    assert seen.count(torch.float32) == 2 * c.num_hidden_layers  # the first run's o and down sums
    assert torch.equal(outs[0], outs[1])


def test_stacked_rows():
    flat = torch.arange(2 * 6 * 4 + 8, dtype=torch.float32)
    a, b = flat[:24].view(6, 4), flat[24:48].view(6, 4)
    both = stacked_rows(a, b)
    assert both is not None and torch.equal(both, torch.cat([a, b])) and both.data_ptr() == a.data_ptr()
    assert stacked_rows(a, flat[28:52].view(6, 4)) is None       # a gap
    assert stacked_rows(b, a) is None                            # wrong order
    assert stacked_rows(a, flat[24:48].view(4, 6)) is None       # another width
    assert stacked_rows(a, flat[24:48].clone().view(6, 4)) is None  # another storage


def test_engine_generation_weights_allow_one_gate_up_gemm():
    """In the engine's generation view every layer's gate_proj and up_proj, and its q/k/v weights and
    biases, lie back to back (so the rollout runs one GEMM for each group), at tg = 1 and in each TP slice."""
    import hybridengine as he

    engine = he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(dtype=torch.float32, device="cpu",
                                                                             max_model_len=32, max_num_seqs=2))
    with engine.rollout():
        for layer in engine.model.model.layers:
            assert stacked_rows(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight) is not None
            a = layer.self_attn
            assert stacked_rows(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) is not None
            assert stacked_rows(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias) is not None
    specs = he.load_model(he.model_config("tiny-qwen2"), dtype=torch.float32, device="cpu").flat_buffer.layout.specs
    for layout in (engine.sharded.layout, he.ShardedLayout(specs, world_size=4, tp_size=2, element_size=2)):
        _check_gate_up_adjacent(layout)


def _check_gate_up_adjacent(layout):
    """gate/up weights, q/k/v weights and q/k/v biases back to back in every TP slice (param_specs' order)."""
    groups = [("mlp.gate_proj.weight", "mlp.up_proj.weight")] + [
        tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv") for kind in ("weight", "bias")]
    for unit in layout.units:
        pieces = {(p.name, p.slice_index): p for p in unit.pieces}
        prefix = unit.name.replace("layers.", "model.layers.") + "."
        if not unit.name.startswith("layers."):
            continue
        for group in groups:
            for t in range(layout.tp_size):
                run = [pieces[(prefix + n, t)] for n in group]
                for a, b in zip(run, run[1:]):
                    assert a.offset + a.slot_numel == b.offset, (unit.name, group, t)


# --------------------------------------------------------------------------------------------
# training variants: gradients against float64 autograd of the reference


def _grads(fn, inputs, dy):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    dys = dy if isinstance(dy, tuple) else (dy,)
    grads = torch.autograd.grad(outs, [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad], dys)
    return outs, grads


def _check_grads(kernel_fn, ref_fn, inputs, dy, factor=4.0):
    """Kernel gradients within `factor` x (the same-dtype eager reference's distance to float64) + 1 ulp."""
    leaf = lambda t, dt=None: t.detach().to(dt or t.dtype).requires_grad_(t.requires_grad)  # noqa: E731
    outs, grads = _grads(kernel_fn, [leaf(x) if isinstance(x, torch.Tensor) else x for x in inputs], dy)
    ref_outs, ref_grads = _grads(ref_fn, [leaf(x) if isinstance(x, torch.Tensor) else x for x in inputs], dy)
    ex_inputs = [leaf(x, torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    ex_dy = tuple(d.double() for d in dy) if isinstance(dy, tuple) else dy.double()
    _, exact = _grads(ref_fn, ex_inputs, ex_dy)
    for got, same, ex in zip(grads, ref_grads, exact):
        err = (got.double() - ex).abs().max().item()
        ref_err = (same.double() - ex).abs().max().item()
        assert err <= factor * ref_err + ulp(ex.to(got.dtype)).max().item() * 2, (err, ref_err)
    return outs, ref_outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_train_gradients(device, monkeypatch, dtype):
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    g = torch.Generator().manual_seed(1)
    rows, cols = 70, 96  # 3 backward programs of 32 rows, the last partial
    x = (torch.randn(rows, cols, generator=g) * 2).to(dtype).to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype).to(device).requires_grad_()
    dy = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    outs, ref_outs = _check_grads(lambda x, w: rms_norm_train(x, w, 1e-6),
                                  lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], dy)
    assert_within_ulp(outs[0], ref_outs[0], ulps=RMS_FP32_ULPS if dtype == torch.float32 else 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_torch_path_is_position_independent(dtype):
    """The CPU path gives an element the same bits wherever it sits: in a row of 20 or 40 columns (a
    tensor-parallel half against the whole), first or last row, a strided view of a stacked gate/up output or a
    contiguous tensor (torch's scalar loop tail rounds exp differently from its vector lanes)."""
    from hybridengine.ops.silu_mul import silu_mul_torch

    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(7, 40, generator=g) * 4).to(dtype)
    up = torch.randn(7, 40, generator=g).to(dtype)
    whole = silu_mul_torch(gate, up)
    halves = [silu_mul_torch(gate[:, :20].contiguous(), up[:, :20].contiguous()),
              silu_mul_torch(gate[:, 20:], up[:, 20:])]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    stacked = torch.cat([gate, up], dim=1)  # the rollout's one GEMM output, gate and up as views
    assert torch.equal(silu_mul_torch(stacked[:, :40], stacked[:, 40:]), whole)
    for r in range(7):
        assert torch.equal(silu_mul_torch(gate[r:r + 1], up[r:r + 1]), whole[r:r + 1])
    ref = silu_mul_ref(gate.double(), up.double())
    assert (whole.double() - ref).abs().max() <= 2 * (silu_mul_ref(gate, up).double() - ref).abs().max() + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_train_gradients(device, monkeypatch, dtype):
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    g = torch.Generator().manual_seed(2)
    gate = (torch.randn(9, 130, generator=g) * 3).to(dtype).to(device).requires_grad_()
    up = torch.randn(9, 130, generator=g).to(dtype).to(device).requires_grad_()
    dy = torch.randn(9, 130, generator=g).to(dtype).to(device)
    _check_grads(silu_mul_train, silu_mul_ref, [gate, up], dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_train_gradients(device, monkeypatch, dtype):
    """The rotation is orthogonal: its backward is the rotation by -angle, exact up to rounding."""
    monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 6, 32, generator=g).to(dtype).to(device).requires_grad_()
    k = torch.randn(5, 2, 32, generator=g).to(dtype).to(device).requires_grad_()
    angle = torch.rand(5, 16, generator=g) * 50
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype).to(device)
    dq, dk = (torch.randn(5, 6, 32, generator=g).to(dtype).to(device),
              torch.randn(5, 2, 32, generator=g).to(dtype).to(device))
    outs, ref_outs = _check_grads(lambda q, k: rope_train(q, k, cos, sin),
                                  lambda q, k: rope_ref(q, k, cos.to(q.dtype), sin.to(q.dtype)), [q, k], (dq, dk))
    assert torch.equal(outs[0], ref_outs[0]) and torch.equal(outs[1], ref_outs[1])

