"""Expert-parallel generation of mixture-of-experts models over gloo: N = 2 and 4 ranks, tg in {2, 4}.

TP rank t holds the whole experts [t * E / tg, (t + 1) * E / tg) and runs only the tokens' assignments to them;
an all-reduce sums the ranks' parts. Greedy tokens equal one process's (tg = 1) and log-probs agree within the
fp32 rounding of a reordered sum; in exact mode at tg = 2 they are equal bit for bit, and equal the trainer's.
The switch to generation and back keeps every expert weight bit for bit."""

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hybridengine as he
from _dist import reporting, spawn
from hybridengine.model.moe import Experts
from hybridengine.model.tensor_parallel import local_config
from hybridengine.ops.grouped_gemm import grouped_mlp, grouped_mlp_ref
from hybridengine.ops.moe_exact import exact_experts
from hybridengine.train.expert_parallel import ExpertParallelTraining

SHAPES = dict(vocab_size=67, hidden_size=64, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=64)
PROMPT_LENS = [3, 9, 17, 6]
MAX_TOKENS = 6


def build(kind: str, **overrides):
    """A random tiny Qwen3-MoE, or Qwen2-MoE with a shared expert and a dense layer (mlp_only_layers)."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**SHAPES, "norm_topk_prob": True, **overrides}))
    else:
        hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**SHAPES, "shared_expert_intermediate_size": 20,
                                                   "mlp_only_layers": [1], **overrides}))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    return hf.eval()


def engine_for(hf, tp, exact=False):
    return he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", tp_generation=tp, block_size=4,
                                               max_model_len=48, max_num_seqs=8, max_num_batched_tokens=64,
                                               exact_logprobs=exact, tuning=he.EngineTuning(sampler="torch")))


def prompts(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def generate(engine, params):
    """[(prompt, token ids, log-probs)] of every completion."""
    with engine.rollout():
        outs = engine.generate(prompts(SHAPES["vocab_size"]), params)
    return [(o.prompt_token_ids, c.token_ids, c.logprobs) for o in outs for c in o.outputs]


GREEDY = he.SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
SAMPLED = he.SamplingParams(n=2, temperature=0.8, max_tokens=MAX_TOKENS, seed=5)


# -- the partial sums, on one process -------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,slices,top_k", [(4, 2, 2), (4, 4, 1), (6, 3, 3), (2, 2, 2)])
def test_expert_partials_sum_to_the_routed_mlp(num_experts, slices, top_k):
    """The slices' `grouped_mlp(first=...)` partials add up to `grouped_mlp_ref` (fp64: to rounding); every slice
    alone covers exactly the assignments to its experts; one slice of every expert is the whole layer."""
    g = torch.Generator().manual_seed(num_experts * 10 + slices)
    N, H, inter = 11, 6, 5
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    gate_up = torch.randn(num_experts, 2 * inter, H, generator=g, dtype=torch.float64)
    down = torch.randn(num_experts, H, inter, generator=g, dtype=torch.float64)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(N)])
    weights = torch.rand(N, top_k, generator=g, dtype=torch.float64)
    ref = grouped_mlp_ref(x, gate_up, down, experts, weights)
    m = num_experts // slices
    parts = [grouped_mlp(x, gate_up[t * m:(t + 1) * m], down[t * m:(t + 1) * m], experts, weights, first=t * m,
                         num_experts=num_experts) for t in range(slices)]
    torch.testing.assert_close(sum(parts), ref, rtol=0, atol=1e-12)
    for t, part in enumerate(parts):  # a token none of whose experts is in the slice gets exact zeros
        none = ~((experts >= t * m) & (experts < (t + 1) * m)).any(dim=1)
        assert torch.equal(part[none], torch.zeros_like(part[none]))
    assert torch.equal(grouped_mlp(x, gate_up, down, experts, weights, first=0, num_experts=num_experts),
                       grouped_mlp(x, gate_up, down, experts, weights))


def test_exact_experts_add_two_fp32_halves_once():
    """Exact mode on one process: the fp32 partials of the two halves of the experts, added once and rounded
    once: what the two ranks of tg = 2 compute and all-reduce."""
    g = torch.Generator().manual_seed(2)
    N, H, inter, E, k = 7, 8, 4, 4, 2
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    module = Experts(E, H, inter)
    module.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * inter, H, generator=g).to(torch.bfloat16))
    module.down_proj = torch.nn.Parameter(torch.randn(E, H, inter, generator=g).to(torch.bfloat16))
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g).to(torch.bfloat16)
    halves = [exact_experts(x, module.gate_up_proj[s:s + 2], module.down_proj[s:s + 2], experts, weights, first=s,
                            num_experts=E) for s in (0, 2)]
    assert halves[0].dtype == torch.float32
    got = module(x, experts, weights, exact=True)  # unrounded: the block adds the shared expert, then rounds
    assert got.dtype == torch.float32 and torch.equal(got, halves[0] + halves[1])
    # batch-invariant: a row's bits do not depend on the other rows
    assert torch.equal(module(x[2:3], experts[2:3], weights[2:3], exact=True), got[2:3])


# -- bad splits --------------------------------------------------------------------------------------------------


def test_bad_expert_splits_raise():
    config = he.ModelConfig.from_hf(build("qwen3_moe", num_experts=6).config)
    with pytest.raises(ValueError, match=r"tp_size=4 \(tp_generation\) must divide num_experts=6"):
        local_config(config, 4)
    local = local_config(config, 2)
    assert (local.num_experts, local.expert_slices, local.num_local_experts) == (6, 2, 3)
    with pytest.raises(ValueError, match="config must be a whole model's"):
        local_config(local, 2)
    shared = he.ModelConfig.from_hf(build("qwen2_moe", shared_expert_intermediate_size=10).config)
    with pytest.raises(ValueError, match="must divide num_experts=4 .* and shared_expert_intermediate_size=10"):
        local_config(shared, 4)
    with pytest.raises(ValueError, match="expert_slices=4 must divide num_experts=6"):
        he.ModelConfig.from_hf(build("qwen3_moe", num_experts=6).config).__class__(
            **{**_fields(config), "expert_slices": 4})
    with pytest.raises(ValueError, match="expert_slices must be an int >= 1, got 0"):
        config.__class__(**{**_fields(config), "expert_slices": 0})
    with pytest.raises(ValueError, match="expert_slices=2 must divide num_experts=0"):
        he.ModelConfig(**{**_fields(config), "num_experts": 0, "num_experts_per_tok": 0, "expert_slices": 2})


def _fields(config):
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def _bad_split_worker(rank, world, init_file, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        with pytest.raises(ValueError, match=r"its 5 experts must divide into tp_size=2 slices of whole experts"):
            engine_for(build("qwen3_moe", num_experts=5), 2)


def test_an_engine_with_experts_tg_does_not_divide_raises():
    spawn(_bad_split_worker, 2)


# -- generation over gloo ----------------------------------------------------------------------------------------


def _gen_worker(rank, world, init_file, kind, overrides, tp, expected, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        engine = engine_for(build(kind, **overrides), tp)
        before = {n: t.clone() for n, t in engine.state_dict()}
        t, m = engine.sharded.tp_rank, SHAPES["num_experts"] // tp
        with engine.rollout():  # this rank's generation view holds its own whole experts
            for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
                owner, attr = name.rsplit(".", 1)
                held = getattr(engine.model.get_submodule(owner), attr)
                assert torch.equal(held, before[name][t * m:(t + 1) * m]), name
        for _ in range(2):  # two rollouts: the switch there and back twice
            got = generate(engine, GREEDY)
            assert [c[1] for c in got] == [c[1] for c in expected], "greedy tokens differ from tg = 1"
            for (_, _, lp), (_, _, ref) in zip(got, expected):
                torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), rtol=0, atol=LOGPROB_ATOL)
        after = dict(engine.state_dict())
        assert after.keys() == before.keys()
        for name, value in before.items():
            assert torch.equal(after[name], value), f"{name} changed over the switch"


LOGPROB_ATOL = 64 * torch.finfo(torch.float32).eps
"""fp32 log-probs of tg > 1 against tg = 1: the same arithmetic but for the order of a few sums (each partial
rounded once more before the all-reduce adds it), through 3 layers and a log-softmax over 67 logits of O(10)."""


@pytest.mark.parametrize("kind,overrides,world,tp", [
    ("qwen3_moe", {}, 2, 2),
    ("qwen2_moe", {}, 4, 2),
    ("qwen3_moe", {}, 4, 4),
    ("qwen2_moe", {}, 4, 4),
])
def test_expert_parallel_generation_equals_one_process(kind, overrides, world, tp):
    expected = generate(engine_for(build(kind, **overrides), 1), GREEDY)
    spawn(_gen_worker, world, kind, overrides, tp, expected)


def _exact_worker(rank, world, init_file, kind, expected, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        engine = engine_for(build(kind), 2, exact=True)
        got = generate(engine, SAMPLED)
        assert got == expected, "exact mode at tg = 2: tokens or log-probs differ from one process's bits"
        batch = he.PPOBatch(input_ids=[torch.tensor(p + c) for p, c, _ in got])
        logp = engine.trainer.log_probs(batch, temperature=SAMPLED.temperature, micro_batch_tokens=24)
        for b, (p, c, lp) in enumerate(got):
            trained = logp[b, len(p) - 1:len(p) - 1 + len(c)]
            assert torch.equal(trained, torch.tensor(lp, dtype=torch.float32)), "trainer log-probs differ"


@pytest.mark.parametrize("kind,world", [("qwen3_moe", 2), ("qwen2_moe", 4)])
def test_exact_expert_parallel_generation_is_bitwise(kind, world):
    """exact_logprobs at tg = 2: each rank's fp32 partial over its half of the experts, all-reduced and rounded
    once, is the single process's sum of the same two halves: the same bits, sampled tokens and log-probs; and
    the trainer's log-probs equal the rollout's."""
    expected = generate(engine_for(build(kind), 1, exact=True), SAMPLED)
    spawn(_exact_worker, world, kind, expected)


# -- expert-parallel training over gloo --------------------------------------------------------------------------


def _nll(logp, entropy, fields):
    return -(logp * fields["mask"]).sum() / fields["mask"].sum()


def _train_batch(rank):
    """Each rank's own sequences (data parallel)."""
    g = torch.Generator().manual_seed(100 + rank)
    seqs = [torch.randint(0, SHAPES["vocab_size"], (int(n),), generator=g) for n in torch.randint(5, 14, (3,),
                                                                                                 generator=g)]
    n = [len(s) - 1 for s in seqs]
    return he.PPOBatch(input_ids=seqs, response_mask=[torch.ones(k) for k in n],
                       old_logprobs=[torch.zeros(k) for k in n], advantages=[torch.ones(k) for k in n])


