"""`HybridEngine.train_step`: the custom-loss hook over the fused LM-head pass, its contract and its errors.

The shipped losses against full-logits references are tests/test_losses.py's; here: the PPO loss through the
hook is `ppo_step` bit for bit (loss, metrics, gradients, weights) at N = 1 and 2 with packing and several
micro-batches; what the loss sees (`fields`); the micro-batch weighting (`TrainConfig.loss_scale`); groups
kept in one micro-batch; exact mode's log-probs; and every bad input, which raises on every rank and leaves
the engine as it was."""

import functools
import math

import pytest
import torch
import torch.distributed as dist

import hybridengine as he
from hybridengine.train import losses as L
from hybridengine.train.batch import micro_batches
from _dist import reporting, spawn
from test_training import CFG, build, full_weights, make_batches

torch.set_num_threads(1)


def engine_for(hf, **kw):
    return he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64, max_num_seqs=4,
                                               **kw))


def full_grads(engine) -> dict[str, torch.Tensor]:
    """The kept gradient shards (keep_grads) gathered to full tensors (tg = 1: the flat unit is natural)."""
    sh, out = engine.sharded, {}
    for u, unit in enumerate(sh.layout.units):
        shard = engine.trainer.grads[u]
        if sh.world_size > 1:
            parts = [torch.empty_like(shard) for _ in range(sh.world_size)]
            dist.all_gather(parts, shard)
            shard = torch.cat(parts)
        for s in unit.params:
            out[s.name] = sh.natural_view(shard[:unit.natural_numel], s.name).clone()
    return out


def ppo_hook(cfg):
    return functools.partial(L.ppo_clip, **L.ppo_options(cfg))


def run_both(hf, batches, rank, cfg):
    """Per mode ('ppo_step', 'train_step'): (stats of each step, kept gradients, weights after the steps)."""
    out = {}
    for mode in ("ppo_step", "train_step"):
        engine = engine_for(hf, keep_grads=True)
        stats = []
        for per_rank in batches:
            batch = he.PPOBatch(**per_rank[rank])
            s = engine.ppo_step(batch, cfg) if mode == "ppo_step" else engine.train_step(batch, ppo_hook(cfg), cfg)
            stats.append({k: v for k, v in s.items() if k != "step_s"})
        out[mode] = stats, full_grads(engine), full_weights(engine)
    return out


def assert_bitwise(out):
    (s1, g1, w1), (s2, g2, w2) = out["ppo_step"], out["train_step"]
    assert s1 == s2
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
        assert torch.equal(w1[name], w2[name]), name


@pytest.mark.parametrize("cfg_kw", [dict(), dict(loss_agg="seq-mean-token-mean", clip_ratio_c=3.0, kl_estimator="k2")])
def test_ppo_through_hook_is_ppo_step_bitwise(cfg_kw):
    """Two steps, three sequences packed into micro-batches of 24 tokens (2-3 micro-batches), KL and entropy
    terms: the stats (loss and every metric), the gradients and the weights agree bit for bit."""
    hf = build()
    cfg = he.PPOConfig(**(CFG | cfg_kw))
    out = run_both(hf, make_batches(hf, 1, steps=2), 0, cfg)
    assert out["ppo_step"][0][0]["micro_batches"] > 1
    assert_bitwise(out)


def _dp_worker(rank, world, init_file, batches, errors):
    from hybridengine.train.batch import plan_micro_batches

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        # A rank with fewer micro-batches splits its own between groups (DPO's pairs), then pads with empty ones.
        if rank == 0:  # four micro-batches
            assert plan_micro_batches([4] * 4, 4, dist.group.WORLD) == [[0], [1], [2], [3]]
        else:  # one micro-batch of two pairs: split between the pairs, then two empty ones
            got = plan_micro_batches([3, 3, 3, 3], 100, dist.group.WORLD, [0, 0, 1, 1])
            assert got == [[0, 1], [2, 3], [], []], got
        hf = build()
        cfg = he.PPOConfig(**CFG)
        assert_bitwise(run_both(hf, batches, rank, cfg))
        # A loss that fails on one rank only: both raise in the same micro-batch, nothing is updated, and the
        # engine goes on (the phase is not broken).
        engine = engine_for(hf)
        before = full_weights(engine)

        def bad_on_rank1(logp, entropy, fields):
            loss = L.sft_nll(logp, entropy, fields)[0]
            return loss * float("nan") if rank == 1 else loss

        match = "non-finite loss" if rank == 1 else "failed on another rank"
        with pytest.raises(L.LossFnError, match=match):
            engine.train_step(he.PPOBatch(**batches[0][rank]), bad_on_rank1, he.TrainConfig(**_step_cfg()))
        assert not engine.trainer.has_optimizer
        after = full_weights(engine)
        assert all(torch.equal(before[k], after[k]) for k in before)
        stats = engine.ppo_step(he.PPOBatch(**batches[0][rank]), cfg)
        assert stats["step"] == 1 and math.isfinite(stats["loss"])


