"""No silent corruption: bad inputs and configs fail at the public boundary, in words, before any work;
a NaN/inf gradient never reaches the weights or the optimizer state (issue 22); bad input the engine used to
accept: non-finite weights, stop ids outside the vocabulary, sequences past the model's positions, 2-D token
ids, a policy_version that repeated after reset_optimizer (issue 40)."""

import asyncio
import contextlib
import re
import warnings

import pytest
import torch

import hybridengine as he
from hybridengine.rollout import generator, kv_cache
from hybridengine.rollout.kv_cache import KVCache, num_kv_blocks
from hybridengine.train import trainer as trainer_module

NAN, INF = float("nan"), float("inf")
FIELDS = ("old_logprobs", "advantages", "ref_logprobs", "old_values", "returns")


def make_engine(**overrides):
    torch.manual_seed(0)
    cfg = dict(dtype=torch.float32, device="cpu", block_size=4, max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=64)
    cfg.update(overrides)
    return he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(**cfg))


def batch_kwargs(vocab=128, lengths=(8, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    rows = lambda: [torch.randn(n - 1, generator=g) for n in lengths]  # noqa: E731
    return dict(input_ids=ids, response_mask=[torch.ones(n - 1) for n in lengths],
                old_logprobs=[-torch.rand(n - 1, generator=g) - 1 for n in lengths], advantages=rows(),
                ref_logprobs=[-torch.rand(n - 1, generator=g) - 1 for n in lengths], old_values=rows(), returns=rows())


def snapshot(engine):
    """The weights and the optimizer state (step count included), as copies."""
    trainer = engine.trainer
    opt = trainer._optimizer
    state = None if opt is None else (opt.num_steps, [t.clone() for t in opt.state_tensors()])
    return [v.clone() for v in engine.sharded.shard_views()], state


def assert_same(a, b):
    """Bitwise equal snapshots (NaN payloads included)."""
    (wa, sa), (wb, sb) = a, b
    bits = lambda t: t.view(torch.int32) if t.dtype == torch.float32 else t  # noqa: E731
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(wa, wb))
    assert (sa is None) == (sb is None)
    if sa is not None:
        assert sa[0] == sb[0]
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(sa[1], sb[1]))


# -- PPOBatch -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_batch_rejects_nonfinite_fields_even_where_masked(field, value):
    kw = batch_kwargs()
    kw["response_mask"][1][2] = 0
    kw[field][1][2] = value
    with pytest.raises(ValueError, match=rf"PPOBatch\.{field}\[1\]\[2\] is {value}; every entry must be finite, "
                                         "masked positions included"):
        he.PPOBatch(**kw)


@pytest.mark.parametrize("field", ["advantages", "old_logprobs", "ref_logprobs"])
def test_ppo_step_rejects_nan_set_after_construction_and_changes_nothing(field):
    """The finding: a NaN advantage on a masked position gave a NaN grad norm and NaN weights."""
    engine = make_engine()
    batch = he.PPOBatch(**batch_kwargs())
    batch.response_mask[0][3] = 0
    getattr(batch, field)[0][3] = NAN  # in place, after the constructor's check
    before = snapshot(engine)
    with pytest.raises(ValueError, match=rf"ppo_step: batch\.{field}\[0\]\[3\] is nan"):
        engine.ppo_step(batch, he.PPOConfig(lr=1e-3, kl_coef=0.1))
    assert_same(before, snapshot(engine))
    assert not engine.trainer.has_optimizer


def test_token_ids_outside_the_vocabulary_are_named_before_any_work():
    engine = make_engine()
    kw = batch_kwargs()
    kw["input_ids"][1][2] = engine.vocab_size + 2
    batch = he.PPOBatch(**kw)  # the constructor does not know the vocabulary
    with pytest.raises(ValueError, match=r"PPOBatch\.input_ids\[1\]\[2\] is token id 130, outside the vocabulary "
                                         r"\[0, 128\)"):
        batch.validate(engine.vocab_size)
    before = snapshot(engine)
    for call in (lambda: engine.ppo_step(batch), lambda: engine.log_probs(batch)):
        with pytest.raises(ValueError, match=r"batch\.input_ids\[1\]\[2\] is token id 130, outside"):
            call()
    assert_same(before, snapshot(engine))
    batch.input_ids[1][2] = -1
    with pytest.raises(ValueError, match=r"input_ids\[1\]\[2\] is token id -1"):
        batch.validate(128)


