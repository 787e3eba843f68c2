"""Checkpoints: bitwise resume, crash-safe save that replaces only checkpoints, checksums, per-rank RNG,
export to transformers, load at another world size."""

import contextlib
import json
import os
import re
import shutil
import warnings
from unittest import mock

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
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the failed save's folder is gone
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

    def module_order(named_shapes, head_dim=None, plan=None):  # param_specs without the reordering
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
    engine_for(build()).save(tmp_path / "ck")
    meta_file = tmp_path / "ck" / "meta.json"
    meta = json.loads(meta_file.read_text())
    edit(meta["layout"]["specs"])
    meta["meta_sha256"] = checkpoint._meta_digest(meta)  # a sound meta.json of another layout
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        he.HybridEngine.load(tmp_path / "ck")


def test_split_master_engine_trains_like_fp32_master_and_resumes_bitwise(tmp_path, device):
    """EngineTuning(split_master=True), bf16: the same training as fp32 masters up to the bf16 weights'
    tie rounding (their masters agree to bf16 precision after 3 steps), 2 bytes of optimizer state per
    parameter less, and save -> load -> step continues bit for bit (on the test device)."""
    def make(split):
        return he.HybridEngine(build(), he.EngineConfig(dtype=torch.bfloat16, device=str(device), max_model_len=64,
                                                        max_num_seqs=4,
                                                        tuning=he.EngineTuning(split_master=split)))

    full, split = make(False), make(True)
    for step in range(3):
        a, b = full.ppo_step(batch(step), CFG), split.ppo_step(batch(step), CFG)
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * max(1.0, abs(a["loss"])), (step, a["loss"], b["loss"])
    opt_full, opt_split = full.trainer.optimizer, split.trainer.optimizer
    assert opt_split.master is None and opt_split.master_lo is not None
    # An element whose bf16 weight rounds the other way at a tie sees another gradient from then on; Adam moves
    # it by at most lr * (1 - beta1) / sqrt(1 - beta2) a step (plus decay), so the two runs part by at most twice
    # that per step there. Everywhere else the masters agree to bf16 precision.
    beta1, beta2 = CFG.betas
    bound = 3 * 2 * CFG.lr * (max(1.0, (1 - beta1) / (1 - beta2) ** 0.5) + CFG.weight_decay)
    for m_full, m_split in zip(opt_full.master, opt_split.masters()):
        far = ~torch.isclose(m_split, m_full, rtol=2**-7, atol=1e-6)
        assert far.float().mean() <= 1e-3, far.float().mean()
        assert (m_split - m_full).abs().max() <= bound
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
    assert resumed.config.tuning.split_master and resumed.device.type == device.type
    for step in range(2, 4):
        resumed.ppo_step(batch(step), CFG)
    for a, b in zip(resumed.sharded.shard_views(), straight.sharded.shard_views()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(resumed.trainer.optimizer.master_lo, straight.trainer.optimizer.master_lo):
        assert torch.equal(a, b)


def test_save_replaces_only_a_checkpoint(tmp_path, monkeypatch):
    """What save did not write stays: a file, a folder with other files (at the path or at the names save
    uses beside it), a symbolic link; a bad path is refused before anything is written."""
    engine = engine_for(build())
    ck = tmp_path / "ck"
    foreign = "a folder with entries that are not a checkpoint's"
    occupants = [
        (ck, "a file", lambda: ck.write_text("notes")),
        (ck, f"{foreign}: notes.txt", lambda: (ck.mkdir(), (ck / "rank0.pt").write_text("x"),
                                               (ck / "notes.txt").write_text("x"))),
        (ck, "a symbolic link", lambda: (tmp_path / "elsewhere").mkdir() or ck.symlink_to(tmp_path / "elsewhere")),
        (tmp_path / ".ck.old", f"{foreign}: data",
         lambda: (tmp_path / ".ck.old").mkdir() or (tmp_path / ".ck.old" / "data").mkdir()),
    ]
    for where, what, occupy in occupants:
        for p in (ck, tmp_path / ".ck.old", tmp_path / "elsewhere"):
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.exists():
                shutil.rmtree(p)
        occupy()
        before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        with pytest.raises(FileExistsError, match=rf"HybridEngine.save: {re.escape(str(where))}( \(.*\))? holds "
                                                  rf"{re.escape(what)}; save replaces only a hybridengine checkpoint"):
            engine.save(ck)
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before, what
    for p in (ck, tmp_path / ".ck.old"):
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            shutil.rmtree(p)
    ck.mkdir()  # an empty folder becomes the checkpoint
    engine.save(ck)
    assert sorted(os.listdir(ck)) == ["meta.json", "rank0.pt"]

    work = tmp_path / "cwd"
    work.mkdir()
    (work / "file").write_text("x")
    monkeypatch.chdir(work)
    for bad, match in [("", "path is empty"), ("  ", "path is empty"), (".", "must end in a folder name"),
                       ("x/..", "must end in a folder name"), ("/", "must end in a folder name"),
                       (None, "path must be a str or os.PathLike naming a folder, got NoneType"),
                       (b"ck", "got bytes"), ("file/ck", "file .the parent of file/ck. is not a folder")]:
        with pytest.raises(ValueError, match=match):
            engine.save(bad)
        assert os.listdir(".") == ["file"], bad
    with pytest.raises(ValueError, match="HybridEngine.load: path is empty"):
        he.HybridEngine.load("")


class _Crash(BaseException):
    """The process dying mid-save: not an Exception, so none of save's clean-up on errors runs."""


def _fail_at(monkeypatch, at=None, error=_Crash, partial=False):
    """Make file-system step number `at` of what follows raise `error` before it acts (partial: a folder's
    removal after its first entry is gone). Returns the names of the steps taken."""
    steps = []

    def wrap(name, act):
        def step(*args, **kwargs):
            steps.append(name)
            if len(steps) - 1 == at:
                if partial:  # a removal
                    os.remove(os.path.join(args[0], sorted(os.listdir(args[0]))[0]))
                raise error(f"{name} (simulated)")
            return act(*args, **kwargs)
        return step

    for module, name in ((os, "replace"), (os, "mkdir"), (os, "fsync"), (shutil, "rmtree"), (torch, "save")):
        monkeypatch.setattr(module, name, wrap(name, getattr(module, name)))
    return steps


def _failure_points(monkeypatch, engine, folder):
    """Every way a save of `engine` over `folder` can stop: before each step, and halfway through each removal."""
    count = folder.parent.parent / "count"
    shutil.copytree(folder.parent, count)
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = _fail_at(m)
        engine.save(count / folder.name)
    shutil.rmtree(count)
    return [(k, False) for k in range(len(steps))] + [(k, True) for k, s in enumerate(steps) if s == "rmtree"]


def _verified_step(folder):
    """The step of the complete checkpoint that load finds at `folder`, every rank file read and checked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = checkpoint.read_meta(folder)
    for r in range(meta.layout.world_size):
        checkpoint._load_rank_file(meta, f"rank{r}.pt")
    return meta.step


def test_a_crash_anywhere_in_save_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """Crash before every file-system step of a save (and halfway through each removal), over a checkpoint
    and as the first save: load restores the previous checkpoint or the new one, bitwise, and says so
    when it is not at the path; the next save succeeds and leaves nothing beside the path. Where the
    only complete checkpoint is beside the path, the next save, crashing anywhere itself, leaves it or a
    newer one."""
    engine = engine_for(build())
    engine.ppo_step(batch(0), CFG)
    engine.save(tmp_path / "over" / "ck")
    (tmp_path / "first").mkdir()
    weights = {1: full_state_dict(engine.sharded)}
    engine.ppo_step(batch(1), CFG)
    weights[2] = full_state_dict(engine.sharded)
    for start in (tmp_path / "over", tmp_path / "first"):
        beside = set()
        for i, (at, partial) in enumerate(_failure_points(monkeypatch, engine, start / "ck")):
            ck = tmp_path / f"{start.name}{i}" / "ck"
            shutil.copytree(start, ck.parent)
            with monkeypatch.context() as m:
                _fail_at(m, at, partial=partial)
                with pytest.raises(_Crash):
                    engine.save(ck)
            state = tuple(sorted(str(p.relative_to(ck.parent)) for p in ck.parent.rglob("*")))
            if not any(map(checkpoint._is_complete, (ck, *checkpoint._siblings(ck)))):
                assert start.name == "first", (i, state)
                with pytest.raises(ValueError, match="has no meta.json"):  # no save has finished yet
                    he.HybridEngine.load(ck)
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    loaded = he.HybridEngine.load(ck)
                assert any("loading the newest complete one" in str(w.message) for w in caught) == \
                    (not checkpoint._is_complete(ck)), (i, state)
                step = loaded.trainer.optimizer.num_steps
                got = full_state_dict(loaded.sharded)
                assert all(torch.equal(got[k], w) for k, w in weights[step].items()), (i, state)
                if not checkpoint._is_complete(ck) and state not in beside:
                    beside.add(state)
                    for j, (at2, partial2) in enumerate(_failure_points(monkeypatch, engine, ck)):
                        ck2 = tmp_path / f"{start.name}{i}-{j}" / "ck"
                        shutil.copytree(ck.parent, ck2.parent)
                        with monkeypatch.context() as m, warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            _fail_at(m, at2, partial=partial2)
                            with pytest.raises(_Crash):
                                engine.save(ck2)
                        assert _verified_step(ck2) == 2, (i, j, state)  # the new one: at the path or beside it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the interrupted save's complete checkpoint is moved to the path first
                engine.save(ck)
            assert _verified_step(ck) == 2 and os.listdir(ck.parent) == ["ck"], (i, state)
        assert len(beside) == 1, beside  # between the two renames, or before the first save's rename


def test_a_failing_step_of_save_puts_everything_back(tmp_path, monkeypatch):
    """An error (not a crash) at any file-system step: save raises (or, once the new checkpoint is in place,
    warns), the path holds the previous or the new checkpoint, and no temporary folder is left."""
    engine = engine_for(build())
    engine.ppo_step(batch(0), CFG)
    engine.save(tmp_path / "start" / "ck")
    engine.ppo_step(batch(1), CFG)
    for i, (at, _) in enumerate(_failure_points(monkeypatch, engine, tmp_path / "start" / "ck")):
        ck = tmp_path / f"fail{i}" / "ck"
        shutil.copytree(tmp_path / "start", ck.parent)
        with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = _fail_at(m, at, error=OSError)
            try:
                engine.save(ck)
                raised = False
            except OSError as e:
                assert "simulated" in str(e)
                raised = True
        assert raised != any("is saved, but" in str(w.message) for w in caught), (i, steps)
        assert _verified_step(ck) == (1 if raised else 2), (i, steps)
        left = sorted(os.listdir(ck.parent))
        assert left == ["ck"] or (not raised and steps[-1] == "rmtree" and left == [".ck.old", "ck"]), (i, steps, left)


def test_load_names_a_damaged_or_foreign_file(tmp_path):
    engine = engine_for(build())
    engine.save(tmp_path / "other")
    engine.ppo_step(batch(0), CFG)
    engine.save(tmp_path / "ck")
    size = os.path.getsize(tmp_path / "ck" / "rank0.pt")

    def flip_64_bytes(f):
        data = bytearray(f.read_bytes())
        data[size // 2:size // 2 + 64] = bytes(b ^ 0xFF for b in data[size // 2:size // 2 + 64])
        f.write_bytes(bytes(data))

    def edit_step(f):
        meta = json.loads(f.read_text())
        meta["step"] += 1
        f.write_text(json.dumps(meta))

    cases = [
        ("rank0.pt", flip_64_bytes,
         r"rank0.pt is damaged or truncated: checksum mismatch \(sha256 \w+, meta.json records"),
        ("rank0.pt", lambda f: f.write_bytes(f.read_bytes()[:size // 2]),
         rf"rank0.pt is damaged or truncated: it has {size // 2} bytes, meta.json records {size}"),
        ("rank0.pt", lambda f: shutil.copy(tmp_path / "other" / "rank0.pt", f),
         r"rank0.pt is from another save \(save id \w+; meta.json's is \w+\)"),
        ("meta.json", lambda f: f.write_text(f.read_text()[:100]), "meta.json is damaged: not valid JSON"),
        ("meta.json", lambda f: f.write_bytes(b"\xff\xfe"), "meta.json is damaged: not valid JSON"),
        ("meta.json", lambda f: f.write_text("[]"), "meta.json is damaged: a JSON list, not an object"),
        ("meta.json", edit_step, "meta.json is damaged: its checksum does not match its contents"),
    ]
    for i, (name, damage, match) in enumerate(cases):
        folder = tmp_path / f"case{i}"
        shutil.copytree(tmp_path / "ck", folder)
        damage(folder / name)
        with pytest.raises(ValueError, match="HybridEngine.load: " + re.escape(str(folder)) + "/" + match):
            he.HybridEngine.load(folder)


def test_a_checkpoint_of_format_1_loads_with_a_warning(tmp_path):
    """Written before checksums and save ids: loads, unverified, and says so."""
    engine = engine_for(build())
    engine.ppo_step(batch(0), CFG)
    engine.save(tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    for key in ("save_id", "files", "meta_sha256"):
        del meta[key]
    meta["format"] = 1
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    state = torch.load(tmp_path / "ck" / "rank0.pt", weights_only=True)
    del state["save_id"], state["rng"]["sampler"]
    torch.save(state, tmp_path / "ck" / "rank0.pt")
    with pytest.warns(UserWarning, match="has format 1 .* its files are not verified"):
        loaded = he.HybridEngine.load(tmp_path / "ck")
    got = full_state_dict(loaded.sharded)
    assert all(torch.equal(got[k], w) for k, w in full_state_dict(engine.sharded).items())


def _rng_round_trip(rank, world, init_file, path, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        engine = engine_for(build())  # tp_generation 1: each rank samples for itself
        torch.manual_seed(1000 + rank)
        engine._sampler.rng.seed(2000 + rank)  # replicas that sampled different numbers of steps
        engine.save(path)
        saved = dict(cpu=torch.get_rng_state(), sampler=engine._sampler.rng.getstate())
        everyone = [None] * world
        dist.all_gather_object(everyone, saved)
        assert not torch.equal(everyone[0]["cpu"], everyone[1]["cpu"])
        assert everyone[0]["sampler"] != everyone[1]["sampler"]
        torch.manual_seed(7)  # what the load must replace
        loaded = he.HybridEngine.load(path)
        assert torch.equal(torch.get_rng_state(), saved["cpu"]), "torch CPU RNG"
        assert loaded._sampler.rng.getstate() == saved["sampler"], "sampler RNG"

        # Last (the engine's guard may count a failed save as breaking the engine): one rank's failed write
        # fails the save on every rank, and rank 0 removes the new folder before it raises.
        failing = mock.patch.object(torch, "save", side_effect=OSError("disk full (simulated)")) if rank == 1 \
            else contextlib.nullcontext()
        with failing, pytest.raises(RuntimeError if rank == 0 else OSError,
                                    match=r"ranks? \[?1\]? failed" if rank == 0 else "simulated"):
            loaded.save(path)
        if rank == 0:
            assert sorted(os.listdir(os.path.dirname(path))) == ["ck"]
            assert _verified_step(path) == 0


def test_each_rank_gets_its_own_rng_back(tmp_path):
    """Two gloo ranks with different torch and sampler RNG states: after load, each has its own (the
    workers see no GPU, so the CUDA state is not exercised here). Also: a rank's failed write fails the
    save on every rank and leaves the checkpoint as it was, with no temporary folder."""
    spawn(_rng_round_trip, 2, str(tmp_path / "ck"))
