"""Mixture-of-experts (Qwen3-MoE, Qwen2-MoE with a shared expert, OLMoE) on the model-family seam: the grouped-GEMM
reference, loading from transformers checkpoints, parity with transformers in fp32 (logits, greedy tokens,
gradients with the load-balancing loss), training and rollout on the shared buffer.

Tolerances: transformers in fp64 is the reference; the engine's fp32 error must stay within a small multiple
of transformers' own fp32 error (plus a few ulps of the reference's scale)."""

import copy

import pytest
import torch
from transformers import (OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

import hybridengine as he
from hybridengine.ops.grouped_gemm import grouped_gemm_ref, grouped_mlp_ref, route_tokens
from hybridengine.sharding.layout import ShardedLayout

SHAPES = dict(vocab_size=67, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_experts=5, num_experts_per_tok=2,
              max_position_embeddings=64)


def qwen3_moe(**overrides):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{**SHAPES, "head_dim": 8, "norm_topk_prob": True, "output_router_logits": True,
                               "router_aux_loss_coef": 0.05, **overrides})
    hf = Qwen3MoeForCausalLM(config).eval()
    hf.set_experts_implementation("eager")  # the per-expert loop: fp64 too (torch's grouped_mm has no fp64)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    return hf


def qwen2_moe():
    torch.manual_seed(1)
    config = Qwen2MoeConfig(**SHAPES, shared_expert_intermediate_size=20, mlp_only_layers=[1],
                            output_router_logits=True, router_aux_loss_coef=0.05)
    hf = Qwen2MoeForCausalLM(config).eval()
    hf.set_experts_implementation("eager")
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    return hf


def olmoe(**overrides):
    """OLMoE: q/k norms over the whole projection, top-k weights not renormalised, experts of intermediate_size."""
    torch.manual_seed(2)
    shapes = {k: v for k, v in SHAPES.items() if k != "moe_intermediate_size"}
    config = OlmoeConfig(**{**shapes, "intermediate_size": SHAPES["moe_intermediate_size"],
                            "output_router_logits": True, "router_aux_loss_coef": 0.05, "pad_token_id": None,
                            "eos_token_id": None, **overrides})
    hf = OlmoeForCausalLM(config).eval()
    hf.set_experts_implementation("eager")
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    return hf


def within_reference_error(got, hf32, hf64, k=4.0):
    """|got - fp64| <= k * |hf fp32 - fp64| (its max) + a few fp32 ulps of the reference's scale."""
    ref_err = (hf32.double() - hf64).abs().max()
    err = (got.double() - hf64).abs().max()
    bound = k * ref_err + 8 * torch.finfo(torch.float32).eps * hf64.abs().max()
    assert err <= bound, f"error {err:.3e} > bound {bound:.3e} (transformers fp32: {ref_err:.3e})"