@pytest.mark.parametrize("ids,match", [
    ([[1.0, 2.0, 3.0]], r"input_ids\[0\] must hold integer token ids, got torch.float32"),
    ([torch.tensor([1.5, 2.0])], r"input_ids\[0\] must hold integer token ids, got torch.float32"),
    ([[True, False, True]], r"input_ids\[0\] must hold integer token ids, got torch.bool"),
])
def test_batch_rejects_float_and_bool_token_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        he.PPOBatch(input_ids=ids)


def test_batch_mask_and_shapes_checked_again_by_validate():
    kw = batch_kwargs()
    kw["response_mask"][0][1] = 0.5
    with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1; response_mask\[0\]\[1\] is 0.5"):
        he.PPOBatch(**kw)
    batch = he.PPOBatch(**batch_kwargs())
    batch.response_mask[1][0] = NAN
    with pytest.raises(ValueError, match=r"ppo_step: batch\.response_mask must hold only 0 and 1; "
                                         r"response_mask\[1\]\[0\] is nan"):
        batch.validate(128, op="ppo_step")
    batch = he.PPOBatch(**batch_kwargs())
    batch.advantages[0] = batch.advantages[0][:-1]
    with pytest.raises(ValueError, match=r"advantages\[0\] has 6 entries; expected len\(input_ids\[0\]\) - 1 = 7"):
        batch.validate()
    batch.advantages = batch.advantages[:1]
    with pytest.raises(ValueError, match="advantages has 1 sequences, input_ids has 2"):
        batch.validate()
    batch = he.PPOBatch(**batch_kwargs())
    batch.input_ids[0] = batch.input_ids[0].float()
    with pytest.raises(ValueError, match=r"input_ids\[0\] must be a 1-D integer tensor of token ids"):
        batch.validate(128)


# -- non-finite gradient norm -------------------------------------------------------------------------

def poison_gradient(monkeypatch, value):
    """Every later step's embedding gradient gets one `value` entry (after the batch passed validation)."""
    original = trainer_module.add_embedding_grad_

    def poisoned(embed_grad, *args):
        original(embed_grad, *args)
        embed_grad[0, 0] = value

    monkeypatch.setattr(trainer_module, "add_embedding_grad_", poisoned)