def _step_cfg():
    return {k: CFG[k] for k in ("micro_batch_tokens", "max_grad_norm", "lr", "weight_decay", "temperature")}


def test_data_parallel_ppo_through_hook_is_ppo_step_bitwise():
    """N = 2: the PPO bitwise check with a rank that pads with an empty micro-batch; groups kept whole by the
    split of `plan_micro_batches`; a loss failing on one rank raises on both, and the engine goes on."""
    hf = build()
    batches = make_batches(hf, 2, steps=2)
    batches[0][1] = {k: v[:1] for k, v in batches[0][1].items()}  # one sequence: rank 1 pads with empty ones
    spawn(_dp_worker, 2, batches)


def test_fields_and_micro_batches():
    """What the loss sees: [B, T] tensors of the micro-batch's whole sequences, with their batch indices,
    masks, targets, extra fields (their dtype) and the batch's counts."""
    hf = build()
    g = torch.Generator().manual_seed(3)
    lengths = [9, 5, 12, 7, 6]
    ids = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in lengths]
    mask = [(torch.arange(n - 1) >= 2).float() for n in lengths]
    weight = [torch.rand(n - 1, generator=g) for n in lengths]
    label = [torch.arange(n - 1) % 3 for n in lengths]
    batch = he.PPOBatch(input_ids=ids, response_mask=mask, extra=dict(weight=weight, label=label))
    seen = []

    def loss_fn(logp, entropy, fields):
        seen.append((logp.detach().clone(), entropy.detach().clone(), dict(fields)))
        return L.sft_nll(logp, entropy, fields)

    engine = engine_for(hf)
    logp_ref = engine.log_probs(batch)
    stats = engine.train_step(batch, loss_fn, he.TrainConfig(micro_batch_tokens=20))
    groups = micro_batches(lengths, 20)
    assert stats["micro_batches"] == len(groups) == len(seen) > 1
    for rows, (logp, entropy, f) in zip(groups, seen):
        width = max(lengths[b] for b in rows) - 1
        assert logp.shape == entropy.shape == (len(rows), width)
        assert f["seq_index"].shape == (len(rows), width) and f["seq_index"][:, 0].tolist() == rows
        for i, b in enumerate(rows):
            n = lengths[b] - 1
            assert f["valid"][i].tolist() == [t < n for t in range(width)]
            assert torch.equal(f["mask"][i, :n], mask[b].bool()) and not f["mask"][i, n:].any()
            assert torch.equal(f["targets"][i, :n], ids[b][1:])
            assert torch.equal(f["weight"][i, :n], weight[b]) and f["weight"].dtype == torch.float32
            assert torch.equal(f["label"][i, :n], label[b]) and f["label"].dtype == torch.int64
            m = mask[b].bool()
            torch.testing.assert_close(logp[i, :n][m], logp_ref[b, :n][m], rtol=1e-5, atol=1e-6)
            assert (logp[i, :n][~m] == 0).all() and (entropy[i, :n][~m] == 0).all() and (entropy[i, :n][m] > 0).all()
        assert f["num_tokens"] == f["global_tokens"] == sum(n - 3 for n in lengths)
        assert f["num_sequences"] == f["global_sequences"] == 5
        assert "old_logprobs" not in f and "response_mask" in f


