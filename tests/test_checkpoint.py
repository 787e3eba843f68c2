"""Checkpoints: bitwise resume, atomic save, export to transformers, load at another world size."""

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hybridengine as he
from hybridengine.sharding import checkpoint
from hybridengine.sharding.checkpoint import full_state_dict

from _dist import reporting, spawn


def build(name="tiny-qwen2", **overrides):
    torch.manual_seed(0)
    cfg = he.model_config(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def engine_for(hf, tp=1, device="cpu"):
    return he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device=str(device), tp_generation=tp,
                                                max_model_len=64, max_num_seqs=4))


def batch(step, rank=0, vocab=128):
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = [9, 14, 6]
    return he.PPOBatch(input_ids=[torch.randint(0, vocab, (n,), generator=g) for n in lengths],
                       response_mask=[torch.ones(n - 1) for n in lengths],
                       old_logprobs=[torch.randn(n - 1, generator=g) - 4 for n in lengths],
                       advantages=[torch.randn(n - 1, generator=g) for n in lengths])


CFG = he.PPOConfig(lr=1e-3, micro_batch_tokens=20, weight_decay=0.01)


def natural_optimizer_state(engine, key):
    """Per unit, the natural-layout optimizer state `key`, gathered from every rank."""
    shards = [t.detach().cpu() for t in engine.trainer.optimizer.state_dict()[key]]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, shards)
    else:
        everyone = [shards]
    return checkpoint._natural_units(engine.sharded.layout, everyone)


def test_resume_is_bitwise_identical(tmp_path, device):
    """On the test device (CUDA: the training step must repeat bit for bit, so no atomics-ordered sums);
    the loaded engine runs where the saved one did."""
    straight = engine_for(build(), device=device)
    for step in range(4):
        straight.ppo_step(batch(step), CFG)
    first = engine_for(build(), device=device)
    for step in range(2):
        first.ppo_step(batch(step), CFG)
    first.save(tmp_path / "ck")
    torch.manual_seed(123)  # the RNG state comes back from the checkpoint, not from here
    resumed = he.HybridEngine.load(tmp_path / "ck")
    assert resumed.device.type == device.type
    for step in range(2, 4):
        resumed.ppo_step(batch(step), CFG)
    for name, w in full_state_dict(straight.sharded).items():
        assert torch.equal(w, full_state_dict(resumed.sharded)[name]), name
    assert resumed.trainer.optimizer.num_steps == 4
    with resumed.rollout():  # generation works on the restored weights
        out = resumed.generate([[1, 2, 3]], he.SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = engine_for(build())
    engine.ppo_step(batch(0), CFG)
    engine.save(tmp_path / "ck")
    before = full_state_dict(he.HybridEngine.load(tmp_path / "ck").sharded)
    engine.ppo_step(batch(1), CFG)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        engine.save(tmp_path / "ck")
    after = full_state_dict(he.HybridEngine.load(tmp_path / "ck").sharded)
    assert all(torch.equal(before[k], after[k]) for k in before)
    monkeypatch.undo()
    engine.save(tmp_path / "ck")  # the stale temporary folder of the crash is cleaned up
    assert not (tmp_path / ".ck.tmp").exists()
    now = full_state_dict(he.HybridEngine.load(tmp_path / "ck").sharded)
    assert any(not torch.equal(before[k], now[k]) for k in before)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama", "tiny-qwen3"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, name):
    hf = build(name)
    engine = engine_for(hf)
    engine.ppo_step(batch(0, vocab=hf.config.vocab_size), CFG)  # trained weights, not the source's
    engine.export_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    reference = build(name)
    reference.load_state_dict(full_state_dict(engine.sharded), strict=False)
    ids = torch.randint(0, hf.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="has no meta.json"):
        he.HybridEngine.load(tmp_path)
    engine = he.HybridEngine(he.ModelConfig.from_hf(he.model_config("tiny-qwen2")),
                             he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64))
    with pytest.raises(ValueError, match="built from a ModelConfig"):
        engine.export_hf(tmp_path / "x")
    engine.save(tmp_path / "ck")
    os.remove(tmp_path / "ck" / "rank0.pt")
    with pytest.raises(ValueError, match=r"lacks the shards of saved ranks \[0\]"):
        he.HybridEngine.load(tmp_path / "ck")


def _save_at(rank, world, init_file, tp, path, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"save rank {rank}"):
        engine = engine_for(build(num_key_value_heads=4), tp)
        for step in range(2):
            engine.ppo_step(batch(step, rank), CFG)
        engine.save(path)
        weights = full_state_dict(engine.sharded)
        state = {k: natural_optimizer_state(engine, k) for k in ("exp_avg", "exp_avg_sq")}
        if rank == 0:
            torch.save(dict(weights=weights, state=state), os.path.join(os.path.dirname(path), "expected.pt"))


def _check_load(engine, expected):
    got = full_state_dict(engine.sharded)
    for k, w in expected["weights"].items():
        assert torch.equal(got[k], w), k
    for key, naturals in expected["state"].items():
        for a, b in zip(natural_optimizer_state(engine, key), naturals):
            assert torch.equal(a, b), key


def _load_at(rank, world, init_file, tp, path, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"load rank {rank} (N={world}, tg={tp})"):
        engine = he.HybridEngine.load(path, he.EngineConfig(dtype=torch.float32, device="cpu", tp_generation=tp,
                                                            max_model_len=64, max_num_seqs=4))
        _check_load(engine, torch.load(os.path.join(os.path.dirname(path), "expected.pt"), weights_only=False))