@pytest.mark.parametrize("value", [NAN, INF])
def test_nonfinite_grad_norm_skips_the_update_and_counts_it(monkeypatch, value):
    engine = make_engine()
    batch = he.PPOBatch(**batch_kwargs())
    assert engine.ppo_step(batch, he.PPOConfig(lr=1e-3))["skipped"] == 0  # the optimizer state exists now
    before = snapshot(engine)
    poison_gradient(monkeypatch, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'skip' is silent
        stats = engine.ppo_step(batch, he.PPOConfig(lr=1e-3, nonfinite_grad="skip"))
    assert stats["skipped"] == 1 and stats["skipped_steps"] == 1 and stats["step"] == 1
    assert stats["grad_norm"] != stats["grad_norm"] or stats["grad_norm"] == INF
    assert_same(before, snapshot(engine))
    with pytest.warns(RuntimeWarning, match=r"ppo_step: the gradient norm is (nan|inf); the update was skipped "
                                            r"\(weights and optimizer state unchanged, 2 step\(s\) skipped so far\)"):
        stats = engine.ppo_step(batch, he.PPOConfig(lr=1e-3))  # default: 'warn'
    assert stats["skipped_steps"] == 2
    with pytest.raises(FloatingPointError, match="the gradient norm is"):
        engine.ppo_step(batch, he.PPOConfig(lr=1e-3, nonfinite_grad="raise"))
    assert_same(before, snapshot(engine))
    monkeypatch.undo()
    stats = engine.ppo_step(batch, he.PPOConfig(lr=1e-3))
    assert stats["skipped"] == 0 and stats["step"] == 2 and stats["skipped_steps"] == 3
    assert all(torch.isfinite(v).all() for v in engine.sharded.shard_views())


def test_nonfinite_grad_on_the_first_step_allocates_no_optimizer(monkeypatch):
    engine = make_engine()
    poison_gradient(monkeypatch, NAN)
    before = snapshot(engine)
    stats = engine.ppo_step(he.PPOBatch(**batch_kwargs()), he.PPOConfig(lr=1e-3, nonfinite_grad="skip"))
    assert stats["skipped"] == 1 and stats["step"] == 0 and stats["lr"] == 1e-3
    assert_same(before, snapshot(engine))
    assert not engine.trainer.has_optimizer


# -- step configs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), r"lr must be in \(0, inf\), got -1.0"), (dict(lr=0.0), r"lr must be in \(0, inf\)"),
    (dict(lr=NAN), "lr must be a finite number"), (dict(betas=(1.5, 0.9)), r"betas must be in \[0, 1\), got 1.5"),
    (dict(betas=(0.9,)), "betas must be a pair"), (dict(eps=0.0), r"eps must be in \(0, inf\)"),
    (dict(weight_decay=-0.1), "weight_decay must be in"), (dict(max_grad_norm=NAN), "max_grad_norm must be a finite"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be in"),
    (dict(nonfinite_grad="ignore"), r"nonfinite_grad must be one of \('skip', 'warn', 'raise'\)"),
    (dict(micro_batch_tokens=2.5), "micro_batch_tokens must be a finite integer"),
])
@pytest.mark.parametrize("config", [he.PPOConfig, he.ValueConfig])
def test_step_configs_reject_bad_values(config, kwargs, match):
    with pytest.raises(ValueError, match=rf"{config.__name__}: {match}"):
        config(**kwargs)


@pytest.mark.parametrize("field,value,match", [("lr", -1.0, "lr must be in"),
                                                ("betas", (1.5, 0.9), "betas must be in")])
def test_rejected_config_leaves_the_engine_usable(field, value, match):
    """The finding: a bad config at the first training call was kept, and every later call failed."""
    engine = make_engine()
    batch = he.PPOBatch(**batch_kwargs())
    bad = he.PPOConfig(lr=1e-3)
    setattr(bad, field, value)  # the dataclass is mutable: the step checks it again
    before = snapshot(engine)
    with pytest.raises(ValueError, match=match):
        engine.ppo_step(batch, bad)
    assert_same(before, snapshot(engine))
    stats = engine.ppo_step(batch, he.PPOConfig(lr=1e-3))
    assert stats["step"] == 1 and stats["skipped"] == 0
    with pytest.raises(ValueError, match=match):  # also after the optimizer exists
        engine.ppo_step(batch, bad)
    assert engine.ppo_step(batch, he.PPOConfig(lr=1e-3))["step"] == 2


# -- sampling params and prompts ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=NAN), "temperature must be >= 0 and finite, got nan"),
    (dict(temperature=INF), "temperature must be >= 0 and finite, got inf"),
    (dict(temperature=-0.5), "temperature must be >= 0 and finite, got -0.5"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=NAN), r"top_p must be in \(0, 1\]"),
    (dict(max_tokens=2.5), "max_tokens must be an int >= 1, got 2.5"),
    (dict(max_tokens=True), "max_tokens must be an int >= 1, got True"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=2**70), r"seed must be None or an int in \[0, 2\*\*63\)"), (dict(seed=-1), r"seed must be None"),
    (dict(seed=2**63), "seed must be None"), (dict(seed=1.5), "seed must be None"), (dict(seed=True), "seed"),
    (dict(stop_token_ids=(2.5,)), r"stop_token_ids must be token ids \(ints >= 0\), got \(2.5,\)"),
    (dict(stop_token_ids=(True,)), "stop_token_ids must be token ids"),
    (dict(stop_token_ids=(-3,)), "stop_token_ids must be token ids"),
    (dict(stop_token_ids=7), "stop_token_ids must be token ids"),
])
def test_sampling_params_reject_coercions(kwargs, match):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{match}"):
        he.SamplingParams(**kwargs)


