"""Checkpoints of a sharded model and its optimizer: sharded save/restore (any world size on load), HF export.

Format (a folder): `meta.json` (model and engine config, the saved layout: specs, world size, TP
degree, alignment, step) and `rank{r}.pt` per saving rank (its weight shard and AdamW state per
unit, its RNG states). A save is atomic: everything is written into a temporary sibling folder,
which replaces the target with two renames only once every rank has finished, so a crash mid-save
leaves the previous checkpoint intact.

Loading at another world size or TP degree: each unit is rebuilt in natural layout from the saved
shards (the saved layout is recomputed from the saved specs), then packed in the new layout, and
each rank keeps its new shard. Every loading rank reads every saved shard: simple and exact, at the
cost of one full model in host memory per rank during the load.

This module knows the sharded buffer and the optimizer, not the engine: the engine describes itself
(`engine_meta` of `save`), builds itself from `read_meta`'s answer and has `restore_` fill it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hybridengine.model.config import ModelConfig, RopeConfig
from hybridengine.ops import segment_copy
from hybridengine.sharding.layout import ParamSpec, ShardedLayout
from hybridengine.sharding.switch import ShardedBuffer

FORMAT = 1
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointMeta:
    """What `read_meta` finds in a checkpoint folder: enough to build the engine that `restore_` fills."""

    path: Path
    role: str
    """'actor' or 'critic'."""
    step: int
    """Optimizer steps taken when it was saved."""
    model_config: ModelConfig
    """The backbone's config (a critic's value head is added again by the engine)."""
    engine_config: dict
    """The saving engine's config fields (dtype as a torch.dtype; device as it was saved)."""
    hf_config: dict | None
    """The transformers config, for `export_hf` (None for an engine built from a ModelConfig)."""
    layout: ShardedLayout
    """The saved layout (specs, world size, TP degree)."""


def _barrier(sharded: ShardedBuffer) -> None:
    if not sharded.local and sharded.world_size > 1:
        dist.barrier(group=sharded.group)


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (how configs store a dtype)."""
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


def save(path: str | os.PathLike, sharded: ShardedBuffer, optimizer, *, engine_meta: dict) -> None:
    """Write the sharded weights, the optimizer state (`optimizer`: a FlatAdamW or None), this rank's
    RNG states and `engine_meta` (role, model_config, hf_config, engine_config: JSON-ready) to folder
    `path`. Every rank calls it."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    if sharded.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a save that died before its renames
        tmp.mkdir()
    _barrier(sharded)
    state_dict = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        state_dict = {"step": sd["step"], **{k: None if sd[k] is None else [t.detach().cpu().clone() for t in sd[k]]
                                             for k in _STATE_KEYS}}
    cuda = sharded.device.type == "cuda"
    state = dict(weights=[s.detach().cpu().clone() for s in sharded.shard_views()], optimizer=state_dict,
                 rng=dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(sharded.device) if cuda else None))
    with open(tmp / f"rank{sharded.rank}.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _barrier(sharded)
    if sharded.rank == 0:
        meta = dict(format=FORMAT, step=0 if optimizer is None else optimizer.num_steps, **engine_meta,
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
    _barrier(sharded)


def read_meta(path: str | os.PathLike) -> CheckpointMeta:
    """The description of the checkpoint in folder `path`; checks that it is complete."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise ValueError(f"HybridEngine.load: {path} has no meta.json (not a hybridengine checkpoint)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"HybridEngine.load: {path} has format {meta.get('format')!r}, expected {FORMAT}")
    layout = _layout_from_meta(meta["layout"])
    missing = [r for r in range(layout.world_size) if not (path / f"rank{r}.pt").exists()]
    if missing:
        raise ValueError(f"HybridEngine.load: {path} lacks the shards of saved ranks {missing}")
    mc = dict(meta["model_config"])
    mc["rope"] = RopeConfig(**mc["rope"])
    mc["layer_types"] = tuple(mc["layer_types"])
    model_config = ModelConfig(**mc)
    if model_config.value_head:
        model_config = dataclasses.replace(model_config, value_head=False)  # the engine adds the head again
    engine_config = dict(meta["engine_config"])
    engine_config["dtype"] = getattr(torch, engine_config["dtype"])
    return CheckpointMeta(path=path, role=meta["role"], step=meta["step"], model_config=model_config,
                          engine_config=engine_config, hf_config=meta.get("hf_config"), layout=layout)


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
    the two may order a unit's parameters differently (checkpoints from before `param_specs` put each
    unit's matrices first)."""
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


def _own_shards(sharded: ShardedBuffer, naturals: list[torch.Tensor]) -> list[torch.Tensor]:
    shards = []
    for u, natural in enumerate(naturals):
        packed = sharded.pack_unit(u, natural.to(sharded.device))
        start, end = sharded.layout.units[u].shard_range(sharded.rank)
        shards.append(packed[start:end])
    return shards


def restore_(meta: CheckpointMeta, sharded: ShardedBuffer, optimizer: Callable[[], object]) -> None:
    """Fill `sharded` (built for `meta`'s model at this process's world size and any TP degree) with the
    checkpoint's weights, the optimizer that `optimizer()` returns (called only when the checkpoint
    holds optimizer state) with its AdamW state, and this rank's RNG states. A rank that the saving
    run did not have (loading at a larger world size) keeps its own RNG states."""
    saved = meta.layout
    states = [torch.load(meta.path / f"rank{r}.pt", map_location="cpu", weights_only=False)
              for r in range(saved.world_size)]
    layout = sharded.layout
    weights = _own_shards(sharded, _to_layout(saved, _natural_units(saved, [s["weights"] for s in states]), layout))
    for dst, src in zip(sharded.shard_views(), weights):
        dst.copy_(src.to(dst.dtype))
    if states[0]["optimizer"] is not None:
        opt = optimizer()
        opt_state = {"step": states[0]["optimizer"]["step"]}
        for key in _STATE_KEYS:
            if states[0]["optimizer"][key] is None:
                opt_state[key] = None
                continue
            naturals = _to_layout(saved, _natural_units(saved, [s["optimizer"][key] for s in states]), layout)
            opt_state[key] = [t.float() for t in _own_shards(sharded, naturals)]
        if opt.master_weights is False:
            opt_state["master"] = None
        elif opt_state["master"] is None:  # saved without masters (fp32 params): the weights are the masters
            opt_state["master"] = [w.float() for w in weights]
        opt.load_state_dict(opt_state)
    if sharded.rank < len(states):
        rng = states[sharded.rank]["rng"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and sharded.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], sharded.device)


def full_state_dict(sharded: ShardedBuffer) -> dict[str, torch.Tensor]:
    """Every parameter in natural layout (CPU), gathered from all ranks (every rank gets it)."""
    out = {}
    for u, unit in enumerate(sharded.layout.units):
        natural = sharded.gather_unit(u)
        for s in unit.params:
            out[s.name] = sharded.natural_view(natural, s.name).detach().cpu().clone()
    return out


def export_hf(path: str | os.PathLike, sharded: ShardedBuffer, *, hf_config: dict, dtype: torch.dtype) -> None:
    """config.json (`hf_config` with `dtype`) + model.safetensors that transformers'
    AutoModelForCausalLM.from_pretrained loads; every rank calls it, rank 0 writes."""
    from safetensors.torch import save_file

    state = full_state_dict(sharded)
    if sharded.rank != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = dict(hf_config)
    config["torch_dtype"] = config["dtype"] = dtype_name(dtype)
    (path / "config.json").write_text(json.dumps(config, indent=1))
