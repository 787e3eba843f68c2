"""verl's training engine on a HybridEngine (hybridengine.integrations.verl.engine) against verl's own FSDP2
engine, on CPU: the same tiny random Qwen2 checkpoint, the same PPO batch in verl's no-padding layout and
verl's own `ppo_loss`, through `BaseEngine.infer_batch` and `train_batch`. The first step's loss and gradient
norm and the log-probs agree within a tolerance derived from verl's own fp32 error against a float64
reference (the transformers model in float64, each sequence alone, the same loss).

verl 0.9.1 has no CPU platform (on a machine without a GPU it reports device "cuda" and calls torch.cuda);
the test sets the integration's (`hybridengine.integrations.verl.platform.CPUPlatform`) through verl's
platform API (`set_platform`), which is all verl's FSDP2 engine needs to run on CPU with a gloo process
group of one rank: verl's engine code runs unmodified.
"""

import copy
import math
import os
from functools import partial

import pytest
import torch

if os.environ.get("HE_REQUIRE_VERL"):
    import verl  # noqa: F401  (make test-verl: a missing verl is an error, not a skip)
else:
    verl = pytest.importorskip("verl", reason="verl is not importable (the verl extra: make setup-verl)")

import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from hybridengine.integrations.verl import shared  # noqa: E402
from hybridengine.integrations.verl.engine import BACKEND, HybridVerlEngine, register_engine  # noqa: E402
from hybridengine.integrations.verl.platform import CPUPlatform  # noqa: E402

VOCAB, PROMPT, RESPONSE = 96, 6, 7
PROMPT_LENS, RESPONSE_LENS = [6, 3, 4, 2, 5, 6], [7, 4, 1, 5, 6, 3]


class _Platform(CPUPlatform):
    """verl's engines move tensors with `.to(get_device_id())`: on CPU the device id must be "cpu" (0 is cuda:0)."""

    def current_device(self):
        return "cpu"


@pytest.fixture(scope="module")
def cpu_group(tmp_path_factory):
    set_platform(_Platform())
    register_engine()
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_shared():
    shared.reset()
    yield
    shared.reset()


def _configs(path, strategy, *, micro=2):
    model = HFModelConfig(path=str(path), load_tokenizer=False, use_remove_padding=True,
                          enable_gradient_checkpointing=False, override_config={"attn_implementation": "sdpa"})
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", mixed_precision=fp32, use_torch_compile=False,
                              use_dynamic_bsz=False, micro_batch_size_per_gpu=micro)
    object.__setattr__(engine, "strategy", strategy)  # as FSDPActorConfig does with actor.strategy
    optim = FSDPOptimizerConfig(lr=1e-3, total_training_steps=10, clip_grad=1.0, weight_decay=0.0)
    return dict(model_config=model, engine_config=engine, optimizer_config=optim, checkpoint_config=CheckpointConfig())


def _batch(seed=1, *, micro=2):
    """A PPO batch as verl's trainer hands it to update_actor: left-padded prompts, right-padded responses,
    converted to the no-padding layout, with the trainer's and the worker's metadata."""
    g = torch.Generator().manual_seed(seed)
    B = len(PROMPT_LENS)
    ids = torch.zeros(B, PROMPT + RESPONSE, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        ids[b, PROMPT - p:PROMPT + r] = torch.randint(1, VOCAB, (p + r,), generator=g)
        attn[b, PROMPT - p:PROMPT + r] = 1
    td = TensorDict({"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
                     "prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "response_mask": attn[:, PROMPT:],
                     "old_log_probs": -torch.rand(B, RESPONSE, generator=g) * 4 - 2,
                     "advantages": torch.randn(B, RESPONSE, generator=g)}, batch_size=[B])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True, global_batch_size=B, use_remove_padding=True,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=micro, max_token_len_per_gpu=None,
                         use_fused_kernels=False, compute_loss=True)
    return td


def _loss_fn():
    actor = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                            ppo_mini_batch_size=len(PROMPT_LENS), use_torch_compile=False, clip_ratio_low=0.2,
                            clip_ratio_high=0.28, entropy_coeff=0.01)
    return partial(ppo_loss, config=actor)


def _first_step(engine):
    """infer_batch's log-probs of the batch, then one train_batch: (log-probs [B, R], loss, grad_norm)."""
    data = _batch()
    with engine.eval_mode():
        out = engine.infer_batch(copy.copy(data))
    logp = no_padding_2_padding(out["model_output"]["log_probs"], data)
    with engine.train_mode():
        out = engine.train_batch(_batch(), loss_function=_loss_fn())
    return logp, sum(out["loss"]), out["metrics"]["grad_norm"], out


def _reference64(path):
    """The same quantities in float64: the transformers model scores each sequence alone (no packing), and
    verl's ppo_loss runs on its log-probs and entropies micro-batch by micro-batch."""
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    data = _batch()
    lp, ent = [], []
    for seq in data["input_ids"].unbind():
        logits = model(seq[None]).logits[0, :-1].double()
        logp_all = torch.log_softmax(logits, -1)
        lp.append(torch.cat([logp_all.gather(-1, seq[1:, None])[:, 0], logits.new_zeros(1)]))
        ent.append(torch.cat([-(logp_all.exp() * logp_all).sum(-1), logits.new_zeros(1)]))
    offsets = data["input_ids"].offsets()
    nested = lambda parts: torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets)  # noqa: E731
    loss_total = 0.0
    tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()), dp_size=1)
    loss_fn = _loss_fn()
    for start in range(0, len(lp), 2):
        idx = list(range(start, start + 2))
        mb = tu.index_select_tensor_dict(data, idx)
        loss, _ = loss_fn(model_output={"log_probs": nested([lp[i] for i in idx]),
                                        "entropy": nested([ent[i] for i in idx])}, data=mb)
        loss_total = loss_total + loss
    loss_total.backward()
    grad_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    logp = no_padding_2_padding(nested([t.detach() for t in lp]), data)
    return logp, float(loss_total.detach()), grad_norm


