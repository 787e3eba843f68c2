"""hybridengine.integrations.trl: TRL's GRPOTrainer with rollout and the optimizer step on a HybridEngine.

A tiny Qwen2 (the `tiny-qwen2` preset, random weights) held twice: by an engine and, with the same weights,
by transformers for TRL's own `GRPOTrainer`; a character-level tokenizer built in code (no downloads); the
reward is the share of digit tokens in a completion. Both trainers score the same rollout: the engine's
step equals TRL's `_compute_loss` (loss and gradient norm) within a tolerance derived from TRL's own
float32 error against float64, and a short run raises the reward. Skipped here when TRL is not installed;
CI installs the `trl` extra and runs it (CI=true makes a missing TRL an error).
"""

import copy
import os

import pytest
import torch

if not os.environ.get("CI"):
    pytest.importorskip("trl", reason="TRL is not installed (make setup EXTRAS=dev,bench,trl); CI installs it")

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import hybridengine as he  # noqa: E402
from hybridengine.integrations import trl as he_trl  # noqa: E402

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"
DIGIT_IDS = range(2, 12)  # "<pad>" = 0, "<eos>" = 1, then the characters


def char_tokenizer(vocab_size: int):
    """One token per character, "<pad>" and "<eos>", and filler tokens up to the model's vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: 2 + i for i, c in enumerate(CHARS)}}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def digit_share(completion_ids, **kwargs):
    """A TRL reward function: the share of digit tokens in each completion."""
    return [sum(t in DIGIT_IDS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def prompts_dataset(num: int = 64):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    letters = torch.randint(10, len(CHARS), (num, 4), generator=gen).tolist()
    return Dataset.from_dict({"prompt": ["".join(CHARS[i] for i in row) for row in letters]})


def hf_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(he.model_config("tiny-qwen2"))


def make_engine(source) -> he.HybridEngine:
    return he.HybridEngine(source, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64,
                                                   max_num_seqs=64, seed=0))


def grpo_config(tmp_path, **overrides):
    from trl import GRPOConfig

    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4, max_completion_length=5,
                  learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], bf16=False, use_cpu=True, max_steps=1,
                  save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


@pytest.fixture
def one_thread():
    """The tiny model's steps are dispatch-bound: extra intra-op threads only contend on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trl_trainer(model, args, tokenizer, dataset, beta: float):
    """TRL's GRPOTrainer as the reference, scoring inputs it is handed. Built with beta 0 (with a nonzero beta it
    would load a reference model from the hub) and given the beta after: _compute_loss reads the inputs'
    ref_per_token_logps. use_vllm marks the rollout as another engine's, so that _compute_loss applies the
    inputs' importance_sampling_ratio as it does for vLLM's."""
    from trl import GRPOTrainer

    trainer = GRPOTrainer(model=model, reward_funcs=digit_share, args=args, processing_class=tokenizer,
                          train_dataset=dataset)
    trainer.beta, trainer.use_vllm = beta, True
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _rollout(trainer):
    """One generation batch of the engine, scored by TRL's code (rewards, advantages, old log-probs)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _grad_norm(model) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


CASES = {
    # TRL's defaults (dapo, sequence_mask importance sampling) with a KL term and an entropy bonus
    "dapo-kl-entropy": dict(loss_type="dapo", beta=0.04, entropy_coef=0.01, epsilon_high=0.28),
    # GSPO's sequence-level ratio, two-sided clipping, token-level truncated importance sampling
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5,
                 vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
    # VESPO's gamma weights, token-level masked importance sampling, the off-policy sequence mask
    "vespo-opsm": dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask",
                       vllm_importance_sampling_clip_min=0.5, off_policy_mask_threshold=0.05),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_step_equals_trl(case, tmp_path, one_thread):
    """The engine's first optimizer step on a rollout: its loss and gradient norm equal TRL's GRPOTrainer
    (`_compute_loss` and backward on a transformers model with the same weights) on the same inputs, within
    10x TRL's own float32 error (against the same model in float64). The old and reference log-probs are
    perturbed (and the sampler's, with the importance-sampling ratio recomputed from them) so that ratios,
    clipping, the masks and the KL term are live."""
    options = CASES[case]
    beta = options.get("beta", 0.0)
    model = hf_model()
    tokenizer, dataset = char_tokenizer(model.config.vocab_size), prompts_dataset()
    engine = make_engine(model)
    ref_engine = make_engine(model) if beta else None
    trainer = he_trl.HybridGRPOTrainer(engine, digit_share, grpo_config(tmp_path / "he", **options),
                                       processing_class=tokenizer, train_dataset=dataset, ref_engine=ref_engine)
    inputs = _rollout(trainer)
    gen = torch.Generator().manual_seed(1)
    mask = inputs["completion_mask"].float()
    for key in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"):
        if key in inputs:
            inputs[key] = inputs[key] + 0.3 * torch.randn(mask.shape, generator=gen) * mask
    if "importance_sampling_ratio" in inputs:  # recomputed from the perturbed old log-probs, as TRL would
        inputs["importance_sampling_ratio"] = he_trl.importance_sampling_ratio(
            inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], mask,
            trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
            trainer.vllm_importance_sampling_clip_max)

    no_beta = {**options, "beta": 0.0}
    ref32 = _trl_trainer(copy.deepcopy(model), grpo_config(tmp_path / "t32", **no_beta), tokenizer, dataset, beta)
    ref64 = _trl_trainer(copy.deepcopy(model).double(), grpo_config(tmp_path / "t64", **no_beta), tokenizer, dataset,
                         beta)
    loss32 = ref32._compute_loss(ref32.model, inputs)
    loss32.backward()
    loss64 = ref64._compute_loss(ref64.model, inputs)
    loss64.backward()
    loss32, loss64 = loss32.item(), loss64.item()
    loss = trainer._engine_step([inputs])

    eps = torch.finfo(torch.float32).eps
    tol = 10 * max(abs(loss32 - loss64), eps * abs(loss64))
    assert abs(loss - loss64) <= tol, (loss, loss32, loss64, tol)
    norm32, norm64 = _grad_norm(ref32.model), _grad_norm(ref64.model)
    tol = 10 * max(abs(norm32 - norm64), eps * norm64)
    assert abs(trainer._engine_stats["grad_norm"] - norm64) <= tol, (trainer._engine_stats["grad_norm"], norm32, norm64)


def _completion_logps(trainer, inputs) -> torch.Tensor:
    """TRL's per-token log-probs of the completions ([B, C]) under `trainer.model`."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention,
                                                                 inputs["completion_ids"].size(1))
    return logps