# -- the grouped GEMM reference -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 3, 1), (7, 5, 2), (13, 4, 4), (0, 2, 1)])
def test_grouped_mlp_matches_the_per_token_loop(tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(tokens)
    H, inter = 6, 5
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    gate_up = torch.randn(num_experts, 2 * inter, H, generator=g, dtype=torch.float64)
    down = torch.randn(num_experts, H, inter, generator=g, dtype=torch.float64)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for n in range(tokens):
        for j in range(top_k):
            e = int(experts[n, j])
            gu = gate_up[e] @ x[n]
            expected[n] += weights[n, j] * (down[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    torch.testing.assert_close(grouped_mlp_ref(x, gate_up, down, experts, weights), expected)
    routing = route_tokens(experts, num_experts)
    assert routing.group_sizes == torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    rows = x[routing.tokens]
    out = grouped_gemm_ref(rows, gate_up, routing.group_sizes)
    start = 0
    for e, n in enumerate(routing.group_sizes):  # each expert's rows times its own weight
        torch.testing.assert_close(out[start:start + n], rows[start:start + n] @ gate_up[e].T)
        start += n


# -- loading and parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [qwen3_moe, qwen2_moe, olmoe])
def test_logits_match_transformers_from_model_and_checkpoint(make, tmp_path):
    hf = make()
    hf64 = copy.deepcopy(hf).double()
    hf.save_pretrained(tmp_path)  # per-expert tensors on disk: experts.<e>.gate_proj.weight, ...
    ids = torch.randint(0, SHAPES["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref32, ref64 = hf(ids).logits, hf64(ids).logits
        for source in (hf, tmp_path):
            model = he.load_model(source)
            assert model.config.num_experts == SHAPES["num_experts"]
            within_reference_error(model(ids), ref32, ref64)
    roles = {s.name: s.role for s in model.flat_buffer.layout.specs}
    assert roles["model.layers.0.mlp.experts.gate_up_proj"] == roles["model.layers.0.mlp.experts.down_proj"] == "expert"
    assert roles["model.layers.0.mlp.gate.weight"] == "replicated"


def test_checkpoint_errors_name_the_expert_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = qwen3_moe()
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.4.up_proj.weight"
    broken = {k: v for k, v in tensors.items() if k != name}
    save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: 'model.layers.1.mlp.experts.gate_up_proj'"):
        he.load_model(tmp_path)
    save_file({**broken, name: torch.zeros(3, 3)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.experts.4.up_proj.weight' .* has shape "
                                         r"\(3, 3\), expected \(12, 32\)"):
        he.load_model(tmp_path)
    save_file({**tensors, "model.layers.1.mlp.experts.5.up_proj.weight": tensors[name].clone()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expert 5 of a model with num_experts=5"):
        he.load_model(tmp_path)


def test_layout_cuts_experts_whole():
    config = qwen3_moe(num_experts=4).config
    specs = he.load_model(config).flat_buffer.layout.specs
    layout = ShardedLayout(specs, world_size=4, tp_size=2, element_size=4)
    gate_up = next(s for s in specs if s.name == "model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up.slice_shape(2) == (2, 24, 32)
    assert gate_up.natural_segments(1, 2) == [(2 * 24 * 32, 2 * 24 * 32)]  # TP rank 1 holds experts 2 and 3
    full = torch.randn(gate_up.shape)
    natural = torch.zeros(layout.units[1].natural_numel)
    layout.natural_view(natural, gate_up.name).copy_(full)
    from hybridengine.ops.segment_copy import segment_copy
    packed = torch.zeros(layout.units[1].numel)
    segment_copy(natural, packed, layout.units[1].pack_table())
    piece = next(p for p in layout.units[1].pieces if p.name == gate_up.name and p.slice_index == 1)
    assert torch.equal(packed[piece.offset:piece.offset + piece.slot_numel].view(2, 24, 32), full[2:])
    odd = next(s for s in he.load_model(qwen3_moe().config).flat_buffer.layout.specs if s.name == gate_up.name)
    with pytest.raises(ValueError, match=r"its 5 experts must divide into tp_size=2 slices of whole experts"):
        ShardedLayout([odd], world_size=2, tp_size=2)
    # expert-parallel generation (tests/test_moe_parallel.py): a TP rank's model holds 2 of the 4 experts
    from hybridengine.model.decoder import CausalLM
    from hybridengine.model.tensor_parallel import local_config
    local = CausalLM(local_config(he.ModelConfig.from_hf(config), 2), device="meta")
    assert local.model.layers[0].mlp.experts.gate_up_proj.shape == gate_up.slice_shape(2)
    assert local.model.layers[0].mlp.gate.weight.shape == (4, 32)  # the router scores every expert


# -- training and rollout on the shared buffer ----------------------------------------------------------------


def _batch(seqs):
    n = [len(s) - 1 for s in seqs]
    return he.PPOBatch(input_ids=seqs, response_mask=[torch.ones(k) for k in n],
                       old_logprobs=[torch.zeros(k) for k in n], advantages=[torch.ones(k) for k in n])


def _nll(logp, entropy, fields):
    return -(logp * fields["mask"]).sum() / fields["mask"].sum()


@pytest.mark.parametrize("make", [qwen3_moe, qwen2_moe, olmoe])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_gradients_match_transformers_with_the_load_balancing_loss(make, checkpointing):
    hf = make()
    assert he.ModelConfig.from_hf(hf.config).router_aux_loss_coef == 0.05
    ids = torch.randint(0, SHAPES["vocab_size"], (3, 10), generator=torch.Generator().manual_seed(4))
    grads = {}
    for dtype in (torch.float32, torch.float64):
        ref = copy.deepcopy(hf).to(dtype).train()
        out = ref(ids, labels=ids, output_router_logits=True)
        assert out.aux_loss > 0
        out.loss.backward()
        grads[dtype] = {n: p.grad for n, p in ref.named_parameters()}
        if dtype == torch.float64:
            ref_loss = float(out.loss.detach())
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=32,
                                                 max_num_seqs=2, keep_grads=True))
    stats = engine.train_step(_batch(list(ids)), _nll, he.TrainConfig(
        lr=1e-3, max_grad_norm=None, micro_batch_tokens=64, activation_checkpointing=checkpointing))
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert stats["aux_loss"] > 0
    layout = engine.sharded.layout
    for name, g32 in grads[torch.float32].items():
        u = layout.unit_index[next(s.unit for s in layout.specs if s.name == name)]
        got = layout.natural_view(engine.trainer.grads[u], name)
        within_reference_error(got, g32, grads[torch.float64][name])


def test_training_on_the_shared_buffer_lowers_the_loss_and_generation_sees_it():
    hf = qwen3_moe()
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=32,
                                                 max_num_seqs=4))
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, SHAPES["vocab_size"], (int(torch.randint(5, 12, (), generator=g)),), generator=g)
            for _ in range(4)]
    cfg = he.TrainConfig(lr=1e-2, micro_batch_tokens=20)  # two micro-batches
    losses = [engine.train_step(_batch(seqs), _nll, cfg)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    # rollout over the same buffer: greedy tokens equal transformers' greedy decode of the trained weights
    trained = copy.deepcopy(hf)
    trained.load_state_dict(dict(engine.state_dict()))
    prompts = [s[:4].tolist() for s in seqs[:2]]
    with engine.rollout():
        outs = engine.generate(prompts, he.SamplingParams(max_tokens=6, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        ref = trained.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("make", [qwen2_moe, olmoe])
def test_greedy_rollout_matches_transformers(make):
    hf = make()
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=32,
                                                 max_num_seqs=4))
    prompts = [[3, 9, 14, 2], [7, 1, 40, 33, 5, 8], [61]]
    with engine.rollout():
        outs = engine.generate(prompts, he.SamplingParams(max_tokens=7, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False, min_new_tokens=7)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_olmoe_config_translation_and_what_it_refuses():
    config = he.ModelConfig.from_hf(olmoe().config)
    assert (config.qk_norm, config.qk_norm_full_width, config.norm_topk_prob) == (True, True, False)
    assert config.moe_intermediate_size == SHAPES["moe_intermediate_size"] and config.router_aux_loss_coef == 0.05
    with pytest.raises(ValueError, match=r"olmoe: clip_qkv=8.0 is not supported"):
        he.ModelConfig.from_hf(OlmoeConfig(**{**SHAPES, "clip_qkv": 8.0}))
    with pytest.raises(ValueError, match="qk_norm_full_width=True needs qk_norm=True"):
        he.ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=4, qk_norm_full_width=True)
    from hybridengine.model.tensor_parallel import local_config
    dense = he.ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=4, qk_norm=True,
                           qk_norm_full_width=True)
    with pytest.raises(ValueError, match=r"tp_size=2: q/k norms over the whole projection"):
        local_config(dense, 2)


# -- checkpoint names: per-expert tensors in and out ------------------------------------------------------------


@pytest.mark.parametrize("make", [qwen3_moe, qwen2_moe, olmoe])
def test_per_expert_names_round_trip_through_load_weights_export_hf_and_state_dict(make, tmp_path):
    """load_weights takes save_pretrained's per-expert tensors; export_hf writes those names again, which
    transformers loads to the same logits; state_dict's stacked names load into transformers too."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine = he.HybridEngine(make(), he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=32,
                                                     max_num_seqs=2))
    other = make()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0.0, 0.15, generator=g)
    other.save_pretrained(tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    assert "model.layers.0.mlp.experts.4.up_proj.weight" in tensors
    written = engine.load_weights(tensors)
    assert "model.layers.0.mlp.experts.gate_up_proj" in written and "model.layers.0.mlp.experts.down_proj" in written
    engine.export_hf(tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(tensors)  # the names save_pretrained writes
    assert all(torch.equal(exported[name], tensors[name]) for name in tensors)
    ids = torch.randint(0, SHAPES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(8))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    back.set_experts_implementation("eager")
    fresh = make()
    fresh.load_state_dict(dict(engine.state_dict()))
    with torch.no_grad():
        expected = other(ids).logits
        assert torch.equal(back(ids).logits, expected)
        assert torch.equal(fresh(ids).logits, expected)


def test_load_weights_refuses_incomplete_or_doubled_expert_pieces():
    hf = qwen3_moe()
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=32,
                                                 max_num_seqs=2))
    prefix = "model.layers.1.mlp.experts"
    piece = torch.zeros(SHAPES["moe_intermediate_size"], SHAPES["hidden_size"])
    with pytest.raises(ValueError, match=rf"load_weights: the per-expert tensors of '{prefix}.gate_up_proj' cover "
                                         r"384 of its 3840 elements; a stacked parameter is written whole"):
        engine.load_weights({f"{prefix}.0.gate_proj.weight": piece})
    with pytest.raises(ValueError, match=rf"load_weights: tensor '{prefix}.gate_up_proj' is given whole and in "
                                         "per-expert pieces"):
        engine.load_weights({f"{prefix}.0.gate_proj.weight": piece,
                             f"{prefix}.gate_up_proj": torch.zeros(5, 24, SHAPES["hidden_size"])})
    with pytest.raises(ValueError, match=rf"load_weights: tensor '{prefix}.0.gate_proj.weight' appears twice"):
        engine.load_weights([(f"{prefix}.0.gate_proj.weight", piece), (f"{prefix}.0.gate_proj.weight", piece)])
    with pytest.raises(ValueError, match=rf"tensor '{prefix}.0.down_proj.weight' in the weights given to load_weights "
                                         r"has shape \(12, 32\), expected \(32, 12\)"):
        engine.load_weights({f"{prefix}.0.down_proj.weight": piece})
    assert engine.load_weights({"model.layers.9.mlp.experts.0.up_proj.weight": piece}, strict=False) == []