def test_registered_as_backend(cpu_group):
    assert EngineRegistry.get_engine_cls("language_model", BACKEND) is HybridVerlEngine
    register_engine()  # idempotent


def test_first_step_matches_fsdp(cpu_group, checkpoint):
    torch.manual_seed(0)
    fsdp = FSDPEngineWithLMHead(**_configs(checkpoint, "fsdp2"))
    fsdp.initialize()
    f_logp, f_loss, f_norm, _ = _first_step(fsdp)
    cfgs = _configs(checkpoint, BACKEND)
    ours = EngineRegistry.new("language_model", BACKEND, **cfgs)
    ours.initialize()
    h_logp, h_loss, h_norm, out = _first_step(ours)
    assert ours.engine.config.dtype == torch.float32
    r_logp, r_loss, r_norm = _reference64(checkpoint)
    # Tolerances from verl's own fp32 error against float64, with a floor of a few fp32 ulps of the value.
    eps = torch.finfo(torch.float32).eps
    mask = no_padding_2_padding(_batch()["input_ids"], _batch()) != 0  # response positions (ids are never 0)
    f_err = float(((f_logp - r_logp).abs() * mask).max())
    h_err = float(((h_logp.double() - r_logp).abs() * mask).max())
    assert h_err <= 4 * max(f_err, 8 * eps * float(r_logp.abs().max())), (h_err, f_err)
    for name, h, f, r in (("loss", h_loss, f_loss, r_loss), ("grad_norm", h_norm, f_norm, r_norm)):
        tol = 4 * max(abs(f - r), 8 * eps * abs(r))
        assert abs(h - r) <= tol, (name, h, f, r, tol)
    assert set(out["metrics"]) >= {"actor/pg_loss", "actor/pg_clipfrac", "actor/entropy_loss", "grad_norm"}
    assert len(out["loss"]) == len(PROMPT_LENS) // 2  # verl's micro-batches, one loss each


def test_steps_change_weights_and_scheduler(cpu_group, checkpoint):
    ours = EngineRegistry.new("language_model", BACKEND, **_configs(checkpoint, BACKEND))
    ours.initialize()
    before = dict(ours.get_per_tensor_param()[0])
    with ours.train_mode():
        ours.train_batch(_batch(), loss_function=_loss_fn())
    assert ours.lr_scheduler_step() == pytest.approx(1e-3)
    after = dict(ours.get_per_tensor_param()[0])
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k]) for k in before)
    assert shared.get() is ours.engine  # the rollout of the same worker finds this engine


def test_bad_input(cpu_group, checkpoint):
    cfgs = _configs(checkpoint, BACKEND)
    with pytest.raises(ValueError, match="lora_rank"):
        HybridVerlEngine(**{**cfgs, "model_config": HFModelConfig(path=checkpoint, load_tokenizer=False,
                                                                  lora_rank=8)})
    bad_optim = FSDPOptimizerConfig(lr=1e-3, total_training_steps=10, optimizer="SGD")
    with pytest.raises(ValueError, match="optimizer_config.optimizer='SGD'"):
        HybridVerlEngine(**{**cfgs, "optimizer_config": bad_optim})
    ours = HybridVerlEngine(**cfgs)
    with pytest.raises(RuntimeError, match="initialize"):
        ours.engine
    ours.initialize()
    with pytest.raises(RuntimeError, match="no forward_backward_batch"):
        ours.optimizer_step()
    with pytest.raises(ValueError, match="TensorDict"):
        ours.forward_backward_batch({"input_ids": None}, _loss_fn())
    data = _batch()
    tu.assign_non_tensor(data, return_model_output=True)
    with pytest.raises(NotImplementedError, match="Tinker"):
        ours.forward_backward_batch(data, _loss_fn())
    data = _batch()
    data["temperature"] = torch.tensor([1.0, 0.7] * 3)
    ours.forward_backward_batch(data, _loss_fn())
    with pytest.raises(ValueError, match="temperature"):
        ours.optimizer_step()
    with pytest.raises(RuntimeError, match="already has a hybridengine engine"):
        HybridVerlEngine(**cfgs).initialize()
    with pytest.raises(ValueError, match="not EngineConfig field"):
        shared.configure(tp_degree=2)


def test_checkpoint_round_trip(cpu_group, checkpoint, tmp_path):
    ours = EngineRegistry.new("language_model", BACKEND, **_configs(checkpoint, BACKEND))
    ours.initialize()
    with ours.train_mode():
        ours.train_batch(_batch(), loss_function=_loss_fn())
    ours.lr_scheduler_step()
    ours.save_checkpoint(str(tmp_path / "step_1"), global_step=1)
    saved = dict(ours.get_per_tensor_param()[0])
    shared.reset()
    back = EngineRegistry.new("language_model", BACKEND, **_configs(checkpoint, BACKEND))
    back.initialize()
    back.load_checkpoint(str(tmp_path / "step_1"))
    loaded = dict(back.get_per_tensor_param()[0])
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert back.engine.policy_version == 1
    with pytest.raises(RuntimeError, match="already built"):
        back.load_checkpoint(str(tmp_path / "step_1"))
    with pytest.raises(ValueError, match="no hybridengine checkpoint"):
        back.load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="hdfs_path"):
        back.save_checkpoint(str(tmp_path / "x"), hdfs_path="hdfs://x")
