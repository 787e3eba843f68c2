"""Training on the shared buffer vs a plain single-process torch reference (HF model + torch AdamW +
the loss of `_formulas`, written from the definitions and sharing no code with the package), over
gloo processes: N in {1, 2, 4, 8}, tg dividing N."""

import copy
import json
import math
import os
import pathlib

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hybridengine as he
import _formulas as formulas
from _dist import reporting, spawn
from _models import reference_tp_slice

GOLDEN = pathlib.Path(__file__).parent / "golden" / "ppo_tiny_qwen2.json"
"""Written only by bin/make_golden.py (`golden_run`), never by a test run."""
STEPS = 5
CFG = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01, loss_agg="token-mean",
           micro_batch_tokens=24, max_grad_norm=1.0, lr=1e-3, weight_decay=0.01, temperature=0.9)


def build(name="tiny-qwen2", **overrides):
    torch.manual_seed(0)
    cfg = he.model_config(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    for p in hf.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    return hf


def make_batches(hf, world, steps=STEPS, seqs_per_rank=3, seed=7):
    """batches[step][rank]: PPOBatch kwargs; old/ref log-probs from the initial model."""
    g = torch.Generator().manual_seed(seed)
    V = hf.config.vocab_size
    out = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world):
            ids, mask, old, adv, ref = [], [], [], [], []
            for _ in range(seqs_per_rank):
                T = int(torch.randint(6, 20, (), generator=g))
                prompt = int(torch.randint(2, T - 1, (), generator=g))
                seq = torch.randint(0, V, (T,), generator=g)
                with torch.no_grad():
                    logp = hf(seq[None]).logits[0, :-1].float().div(CFG["temperature"]).log_softmax(-1)
                    logp = logp.gather(-1, seq[1:, None]).squeeze(1)
                m = torch.zeros(T - 1)
                m[prompt - 1:] = 1
                ids.append(seq)
                mask.append(m)
                old.append(logp + 0.3 * torch.randn(T - 1, generator=g))
                ref.append(logp + 0.2 * torch.randn(T - 1, generator=g))
                adv.append(torch.randn(T - 1, generator=g))
            per_rank.append(dict(input_ids=ids, response_mask=mask, old_logprobs=old, advantages=adv,
                                 ref_logprobs=ref))
        out.append(per_rank)
    return out


