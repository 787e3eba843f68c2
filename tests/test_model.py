"""The compact decoder against transformers (fp32, eager attention) and its flat-buffer views."""

import ast
import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hybridengine as he
from hybridengine import load_model
from hybridengine.model.config import ModelConfig, RopeConfig
from hybridengine.model.decoder import CausalLM

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
ATOL = 1e-4  # fp32 vs fp32: the observed error is ~5e-7 on logits of magnitude ~1


def hf_config(name: str, **overrides):
    kw = {**copy.deepcopy(he.MODEL_CONFIGS[name]), **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def hf_model(config, seed: int = 0):
    """An fp32 HF model whose weights are all perturbed: HF's ones-norms and zero-biases would hide
    a norm or bias that is read from the wrong place."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def compare(hf, T: int, B: int = 2, position_ids=None, seed: int = 1, device="cpu"):
    torch.manual_seed(seed)
    model = load_model(hf, device=device)
    hf = hf.to(device)
    ids = torch.randint(0, hf.config.vocab_size, (B, T)).to(device)
    position_ids = None if position_ids is None else position_ids.to(device)
    with torch.no_grad():
        ref = hf(ids, position_ids=position_ids).logits
        out = model(ids, position_ids=position_ids)
    assert out.shape == (B, T, hf.config.vocab_size) and out.dtype == ref.dtype
    err = (out - ref).abs().max().item()
    assert err <= ATOL, f"max abs error {err}"
    return model


@pytest.mark.parametrize("T", [17, 80])  # 80 > the llama3 original_max_position_embeddings=64
@pytest.mark.parametrize("name", FAMILIES)
def test_matches_hf(name, T, device):
    compare(hf_model(he.model_config(name)), T, device=device)


@pytest.mark.parametrize("name, overrides", [
    ("tiny-mistral", dict(sliding_window=5)),
    ("tiny-qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),  # layer 1 only
    ("tiny-llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    ("tiny-llama", dict(rope_scaling=None)),
    ("tiny-llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    ("tiny-qwen3", dict(attention_bias=True)),
    ("tiny-qwen2", dict(tie_word_embeddings=False)),
], ids=["mistral-window5", "qwen2-window6-layer1", "llama-linear-rope", "llama-default-rope",
        "llama-biases-tied", "qwen3-bias", "qwen2-untied"])
def test_variants_match_hf(name, overrides, device):
    model = compare(hf_model(hf_config(name, **overrides)), T=17, device=device)
    if "sliding_window" in overrides:
        assert "sliding_attention" in model.config.layer_types


def test_position_ids_match_hf():
    T = 13
    pos = torch.stack([torch.arange(T) + 5, torch.arange(T) * 2])  # offset and strided positions
    compare(hf_model(he.model_config("tiny-llama")), T, position_ids=pos)


def test_llama3_scaling_is_exercised():
    # The tiny-llama parity test only covers llama3 scaling if it changes the frequencies.
    cfg = ModelConfig.from_hf(he.model_config("tiny-llama"))
    assert cfg.rope.rope_type == "llama3"
    scaled, plain = cfg.rope.inv_freq(cfg.head_dim), RopeConfig(theta=cfg.rope.theta).inv_freq(cfg.head_dim)
    assert not torch.allclose(scaled, plain) and torch.equal(scaled[0], plain[0])


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_are_views_of_flat_buffer(name):
    hf = hf_model(he.model_config(name))
    model = load_model(hf)
    buf = model.flat_buffer
    lo = buf.data.data_ptr()
    hi = lo + buf.nbytes()
    params = dict(model.named_parameters())
    # Names are exactly HF's (the tied lm_head is the embedding, not a second tensor).
    expected = set(hf.state_dict()) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    assert set(params) == expected == set(buf.names)
    for pname, p in params.items():
        assert p.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr(), pname
        assert lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= hi, pname
        assert p.data_ptr() == buf.view(pname).data_ptr()
    if hf.config.tie_word_embeddings:
        assert model.lm_head is None and model.lm_head_weight is model.model.embed_tokens.weight


def test_writing_flat_buffer_changes_output():
    model = load_model(he.model_config("tiny-qwen3"))
    ids = torch.randint(0, 131, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
        model.flat_buffer.view("model.layers.1.self_attn.k_norm.weight").mul_(3.0)
        changed = model(ids)
        model.flat_buffer.data.zero_()  # final norm weight 0 -> hidden 0 -> logits 0
        zeroed = model(ids)
    assert not torch.allclose(before, changed)
    assert torch.count_nonzero(zeroed) == 0


def test_split_forward_equals_forward():
    model = load_model(he.model_config("tiny-qwen2"))
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        assert hidden.shape == (3, 11, 64)
        assert torch.equal(model.compute_logits(hidden), model(ids))
        assert model.vocab_shard is None and torch.equal(model.local_logits(hidden), model.compute_logits(hidden))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-mistral"])
def test_flat_layers_run_the_kernels_their_attention_declares(name):
    """The layers on packed flat tokens equal the dense forward per sequence, with the kernels the attention
    backend declares (Kernels.TORCH: the module code; Kernels.TRAIN: the ops' autograd kernels, their torch
    reference on CPU); a Kernels.ROLLOUT backend is chained by hidden_states_paged, not by the layers."""
    from hybridengine.model.decoder import Kernels
    from hybridengine.train.packed_attention import PackedAttention

    model = load_model(he.model_config(name))
    lens = [5, 9]
    ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = [0, lens[0], sum(lens)]
    outs = {}
    for fused in (False, True):
        attn = PackedAttention(cu, fused=fused)
        assert attn.kernels is (Kernels.TRAIN if fused else Kernels.TORCH)
        x = model.model.embed_tokens(ids)
        cos, sin = model.rope(positions, x.dtype)
        for i, layer in enumerate(model.model.layers):
            x = layer(x, cos, sin, attn, i)
        outs[fused] = model.model.norm(x)
    with torch.no_grad():
        for (s, e) in zip(cu[:-1], cu[1:]):
            torch.testing.assert_close(outs[False][s:e].detach(), model.hidden_states(ids[None, s:e])[0],
                                       rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-6)
    rollout = type("RolloutAttention", (), {"kernels": Kernels.ROLLOUT})()
    with pytest.raises(KeyError):
        model.model.layers[0](x, cos, sin, rollout, 0)


def test_backward_reaches_flat_buffer_params():
    model = load_model(he.model_config("tiny-mistral"))
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_move_or_cast_raises_but_noop_is_allowed():
    model = load_model(he.model_config("tiny-llama"))
    assert model.to("cpu") is model and model.float() is model
    with pytest.raises(RuntimeError, match="views of flat_buffer"):
        model.to(torch.float64)


def test_external_buffer_must_match():
    cfg = ModelConfig.from_hf(he.model_config("tiny-llama"))
    model = CausalLM(cfg)
    shared = CausalLM(cfg, buffer=model.flat_buffer)
    assert shared.model.norm.weight.data_ptr() == model.model.norm.weight.data_ptr()
    other = CausalLM(ModelConfig.from_hf(he.model_config("tiny-mistral")))
    with pytest.raises(ValueError, match="do not match"):
        CausalLM(cfg, buffer=other.flat_buffer)


@pytest.mark.parametrize("config, match", [
    (lambda: AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2), "model_type 'gpt2'.*not supported"),
    (lambda: hf_config("tiny-llama", rope_scaling=dict(rope_type="yarn", factor=2.0,
                                                     original_max_position_embeddings=64)), "rope type 'yarn'"),
    (lambda: hf_config("tiny-llama", hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda: hf_config("tiny-llama", num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3"),
], ids=["gpt2", "yarn", "gelu", "gqa-ratio"])
def test_unsupported_configs(config, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(config())


def test_model_config_validation():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    assert ModelConfig(**base, sliding_window=3).layer_types == ("sliding_attention",) * 2
    for bad, match in [(dict(model_type="gpt2"), "model_type 'gpt2'"), (dict(head_dim=3), "head_dim=3"),
                       (dict(vocab_size=0), "vocab_size"), (dict(layer_types=("full_attention",)), "layer_types"),
                       (dict(layer_types=("sliding_attention",) * 2), "sliding_window is None"),
                       (dict(rope=None), "rope")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(**{**base, **bad})
    with pytest.raises(ValueError, match="rope_type 'ntk'"):
        RopeConfig(rope_type="ntk")


def test_model_never_imports_torch_distributed():
    # The model (all of model/ but the TP application), and the flat buffer and layout it is built on,
    # know nothing of sharding: no collectives, no rollout, training or switch.
    modules = [p.relative_to(Path(he.__file__).parent).as_posix()
               for p in (Path(he.__file__).parent / "model").glob("*.py")
               if p.name != "tensor_parallel.py"] + ["sharding/buffer.py", "sharding/layout.py"]
    assert "model/decoder.py" in modules
    for module in modules:
        tree = ast.parse((Path(he.__file__).parent / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            else:
                continue
            assert not any("distributed" in n for n in names), f"{module}:{node.lineno} uses {names}"
            rooms = ("hybridengine.engine", "hybridengine.rollout", "hybridengine.train",
                     "hybridengine.sharding.switch", "hybridengine.sharding.generation_memory",
                     "hybridengine.sharding.vmm", "hybridengine.sharding.checkpoint")
            assert not any(n.startswith(rooms) for n in names), f"{module}:{node.lineno} imports {names}"
