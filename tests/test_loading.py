"""`he.load_model` from a transformers model, a config, and local safetensors folders; every error path."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import hybridengine as he
from hybridengine.model.loading import INDEX_FILE, load_model
from hybridengine.model.config import ModelConfig

from test_model import ATOL, hf_config, hf_model


def logits(model, vocab_size: int, T: int = 17) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (2, T), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = model(ids)
        return out.logits if hasattr(out, "logits") else out


def saved(tmp_path, name="tiny-llama", **save_kw):
    hf = hf_model(he.model_config(name))
    folder = tmp_path / name
    hf.save_pretrained(folder, **save_kw)
    return hf, folder


def rewrite(folder, edit):
    """Apply `edit(dict of tensors)` to a single-file checkpoint in place."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------- good loads


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_folder_single_file_matches_hf(tmp_path, name):
    hf, folder = saved(tmp_path, name)
    assert (folder / "model.safetensors").is_file() and not (folder / INDEX_FILE).exists()
    err = (logits(load_model(folder), hf.config.vocab_size) - logits(hf, hf.config.vocab_size)).abs().max()
    assert err <= ATOL


def test_folder_sharded_matches_hf(tmp_path, device):
    hf, folder = saved(tmp_path, "tiny-qwen3", max_shard_size="40KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert (folder / INDEX_FILE).is_file() and len(shards) > 2
    (folder / "consolidated.safetensors").write_bytes(shards[0].read_bytes())  # not in the index: ignored
    model = load_model(str(folder), device=device)  # str paths work too
    assert model.flat_buffer.device.type == device.type
    assert (logits(model, 131).cpu() - logits(hf, 131)).abs().max() <= ATOL


def test_from_hf_model_and_folder_give_identical_buffers(tmp_path):
    hf, folder = saved(tmp_path, "tiny-mistral")
    assert torch.equal(load_model(hf).flat_buffer.data, load_model(folder).flat_buffer.data)


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
    hf, folder = saved(tmp_path, "tiny-qwen2")  # tie_word_embeddings=True
    rewrite(folder, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = load_model(folder)
    assert "lm_head.weight" not in model.flat_buffer.names
    assert (logits(model, 128) - logits(hf, 128)).abs().max() <= ATOL


def test_old_rotary_buffers_are_ignored(tmp_path):
    """A saved `rotary_emb.inv_freq` (here a wrong one) neither errors nor reaches the model: the rotary
    frequencies come from the config, and the weights and logits are those of the checkpoint without it."""
    hf, folder = saved(tmp_path)
    rewrite(folder, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    model = load_model(folder)
    assert not any("rotary_emb" in n for n in model.flat_buffer.names)
    assert torch.equal(model.flat_buffer.data, load_model(hf).flat_buffer.data)
    assert (logits(model, hf.config.vocab_size) - logits(hf, hf.config.vocab_size)).abs().max() <= ATOL


def test_config_init_is_seeded_and_hf_like():
    cfg = hf_config("tiny-qwen2", tie_word_embeddings=False)
    a, b, c = load_model(cfg, seed=3), load_model(cfg, seed=3), load_model(cfg, seed=4)
    assert torch.equal(a.flat_buffer.data, b.flat_buffer.data)
    assert not torch.equal(a.flat_buffer.data, c.flat_buffer.data)
    views = a.flat_buffer.views()
    assert all(torch.all(v == 1) for n, v in views.items() if n.endswith("norm.weight"))
    assert all(torch.all(v == 0) for n, v in views.items() if n.endswith(".bias"))
    embed = views["model.embed_tokens.weight"]
    assert abs(embed.std().item() - cfg.initializer_range) < 0.002 and abs(embed.mean().item()) < 0.002
    # ModelConfig works as a source too; the same seed gives the same weights in every dtype.
    d = load_model(ModelConfig.from_hf(cfg), seed=3, dtype=torch.bfloat16)
    assert torch.equal(d.flat_buffer.data, a.flat_buffer.data.to(torch.bfloat16))


@pytest.mark.parametrize("via_folder", [False, True])
def test_bf16_load(tmp_path, via_folder, device):
    hf, folder = saved(tmp_path, "tiny-llama")
    model = load_model(folder if via_folder else hf, dtype=torch.bfloat16, device=device)
    assert model.flat_buffer.dtype == torch.bfloat16 and model.flat_buffer.device.type == device.type
    assert all(p.dtype == torch.bfloat16 and p.device.type == device.type for p in model.parameters())
    hf = hf.to(device)
    ref = logits(hf, 130)
    ours = logits(model, 130)
    assert ours.dtype == torch.bfloat16
    # Tolerance from the reference's own error: HF itself in bf16 vs fp32.
    hf_err = (logits(hf.to(torch.bfloat16), 130).float() - ref).abs().max().item()
    err = (ours.float() - ref).abs().max().item()
    assert 0 < err <= 2 * hf_err, (err, hf_err)


# ---------------------------------------------------------------------------------- errors


def test_missing_tensor(tmp_path):
    _, folder = saved(tmp_path)
    rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(folder)


def test_extra_tensor(tmp_path):
    _, folder = saved(tmp_path)
    rewrite(folder, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' "
                                         r"in file 'model\.safetensors'"):
        load_model(folder)


def test_misshaped_tensor(tmp_path):
    _, folder = saved(tmp_path)
    rewrite(folder, lambda t: t.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in file 'model\.safetensors' has shape \(63,\), "
                                         r"expected \(64,\)"):
        load_model(folder)


def test_integer_tensor(tmp_path):
    _, folder = saved(tmp_path)
    rewrite(folder, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in file 'model\.safetensors' has dtype I32, "
                                         r"expected a floating dtype"):
        load_model(folder)


def test_integer_tensor_in_hf_state_dict():
    hf = hf_model(he.model_config("tiny-llama"))
    hf.model.norm.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in the given model's state_dict has dtype "
                                         r"torch\.int64"):
        load_model(hf)


def test_tied_checkpoint_with_different_lm_head(tmp_path):
    _, folder = saved(tmp_path, "tiny-qwen2")
    rewrite(folder, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"] + 1))
    with pytest.raises(ValueError, match=r"'lm_head\.weight' in file 'model\.safetensors' differs from "
                                         r"'model\.embed_tokens\.weight'.*tie_word_embeddings"):
        load_model(folder)


def test_tensor_in_two_shards(tmp_path):
    _, folder = saved(tmp_path, "tiny-llama", max_shard_size="40KB")
    index = json.loads((folder / INDEX_FILE).read_text())
    save_file({"model.norm.weight": torch.ones(64)}, folder / "extra.safetensors")
    index["weight_map"]["model.norm.weight.dup"] = "extra.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' appears twice: in file '.+' and in file "
                                         r"'extra\.safetensors'"):
        load_model(folder)


def test_index_names_missing_shard(tmp_path):
    _, folder = saved(tmp_path, "tiny-llama", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"names shard '{shard.name}', which is not in"):
        load_model(folder)


def test_bad_index(tmp_path):
    _, folder = saved(tmp_path)
    (folder / INDEX_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not a safetensors index"):
        load_model(folder)


def test_missing_config_json(tmp_path):
    _, folder = saved(tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(folder)


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_no_safetensors(tmp_path):
    _, folder = saved(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files.*pytorch_model\.bin.*only safetensors"):
        load_model(folder)


def test_unsupported_architecture(tmp_path):
    gpt2 = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match="model_type 'gpt2'.*not supported"):
        load_model(gpt2)
    gpt2.save_pretrained(tmp_path)
    save_file({"wte.weight": torch.zeros(50, 32)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model_type 'gpt2'.*not supported"):
        load_model(tmp_path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be a floating"):
        load_model(he.model_config("tiny-llama"), dtype=torch.int32)
    with pytest.raises(TypeError, match="source must be"):
        load_model(42)