def pad(rows, width, dtype=torch.float32):
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def reference_run(hf, batches, first_grads: dict | None = None, dtype=torch.float32, grads: list | None = None):
    """Plain torch: per-rank loss (`_formulas.ppo_loss`) over full logits, mean over ranks, clip, torch
    AdamW, in `dtype`.
    `first_grads` (a dict) receives the unclipped gradients of the first step; `grads` (a list) each
    step's clipped gradients (what AdamW sees)."""
    model = copy.deepcopy(hf).to(dtype).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=CFG["weight_decay"]),
                             dict(params=no_decay, weight_decay=0.0)], lr=CFG["lr"])
    losses = []
    for per_rank in batches:
        opt.zero_grad()
        total = 0.0
        for b in per_rank:
            width = max(len(s) for s in b["input_ids"]) - 1
            targets = torch.zeros(len(b["input_ids"]), width, dtype=torch.long)
            hs = []
            for i, seq in enumerate(b["input_ids"]):
                h = model.model(seq[None]).last_hidden_state[0, :-1]
                hs.append(h)
                targets[i, :len(seq) - 1] = seq[1:]
            hidden = torch.nn.utils.rnn.pad_sequence(hs, batch_first=True)
            # kl_estimator and clip_ratio_c: PPOConfig's defaults, which CFG leaves alone
            loss, _ = formulas.ppo_loss(hidden, model.lm_head.weight, targets,
                                        pad(b["old_logprobs"], width, dtype), pad(b["advantages"], width, dtype),
                                        pad(b["response_mask"], width, dtype), temperature=CFG["temperature"],
                                        clip_low=CFG["clip_low"], clip_high=CFG["clip_high"], clip_ratio_c=None,
                                        ref_logprobs=pad(b["ref_logprobs"], width, dtype), kl_coef=CFG["kl_coef"],
                                        kl_estimator="k3", entropy_coef=CFG["entropy_coef"], loss_agg=CFG["loss_agg"])
            (loss / len(per_rank)).backward()
            total += float(loss.detach()) / len(per_rank)
        if first_grads is not None and not first_grads:
            first_grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_grad_norm"])
        if grads is not None:
            grads.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(hf, batches, rank, tp, checkpointing=True, fused_training=False, keep_grads=False, device="cpu"):
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device=str(device), tp_generation=tp,
                                                 max_model_len=64, max_num_seqs=4,
                                                 tuning=he.EngineTuning(fused_training=fused_training),
                                                 keep_grads=keep_grads))
    if fused_training and engine.device.type != "cuda":
        engine.trainer.fused = True  # the engine runs the fused ops on CUDA only; the caller patched them onto CPU
    cfg = he.PPOConfig(**CFG, activation_checkpointing=checkpointing)
    losses = []
    for per_rank in batches:
        stats = engine.ppo_step(he.PPOBatch(**per_rank[rank]), cfg)
        loss = torch.tensor(stats["loss"], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(float(loss))
    return engine, losses


def full_weights(engine):
    """Every parameter gathered back to natural layout (training view)."""
    sh = engine.sharded
    out = {}
    for u, unit in enumerate(sh.layout.units):
        natural = sh.gather_unit(u)
        for s in unit.params:
            out[s.name] = sh.natural_view(natural, s.name).clone()
    return out


U32 = 2.0**-24
BETAS, EPS = (0.9, 0.999), 1e-8
"""AdamW's betas and eps: PPOConfig's defaults, which are torch.optim.AdamW's."""


def reference(hf, batches):
    """(fp32 reference losses, fp64 reference weights, per-element bound on |fp32 weights - fp64 weights|).

    The fp64 run is the exact training up to negligible rounding. An fp32 run differs from it through
    its gradients, whose rounding depends on the summation order (ranks, micro-batches, packed
    sequences, the machine's GEMM kernels); Adam then divides each gradient by its own running RMS,
    so an element whose gradient is small next to its rounding error moves by up to Adam's whole
    step. The bound follows that path: each step's gradient error is torch's own fp32 error (its max
    over the tensor, against the fp64 gradient), doubled for another summation order; `adam_bound`
    carries it through AdamW's moments per element, capped at twice Adam's largest step; plus one
    rounding of the weight per step. A parameter with an exactly zero gradient (the k_proj bias:
    softmax is shift-invariant along the keys) gets the cap: fp32 runs move it by rounding noise."""
    g32, g64 = [], []
    losses, _ = reference_run(hf, batches, grads=g32)
    _, w64 = reference_run(hf, batches, dtype=torch.float64, grads=g64)
    bounds = {}
    for name, w in w64.items():
        errors = [2 * float((a[name] - b[name]).abs().max()) for a, b in zip(g32, g64)]
        bounds[name] = adam_bound([g[name] for g in g64], errors) + 2 * len(g64) * U32 * (w.abs() + CFG["lr"])
    return losses, w64, bounds


def adam_bound(grads: list[torch.Tensor], errors: list[float]) -> torch.Tensor:
    """Per element, the most that AdamW's total displacement lr * sum(m_hat / (sqrt(v_hat) + eps)) can
    change when each step's gradient changes by at most errors[step] (first order in the moments,
    each step's change capped at twice the largest |m_hat / sqrt(v_hat)| Adam can reach by then)."""
    (b1, b2), lr = BETAS, CFG["lr"]
    m = torch.zeros_like(grads[0])
    v, dv, total = m.clone(), m.clone(), m.clone()
    dm, reach = 0.0, 0.0
    for step, (g, err) in enumerate(zip(grads, errors), 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        dm, dv = b1 * dm + (1 - b1) * err, b2 * dv + (1 - b2) * (2 * g.abs() * err + err * err)
        c1, c2 = 1 - b1**step, 1 - b2**step
        root = (v / c2).sqrt()
        d_root = torch.minimum(dv / c2 / (2 * root).clamp_min(1e-300), (dv / c2).sqrt())
        d_step = dm / c1 / (root + EPS) + (m / c1).abs() * d_root / (root + EPS) ** 2
        # |m_hat| / sqrt(v_hat) <= (1 - b1) / c1 * sqrt(c2 / (1 - b2) * sum_k (b1^2 / b2)^k) (Cauchy-Schwarz)
        reach = (1 - b1) / c1 * math.sqrt(c2 / (1 - b2) * sum((b1 * b1 / b2) ** k for k in range(step)))
        total += lr * d_step.clamp_max(2 * reach)
    return total


def assert_weight_close(name, got, ref):
    """|got - fp64 reference| within the parameter's per-element bound (`reference`)."""
    _, weights, bounds = ref
    err = (got.double() - weights[name]).abs()
    worst = int((err / bounds[name]).argmax())
    assert (err <= bounds[name]).all(), (f"{name}: |engine - fp64 reference| = {err.flatten()[worst]:.3g} > its bound "
                                         f"{bounds[name].flatten()[worst]:.3g} at flat index {worst}")


def compare(losses, weights, ref):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
    for name, w in weights.items():
        assert_weight_close(name, w, ref)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_single_process_matches_torch_reference(checkpointing):
    hf = build()
    batches = make_batches(hf, 1)
    ref = reference(hf, batches)
    engine, losses = engine_run(hf, batches, 0, 1, checkpointing)
    compare(losses, full_weights(engine), ref)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_fused_training_kernels_match_torch_reference(monkeypatch, device, checkpointing):
    """EngineTuning(fused_training=True): the layers' RMSNorm, RoPE and SiLU * up run as the Triton
    autograd ops (on the test device: on CPU forced onto CPU tensors, under the interpreter); the loss
    and every parameter's gradient of a step equal the plain torch reference's (fp32: 1e-4 relative,
    the kernels' formulas differ from autograd's chain only in rounding), on a model with q/k norms
    (Qwen3) and one with q/k/v biases (Qwen2)."""
    if device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton ops on CPU tensors run only under TRITON_INTERPRET=1")
        from hybridengine.ops import _launch

        monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    for name in ("tiny-qwen2", "tiny-qwen3"):
        hf = build(name)
        batches = make_batches(hf, 1, steps=3)
        ref_grads: dict = {}
        ref_losses, _ = reference_run(hf, batches[:1], first_grads=ref_grads)
        engine, losses = engine_run(hf, batches[:1], 0, 1, checkpointing, fused_training=True, keep_grads=True,
                                    device=device)
        assert engine.trainer.fused
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        # The gradients themselves (N = 1: each unit's shard is its natural layout), before Adam, which
        # would amplify fp32-formula differences where a gradient is near eps.
        sh, grads = engine.sharded, engine.trainer.grads
        for u, unit in enumerate(sh.layout.units):
            for spec in unit.params:
                got = sh.natural_view(grads[u], spec.name).cpu()
                torch.testing.assert_close(got, ref_grads[spec.name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{name} {spec.name}: {m}")


def test_gradients_freed_after_step_unless_kept():
    """By default a step's gradient shards are freed after the optimizer update (the next step's
    forward does not hold them); keep_grads=True keeps them; both runs train identically."""
    hf = build()
    batches = make_batches(hf, 1, steps=2)
    freed, losses_freed = engine_run(hf, batches, 0, 1)
    assert freed.trainer.held_gradients == []
    assert freed.memory_report()["gradients"] == 0.0
    kept, losses_kept = engine_run(hf, batches, 0, 1, keep_grads=True)
    assert losses_kept == losses_freed
    grads = kept.trainer.held_gradients
    assert len(grads) == len(kept.sharded.layout.units) and all(g.abs().sum() > 0 for g in grads)
    report = kept.memory_report()["gradients"]
    assert report == sum(g.numel() * 4 for g in grads) / 2**30
    for name, w in full_weights(kept).items():
        assert torch.equal(w, full_weights(freed)[name]), name


@pytest.mark.parametrize("checkpointing,keep_grads", [(True, False), (False, True)])
def test_failed_step_lets_go_of_its_gradients(monkeypatch, checkpointing, keep_grads):
    """A step that fails in its backward (out of memory, injected at the third unit's reduce, after some
    units' gradient shards exist) holds no gradient afterwards (its memory is free again), changes no
    weight, and the engine's next step equals that of an engine that never failed, bit for bit."""
    from hybridengine.train.trainer import Trainer

    hf = build()
    batches = make_batches(hf, 1, steps=2)
    ref, ref_losses = engine_run(hf, batches, 0, 1, checkpointing, keep_grads=keep_grads)
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64, max_num_seqs=4,
                                                 keep_grads=keep_grads))
    cfg = he.PPOConfig(**CFG, activation_checkpointing=checkpointing)
    losses = [engine.ppo_step(he.PPOBatch(**batches[0][0]), cfg)["loss"]]
    before = full_weights(engine)
    real, calls = Trainer._reduce, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_reduce", failing)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        engine.ppo_step(he.PPOBatch(**batches[1][0]), cfg)
    monkeypatch.setattr(Trainer, "_reduce", real)
    assert engine.trainer.held_gradients == [] and engine.memory_report()["gradients"] == 0.0
    for name, w in full_weights(engine).items():
        assert torch.equal(w, before[name]), name
    losses.append(engine.ppo_step(he.PPOBatch(**batches[1][0]), cfg)["loss"])
    assert losses == ref_losses
    for name, w in full_weights(engine).items():
        assert torch.equal(w, full_weights(ref)[name]), name


def golden_run() -> tuple[list[float], float, float]:
    """The tiny deterministic run of the golden file (tiny-qwen2, one rank, STEPS steps): its per-step
    losses, and the first step's loss by the fp32 and the fp64 reference (the formulas over a plain
    forward at the initial weights: the one step the reference computes without the engine's history)."""
    hf = build()
    batches = make_batches(hf, 1)
    _, losses = engine_run(hf, batches, 0, 1)
    (first32,), _ = reference_run(hf, batches[:1])
    (first64,), _ = reference_run(hf, batches[:1], dtype=torch.float64)
    return losses, first32, first64


def check_first_step(loss: float, first32: float, first64: float) -> None:
    """An fp32 first-step loss within 2x the fp32 reference's distance from the fp64 one, plus 8 fp32
    ulps of the loss (the fp32 reference can be exact by luck)."""
    bound = 2 * abs(first32 - first64) + 16 * U32 * abs(first64)
    assert abs(loss - first64) <= bound, (f"first step's loss {loss!r} is {abs(loss - first64):.3g} off the fp64 "
                                          f"reference {first64!r} (allowed {bound:.3g})")


def test_golden_losses():
    """A tiny deterministic run against the checked-in per-step losses, whose first step is the
    independent reference's (regenerate with bin/make_golden.py, never from a test run)."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["config"] == CFG, "CFG changed since the golden file was written: run bin/make_golden.py"
    losses, first32, first64 = golden_run()
    check_first_step(golden["losses"][0], first32, first64)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(golden["losses"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sampler", ["torch", pytest.param("fused", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the fused sampler on CPU runs in the interpreter"))])
def test_generation_logprobs_equal_engine_log_probs(sampler):
    """The log-prob convention (log_softmax(logits / T) at the token) holds for both samplers."""
    hf = build("tiny-llama")
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", block_size=4, max_model_len=64,
                                                 tuning=he.EngineTuning(sampler=sampler)))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (4, 9, 13)]
    with engine.rollout():
        outs = engine.generate(prompts, he.SamplingParams(temperature=0.8, max_tokens=10, seed=1))
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    logp = engine.log_probs(he.PPOBatch(input_ids=[torch.tensor(s) for s in seqs]), temperature=0.8)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        got = logp[b, len(p) - 1:len(seqs[b]) - 1]
        torch.testing.assert_close(got, torch.tensor(o.outputs[0].logprobs), rtol=0, atol=2e-5)


def test_errors():
    with pytest.raises(ValueError, match=r"input_ids\[0\] has 1 tokens"):
        he.PPOBatch(input_ids=[torch.tensor([1])])
    with pytest.raises(ValueError, match=r"response_mask\[0\] has 3 entries; expected len\(input_ids\[0\]\) - 1 = 4"):
        he.PPOBatch(input_ids=[torch.arange(5)], response_mask=[torch.ones(3)])
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        he.PPOConfig(loss_agg="sum")
    hf = build()
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64))
    with pytest.raises(ValueError, match="needs batch.response_mask"):
        engine.ppo_step(he.PPOBatch(input_ids=[torch.arange(5)]))
    with engine.rollout():
        with pytest.raises(RuntimeError, match="not allowed inside rollout"):
            engine.log_probs(he.PPOBatch(input_ids=[torch.arange(5)]))


def _worker(rank, world, init_file, tp, overrides, batches, ref, checkpointing, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank} (N={world}, tg={tp})"):
        engine, losses = engine_run(build(**overrides), batches, rank, tp, checkpointing)
        compare(losses, full_weights(engine), ref)
        with engine.rollout():  # the optimizer's writes are what generation sees: no sync step
            t = rank // (world // tp)
            _, weights, bounds = ref
            for s in engine.sharded.layout.specs:
                view = engine.sharded.generation_views()[s.name]
                expected = reference_tp_slice(weights[s.name], s.role, t, tp)
                assert view.shape == expected.shape, s.name
                bound = reference_tp_slice(bounds[s.name], s.role, t, tp)
                assert_weight_close(s.name, view, (None, {s.name: expected}, {s.name: bound}))


# N = 8 runs two cases (45-50 s each on the 2-core CI machine): tg 1 and 4 take the code paths they take at N = 4.
@pytest.mark.parametrize("world,tp,checkpointing",
                         [(2, 1, True), (2, 2, True), (4, 1, True), (4, 2, True), (4, 4, True),
                          (2, 1, False), (4, 2, False), (8, 2, False), (8, 8, False)])
def test_data_parallel_matches_torch_reference(world, tp, checkpointing):
    """checkpointing False: activations kept, parameters re-gathered in backward (saved-tensor hooks).
    N = 8 (gloo) is the CPU part of the scaling issue: every tg, micro-DP groups of 8, 4, 2 and 1."""
    # TP splits whole heads: tg = 4 needs 4 KV heads, tg = 8 eight query and KV heads
    overrides = {4: dict(num_key_value_heads=4), 8: dict(num_attention_heads=8, num_key_value_heads=8)}.get(tp, {})
    hf = build(**overrides)
    batches = make_batches(hf, world)
    spawn(_worker, world, tp, overrides, batches, reference(hf, batches), checkpointing)


def test_critic_matches_torch_reference():
    """role='critic': a value head on the backbone; values() and value_step() against plain torch."""
    hf = build("tiny-llama")
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64), role="critic")
    score0 = full_weights(engine)["score.weight"]
    backbone = copy.deepcopy(hf.model).train()
    score = torch.nn.Parameter(score0.clone())
    params = list(backbone.parameters()) + [score]
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.01),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)], lr=1e-3)
    cfg = he.ValueConfig(clip=0.2, lr=1e-3, weight_decay=0.01, micro_batch_tokens=20, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(11)
    for step in range(3):
        lengths = [7, 12, 5]
        ids = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in lengths]
        mask = [torch.ones(n - 1) for n in lengths]
        mask[1][:4] = 0
        old = [torch.randn(n - 1, generator=g) * 0.1 for n in lengths]
        ret = [torch.randn(n - 1, generator=g) for n in lengths]
        batch = he.PPOBatch(input_ids=ids, response_mask=mask, old_values=old, returns=ret)
        if step == 0:
            with torch.no_grad():
                ref_v = [(backbone(s[None]).last_hidden_state[0, :-1] @ score.T).squeeze(-1) for s in ids]
            torch.testing.assert_close(engine.values(batch), pad(ref_v, 11), rtol=1e-5, atol=1e-6)
        stats = engine.value_step(batch, cfg)
        opt.zero_grad()
        values = torch.nn.utils.rnn.pad_sequence(
            [(backbone(s[None]).last_hidden_state[0, :-1] @ score.T).squeeze(-1) for s in ids], batch_first=True)
        loss = he.value_loss(values, pad(old, 11), pad(ret, 11), pad(mask, 11), clip=0.2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        torch.testing.assert_close(torch.tensor(stats["loss"], dtype=torch.float64), loss.detach().double(),
                                   rtol=1e-5, atol=1e-6)
    weights = full_weights(engine)
    torch.testing.assert_close(weights["score.weight"], score.detach(), rtol=1e-5, atol=1e-5)
    for name, p in backbone.named_parameters():
        torch.testing.assert_close(weights["model." + name], p.detach(), rtol=1e-5, atol=CFG["lr"] * 3 * 1e-3)
    with pytest.raises(ValueError, match="needs an actor engine"):
        engine.log_probs(batch)
    with pytest.raises(RuntimeError, match="rollout\\(\\) needs an actor engine"):
        with engine.rollout():
            pass
    with pytest.raises(ValueError, match="role must be 'actor' or 'critic'"):
        he.HybridEngine(hf, role="reward")


def test_embedding_grad_sums_each_ids_rows():
    """The trainer's embedding gradient (per distinct id, no atomics on CUDA) is index_add_'s sum: bit for
    bit from zero on the CPU (both add each id's rows in token order), and on top of a tied head's
    gradient within one rounding per add."""
    from hybridengine.train.trainer import add_embedding_grad_

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (200,), generator=g)  # every id repeated
    grad_x = torch.randn(200, 16, generator=g)
    expected = torch.zeros(12, 16).index_add_(0, ids, grad_x)
    got = torch.zeros(12, 16)
    add_embedding_grad_(got, *torch.unique(ids, sorted=True, return_inverse=True), grad_x)
    assert torch.equal(got, expected)
    head = torch.randn(12, 16, generator=g)
    got = head.clone()
    add_embedding_grad_(got, *torch.unique(ids, sorted=True, return_inverse=True), grad_x)
    terms = int(torch.bincount(ids).max()) + 1  # per row: its tokens' rows and the head's gradient
    # Two orders of the same fp32 sum: each within (terms - 1) u sum|term| of the exact sum.
    bound = 2 * terms * U32 * (head.abs() + torch.zeros(12, 16).index_add_(0, ids, grad_x.abs()))
    assert ((got - head.clone().index_add_(0, ids, grad_x)).abs() <= bound).all()


def test_released_params_never_read_the_old_buffer():
    """Activation checkpointing off: after the forward, the gathered buffer may be freed and reused
    (here: overwritten with NaN); backward over a fresh gather gives the plain autograd gradients."""
    from hybridengine.train.released_params import ReleasedParams

    class Layout:  # natural_view over a flat buffer: name -> (offset, shape)
        spans = {"l.w1": (0, (8, 4)), "l.w2": (32, (4, 8)), "l.norm": (64, (4,))}

        def natural_view(self, natural, name):
            offset, shape = self.spans[name]
            return natural[offset:offset + torch.Size(shape).numel()].view(shape)

    def layer(params, x):
        h = F.linear(x * params["norm"], params["w1"])
        return F.linear(torch.nn.functional.silu(h), params["w2"]) + x

    F = torch.nn.functional
    torch.manual_seed(0)
    layout, values = Layout(), torch.randn(68, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    plain = {k[2:]: layout.natural_view(values, k).clone().requires_grad_() for k in layout.spans}
    layer(plain, x).square().sum().backward()

    natural = values.clone()
    params = {k[2:]: layout.natural_view(natural, k).detach().requires_grad_() for k in layout.spans}
    slots = ReleasedParams(params, natural, layout, "l.")
    packed = []
    pack = lambda t: packed.append(slots.pack(t)) or packed[-1]  # noqa: E731
    xi = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, slots.unpack):
        out = layer(params, xi)
    assert sum(isinstance(p, tuple) for p in packed) >= 3  # every weight use was saved by reference
    assert not any(isinstance(p, torch.Tensor)
                   and p.untyped_storage().data_ptr() == natural.untyped_storage().data_ptr()
                   for p in packed)
    slots.release()
    assert all(p.numel() == 0 for p in params.values())
    natural.fill_(float("nan"))  # the allocator hands the old gather to someone else
    slots.attach(values.clone())  # the backward's gather
    out.square().sum().backward()
    torch.testing.assert_close(xi.grad, x.grad, rtol=0, atol=0)
    for k, p in params.items():
        torch.testing.assert_close(p.grad, plain[k].grad, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
def test_gpu_packed_attention_varlen_matches_per_sequence(device, window):
    """PackedAttention on CUDA (exact_attention over all sequences) against one SDPA call per sequence:
    outputs and the gradients of q, k, v in bf16 (both flash-style kernels: a few bf16 ulps at |x| ~ 1);
    the gradients repeat bit for bit."""
    from hybridengine.train.packed_attention import PackedAttention

    cu = [0, 7, 40, 41, 100]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(100, h, 64, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (8, 2, 2))
    attn = PackedAttention(cu)
    out = attn.attend(0, q, k, v, window)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    again = torch.autograd.grad(attn.attend(0, q, k, v, window).float().square().sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    ref = attn._per_sequence(q, k, v, window)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_scoring_engine_holds_no_optimizer_state():
    """log_probs alone (a reference model) allocates neither gradients nor AdamW state; the first step
    allocates AdamW state and frees its gradients again."""
    engine = he.HybridEngine(build(), he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64))
    batch = he.PPOBatch(input_ids=[torch.arange(6), torch.arange(4)])
    engine.log_probs(batch)
    report = engine.memory_report()
    assert report["optimizer"] == 0 and report["gradients"] == 0
    assert not engine.trainer.has_optimizer and engine.trainer.held_gradients == []
    engine.ppo_step(he.PPOBatch(input_ids=batch.input_ids, response_mask=[torch.ones(5), torch.ones(3)],
                                old_logprobs=[torch.zeros(5), torch.zeros(3)],
                                advantages=[torch.ones(5), torch.ones(3)]))
    report = engine.memory_report()
    numel = engine.sharded.layout.shard_numel
    assert report["gradients"] == 0
    assert report["optimizer"] * 2**30 >= 8 * numel
