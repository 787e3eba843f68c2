"""Exact mode for mixture-of-experts models (`ops.moe_exact`) and the rollout's routed experts
(`EngineConfig.return_routed_experts`, rollout/routing.py).

The op: batch invariance bit for bit (each row alone, in any batch, in any order), ties to the lowest expert id,
and the float64 reference (tolerance: the error of the grouped-GEMM reference in the same dtype). The engine:
rollout log-probs, router logits and choices equal to the trainer's bit for bit, on the torch path and on the
Triton kernels under the interpreter; routed experts equal to the trainer's top-k, through the samples of one
prompt, a cached prefix and preemption.
"""

import pytest
import torch

import hybridengine as he
from conftest import DEVICE
from hybridengine.model import moe
from hybridengine.ops import _launch
from hybridengine.ops.grouped_gemm import grouped_mlp_ref
from hybridengine.ops.moe_exact import exact_experts, exact_experts_ref, exact_routing, moe_experts_exact, sigmoid_exact
from hybridengine.train import packed_attention
from test_exact import assert_bitwise, completions, prompts, sampled, trainer_logprobs
from test_moe import SHAPES, olmoe, qwen2_moe, qwen3_moe

VOCAB = SHAPES["vocab_size"]


def experts_case(tokens, num_experts, top_k, dtype, seed=0, H=32, inter=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, H, generator=g) * 0.2).to(dtype)
    down = (torch.randn(num_experts, H, inter, generator=g) * 0.2).to(dtype)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=g), -1)
    weights, experts = exact_routing(probs, top_k, True)
    return x, gate_up, down, experts, weights


# -- the op ----------------------------------------------------------------------------------------------------


def test_routing_takes_the_largest_and_breaks_ties_by_the_lowest_expert_id():
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.0, 0.3],
                          [0.2, 0.2, 0.2, 0.2, 0.2],
                          [0.5, 0.1, 0.0, 0.4, 0.0]])
    weights, experts = exact_routing(probs, 2, False)
    assert experts.tolist() == [[1, 2], [0, 1], [0, 3]]
    assert torch.equal(weights, probs.gather(1, experts))
    weights, experts = exact_routing(probs, 3, True)
    assert experts.tolist() == [[1, 2, 4], [0, 1, 2], [0, 3, 1]]
    total = (probs.gather(1, experts)[:, 0] + probs.gather(1, experts)[:, 1]) + probs.gather(1, experts)[:, 2]
    assert torch.equal(weights, probs.gather(1, experts) / total.unsqueeze(1))  # the slot-order sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 3, 1), (13, 5, 2), (29, 4, 4), (40, 8, 3)])