def test_every_loss_type_equals_trl(tmp_path, one_thread):
    """`grpo_loss` over the engine's log-probs (the evaluation path, `compute_loss`) equals TRL's `_compute_loss`
    for every loss_type, within 10x the larger of TRL's float32 error against float64 and what a float32
    forward's log-prob error moves the loss by to first order: d = max |logp32 - logp64| over the completion
    tokens times the tokens' mean |d term / d logp|, bounded by |A| (1 + |logp|) max(1, ratio) (the ratio's
    derivative, and cispo's logp factor; sapo's gate has slope <= 1)."""
    model = hf_model()
    tokenizer, dataset = char_tokenizer(model.config.vocab_size), prompts_dataset()
    trainer = he_trl.HybridGRPOTrainer(make_engine(model), digit_share, grpo_config(tmp_path / "he"),
                                       processing_class=tokenizer, train_dataset=dataset)
    inputs = _rollout(trainer)
    mask = inputs["completion_mask"].float()
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + 0.3 * torch.randn(
        mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    ref32 = _trl_trainer(copy.deepcopy(model), grpo_config(tmp_path / "t32"), tokenizer, dataset, 0.0)
    ref64 = _trl_trainer(copy.deepcopy(model).double(), grpo_config(tmp_path / "t64"), tokenizer, dataset, 0.0)
    eps = torch.finfo(torch.float32).eps
    logp32, logp64 = _completion_logps(ref32, inputs).double(), _completion_logps(ref64, inputs)
    on = mask.bool()
    d = float((logp32 - logp64)[on].abs().max())
    ratio = torch.exp(logp64 - inputs["old_per_token_logps"].double())
    slope = inputs["advantages"].double().abs()[:, None] * (1 + logp64.abs()) * ratio.clamp(min=1)
    forward = d * float(slope[on].mean())
    for loss_type in he_trl.LOSS_TYPES:
        trainer.loss_config.loss_type = ref32.loss_type = ref64.loss_type = loss_type
        with torch.no_grad():
            loss32 = float(ref32._compute_loss(ref32.model, inputs))
            loss64 = float(ref64._compute_loss(ref64.model, inputs))
        loss = float(trainer.compute_loss(None, inputs))
        tol = 10 * max(abs(loss32 - loss64), eps * abs(loss64), forward)
        assert abs(loss - loss64) <= tol, (loss_type, loss, loss32, loss64, tol)


def test_reward_rises(tmp_path, one_thread):
    """12 steps of HybridGRPOTrainer.train() (TRL's loop, callbacks and logging) lift the reward from chance
    (10 digit tokens of 128) toward 1; the logged metrics carry the engine's gradient norm."""
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        rows: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.rows.append(dict(logs))

    logs = Logs()
    engine = make_engine(he.model_config("tiny-qwen2"))
    args = grpo_config(tmp_path, per_device_train_batch_size=32, num_generations=8, max_completion_length=4,
                       max_steps=12)
    trainer = he_trl.HybridGRPOTrainer(engine, digit_share, args, processing_class=char_tokenizer(engine.vocab_size),
                                       train_dataset=prompts_dataset(), callbacks=[logs])
    trainer.train()
    rewards = [row["reward"] for row in logs.rows if "reward" in row]
    assert len(rewards) == 12
    assert sum(rewards[:3]) / 3 < 0.25, rewards
    assert sum(rewards[-3:]) / 3 > 0.6, rewards
    assert engine.policy_version == 12
    assert all(row["grad_norm"] > 0 for row in logs.rows[:3] if "grad_norm" in row)


def test_save_model_exports_the_engine(tmp_path):
    """save_model writes the engine's weights as a transformers checkpoint (the Trainer's model is weightless)."""
    from transformers import AutoModelForCausalLM

    model = hf_model()
    trainer = he_trl.HybridGRPOTrainer(make_engine(model), digit_share, grpo_config(tmp_path / "run"),
                                       processing_class=char_tokenizer(model.config.vocab_size),
                                       train_dataset=prompts_dataset())
    assert sum(p.numel() for p in trainer.model.parameters()) == 0
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, p in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("option, value, match", [
    ("use_vllm", True, "use_vllm=True is not supported"),
    ("top_entropy_quantile", 0.2, "top_entropy_quantile=0.2 is not supported"),
    ("use_adaptive_entropy", True, "use_adaptive_entropy=True is not supported"),
    ("min_p", 0.1, "min_p=0.1 is not supported"),
    ("repetition_penalty", 1.1, "repetition_penalty=1.1 is not supported"),
    ("generation_kwargs", {"top_a": 1}, "generation_kwargs=.* is not supported"),
    ("optim", "sgd", "optim='sgd' is not supported"),
    ("beta", 0.1, "beta=0.1 needs ref_engine"),
])
def test_unsupported_options_raise(tmp_path, option, value, match):
    args = grpo_config(tmp_path)
    setattr(args, option, value)
    with pytest.raises(ValueError, match=match):
        he_trl.check_grpo_config(args)


def test_argument_errors(tmp_path):
    engine = make_engine(he.model_config("tiny-qwen2"))
    tokenizer, args = char_tokenizer(engine.vocab_size), grpo_config(tmp_path)
    with pytest.raises(ValueError, match="engine must be an actor HybridEngine"):
        he_trl.HybridGRPOTrainer("Qwen/Qwen2.5-0.5B", digit_share, args, processing_class=tokenizer)
    with pytest.raises(ValueError, match="processing_class must be a tokenizer"):
        he_trl.HybridGRPOTrainer(engine, digit_share, args, processing_class=None)
    with pytest.raises(ValueError, match="ref_engine must be None or an actor HybridEngine"):
        he_trl.HybridGRPOTrainer(engine, digit_share, args, processing_class=tokenizer, ref_engine=object())