def test_checkpoint_from_two_ranks_loads_at_one_and_four(tmp_path):
    path = str(tmp_path / "ck")
    spawn(_save_at, 2, 2, path)                      # saved at N = 2, tg = 2
    expected = torch.load(tmp_path / "expected.pt", weights_only=False)
    _check_load(he.HybridEngine.load(path, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64)),
                expected)                              # N = 1
    spawn(_load_at, 4, 4, path)                      # N = 4, tg = 4
    spawn(_load_at, 4, 1, path)                      # N = 4, tg = 1


def test_checkpoint_in_the_old_parameter_order_loads(tmp_path, monkeypatch):
    """A checkpoint written before layout.param_specs put each unit's matrices first (module order)
    loads into today's layout: weights and optimizer state by name, bitwise."""
    import hybridengine.sharding.layout as layout_mod
    import hybridengine.model.decoder as model_mod

    def module_order(named_shapes, head_dim=None):  # param_specs without the reordering
        specs = []
        for name, shape in named_shapes:
            granule = head_dim if (head_dim and any(f".{p}_proj." in name for p in "qkv")) else 1
            specs.append(layout_mod.ParamSpec(name, tuple(shape), layout_mod.tp_role(name), layout_mod.unit_of(name),
                                              granule))
        return specs

    monkeypatch.setattr(model_mod, "param_specs", module_order)
    old = engine_for(build())
    old.ppo_step(batch(0), CFG)
    names = [s.name for s in old.sharded.layout.specs]
    assert names.index("model.layers.0.self_attn.q_proj.bias") < names.index("model.layers.0.self_attn.k_proj.weight")
    weights = full_state_dict(old.sharded)
    state = {key: [t.clone() for t in natural_optimizer_state(old, key)] for key in ("exp_avg", "exp_avg_sq")}
    old.save(tmp_path / "old")
    monkeypatch.undo()
    loaded = he.HybridEngine.load(tmp_path / "old")
    names = [s.name for s in loaded.sharded.layout.specs]
    assert names.index("model.layers.0.self_attn.k_proj.weight") < names.index("model.layers.0.self_attn.q_proj.bias")
    got = full_state_dict(loaded.sharded)
    for name, w in weights.items():
        assert torch.equal(got[name], w), name
    by_name = {}
    for key in state:  # natural units differ in order between the layouts: compare parameter by parameter
        for layout, units, tag in ((old.sharded.layout, state[key], "old"),
                                   (loaded.sharded.layout, natural_optimizer_state(loaded, key), "new")):
            for unit, natural in zip(layout.units, units):
                for spec in unit.params:
                    by_name.setdefault((key, spec.name), {})[tag] = layout.natural_view(natural, spec.name)
    for (key, name), pair in by_name.items():
        assert torch.equal(pair["old"], pair["new"]), (key, name)


@pytest.mark.parametrize("edit,match", [
    (lambda specs: specs[0].__setitem__(0, "model.embed_tokens.renamed"),
     "the checkpoint has no parameter 'model.embed_tokens.weight'"),
    (lambda specs: next(s for s in specs if s[0].endswith("layers.0.mlp.down_proj.weight"))[1].reverse(),
     r"model.layers.0.mlp.down_proj.weight is \(96, 64\) in the checkpoint, \(64, 96\) in this model"),
])
def test_load_names_a_parameter_the_checkpoint_lacks_or_shapes_otherwise(tmp_path, edit, match):
    import json

    engine_for(build()).save(tmp_path / "ck")
    meta_file = tmp_path / "ck" / "meta.json"
    meta = json.loads(meta_file.read_text())
    edit(meta["layout"]["specs"])
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        he.HybridEngine.load(tmp_path / "ck")


def test_split_master_engine_trains_like_fp32_master_and_resumes_bitwise(tmp_path, device):
    """EngineConfig(split_master=True), bf16: the same training as fp32 masters up to the bf16 weights'
    tie rounding (their masters agree to bf16 precision after 3 steps), 2 bytes of optimizer state per
    parameter less, and save -> load -> step continues bit for bit (on the test device)."""
    def make(split):
        return he.HybridEngine(build(), he.EngineConfig(dtype=torch.bfloat16, device=str(device), max_model_len=64,
                                                        max_num_seqs=4, split_master=split))

    full, split = make(False), make(True)
    for step in range(3):
        a, b = full.ppo_step(batch(step), CFG), split.ppo_step(batch(step), CFG)
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * max(1.0, abs(a["loss"])), (step, a["loss"], b["loss"])
    opt_full, opt_split = full.trainer.optimizer, split.trainer.optimizer
    assert opt_split.master is None and opt_split.master_lo is not None
    for m_full, m_split in zip(opt_full.master, opt_split.masters()):
        torch.testing.assert_close(m_split, m_full, rtol=2**-7, atol=1e-6)
    rep_full, rep_split = full.memory_report(), split.memory_report()
    params = sum(s.numel() for s in split.sharded.shard_views())
    assert abs((rep_full["optimizer"] - rep_split["optimizer"]) * 2**30 - 2 * params) < 1e-3 * 2**30

    straight = make(True)
    for step in range(4):
        straight.ppo_step(batch(step), CFG)
    first = make(True)
    for step in range(2):
        first.ppo_step(batch(step), CFG)
    first.save(tmp_path / "ck")
    resumed = he.HybridEngine.load(tmp_path / "ck")
    assert resumed.config.split_master and resumed.device.type == device.type
    for step in range(2, 4):
        resumed.ppo_step(batch(step), CFG)
    for a, b in zip(resumed.sharded.shard_views(), straight.sharded.shard_views()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(resumed.trainer.optimizer.master_lo, straight.trainer.optimizer.master_lo):
        assert torch.equal(a, b)
