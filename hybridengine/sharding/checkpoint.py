"""Checkpoints of a HybridEngine: sharded save/load (any world size on load), HF export.

Format (a folder): `meta.json` (model and engine config, the saved layout: specs, world size, TP
degree, alignment, step) and `rank{r}.pt` per saving rank (its weight shard and AdamW state per
unit, RNG states). A save is atomic: everything is written into a temporary sibling folder, which
replaces the target with two renames only once every rank has finished, so a crash mid-save leaves
the previous checkpoint intact.

Loading at another world size or TP degree: each unit is rebuilt in natural layout from the saved
shards (the saved layout is recomputed from the saved specs), then packed in the new layout, and
each rank keeps its new shard. Every loading rank reads every saved shard: simple and exact, at the
cost of one full model in host memory per rank during the load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hybridengine.sharding.layout import ParamSpec, ShardedLayout
from hybridengine.model.config import ModelConfig, RopeConfig
from hybridengine.ops import segment_copy

FORMAT = 1
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _barrier(engine) -> None:
    if dist.is_initialized() and engine.world_size > 1:
        dist.barrier()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout_meta(layout: ShardedLayout) -> dict:
    return dict(world_size=layout.world_size, tp_size=layout.tp_size, element_size=layout.element_size,
                align_bytes=layout.align_bytes, shard_align_bytes=layout.shard_align_bytes,
                specs=[[s.name, list(s.shape), s.role, s.unit, s.granule] for s in layout.specs])


def _layout_from_meta(meta: dict) -> ShardedLayout:
    specs = [ParamSpec(n, tuple(shape), role, unit, granule) for n, shape, role, unit, granule in meta["specs"]]
    return ShardedLayout(specs, world_size=meta["world_size"], tp_size=meta["tp_size"],
                         element_size=meta["element_size"], align_bytes=meta["align_bytes"],
                         shard_align_bytes=meta["shard_align_bytes"])


def save(engine, path: str | os.PathLike) -> None:
    """Write the engine's sharded state (weights, optimizer, step, RNG, config) to folder `path`."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    if engine.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a save that died before its renames
        tmp.mkdir()
    _barrier(engine)
    sharded = engine.sharded
    opt = engine._training._optimizer if engine._training is not None else None
    optimizer = None
    if opt is not None:
        sd = opt.state_dict()
        optimizer = {"step": sd["step"], **{k: None if sd[k] is None else [t.detach().cpu().clone() for t in sd[k]]
                                            for k in _STATE_KEYS}}
    state = dict(weights=[s.detach().cpu().clone() for s in sharded.shard_views()], optimizer=optimizer,
                 rng=dict(cpu=torch.get_rng_state(),
                          cuda=torch.cuda.get_rng_state(engine.device) if engine.device.type == "cuda" else None))
    with open(tmp / f"rank{engine.rank}.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _barrier(engine)
    if engine.rank == 0:
        meta = dict(format=FORMAT, role=engine.role, step=0 if opt is None else opt.num_steps,
                    model_config=dataclasses.asdict(engine.model_config), hf_config=engine.hf_config,
                    engine_config={k: (_dtype_name(v) if isinstance(v, torch.dtype) else v)
                                   for k, v in dataclasses.asdict(engine.config).items()},
                    layout=_layout_meta(sharded.layout))
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = path.parent / f".{path.name}.old"
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            path.rename(old)
        tmp.rename(path)  # the checkpoint switches here, all at once
        if old.exists():
            shutil.rmtree(old)
    _barrier(engine)


def _natural_units(layout: ShardedLayout, shards_by_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per unit, the natural-layout buffer rebuilt from every rank's shard of it."""
    out = []
    for u, unit in enumerate(layout.units):
        full = torch.cat([shards_by_rank[r][u] for r in range(layout.world_size)])
        if layout.tp_size == 1:
            out.append(full[:unit.natural_numel].clone())
            continue
        natural = torch.zeros(unit.natural_numel, dtype=full.dtype)
        segment_copy(full, natural, unit.unpack_table())
        out.append(natural)
    return out


def _to_layout(saved: ShardedLayout, naturals: list[torch.Tensor], layout: ShardedLayout) -> list[torch.Tensor]:
    """The saved layout's natural units -> `layout`'s natural units, parameter by parameter (by name):
    the two may order a unit's parameters differently (param_specs' order changed on 2026-11-30)."""
    out = []
    for unit in layout.units:
        buf = torch.zeros(unit.natural_numel, dtype=naturals[0].dtype)
        for spec in unit.params:
            try:
                src_spec, src_unit, _ = saved._find(spec.name)
            except KeyError:
                raise ValueError(f"HybridEngine.load: the checkpoint has no parameter {spec.name!r}") from None
            if src_spec.shape != spec.shape:
                raise ValueError(f"HybridEngine.load: {spec.name} is {src_spec.shape} in the checkpoint, "
                                 f"{spec.shape} in this model")
            natural = naturals[saved.unit_index[src_unit.name]]
            layout.natural_view(buf, spec.name).copy_(saved.natural_view(natural, spec.name))
        out.append(buf)
    return out


def _own_shards(engine, naturals: list[torch.Tensor]) -> list[torch.Tensor]:
    sharded = engine.sharded
    shards = []
    for u, natural in enumerate(naturals):
        packed = sharded.pack_unit(u, natural.to(sharded.device))
        start, end = sharded.layout.units[u].shard_range(sharded.rank)
        shards.append(packed[start:end])
    return shards


def load(path: str | os.PathLike, *, config=None):
    """A HybridEngine restored from `save` (at this process's world size; TP degree from `config`)."""
    from hybridengine.engine import EngineConfig, HybridEngine

    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise ValueError(f"HybridEngine.load: {path} has no meta.json (not a hybridengine checkpoint)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"HybridEngine.load: {path} has format {meta.get('format')!r}, expected {FORMAT}")
    saved = _layout_from_meta(meta["layout"])
    missing = [r for r in range(saved.world_size) if not (path / f"rank{r}.pt").exists()]
    if missing:
        raise ValueError(f"HybridEngine.load: {path} lacks the shards of saved ranks {missing}")
    mc = dict(meta["model_config"])
    mc["rope"] = RopeConfig(**mc["rope"])
    mc["layer_types"] = tuple(mc["layer_types"])
    model_config = ModelConfig(**mc)
    if config is None:
        ec = dict(meta["engine_config"])
        ec["dtype"] = getattr(torch, ec["dtype"])
        ec.pop("device", None)  # this process's device, not the saver's
        config = EngineConfig(**ec)
    if model_config.value_head:
        model_config = dataclasses.replace(model_config, value_head=False)  # the engine adds the head again
    engine = HybridEngine(model_config, config, role=meta["role"])
    engine.hf_config = meta.get("hf_config")
    states = [torch.load(path / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in range(saved.world_size)]
    layout = engine.sharded.layout
    weights = _own_shards(engine, _to_layout(saved, _natural_units(saved, [s["weights"] for s in states]), layout))
    for dst, src in zip(engine.sharded.shard_views(), weights):
        dst.copy_(src.to(dst.dtype))
    if states[0]["optimizer"] is not None:
        trainer = engine._trainer()
        opt_state = {"step": states[0]["optimizer"]["step"]}
        for key in _STATE_KEYS:
            if states[0]["optimizer"][key] is None:
                opt_state[key] = None
                continue
            naturals = _to_layout(saved, _natural_units(saved, [s["optimizer"][key] for s in states]), layout)
            opt_state[key] = [t.float() for t in _own_shards(engine, naturals)]
        if trainer.optimizer.master_weights is False:
            opt_state["master"] = None
        elif opt_state["master"] is None:  # saved without masters (fp32 params): the weights are the masters
            opt_state["master"] = [w.float() for w in weights]
        trainer.optimizer.load_state_dict(opt_state)
    rng = states[engine.rank]["rng"] if engine.rank < len(states) else states[0]["rng"]
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and engine.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], engine.device)
    return engine


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Every parameter in natural layout (CPU), gathered from all ranks (every rank gets it)."""
    sharded = engine.sharded
    out = {}
    for u, unit in enumerate(sharded.layout.units):
        natural = sharded.gather_unit(u)
        for s in unit.params:
            out[s.name] = sharded.natural_view(natural, s.name).detach().cpu().clone()
    return out


def export_hf(engine, path: str | os.PathLike) -> None:
    """config.json + model.safetensors that transformers' AutoModelForCausalLM.from_pretrained loads."""
    from safetensors.torch import save_file

    if engine.role != "actor":
        raise ValueError("export_hf: only an actor (causal LM) exports to a transformers checkpoint")
    if engine.hf_config is None:
        raise ValueError("export_hf: the engine was built from a ModelConfig, not a transformers config, model or "
                         "checkpoint, so there is no config.json to write")
    state = full_state_dict(engine)
    if engine.rank != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = dict(engine.hf_config)
    config["torch_dtype"] = config["dtype"] = _dtype_name(engine.config.dtype)
    (path / "config.json").write_text(json.dumps(config, indent=1))