def test_groups_stay_in_one_micro_batch():
    """A group (DPO's pair) is never split: at the token budget, nor when a data-parallel peer needs more
    micro-batches (`plan_micro_batches` splits between groups)."""
    from hybridengine.train.batch import _units_of

    assert micro_batches([4, 4, 4, 4], 10) == [[0, 1], [2, 3]]
    assert micro_batches([4, 4, 4, 4], 10, [0, 1, 1, 2]) == [[0], [1, 2], [3]]
    assert micro_batches([4, 4, 4, 4], 4, [0, 0, 1, 1]) == [[0, 1], [2, 3]]  # a group over the budget goes alone
    assert _units_of([2, 3, 4, 5], [0, 0, 1, 1, 1, 1]) == [[2, 3, 4, 5]]
    with pytest.raises(ValueError, match=r"groups\[2\] = 0 returns to a group seen before"):
        he.PPOBatch(input_ids=[torch.arange(3)] * 3, groups=[0, 1, 0])
    with pytest.raises(ValueError, match=r"groups must hold one group id per sequence \(3\)"):
        he.PPOBatch(input_ids=[torch.arange(3)] * 3, groups=[0, 1])


def test_loss_scale_sum_equals_tokens_when_the_loss_normalises_itself():
    """loss_scale 'sum' with a loss that divides by the rank's token count is 'tokens' with the token mean
    (the same gradients up to rounding); 'global-tokens' at N = 1 is 'tokens'."""
    hf = build()
    batch = he.PPOBatch(**make_batches(hf, 1, steps=1)[0][0])

    def self_normalised(logp, entropy, fields):
        return -torch.where(fields["mask"], logp, 0.0).sum() / fields["num_tokens"]

    grads = {}
    for name, fn, scale in [("tokens", L.sft_nll, "tokens"), ("sum", self_normalised, "sum"),
                            ("global", L.sft_nll, "global-tokens")]:
        engine = engine_for(hf, keep_grads=True)
        engine.train_step(batch, fn, he.TrainConfig(micro_batch_tokens=24, loss_scale=scale, max_grad_norm=None))
        grads[name] = full_grads(engine)
    for name in grads["tokens"]:
        torch.testing.assert_close(grads["sum"][name], grads["tokens"][name], rtol=1e-5, atol=1e-7)
        assert torch.equal(grads["global"][name], grads["tokens"][name])


def test_exact_mode_logprobs_are_token_logprobs():
    """EngineConfig.exact_logprobs: the log-probs the loss sees are, bit for bit, those of `log_probs`
    (token_logprobs(exact=True)), so old log-probs from the rollout give a ratio of exactly 1."""
    hf = build()
    batch = he.PPOBatch(**make_batches(hf, 1, steps=1)[0][0])
    engine = engine_for(hf, exact_logprobs=True)
    temperature = CFG["temperature"]
    want = engine.log_probs(batch, temperature=temperature)
    seen = []

    def loss_fn(logp, entropy, fields):
        seen.append((logp.detach().clone(), fields["seq_index"][:, 0].tolist(), fields["mask"]))
        return L.sft_nll(logp, entropy, fields)

    engine.train_step(batch, loss_fn, he.TrainConfig(micro_batch_tokens=24, temperature=temperature))
    for logp, rows, mask in seen:
        for i, b in enumerate(rows):
            n = len(batch.input_ids[b]) - 1
            assert torch.equal(logp[i, :n][mask[i, :n]], want[b, :n][mask[i, :n]])


# ---------------------------------------------------------------------------------------------------------
# errors: each raises before the optimizer, names what is wrong, and leaves the engine as it was


def _ok_loss(logp, entropy, fields):
    return L.sft_nll(logp, entropy, fields)[0]


BAD_LOSSES = [
    (lambda lp, e, f: lp.sum(-1), r"must return a 0-dim float tensor .* got a torch.float32 tensor of shape \[\d+\]"),
    (lambda lp, e, f: 1.0, r"loss_fn must return a 0-dim float tensor .* got float 1.0"),
    (lambda lp, e, f: lp.sum() * float("inf"), r"loss_fn returned a non-finite loss \((-?inf|nan)\) on rank 0"),
    (lambda lp, e, f: lp.detach().sum(), r"does not depend on logp or entropy"),
    (lambda lp, e, f: (lp.sum(), [1]), r"metrics must be a dict of scalars, got list"),
    (lambda lp, e, f: (lp.sum(), {"m": lp}), r"metric 'm' must be a scalar"),
    (lambda lp, e, f: lp.sum() * f["advantages"].sum(), r"fields\['advantages'\]: this batch has no such field"),
    (functools.partial(L.gspo), r"gspo needs fields 'old_logprobs', 'advantages'"),
    (functools.partial(L.dpo), r"dpo needs fields 'ref_logprobs'"),
    (lambda lp, e, f: 1 / 0, r"loss_fn raised ZeroDivisionError: division by zero"),
]


