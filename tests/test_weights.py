"""Weights in and out in transformers naming: HybridEngine.state_dict / load_weights against a transformers
Qwen2 model, bitwise round trips at N in {1, 2, 4} and tg in {1, 2}, the generation view inside rollout(),
strictness, partial loads, and the optimizer's masters after a load."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hybridengine as he
from hybridengine.sharding import checkpoint

from _dist import reporting, spawn
from test_checkpoint import batch  # three sequences of a PPO batch, seeded by step and rank

GREEDY = he.SamplingParams(n=2, temperature=0.0, max_tokens=6)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]]  # shared prefixes


def tiny_config(tied=True):
    cfg = he.model_config("tiny-qwen2")
    cfg.tie_word_embeddings = tied
    return cfg


def hf_model(seed=0, tied=True):
    """A tiny transformers Qwen2 (q/k/v biases), every weight random (biases and norms too)."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(tiny_config(tied), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def engine_for(source, tp=1, dtype=torch.float32, **kw):
    return he.HybridEngine(source, he.EngineConfig(dtype=dtype, device="cpu", tp_generation=tp, block_size=4,
                                                   max_model_len=64, max_num_seqs=8, **kw))


def generate(engine):
    res = engine.generate(PROMPTS, GREEDY)
    return [[(o.token_ids, o.logprobs) for o in r.outputs] for r in res]


def assert_weights(engine, expected, dtype=torch.float32):
    got = dict(engine.state_dict())
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t.to(dtype)), name


def masters(engine):
    """{name: fp32 master} gathered from every rank (natural layout)."""
    shards = [t.cpu() for t in engine.trainer.optimizer.masters()]
    everyone = [shards]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, shards)
    layout = engine.sharded.layout
    units = checkpoint._natural_units(layout, everyone)
    return {s.name: layout.natural_view(units[layout.unit_index[s.unit]], s.name) for s in layout.specs}


# -- one process ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_is_the_transformers_state_dict(tied):
    hf = hf_model(tied=tied)
    expected = hf.state_dict()
    items = list(engine_for(hf).state_dict())
    names = [n for n, _ in items]
    assert {n: tuple(t.shape) for n, t in items} == {n: tuple(t.shape) for n, t in expected.items()}
    assert len(names) == len(expected)
    for name, t in items:
        assert torch.equal(t, expected[name]), name
    if tied:  # the tied head right after the embedding, as the same tensor (transformers: the same parameter)
        assert names[:2] == ["model.embed_tokens.weight", "lm_head.weight"] and items[0][1] is items[1][1]
        names.insert(len(names) - 1, names.pop(1))
    assert names == list(expected)  # transformers' order
    for name, t in items:  # each its own tensor: writing the engine does not change what was yielded
        assert t.is_contiguous() and t.numel() == t.untyped_storage().nbytes() // t.element_size(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_a_transformers_model_equals_building_from_it(dtype):
    other = hf_model(seed=1)
    engine = engine_for(hf_model(), dtype=dtype)
    loaded = engine.load_weights(other.state_dict())  # tied: lm_head.weight equals the embedding
    assert loaded == [s.name for s in engine.sharded.layout.specs]
    assert_weights(engine, other.state_dict(), dtype)
    fresh = engine_for(other, dtype=dtype)
    assert torch.equal(engine.log_probs(batch(0)), fresh.log_probs(batch(0)))
    # an iterator of pairs (a generator is materialised before anything is written) works alike
    engine.load_weights((n, t) for n, t in hf_model().named_parameters())
    assert_weights(engine, hf_model().state_dict(), dtype)


def test_load_inside_rollout_updates_the_generation_view():
    """Inside rollout() the generation view takes the new weights (and the prefix cache holding the old
    weights' KV is dropped: the same prompts come again): generation equals an engine built from them."""
    other = hf_model(seed=1)
    engine = engine_for(hf_model())
    with engine.rollout():
        before = generate(engine)
        engine.load_weights(other.state_dict())
        after = generate(engine)
    fresh = engine_for(other)
    with fresh.rollout():
        assert after == generate(fresh)
    assert after != before
    assert_weights(engine, other.state_dict())  # and the training view