def test_each_tokens_bits_do_not_depend_on_the_batch(tokens, num_experts, top_k, dtype):
    x, gate_up, down, experts, weights = experts_case(tokens, num_experts, top_k, dtype, seed=tokens)
    full = exact_experts(x, gate_up, down, experts, weights)
    assert full.dtype == torch.float32 and full.shape == x.shape
    for i in range(tokens):
        alone = exact_experts(x[i:i + 1], gate_up, down, experts[i:i + 1], weights[i:i + 1])
        assert torch.equal(alone, full[i:i + 1]), i
    perm = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    assert torch.equal(exact_experts(x[perm], gate_up, down, experts[perm], weights[perm]), full[perm])
    assert torch.equal(exact_experts(x[:0], gate_up, down, experts[:0], weights[:0]), full[:0])
    gate = torch.randn(tokens, 1, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert all(torch.equal(sigmoid_exact(gate[i:i + 1]), sigmoid_exact(gate)[i:i + 1]) for i in range(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_the_float64_reference_within_the_grouped_references_error(dtype):
    x, gate_up, down, experts, weights = experts_case(57, 6, 2, dtype, seed=3, H=48, inter=20)
    ref = exact_experts_ref(x, gate_up, down, experts, weights)
    got = exact_experts(x, gate_up, down, experts, weights)
    # the grouped-GEMM reference in the same dtype (transformers' roundings) against the same float64 value
    grouped = grouped_mlp_ref(x, gate_up, down, experts, weights.to(dtype))
    ref_err = (grouped.double() - ref).abs().max()
    err = (got.double() - ref).abs().max()
    assert err <= ref_err + 8 * torch.finfo(torch.float32).eps * ref.abs().max(), (err, ref_err)
    assert torch.equal(moe_experts_exact(x, gate_up, down, experts, weights), got)


def test_bad_arguments_are_named():
    x, gate_up, down, experts, weights = experts_case(5, 4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"moe_experts_exact: x must be 2-D, got shape \(32,\)"):
        moe_experts_exact(x[0], gate_up, down, experts, weights)
    with pytest.raises(ValueError, match=r"gate_up must be \[E, 2I, H=32\] .* got shape \(4, 24, 31\)"):
        moe_experts_exact(x, gate_up[..., :31], down, experts, weights)
    with pytest.raises(ValueError, match=r"down must have shape \(4, 32, 12\), got \(4, 32, 11\)"):
        moe_experts_exact(x, gate_up, down[..., :11], experts, weights)
    with pytest.raises(ValueError, match=r"gate_up must be torch.float32, got torch.bfloat16"):
        moe_experts_exact(x, gate_up.bfloat16(), down, experts, weights)
    with pytest.raises(ValueError, match=r"experts must be torch.int64, got torch.int32"):
        moe_experts_exact(x, gate_up, down, experts.int(), weights)
    with pytest.raises(ValueError, match=r"experts must be \[N=5, k >= 1\], got shape \(4, 2\)"):
        moe_experts_exact(x, gate_up, down, experts[:4], weights)
    with pytest.raises(ValueError, match=r"experts must hold ids in \[0, 4\), got 0..4"):
        moe_experts_exact(x, gate_up, down, experts.clamp(max=3).index_fill(0, torch.tensor([2]), 4), weights)
    with pytest.raises(ValueError, match=r"weights must be torch.float32, got torch.bfloat16"):
        moe_experts_exact(x, gate_up, down, experts, weights.bfloat16())


# -- the engine ------------------------------------------------------------------------------------------------


def moe_engine(make, dtype, *, exact=True, routed=False, **kw):
    cfg = he.EngineConfig(dtype=dtype, device=str(DEVICE), block_size=4, max_model_len=48,
                          max_num_batched_tokens=64, exact_logprobs=exact, return_routed_experts=routed,
                          tuning=he.EngineTuning(sampler="torch"), **{"max_num_seqs": 8, **kw})
    return he.HybridEngine(make(), cfg)


def generate(engine, ps, params):
    with engine.rollout():
        return engine.generate(ps, params)


@pytest.fixture(params=["native", "interpreter"])
def kernels(request, monkeypatch):
    """The device's own path, or on CPU the Triton kernels under the interpreter (as test_exact's)."""
    if request.param == "interpreter":
        if DEVICE.type == "cuda":
            pytest.skip("the interpreter runs the kernels on CPU; on CUDA the native path is the kernels")
        monkeypatch.setattr(_launch, "use_kernel", lambda t: True)
    return request.param


@pytest.mark.parametrize("make,dtype", [(qwen3_moe, torch.float32), (qwen2_moe, torch.bfloat16),
                                        (olmoe, torch.float32)])
def test_rollout_logprobs_equal_the_trainers_bitwise(make, dtype, kernels):
    if kernels == "interpreter" and make is not qwen2_moe:
        pytest.skip("the interpreter runs one model (Qwen2-MoE in bf16, with its shared expert): it is slow on CPU")
    engine = moe_engine(make, dtype)
    lens, tokens = ([3, 9, 17, 6, 1], 8) if kernels == "native" else ([3, 9, 1], 4)
    seqs = completions(generate(engine, prompts(VOCAB, lens), sampled(max_tokens=tokens)))
    assert_bitwise(seqs, trainer_logprobs(engine, seqs))
    assert_bitwise(seqs[:3], [trainer_logprobs(engine, [s])[0] for s in seqs[:3]])
    assert_bitwise(seqs, trainer_logprobs(engine, seqs, micro_batch_tokens=20))


def test_first_ppo_step_on_rollout_logprobs_has_ratio_one():
    """Qwen2-MoE with the load-balancing loss: the step's forward (with autograd through the exact experts)
    computes the rollout's bits (ratio 1, KL 0), and the step trains the routed experts."""
    engine = moe_engine(qwen2_moe, torch.float32)
    seqs = completions(generate(engine, prompts(VOCAB, [4, 7]), sampled(n=2)))
    ids, mask, old = [], [], []
    for p, c, lp in seqs:
        ids.append(torch.tensor(p + c))
        m = torch.zeros(len(p) + len(c) - 1)
        m[len(p) - 1:] = 1
        o = torch.zeros_like(m)
        o[len(p) - 1:] = torch.tensor(lp)
        mask.append(m)
        old.append(o)
    adv = [m * (1.0 if i % 2 else -1.0) for i, m in enumerate(mask)]
    name = "model.layers.0.mlp.experts.down_proj"
    before = dict(engine.state_dict())[name].clone()
    stats = engine.ppo_step(he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=old, advantages=adv),
                            he.PPOConfig(lr=1e-3, temperature=0.8, micro_batch_tokens=16))
    assert stats["ppo_kl"] == 0.0 and stats["pg_clipfrac"] == 0.0 and stats["aux_loss"] > 0
    assert not torch.equal(dict(engine.state_dict())[name], before)


def test_router_logits_and_choices_equal_the_trainers_bitwise(monkeypatch):
    """One request (prefill of the prompt, then one decode row per step): each layer's router logits, routing
    weights and experts per position, against the trainer's forward over prompt + completion."""
    calls = []
    route = moe.SparseMoeBlock.route

    def spy(self, x, exact=False):
        out = route(self, x, exact)
        calls.append((self.gate.weight.data_ptr(), *(t.detach().clone() for t in out)))
        return out

    monkeypatch.setattr(moe.SparseMoeBlock, "route", spy)
    engine = moe_engine(qwen3_moe, torch.bfloat16)
    seqs = completions(generate(engine, prompts(VOCAB, [7]), sampled(n=1, max_tokens=6)))
    rollout = list(calls)
    calls.clear()
    trainer_logprobs(engine, seqs)
    (prompt, completion, _), = seqs
    positions = len(prompt) + len(completion) - 1
    layers = list(dict.fromkeys(c[0] for c in calls))  # the trainer's weights: another view than the rollout's
    assert len(layers) == 3
    for i in range(len(layers)):
        steps = rollout[i::3]  # one call per layer per step, in layer order
        train = calls[i]
        for k in (1, 2, 3):  # logits, weights, experts
            got = torch.cat([s[k] for s in steps])
            assert got.shape[0] == positions
            assert torch.equal(got, train[k][:positions]), (i, k)


def routing_of_trainer(engine, prompt, completion, monkeypatch) -> dict[int, torch.Tensor]:
    """The trainer forward's top-k experts per MoE layer for prompt + completion."""
    seen = {}
    record = packed_attention.PackedAttention.record_routing

    def spy(self, layer, logits, experts):
        seen[layer] = experts.detach().clone()
        record(self, layer, logits, experts)

    monkeypatch.setattr(packed_attention.PackedAttention, "record_routing", spy)
    trainer_logprobs(engine, [(prompt, completion, None)])
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("case", ["samples-and-prefix", "preempted"])
def test_routed_experts_are_the_trainers_topk(case, monkeypatch):
    """Qwen2-MoE (layer 1 dense): shape [prompt + completion - 1, layers, k], -1 in the dense layer, equal to
    the trainer's choices; through n = 2 samples of one prompt, a prompt whose prefix is cached from an earlier
    call in the rollout, and sequences preempted and recomputed in a small cache."""
    engine = moe_engine(qwen2_moe, torch.float32, routed=True,
                        **(dict(num_kv_blocks=10) if case == "preempted" else {}))
    ps = prompts(VOCAB, [9, 3, 13, 5])
    with engine.rollout():
        outs = engine.generate(ps, sampled(n=2, max_tokens=8))
        if case == "samples-and-prefix":
            outs += engine.generate([ps[0] + [1, 2, 3]], he.SamplingParams(temperature=0.0, max_tokens=5))
            assert engine.stats["prefix_cache_hit_tokens"] > 0
    if case == "preempted":
        assert engine.stats["preemptions"] > 0
    for out in outs:
        for c in out.outputs:
            routed, positions = c.routed_experts, len(out.prompt_token_ids) + len(c.token_ids) - 1
            assert routed.dtype == torch.int16 and routed.device.type == "cpu"
            assert routed.shape == (positions, 3, 2)
            assert (routed[:, 1] == -1).all()
            trained = routing_of_trainer(engine, out.prompt_token_ids, c.token_ids, monkeypatch)
            assert sorted(trained) == [0, 2]
            for layer, experts in trained.items():
                assert torch.equal(routed[:, layer].long(), experts[:positions]), layer


def test_routed_experts_only_when_asked_and_for_moe_models():
    out = generate(moe_engine(qwen3_moe, torch.float32), [[1, 2, 3]], he.SamplingParams(max_tokens=3))
    assert out[0].outputs[0].routed_experts is None
    out = generate(moe_engine(qwen3_moe, torch.float32, exact=False, routed=True), [[1, 2, 3]],
                   he.SamplingParams(max_tokens=3))
    assert out[0].outputs[0].routed_experts.shape == (5, 3, 2)
    with pytest.raises(ValueError, match="EngineConfig.return_routed_experts must be a bool, got int 1"):
        he.EngineConfig(return_routed_experts=1)
    with pytest.raises(ValueError, match=r"return_routed_experts=True needs a mixture-of-experts model, got "
                                         r"model_type 'qwen2' with num_experts=0"):
        he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(device="cpu", return_routed_experts=True))