def test_largest_seed_generates():
    engine = make_engine()
    with engine.rollout():
        a, b = (engine.generate([[1, 2, 3]], he.SamplingParams(max_tokens=3, n=2, seed=2**63 - 1)) for _ in range(2))
    assert [o.token_ids for o in a[0].outputs] == [o.token_ids for o in b[0].outputs]


@pytest.mark.parametrize("prompts,match", [
    ([[1.0, 2.0]], r"prompts\[0\]\[0\] must be an integer token id, got float 1.0"),
    ([[3, 4], [5, True]], r"prompts\[1\]\[1\] must be an integer token id, got bool True"),
    (["hello"], r"prompts\[0\] is text \('hello'\); prompts must be token ids \(the engine has no tokenizer"),
    ("hello", r"prompts must be token ids \(a list of token-id lists\), got text: the engine has no tokenizer"),
    ([1, 2, 3], r"prompts\[0\] is a single token id 1: prompts must be a list of token-id lists"),
    ([{1, 2}], r"prompts\[0\] must be a list of token ids, got set"),
])
def test_bad_prompts_are_named(prompts, match):
    engine = make_engine()
    with engine.rollout():
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, he.SamplingParams(max_tokens=2))


def test_token_id_lists_converts_tensors():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert generator.token_id_lists(ids) == [[1, 2, 3], [4, 5, 6]]
    assert generator.token_id_lists(ids[0]) == [[1, 2, 3]]
    assert generator.token_id_lists([ids[0], [7, 8]]) == [[1, 2, 3], [7, 8]]
    assert generator.token_id_lists([[1]]) == [[1]]
    with pytest.raises(ValueError, match=r"prompts as a tensor must be 1-D \(one prompt\) or 2-D"):
        generator.token_id_lists(ids[None])


def test_tensor_prompts_are_accepted():
    engine = make_engine()
    greedy = he.SamplingParams(max_tokens=3, temperature=0.0)
    with engine.rollout():
        expected = engine.generate([[1, 2, 3], [4, 5, 6]], greedy)
        got = engine.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), greedy)
        one = engine.generate(torch.tensor([1, 2, 3]), greedy)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in expected]
    assert got[0].prompt_token_ids == [1, 2, 3] and len(one) == 1


# -- EngineConfig and the KV cache ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(collective_timeout_s=0.0), r"collective_timeout_s must be in \(0, inf\)"),
    (dict(collective_timeout_s=-5), r"collective_timeout_s must be in \(0, inf\)"),
    (dict(collective_timeout_s=NAN), "collective_timeout_s must be a finite number"),
    (dict(collective_timeout_s=INF), "collective_timeout_s must be a finite number"),
    (dict(collective_timeout_s="60"), "collective_timeout_s must be a finite number"),
    (dict(seed=2**70), r"seed must be in \[0, 9223372036854775808\)"), (dict(seed=-1), "seed must be in"),
])
def test_engine_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=rf"EngineConfig: {match}"):
        he.EngineConfig(**kwargs)


def test_engine_tuning_rejects_bad_values_and_is_the_configs_own():
    with pytest.raises(ValueError, match="EngineTuning.expandable_segments must be None, True or False, got int"):
        he.EngineTuning(expandable_segments=1)
    tuning = he.EngineTuning()  # split_master None: each config resolves it for its dtype, on its own copy
    bf16 = he.EngineConfig(device="cpu", dtype=torch.bfloat16, tuning=tuning)
    fp32 = he.EngineConfig(device="cpu", dtype=torch.float32, tuning=tuning)
    assert (bf16.tuning.split_master, fp32.tuning.split_master, tuning.split_master) == (True, False, None)
    assert he.EngineConfig().collective_timeout_s == 300.0