def test_a_partial_load_writes_only_its_parameters():
    hf, other = hf_model(), hf_model(seed=1).state_dict()
    engine = engine_for(hf)
    part = ["model.layers.1.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    order = [s.name for s in engine.sharded.layout.specs]
    assert engine.load_weights({n: other[n] for n in reversed(part)}) == sorted(part, key=order.index)
    expected = {n: (other[n] if n in part else t) for n, t in hf.state_dict().items()}
    assert_weights(engine, expected)
    # a tied model's lm_head.weight alone is its embedding (as assigning it in transformers)
    assert engine.load_weights([("lm_head.weight", other["lm_head.weight"])]) == ["model.embed_tokens.weight"]
    expected["model.embed_tokens.weight"] = expected["lm_head.weight"] = other["lm_head.weight"]
    assert_weights(engine, expected)
    assert engine.load_weights({}) == []


def test_a_critic_loads_an_actors_backbone_with_strict_false():
    actor, critic = engine_for(hf_model(seed=1)), he.HybridEngine(hf_model(), he.EngineConfig(
        dtype=torch.float32, device="cpu", max_model_len=64), role="critic")
    head = dict(critic.state_dict())["score.weight"]
    with pytest.raises(ValueError, match="unexpected tensor 'lm_head.weight'"):
        critic.load_weights(actor.state_dict())
    loaded = critic.load_weights(actor.state_dict(), strict=False)
    assert "score.weight" not in loaded and len(loaded) == len(critic.sharded.layout.specs) - 1
    got, expected = dict(critic.state_dict()), dict(actor.state_dict())
    assert torch.equal(got.pop("score.weight"), head)
    assert all(torch.equal(t, expected[n]) for n, t in got.items())


E = "model.embed_tokens.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


def _bad_inputs(sd):
    good = list(sd.items())
    return [
        (good + [("model.layers.9.mlp.up_proj.weight", sd[Q])], {}, "unexpected tensor 'model.layers.9.mlp.up_proj"),
        (good[:1] + [(Q, sd[Q][:, :7])], {}, rf"tensor '{Q}' .* has shape \(64, 7\), expected \(64, 64\)"),
        ([(Q, sd[Q][:-1])], {"strict": False}, r"has shape \(63, 64\), expected \(64, 64\)"),
        ([(Q, sd[Q].to(torch.int32))], {}, "has dtype torch.int32, expected a floating dtype"),
        (good + [(Q, sd[Q])], {}, f"tensor '{Q}' appears twice"),
        (good[:2] + [(Q,)], {}, r"item 2 of weights must be a \(str, torch.Tensor\) pair"),
        ([(Q, sd[Q].tolist())], {}, r"item 0 of weights must be a \(str, torch.Tensor\) pair"),
        (sd[Q], {}, "weights must be a mapping or an iterable"),
        ([("lm_head.weight", sd[E] + 1), (E, sd[E])], {}, "'lm_head.weight' .* differs from 'model.embed_tokens"),
        ([(Q, torch.empty(64, 64, device="meta"))], {}, "is on the meta device"),
        ({}, {"strict": 1}, "strict must be a bool"),
    ]


def test_strictness_errors_write_nothing():
    hf, other = hf_model(), hf_model(seed=1).state_dict()
    engine = engine_for(hf)
    for weights, kw, match in _bad_inputs(other):
        with pytest.raises(ValueError, match=match):
            engine.load_weights(weights, **kw)
        assert_weights(engine, hf.state_dict())  # a bad item after good ones: nothing was written
    assert engine.load_weights({"foo.weight": other[Q], Q: other[Q]}, strict=False) == [Q]
    with engine.rollout(), pytest.raises(RuntimeError, match="not allowed inside rollout"):
        engine.state_dict()
    with pytest.raises(ValueError, match="rank0_only must be a bool"):
        engine.state_dict(rank0_only="yes")
    with pytest.raises(ValueError, match="device 'gpu0' is not a device"):
        engine.state_dict(device="gpu0")


@pytest.mark.parametrize("split,offload,inside", [(False, "none", False), (True, "none", False),
                                                  (False, "rollout", True), (True, "optimizer", True)])
def test_a_step_after_load_trains_from_the_loaded_weights(split, offload, inside):
    """bf16 weights with fp32 masters (or split masters; with the optimizer state in host memory, loaded
    inside rollout()): load_weights sets the masters of what it writes to the new weights, keeping moments
    and step count. So the next step equals a step of an engine built from the loaded weights whose
    optimizer state is the first engine's moments with those masters; without the refresh it would start
    from the old masters (the weights would jump back)."""
    cfg = he.PPOConfig(lr=1e-3, micro_batch_tokens=20, weight_decay=0.01)
    other = hf_model(seed=1)
    engine = engine_for(hf_model(), dtype=torch.bfloat16, tuning=he.EngineTuning(split_master=split),
                        offload=offload)
    engine.ppo_step(batch(0), cfg)
    with engine.rollout() if inside else contextlib.nullcontext():
        engine.load_weights(other.state_dict())
    for name, master in masters(engine).items():
        assert torch.equal(master, other.state_dict()[name].to(torch.bfloat16).float()), name
    state = engine.trainer.optimizer.state_dict()
    twin = engine_for(other, dtype=torch.bfloat16, tuning=he.EngineTuning(split_master=split))
    twin.trainer.optimizer.load_state_dict({"step": state["step"], "exp_avg": state["exp_avg"],
                                            "exp_avg_sq": state["exp_avg_sq"],
                                            "master": [p.float() for p in twin.sharded.shard_views()]})
    a, b = engine.ppo_step(batch(1), cfg), twin.ppo_step(batch(1), cfg)
    assert a["loss"] == b["loss"] and engine.policy_version == twin.policy_version == 2
    assert_weights(engine, dict(twin.state_dict()), torch.bfloat16)


# -- N ranks over gloo ---------------------------------------------------------------------------------

def _ranks(rank, world, init_file, rollout, weights, errors):
    """Both TP degrees in the same processes (a spawn costs more than the checks)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank} (N={world})"):
        for tp, tied in ((1, world == 2), (2, world != 2)):
            try:
                _round_trip(rank, world, tp, tied, rollout, *weights[tied])
            except BaseException as e:
                e.add_note(f"at tg={tp}")
                raise


def _round_trip(rank, world, tp, tied, rollout, initial, first, second):
    """initial: the weights of an engine built from the config alone (N = 1); first, second: two
    transformers models' state_dicts."""
    bf16 = torch.bfloat16
    engine = engine_for(tiny_config(tied), tp, dtype=bf16)
    assert_weights(engine, initial, bf16)  # every rank gets every tensor
    only = list(engine.state_dict(rank0_only=True, device="cpu"))
    assert len(only) == (len(initial) if rank == 0 else 0)
    assert len(engine.load_weights(first)) == len(engine.sharded.layout.specs)
    assert_weights(engine, first, bf16)
    engine.ppo_step(batch(0, rank), he.PPOConfig(lr=1e-3))  # the masters now differ from the weights

    # a full load, round trip bitwise, masters refreshed
    g = torch.Generator().manual_seed(5)
    new = {n: torch.randn(t.shape, generator=g).to(bf16) for n, t in dict(engine.state_dict()).items()}
    if tied:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    engine.load_weights(new)
    assert_weights(engine, new, bf16)
    assert all(torch.equal(m, new[n].float()) for n, m in masters(engine).items())

    # a partial load inside a unit, and across ranks' shards: the rest keeps its bits (masters too)
    part = {n: new[n] * 2 for n in ("model.layers.0.self_attn.v_proj.bias", "model.layers.0.mlp.down_proj.weight",
                                     "model.layers.1.input_layernorm.weight")}
    assert engine.load_weights(part) == [s.name for s in engine.sharded.layout.specs if s.name in part]
    new.update(part)
    assert_weights(engine, new, bf16)
    assert all(torch.equal(m, new[n].float()) for n, m in masters(engine).items())

    if not rollout:
        return
    # a rank's bad input raises on every rank before anything is written; so do different sets of names
    bad = {"model.layers.7.mlp.up_proj.weight": new[Q]} if rank == world - 1 else {Q: new[Q] + 1}
    mine = (ValueError, "unexpected tensor") if rank == world - 1 else (he.CollectiveError, "rejected its inputs")
    with pytest.raises(mine[0], match=mine[1]):
        engine.load_weights(bad)
    with pytest.raises(ValueError, match=r"ranks \[1.*\] pass other parameters than rank 0"):
        engine.load_weights({Q: new[Q] + 1} if rank == 0 else {E: new[E] + 1})
    assert_weights(engine, new, bf16)

    # inside rollout(): the generation view (the whole TP slice, not only the shard) takes the weights,
    # and generates what an engine given them outside a rollout generates
    with engine.rollout():
        before = generate(engine)
        engine.load_weights(second)
        after = generate(engine)
    fresh = engine_for(tiny_config(tied), tp, dtype=bf16)
    fresh.load_weights(second)
    with fresh.rollout():
        assert after == generate(fresh)
    assert after != before
    assert_weights(engine, second, bf16)


# tg = 1 and 2 at each N (tied embeddings at one of them). The errors and the rollout at N = 2: at tg = 1 a load
# inside rollout() writes the other rank's shard of the TP slice too, at tg = 2 only its own.
@pytest.mark.parametrize("world,rollout", [(2, True), (4, False)])
def test_round_trip_and_load_on_n_ranks(world, rollout):
    # What one process sees: the sharded engines' state_dict must equal it; the two models' weights go in.
    weights = {tied: (dict(engine_for(tiny_config(tied), dtype=torch.bfloat16).state_dict()),
                      hf_model(tied=tied).state_dict(), hf_model(seed=1, tied=tied).state_dict())
               for tied in (True, False)}
    spawn(_ranks, world, rollout, weights)