@pytest.mark.parametrize("loss_fn,match", BAD_LOSSES)
def test_bad_loss_raises_and_leaves_the_engine_unchanged(loss_fn, match):
    hf = build()
    batch = he.PPOBatch(**{k: v for k, v in make_batches(hf, 1, steps=1)[0][0].items()
                           if k in ("input_ids", "response_mask")})
    engine = engine_for(hf)
    before = full_weights(engine)
    with pytest.raises(L.LossFnError, match=match):
        engine.train_step(batch, loss_fn, he.TrainConfig(micro_batch_tokens=24))
    assert not engine.trainer.has_optimizer and engine.trainer.held_gradients == []
    after = full_weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # usable, and as a fresh engine: the same step gives the same weights
    engine.train_step(batch, _ok_loss, he.TrainConfig(micro_batch_tokens=24))
    fresh = engine_for(hf)
    fresh.train_step(batch, _ok_loss, he.TrainConfig(micro_batch_tokens=24))
    w1, w2 = full_weights(engine), full_weights(fresh)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_bad_arguments_raise_before_any_work():
    hf = build()
    engine = engine_for(hf)
    ids = [torch.arange(6), torch.arange(4)]
    batch = he.PPOBatch(input_ids=ids)
    with pytest.raises(ValueError, match="train_step: loss_fn must be a callable"):
        engine.train_step(batch, "sft", he.TrainConfig())
    with pytest.raises(ValueError, match="train_step: config must be a TrainConfig .*got ValueConfig"):
        engine.train_step(batch, _ok_loss, he.ValueConfig())
    with pytest.raises(ValueError, match="train_step: batch must be a PPOBatch"):
        engine.train_step({"input_ids": ids}, _ok_loss)
    with pytest.raises(ValueError, match="TrainConfig: loss_scale must be one of"):
        he.TrainConfig(loss_scale="mean")
    cfg = he.TrainConfig()
    cfg.temperature = 0.0
    with pytest.raises(ValueError, match="TrainConfig: temperature must be"):
        engine.train_step(batch, _ok_loss, cfg)
    # extra fields: shape, dtype, names, finiteness; checked at construction and again by the step
    with pytest.raises(ValueError,
                       match=r"PPOBatch.extra\['w'\]\[1\] has 2 entries; expected len\(input_ids\[1\]\) - 1"):
        he.PPOBatch(input_ids=ids, extra={"w": [torch.ones(5), torch.ones(2)]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra\['w'\]\[0\] must be a 1-D tensor"):
        he.PPOBatch(input_ids=ids, extra={"w": [torch.ones(5, 2), torch.ones(3)]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra\['w'\] has 1 sequences, input_ids has 2"):
        he.PPOBatch(input_ids=ids, extra={"w": [torch.ones(5)]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra\['advantages'\] clashes with a built-in field"):
        he.PPOBatch(input_ids=ids, extra={"advantages": [torch.ones(5), torch.ones(3)]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra\['seq_index'\] clashes with a built-in field"):
        he.PPOBatch(input_ids=ids, extra={"seq_index": [torch.ones(5), torch.ones(3)]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra\['w'\]\[1\]\[2\] is nan; every entry must be finite"):
        he.PPOBatch(input_ids=ids, extra={"w": [torch.ones(5), torch.tensor([1.0, 2.0, math.nan])]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra\['w'\] mixes dtypes"):
        he.PPOBatch(input_ids=ids, extra={"w": [torch.ones(5), torch.ones(3, dtype=torch.long)]})
    with pytest.raises(ValueError, match=r"PPOBatch.extra must be a dict"):
        he.PPOBatch(input_ids=ids, extra=[torch.ones(5), torch.ones(3)])
    good = he.PPOBatch(input_ids=ids, extra={"w": [torch.ones(5), torch.ones(3)]})
    good.extra["w"][1] = torch.ones(4)  # changed after construction: the step checks again
    with pytest.raises(ValueError, match=r"train_step: batch.extra\['w'\]\[1\] has 4 entries"):
        engine.train_step(good, _ok_loss)
    assert not engine.trainer.has_optimizer
