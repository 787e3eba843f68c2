"""The model-family seam (hybridengine.model.family): a family is declared in one place, and a parameter its
parallel plan does not cover is an error, never silently replicated."""

import pytest
import torch
from torch import nn

import hybridengine as he
from hybridengine.model.decoder import MLP
from hybridengine.model.families.dense import DENSE_PLAN, MLP_ROLES, decoder_plan
from hybridengine.model.families.qwen_moe import MOE_PLAN
from hybridengine.model.family import ModelFamily, ParallelPlan, family_of, register_family, unregister_family
from hybridengine.sharding.layout import param_specs, tp_role

TINY = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


class ScaledMLP(MLP):
    """A dense MLP whose output is scaled per channel: one parameter the dense plan does not know."""

    def __init__(self, config):
        super().__init__(config)
        self.scale = nn.Parameter(torch.empty(config.hidden_size, device="meta"))

    def forward(self, x):
        return super().forward(x) * self.scale

    def forward_flat(self, h, ops, exact, attn, layer_idx):
        return super().forward_flat(h, ops, exact, attn, layer_idx) * self.scale

    def forward_rollout(self, h, exact, attn, layer_idx):
        return super().forward_rollout(h, exact, attn, layer_idx).to(h.dtype) * self.scale


@pytest.fixture
def scaled_family():
    family = register_family(ModelFamily(
        model_type="test_scaled", build_mlp=lambda config, i: ScaledMLP(config),
        plan=decoder_plan("test_scaled", {**MLP_ROLES, "mlp.scale": "replicated"})))
    yield family
    unregister_family("test_scaled")


def test_a_family_declared_in_one_place_builds_loads_trains_and_generates(scaled_family):
    config = he.ModelConfig(model_type="test_scaled", **TINY)
    model = he.load_model(config, seed=1)
    assert model.family is scaled_family and family_of("test_scaled") is scaled_family
    roles = {s.name: s.role for s in model.flat_buffer.layout.specs}
    assert roles["model.layers.1.mlp.scale"] == "replicated"
    assert roles["model.layers.1.mlp.gate_proj.weight"] == "column"
    assert roles["model.layers.1.mlp.down_proj.weight"] == "row"
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.model.layers[0].mlp.scale.fill_(0.5)
        half = model(ids)
        model.model.layers[0].mlp.scale.fill_(1.0)
        assert not torch.equal(half, model(ids))  # the family's module runs
    engine = he.HybridEngine(config, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=32,
                                                     max_num_seqs=2))
    seqs = [torch.randint(0, TINY["vocab_size"], (9,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    batch = he.PPOBatch(input_ids=seqs, response_mask=[torch.ones(8)] * 2, old_logprobs=[torch.zeros(8)] * 2,
                        advantages=[torch.ones(8)] * 2)
    stats = engine.ppo_step(batch, he.PPOConfig(lr=1e-2))
    assert torch.isfinite(torch.tensor(stats["loss"]))
    with engine.rollout():
        out = engine.generate([seqs[0][:4].tolist()], he.SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_parameter_the_plan_does_not_cover_raises():
    family = register_family(ModelFamily(model_type="test_unplanned", build_mlp=lambda config, i: ScaledMLP(config),
                                         plan=DENSE_PLAN))
    try:
        with pytest.raises(ValueError, match=r"'model.layers.0.mlp.scale' is not covered by the parallel plan "
                                             r"of model family 'llama'"):
            he.load_model(he.ModelConfig(model_type="test_unplanned", **TINY))
    finally:
        unregister_family(family.model_type)
    # the names that regular expressions used to misread: a per-expert weight is not a dense column weight,
    # and a router is not replicated by default
    with pytest.raises(ValueError, match="not covered by the parallel plan"):
        tp_role("model.layers.0.mlp.experts.3.gate_proj.weight")
    with pytest.raises(ValueError, match="not covered by the parallel plan"):
        param_specs([("model.layers.0.mlp.gate.weight", (4, 8))])
    assert tp_role("model.layers.0.mlp.experts.gate_up_proj", MOE_PLAN) == "expert"
    assert tp_role("model.layers.0.mlp.gate.weight", MOE_PLAN) == "replicated"


def test_family_declaration_errors(scaled_family):
    with pytest.raises(ValueError, match="model_type 'test_scaled' already has a family"):
        register_family(ModelFamily(model_type="test_scaled", plan=DENSE_PLAN, build_mlp=lambda c, i: MLP(c)))
    with pytest.raises(ValueError, match="family must be a ModelFamily"):
        register_family("llama")
    with pytest.raises(ValueError, match=r"layer roles \{'mlp.x': 'diagonal'\} are not among"):
        ParallelPlan(family="bad", embed={}, head={}, layer={"mlp.x": "diagonal"})
    with pytest.raises(ValueError, match=r"head_granule names \['q'\] are not layer parameters"):
        ParallelPlan(family="bad", embed={}, head={}, layer={}, head_granule=frozenset({"q"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        family_of("gpt2")