def test_max_model_len_beyond_the_models_positions():
    model = he.ModelConfig.from_hf(he.model_config("tiny-qwen2"))
    he.EngineConfig(max_model_len=4096).check_model(model)
    with pytest.raises(ValueError, match=r"EngineConfig.max_model_len=8192 exceeds the model's "
                                         r"max_position_embeddings=4096"):
        he.EngineConfig(max_model_len=8192).check_model(model)
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):  # also where rollout() sizes the cache
        num_kv_blocks(he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=8192), model,
                      torch.device("cpu"))


def test_max_model_len_beyond_the_models_positions_fails_at_construction():
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        make_engine(max_model_len=8192)


def test_cpu_kv_cache_default_is_bounded():
    """The finding: Qwen2.5-1.5B shapes at the defaults asked for max_num_seqs x max_model_len of cache."""
    model = he.ModelConfig.from_hf(he.model_config("qwen2.5-1.5b"))
    config = he.EngineConfig(dtype=torch.bfloat16, device="cpu")
    per_block = KVCache.bytes_per_block(num_layers=model.num_hidden_layers, block_size=config.block_size,
                                        num_kv_heads=model.num_key_value_heads, head_dim=model.head_dim,
                                        dtype=config.dtype)
    blocks = num_kv_blocks(config, model, torch.device("cpu"))
    assert blocks * per_block <= kv_cache.CPU_KV_CACHE_BYTES
    assert blocks >= config.max_model_len // config.block_size


def test_cpu_kv_cache_too_small_for_one_sequence_and_explicit_sizes(monkeypatch):
    model = he.ModelConfig.from_hf(he.model_config("tiny-qwen2"))
    config = he.EngineConfig(dtype=torch.float32, device="cpu", block_size=4, max_model_len=64)
    per_block = 2 * 2 * 4 * model.num_key_value_heads * model.head_dim * 4  # layers x K/V x block x kv x hd x fp32
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 15 * per_block)  # 16 blocks hold one sequence
    with pytest.raises(RuntimeError, match=r"rank 0: the KV cache budget off CUDA .* does not hold one sequence of "
                                           r"max_model_len=64"):
        num_kv_blocks(config, model, torch.device("cpu"))
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 40 * per_block)
    assert num_kv_blocks(config, model, torch.device("cpu")) == 40
    explicit = he.EngineConfig(dtype=torch.float32, device="cpu", block_size=4, max_model_len=64, num_kv_blocks=100)
    assert num_kv_blocks(explicit, model, torch.device("cpu")) == 100  # past the default budget: honoured
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 50 * per_block)
    with pytest.raises(RuntimeError, match=r"EngineConfig.num_kv_blocks=100 needs .* GiB of KV cache, .* GiB of "
                                           "memory is available"):
        num_kv_blocks(explicit, model, torch.device("cpu"))


def test_log_probs_rejects_a_bad_temperature_before_any_work():
    engine = make_engine()
    batch = he.PPOBatch(input_ids=batch_kwargs()["input_ids"])
    for temperature in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"log_probs: temperature must be (in \(0, inf\)|a finite number)"):
            engine.log_probs(batch, temperature=temperature)
    assert engine.log_probs(batch, temperature=0.5).shape == (2, 7)


# -- bad input the engine used to accept (issue 40) ----------------------------------------------------

def positions_engine(max_positions=16, role="actor"):
    """A tiny engine whose model has only `max_positions` positions."""
    torch.manual_seed(0)
    cfg = he.model_config("tiny-qwen2")
    cfg.max_position_embeddings = max_positions
    return he.HybridEngine(cfg, he.EngineConfig(dtype=torch.float32, device="cpu", block_size=4,
                                                max_model_len=max_positions, max_num_seqs=4,
                                                max_num_batched_tokens=64), role=role)