def _train_engine(hf, tp, ep, exact=False):
    return he.HybridEngine(hf, he.EngineConfig(
        dtype=torch.float32, device="cpu", tp_generation=tp, max_model_len=32, max_num_seqs=2, keep_grads=True,
        exact_logprobs=exact, tuning=he.EngineTuning(sampler="torch", expert_parallel_training=ep)))


def _close(got, ref, what, k=64):
    """|got - ref| <= k fp32 ulps of ref's scale: the engines differ only in how the experts' GEMMs group rows."""
    bound = k * torch.finfo(torch.float32).eps * max(ref.abs().max().item(), 1.0)
    err = (got - ref).abs().max().item()
    assert err <= bound, f"{what}: |difference| {err:.3g} > {bound:.3g}"


def _ep_train_worker(rank, world, init_file, kind, tp, checkpointing, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        hf = build(kind, router_aux_loss_coef=0.05, output_router_logits=True)
        base, ep = _train_engine(hf, tp, False), _train_engine(hf, tp, True)
        cfg = he.TrainConfig(lr=1e-2, max_grad_norm=None, micro_batch_tokens=24,
                             activation_checkpointing=checkpointing)
        stats = [e.train_step(_train_batch(rank), _nll, cfg) for e in (base, ep)]
        assert stats[1]["aux_loss"] > 0
        moe_layers = [layer.mlp.experts for layer in ep.trainer.model.skeleton.model.layers
                      if hasattr(layer.mlp, "experts")]
        assert moe_layers and all(isinstance(m, ExpertParallelTraining) for m in moe_layers)
        assert [m.first for m in moe_layers[:1]] == [ep.sharded.tp_rank * SHAPES["num_experts"] // tp]
        # the trainer's gather of a layer brings this rank's own experts only (the others zero), every other
        # parameter whole; a plain gather (state_dict, checkpoints) still brings everything
        sb, name = ep.sharded, "model.layers.0.mlp.experts.gate_up_proj"
        u = sb.layout.unit_index["layers.0"]
        own, whole = (sb.natural_view(sb.gather_unit(u, own_experts=flag), name) for flag in (True, False))
        lo, hi = moe_layers[0].first, moe_layers[0].first + moe_layers[0].num_local
        assert torch.equal(own[lo:hi], whole[lo:hi]) and not own[:lo].any() and not own[hi:].any()
        router = "model.layers.0.mlp.gate.weight"
        assert torch.equal(*(sb.natural_view(sb.gather_unit(u, own_experts=f), router) for f in (True, False)))
        for key in ("loss", "aux_loss"):
            _close(torch.tensor(stats[1][key]), torch.tensor(stats[0][key]), key)
        for u, (g_ep, g_base) in enumerate(zip(ep.trainer.grads, base.trainer.grads)):
            _close(g_ep, g_base, f"gradient shard of unit {base.sharded.layout.units[u].name}")
        # AdamW's first step moves a weight by lr * g / (|g| + eps) (at most lr): where |g| is near eps, an ulp
        # of gradient moves it by up to lr. So the weights agree up to the difference of the two updates, plus
        # the rounding of w - update, a few ulps of the operands' scale |w| + lr.
        layout, data = base.sharded.layout, (base.sharded.flat_buffer.data, ep.sharded.flat_buffer.data)
        for u, (off, numel) in enumerate(layout.shard_in_gen(rank)):
            g0, g1 = base.trainer.grads[u], ep.trainer.grads[u]
            w0, w1 = (d[off:off + numel] for d in data)
            moved = cfg.lr * (g1 / (g1.abs() + cfg.eps) - g0 / (g0.abs() + cfg.eps)).abs()
            rounding = 4 * torch.finfo(torch.float32).eps * (w0.abs() + cfg.lr)
            assert ((w1 - w0).abs() <= moved + rounding).all(), (
                f"unit {layout.units[u].name}: weights after one step differ by more than the updates do")


@pytest.mark.parametrize("kind,world,tp,checkpointing", [
    ("qwen3_moe", 2, 2, True),
    ("qwen2_moe", 4, 2, False),
    ("qwen3_moe", 4, 4, True),
])
def test_expert_parallel_training_equals_the_gathered_experts(kind, world, tp, checkpointing):
    """EngineTuning.expert_parallel_training: each rank's tokens go to the experts' owners (all-to-all over the
    TP group) and back; loss, load-balancing loss, every gradient shard and the weights after one AdamW step
    equal those of every rank running every expert, up to the rounding of differently grouped GEMM rows."""
    spawn(_ep_train_worker, world, kind, tp, checkpointing)


def _ep_exact_worker(rank, world, init_file, kind, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        engine = _train_engine(build(kind), 2, True, exact=True)
        seqs = generate(engine, SAMPLED)
        batch = he.PPOBatch(input_ids=[torch.tensor(p + c) for p, c, _ in seqs])
        logp = engine.trainer.log_probs(batch, temperature=SAMPLED.temperature, micro_batch_tokens=24)
        assert isinstance(engine.trainer.model.skeleton.model.layers[0].mlp.experts, ExpertParallelTraining)
        for b, (p, c, lp) in enumerate(seqs):
            trained = logp[b, len(p) - 1:len(p) - 1 + len(c)]
            assert torch.equal(trained, torch.tensor(lp, dtype=torch.float32)), "trainer log-probs differ"


@pytest.mark.parametrize("kind,world", [("qwen2_moe", 2)])
def test_exact_expert_parallel_training_scores_the_rollouts_bits(kind, world):
    """exact_logprobs with expert-parallel training: the owners' outputs, sent back and added as the two fp32
    halves, give the trainer the rollout's log-probs bit for bit."""
    spawn(_ep_exact_worker, world, kind)


def test_expert_parallel_training_errors():
    config = he.ModelConfig.from_hf(build("qwen3_moe", num_experts=6).config)
    from hybridengine.model.decoder import CausalLM
    from hybridengine.train.expert_parallel import apply_expert_parallel

    skeleton = CausalLM(config, device="meta")
    with pytest.raises(ValueError, match=r"EP group's 4 ranks \(tp_generation\) must divide num_experts=6"):
        apply_expert_parallel(skeleton, None, 0, 4)
    assert apply_expert_parallel(skeleton, None, 1, 1) == 0  # one rank: nothing to change
    assert apply_expert_parallel(skeleton, None, 1, 2) == config.num_hidden_layers
    assert skeleton.model.layers[0].mlp.experts.first == 3
    with pytest.raises(ValueError, match="EngineTuning.expert_parallel_training must be a bool, got"):
        he.EngineTuning(expert_parallel_training=1)