def assert_generates(engine):
    with engine.rollout():
        out = engine.generate([[1, 2, 3]], he.SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


LATE = "model.layers.1.mlp.up_proj.weight"  # written after the embedding and layer 0


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("in_rollout", [False, True])
def test_load_weights_rejects_nonfinite_tensors_and_changes_nothing(value, in_rollout):
    """The finding: a NaN in a loaded tensor went into the weights (and the optimizer's masters)."""
    engine = make_engine()
    batch = he.PPOBatch(**batch_kwargs())
    engine.ppo_step(batch, he.PPOConfig(lr=1e-3))  # the optimizer's masters exist and must not change either
    weights = {name: t + 0.01 for name, t in engine.state_dict()}  # every tensor differs from the engine's
    weights[LATE][3, 5] = value
    before = snapshot(engine)
    with engine.rollout() if in_rollout else contextlib.nullcontext():
        with pytest.raises(ValueError, match=rf"load_weights: tensor '{LATE}' holds {value} at index \(3, 5\); "
                                             "every weight must be finite"):
            engine.load_weights(weights)
    assert_same(before, snapshot(engine))
    assert_generates(engine)
    assert engine.ppo_step(batch, he.PPOConfig(lr=1e-3))["skipped"] == 0
    weights[LATE][3, 5] = 0.0
    assert LATE in engine.load_weights(weights)


def test_load_weights_rejects_values_that_overflow_the_engines_dtype():
    engine = make_engine(dtype=torch.float16)
    weights = {name: t.float() for name, t in engine.state_dict()}
    weights["model.norm.weight"][3] = 1e6  # finite in fp32, inf in fp16
    before = snapshot(engine)
    with pytest.raises(ValueError, match=r"load_weights: tensor 'model.norm.weight' holds 1000000.0 at index \(3,\), "
                                         r"which is inf in the engine's torch.float16; every weight must be finite"):
        engine.load_weights(weights)
    assert_same(before, snapshot(engine))


@pytest.mark.parametrize("stop,match", [((5, 128), r"\(5, 128\)"), ((5, 1000), r"\(5, 1000\)"), ((-1,), r"\(-1,\)")])
@pytest.mark.parametrize("call", ["generate", "add_request", "generate_async"])
def test_stop_token_ids_outside_the_vocabulary_are_rejected_before_any_request_is_queued(call, stop, match):
    """The finding: a stop id the model cannot emit never stopped a sample, silently. SamplingParams rejects
    negative ids itself; it does not know the vocabulary, so the engine checks (again, for a changed one)."""
    engine = make_engine()
    params = he.SamplingParams(max_tokens=3)
    params.stop_token_ids = stop  # the dataclass is mutable: the engine checks it again
    name = "sampling_params[0]" if call == "generate" else "sampling_params"
    with engine.rollout():
        with pytest.raises(ValueError, match=rf"{re.escape(name)}\.stop_token_ids must be token ids in the "
                                             rf"vocabulary \[0, 128\), got {match}"):
            if call == "generate":
                engine.generate([[1, 2, 3]], params)
            elif call == "add_request":
                engine.add_request("r", [1, 2, 3], params)
            else:
                asyncio.run(engine.generate_async([1, 2, 3], params))
        assert not engine.has_unfinished_requests()
        engine.add_request("r", [1, 2, 3], he.SamplingParams(max_tokens=3, stop_token_ids=(127,)))  # "r" is free
        while engine.has_unfinished_requests():
            engine.step()
    with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids must be token ids \(ints >= 0\), got "
                                         r"\(5, -3\)"):
        he.SamplingParams(stop_token_ids=(5, -3))


@pytest.mark.parametrize("call", ["log_probs", "ppo_step", "train_step", "values", "value_step"])
def test_sequences_longer_than_the_models_positions_are_rejected(call):
    """The finding: training sequences past max_position_embeddings ran, at rotary positions the model has not
    got (max_model_len bounds only the rollout's prompt + completion)."""
    critic = call in ("values", "value_step")
    engine = positions_engine(16, role="critic" if critic else "actor")
    run = {"log_probs": lambda b: engine.log_probs(b), "values": lambda b: engine.values(b),
           "ppo_step": lambda b: engine.ppo_step(b, he.PPOConfig(lr=1e-3)),
           "train_step": lambda b: engine.train_step(b, he.losses.sft_nll, he.TrainConfig(lr=1e-3)),
           "value_step": lambda b: engine.value_step(b, he.ValueConfig(lr=1e-3))}[call]
    before = snapshot(engine)
    with pytest.raises(ValueError, match=rf"{call}: batch\.input_ids\[1\] has 17 tokens, more than the model's "
                                         r"max_position_embeddings=16 \(its rotary positions end there\)"):
        run(he.PPOBatch(**batch_kwargs(lengths=(8, 17, 30))))
    assert_same(before, snapshot(engine))
    run(he.PPOBatch(**batch_kwargs(lengths=(8, 16))))  # at the limit: runs


@pytest.mark.parametrize("ids,match", [
    (torch.randint(0, 128, (2, 8)), r"PPOBatch\.input_ids must be a list of at least one sequence \(each a 1-D tensor "
                                    r"or list of token ids\), got torch.int64 tensor of shape \(2, 8\) on cpu"),
    ([], r"PPOBatch\.input_ids must be a list of at least one sequence .*, got list"),
    ([torch.randint(0, 128, (2, 4))], r"PPOBatch\.input_ids\[0\] must be one sequence \(a 1-D tensor or list of token "
                                      r"ids\), got shape \(2, 4\)"),
    ([[1, 2, 3], [[1, 2], [3, 4]]], r"PPOBatch\.input_ids\[1\] must be one sequence .*, got shape \(2, 2\)"),
])
def test_batch_input_ids_must_be_a_list_of_1d_sequences(ids, match):
    """The finding: a 2-D tensor inside the list was flattened into one sequence."""
    with pytest.raises(ValueError, match=match):
        he.PPOBatch(input_ids=ids)
    batch = he.PPOBatch(**batch_kwargs())
    batch.input_ids = torch.stack([batch.input_ids[0], batch.input_ids[0]])
    with pytest.raises(ValueError, match=r"log_probs: batch\.input_ids must be a list of at least one sequence"):
        make_engine().log_probs(batch)


@pytest.mark.parametrize("call", ["generate", "add_request", "generate_async"])
def test_a_2d_tensor_prompt_names_what_is_expected(call):
    engine = make_engine()
    name = "prompts[0]" if call == "generate" else "prompt_token_ids"
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with engine.rollout():
        with pytest.raises(ValueError, match=rf"{re.escape(name)} must be one prompt: a list or 1-D tensor of token "
                                             r"ids, got torch.int64 tensor of shape \(2, 3\)"):
            if call == "generate":
                engine.generate([prompt], he.SamplingParams(max_tokens=2))
            elif call == "add_request":
                engine.add_request("r", prompt, he.SamplingParams(max_tokens=2))
            else:
                asyncio.run(engine.generate_async(prompt, he.SamplingParams(max_tokens=2)))
        assert not engine.has_unfinished_requests()


def test_policy_version_keeps_increasing_across_reset_optimizer(tmp_path):
    """The finding: reset_optimizer() sent policy_version back to 0, so tokens of different weights shared a
    version. The optimizer's own step count (its LR schedule, bias correction) restarts; the version does not."""
    engine = make_engine()
    batch = he.PPOBatch(**batch_kwargs())
    seen = [engine.policy_version]
    for _ in range(2):
        engine.ppo_step(batch, he.PPOConfig(lr=1e-3))
        seen.append(engine.policy_version)
    assert seen == [0, 1, 2]
    engine.trainer.reset_optimizer()
    assert engine.policy_version == 2  # the weights have not changed
    engine.save(tmp_path / "no-optimizer")
    assert engine.ppo_step(batch, he.PPOConfig(lr=1e-3))["step"] == 1  # a fresh AdamW
    assert engine.policy_version == 3 > max(seen)
    with engine.rollout():
        out = engine.generate([[1, 2, 3]], he.SamplingParams(max_tokens=2))
    assert out[0].outputs[0].policy_versions == [3, 3]
    engine.save(tmp_path / "optimizer")
    for name, version in (("no-optimizer", 2), ("optimizer", 3)):
        twin = he.HybridEngine.load(tmp_path / name)
        assert twin.policy_version == version
        twin.ppo_step(batch, he.PPOConfig(lr=1e-3))
        assert twin.policy_version == version + 1
