"""Checkpoints of a sharded model and its optimizer: sharded save/restore (any world size on load), HF export.

Format (a folder): `meta.json` (model and engine config, the saved layout: specs, world size, TP
degree, alignment, step; a save id; the size and sha256 of every rank file; its own sha256) and
`rank{r}.pt` per saving rank (the save id, its weight shard and AdamW state per unit, its RNG
states: torch CPU, CUDA, the sampler's).

A save writes into the sibling folder `.{name}.tmp`: every rank its rank file, then rank 0
`meta.json` (through a rename, so it is whole or absent), which marks the folder complete. The
complete folder then replaces `path`: the old one is renamed to `.{name}.old`, the new one to
`path`, and the old one deleted. Whenever the process dies, a complete checkpoint is at `path` or,
between the two renames, at `.{name}.tmp` (the new one) and `.{name}.old` (the previous one);
`read_meta` and the next `save` take the newest complete one (the new before the old) and say so
in a warning. A save replaces only what a save writes: `path` and its two siblings must be absent,
empty folders, or folders holding only a checkpoint's files.

Loading at another world size or TP degree: each unit is rebuilt in natural layout from the saved
shards (the saved layout is recomputed from the saved specs), then packed in the new layout, and
each rank keeps its new shard. Every loading rank reads (and checks) every saved shard: simple and
exact, at the cost of one full model in host memory per rank during the load.

This module knows the sharded buffer and the optimizer, not the engine: the engine describes itself
(`engine_meta` of `save`), builds itself from `read_meta`'s answer and has `restore_` fill it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hybridengine.model.config import ModelConfig, RopeConfig
from hybridengine.ops import segment_copy
from hybridengine.sharding.layout import ParamSpec, ShardedLayout
from hybridengine.sharding.switch import ShardedBuffer
from hybridengine.sharding.weights import unit_names, unit_tensors

FORMAT = 2
"""1: before checksums, save ids and the sampler's RNG state (still read, unverified, with a warning)."""
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")
_OWN_FILE = re.compile(r"rank\d+\.pt|meta\.json(\.tmp)?")
"""The names a save writes into a checkpoint folder: what it may delete."""


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointMeta:
    """What `read_meta` finds in a checkpoint folder: enough to build the engine that `restore_` fills."""

    path: Path
    """The folder read: the one asked for, or its complete sibling after an interrupted save."""
    role: str
    """'actor' or 'critic'."""
    step: int
    """Optimizer steps taken when it was saved."""
    policy_version: int
    """`HybridEngine.policy_version` when it was saved: `step` plus the steps of optimizers dropped by
    `reset_optimizer` (`step` in a checkpoint that does not record it)."""
    model_config: ModelConfig
    """The backbone's config (a critic's value head is added again by the engine)."""
    engine_config: dict
    """The saving engine's config fields (dtype as a torch.dtype; device as it was saved)."""
    hf_config: dict | None
    """The transformers config, for `export_hf` (None for an engine built from a ModelConfig)."""
    layout: ShardedLayout
    """The saved layout (specs, world size, TP degree)."""
    save_id: str | None
    """The id written into meta.json and every rank file (None: format 1)."""
    files: dict | None
    """Per rank file, {"bytes": size, "sha256": hex digest} (None: format 1, nothing to verify)."""


def _group_size(sharded: ShardedBuffer) -> int:
    return 1 if sharded.local else sharded.world_size


def _on_rank0(sharded: ShardedBuffer, fn: Callable[[], object]) -> object:
    """fn() on rank 0; its result on every rank, or its exception raised on every rank (rank 0's own;
    on the others a copy, or a RuntimeError with its words when it does not pickle)."""
    out, error = [None, None], None
    if sharded.rank == 0:
        try:
            out[0] = fn()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
            try:
                out[1] = pickle.loads(pickle.dumps(e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle must still reach the peers
                out[1] = RuntimeError(f"rank 0: {type(e).__name__}: {e}")
    if _group_size(sharded) > 1:
        dist.broadcast_object_list(out, src=dist.get_global_rank(sharded.group, 0), group=sharded.group)
    if error is not None:
        raise error
    if out[1] is not None:
        raise out[1]
    return out[0]


def _all_gather(sharded: ShardedBuffer, obj) -> list:
    if _group_size(sharded) == 1:
        return [obj]
    everyone = [None] * sharded.world_size
    dist.all_gather_object(everyone, obj, group=sharded.group)
    return everyone


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


# -- where a checkpoint lives ------------------------------------------------------------------------

def checked_path(path, op: str) -> Path:
    """`path` as a Path when it can name a checkpoint folder; a ValueError naming `op` when not."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise ValueError(f"{op}: path must be a str or os.PathLike naming a folder, got {type(path).__name__}")
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"{op}: path is empty; it must name a folder")
    checked = Path(text)
    if checked.name in ("", ".", ".."):
        raise ValueError(f"{op}: path {text!r} must end in a folder name of its own, not '.', '..' or '/'")
    return checked


def _siblings(path: Path) -> tuple[Path, Path]:
    """The folders a save writes beside `path`: the new checkpoint, then the one it replaces."""
    return path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"


def _foreign(path: Path) -> str | None:
    """What at `path` a save did not write, in words (None: nothing there, or a checkpoint's files only)."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "a file"
    others = sorted(e.name for e in os.scandir(path) if not (_OWN_FILE.fullmatch(e.name)
                                                              and e.is_file(follow_symlinks=False)))
    if not others:
        return None
    more = f" and {len(others) - 5} more" if len(others) > 5 else ""
    return f"a folder with entries that are not a checkpoint's: {', '.join(others[:5])}{more}"


def _rmtree(path: Path) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    """Make the renames in folder `path` durable (a rename is in the folder, not in the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(data: bytes | Path) -> str:
    digest = hashlib.sha256()
    if isinstance(data, Path):
        with open(data, "rb") as f:
            while chunk := f.read(1 << 24):  # hashlib.file_digest is Python 3.11+
                digest.update(chunk)
    else:
        digest.update(data)
    return digest.hexdigest()


def _meta_digest(meta: dict) -> str:
    """meta.json's own checksum: of its fields but this one, in a canonical order."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return _sha256(json.dumps(body, sort_keys=True).encode())


def _parse_meta(folder: Path) -> dict:
    """meta.json of `folder`, parsed and self-checked: a ValueError naming the file says what is wrong."""
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"HybridEngine.load: {folder} has no meta.json (not a hybridengine checkpoint)")
    try:
        meta = json.loads(meta_file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"HybridEngine.load: {meta_file} is damaged: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"HybridEngine.load: {meta_file} is damaged: a JSON {type(meta).__name__}, not an object")
    if meta.get("format") not in (1, FORMAT):
        raise ValueError(f"HybridEngine.load: {meta_file} has format {meta.get('format')!r}, expected {FORMAT}")
    if meta["format"] > 1 and meta.get("meta_sha256") != _meta_digest(meta):
        raise ValueError(f"HybridEngine.load: {meta_file} is damaged: its checksum does not match its contents")
    return meta


def _rank_files(meta: dict) -> list[str]:
    return [f"rank{r}.pt" for r in range(meta["layout"]["world_size"])]


def _is_complete(folder: Path) -> bool:
    """Whether `folder` holds a whole checkpoint: meta.json (written last) sound, every rank file there at
    its recorded size. The checksums are read by `restore_`, not here (reading every byte to choose)."""
    try:
        meta = _parse_meta(folder)
        files = meta.get("files") or {name: None for name in _rank_files(meta)}
        return all((folder / name).is_file() and (entry is None or (folder / name).stat().st_size == entry["bytes"])
                   for name, entry in files.items())
    except (ValueError, KeyError, TypeError, OSError):
        return False


def _complete_sibling(path: Path) -> Path | None:
    """When `path` holds no complete checkpoint, the newest complete one a save left beside it."""
    if _is_complete(path):
        return None
    return next((s for s in _siblings(path) if _is_complete(s)), None)  # the new one, then the one it replaces


# -- save --------------------------------------------------------------------------------------------

def _begin(path: Path) -> str:
    """Rank 0, before anything is written: refuse what a save did not write, restore the complete
    checkpoint of an interrupted save to `path`, clear the siblings, create the new checkpoint's folder.
    Returns the save id."""
    tmp, old = _siblings(path)
    if os.path.lexists(path.parent) and not path.parent.is_dir():
        raise ValueError(f"HybridEngine.save: {path.parent} (the parent of {path}) is not a folder")
    for p, role in ((path, ""), (tmp, f" (where a save of {path} writes the new checkpoint)"),
                    (old, f" (where a save of {path} moves the checkpoint it replaces)")):
        what = _foreign(p)
        if what is not None:
            raise FileExistsError(f"HybridEngine.save: {p}{role} holds {what}; save replaces only a hybridengine "
                                  f"checkpoint (or an empty folder), so it leaves it alone: remove it or choose "
                                  f"another path")
    found = _complete_sibling(path)
    if found is not None:  # an earlier save died between its renames: keep its checkpoint until this one is whole
        warnings.warn(f"HybridEngine.save: {path} holds no complete checkpoint (an earlier save was interrupted); "
                      f"moving the complete one at {found} there first", stacklevel=6)
        _rmtree(path)
        os.replace(found, path)
        _fsync_dir(path.parent)
    _rmtree(tmp)  # leftovers of an interrupted save: incomplete, or older than `path`
    _rmtree(old)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True)
    tmp.mkdir()
    return uuid.uuid4().hex


def _write_rank_file(file: Path, state: dict) -> dict:
    with open(file, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return dict(bytes=file.stat().st_size, sha256=_sha256(file))


def _commit(path: Path, meta: dict) -> None:
    """Rank 0, once every rank file is written: meta.json (the complete marker), then the swap. An error
    before the swap puts everything back as it was and removes the new folder."""
    tmp, old = _siblings(path)
    meta["meta_sha256"] = _meta_digest(meta)
    try:
        part = tmp / "meta.json.tmp"
        with open(part, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / "meta.json")
        _fsync_dir(tmp)
        if os.path.lexists(path):
            os.replace(path, old)
        os.replace(tmp, path)  # the checkpoint switches here, all at once
    except Exception:
        if not os.path.lexists(path) and os.path.lexists(old):
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:  # the new checkpoint is in place: what fails from here on is worth a warning, not a failed save
        _fsync_dir(path.parent)
    except OSError as e:
        warnings.warn(f"HybridEngine.save: {path} is saved, but its folder could not be synced: {e!r}", stacklevel=6)
    try:
        _rmtree(old)
    except OSError as e:
        warnings.warn(f"HybridEngine.save: {path} is saved, but {old} could not be removed: {e!r} (the next save "
                      f"removes it)", stacklevel=6)


def save(path: str | os.PathLike, sharded: ShardedBuffer, optimizer, *, engine_meta: dict,
         sampler_rng: random.Random | None = None) -> None:
    """Write the sharded weights, the optimizer state (`optimizer`: a FlatAdamW or None), this rank's
    RNG states (torch's and `sampler_rng`'s) and `engine_meta` (role, model_config, hf_config,
    engine_config: JSON-ready) to folder `path`, replacing the checkpoint there. Every rank calls it;
    an error on any rank raises on every rank and leaves `path` as it was, with no temporary folder."""
    path = checked_path(path, "HybridEngine.save")
    save_id = _on_rank0(sharded, lambda: _begin(path))
    tmp = _siblings(path)[0]
    try:
        state_dict = None
        if optimizer is not None:
            sd = optimizer.state_dict()
            state_dict = {"step": sd["step"], **{k: None if sd[k] is None else [t.detach().cpu().clone() for t in sd[k]]
                                                 for k in _STATE_KEYS}}
        cuda = sharded.device.type == "cuda"
        rng = dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(sharded.device) if cuda else None,
                   sampler=None if sampler_rng is None else sampler_rng.getstate())
        state = dict(save_id=save_id, weights=[s.detach().cpu().clone() for s in sharded.shard_views()],
                     optimizer=state_dict, rng=rng)
        written, error = _write_rank_file(tmp / f"rank{sharded.rank}.pt", state), None
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        written, error = f"{type(e).__name__}: {e}", e
    everyone = _all_gather(sharded, written)
    failed = {r: w for r, w in enumerate(everyone) if isinstance(w, str)}
    if failed:
        if sharded.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(f"HybridEngine.save: {path} not written: ranks {sorted(failed)} failed to write their "
                           f"files ({'; '.join(f'rank {r}: {e}' for r, e in failed.items())})")
    meta = dict(format=FORMAT, save_id=save_id, step=0 if optimizer is None else optimizer.num_steps, **engine_meta,
                layout=_layout_meta(sharded.layout), files={f"rank{r}.pt": w for r, w in enumerate(everyone)})
    _on_rank0(sharded, lambda: _commit(path, meta))


# -- load --------------------------------------------------------------------------------------------

def read_meta(path: str | os.PathLike) -> CheckpointMeta:
    """The description of the checkpoint in folder `path` (or, after a save that died between its
    renames, of the complete one beside it, with a warning); checks that meta.json is sound and that
    every rank file is there at its recorded size."""
    path = checked_path(path, "HybridEngine.load")
    found = _complete_sibling(path)
    if found is not None:
        warnings.warn(f"HybridEngine.load: {path} holds no complete checkpoint (a save was interrupted); loading "
                      f"the newest complete one, {found}", stacklevel=3)
        path = found
    meta = _parse_meta(path)
    meta_file = path / "meta.json"
    try:
        layout = _layout_from_meta(meta["layout"])
        files = meta.get("files")
        missing = [r for r, name in enumerate(_rank_files(meta)) if not (path / name).is_file()]
        if missing:
            raise ValueError(f"HybridEngine.load: {path} lacks the shards of saved ranks {missing}")
        if files is None:
            warnings.warn(f"HybridEngine.load: {path} has format 1 (written before checkpoints carried checksums): "
                          f"its files are not verified", stacklevel=3)
        else:
            if sorted(files) != sorted(_rank_files(meta)):
                raise ValueError(f"HybridEngine.load: {meta_file} is damaged: it records files {sorted(files)} for "
                                 f"{layout.world_size} saved ranks")
            for name, entry in files.items():
                size = (path / name).stat().st_size
                if size != entry["bytes"]:
                    _mismatch(path / name, meta, f"it has {size} bytes, meta.json records {entry['bytes']}")
        mc = dict(meta["model_config"])
        mc["rope"] = RopeConfig(**mc["rope"])
        mc["layer_types"] = tuple(mc["layer_types"])
        model_config = ModelConfig(**mc)
        engine_config = dict(meta["engine_config"])
        engine_config["dtype"] = getattr(torch, engine_config["dtype"])
        role, step = meta["role"], meta["step"]
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"HybridEngine.load: {meta_file} is damaged: {type(e).__name__}: {e}") from None
    if model_config.value_head:
        model_config = dataclasses.replace(model_config, value_head=False)  # the engine adds the head again
    return CheckpointMeta(path=path, role=role, step=step, policy_version=meta.get("policy_version", step),
                          model_config=model_config, engine_config=engine_config,
                          hf_config=meta.get("hf_config"), layout=layout, save_id=meta.get("save_id"), files=files)


def _mismatch(file: Path, meta: dict | CheckpointMeta, what: str):
    """Raise the error for a rank file that is not the one meta.json records: from another save (its save
    id says so, when it still loads), or damaged."""
    save_id = meta.save_id if isinstance(meta, CheckpointMeta) else meta.get("save_id")
    try:
        other = torch.load(file, map_location="cpu", weights_only=True).get("save_id")
    except Exception:  # noqa: BLE001 - a damaged file does not load: that is the answer
        other = None
    if other is not None and other != save_id:
        raise ValueError(f"HybridEngine.load: {file} is from another save (save id {other}; meta.json's is "
                         f"{save_id}): {what}")
    raise ValueError(f"HybridEngine.load: {file} is damaged or truncated: {what}")


def _load_rank_file(meta: CheckpointMeta, name: str) -> dict:
    """A rank file, checked against meta.json's checksum and save id."""
    file = meta.path / name
    data = file.read_bytes()
    if meta.files is not None:
        expected = meta.files[name]["sha256"]
        digest = _sha256(data)
        if digest != expected:
            _mismatch(file, meta, f"checksum mismatch (sha256 {digest}, meta.json records {expected})")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - only a format-1 file gets here unverified
        raise ValueError(f"HybridEngine.load: {file} is damaged: {type(e).__name__}: {e}") from None
    if state.get("save_id") != meta.save_id:
        raise ValueError(f"HybridEngine.load: {file} is from another save (save id {state.get('save_id')}; "
                         f"meta.json's is {meta.save_id})")
    return state


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


def restore_(meta: CheckpointMeta, sharded: ShardedBuffer, optimizer: Callable[[], object], *,
             sampler_rng: random.Random | None = None) -> None:
    """Fill `sharded` (built for `meta`'s model at this process's world size and any TP degree) with the
    checkpoint's weights, the optimizer that `optimizer()` returns (called only when the checkpoint
    holds optimizer state) with its AdamW state, and this rank's RNG states. A rank that the saving
    run did not have (loading at a larger world size) keeps its own torch RNG states. `sampler_rng`
    gets this rank's saved sampler state when the world size and TP degree are the saved ones, else
    saved rank 0's on every rank: the ranks of a TP group sample with one key, and another TP degree
    regroups the ranks (the same holds at construction, where every rank's is seeded alike)."""
    saved = meta.layout
    states = [_load_rank_file(meta, f"rank{r}.pt") for r in range(saved.world_size)]
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
    same_groups = (saved.world_size, saved.tp_size) == (sharded.world_size, layout.tp_size)
    sampler_state = states[sharded.rank if same_groups else 0]["rng"].get("sampler")
    if sampler_rng is not None and sampler_state is not None:
        sampler_rng.setstate(sampler_state)


def full_state_dict(sharded: ShardedBuffer) -> dict[str, torch.Tensor]:
    """Every parameter in natural layout (CPU), gathered from all ranks (every rank gets it)."""
    return {name: t for u, names in enumerate(unit_names(sharded.layout))
            for name, t in unit_tensors(sharded, u, names, device="cpu")}


def export_hf(path: str | os.PathLike, sharded: ShardedBuffer, *, hf_config: dict, dtype: torch.dtype) -> None:
    """config.json (`hf_config` with `dtype`) + model.safetensors that transformers'
    AutoModelForCausalLM.from_pretrained loads, in the names save_pretrained writes (a stacked expert parameter
    as its per-expert tensors: `ModelFamily.hf_split`); every rank calls it, rank 0 writes."""
    from safetensors.torch import save_file

    from hybridengine.model.family import family_of

    state = full_state_dict(sharded)
    if sharded.rank != 0:
        return
    split = family_of(hf_config["model_type"]).hf_split
    tensors = {}
    for name, tensor in state.items():
        pieces = split(name, tensor)
        # a clone each: safetensors refuses tensors that share storage
        tensors.update({name: tensor} if pieces is None else {n: t.clone() for n, t in pieces})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = dict(hf_config)
    config["torch_dtype"] = config["dtype"] = dtype_name(dtype)
    (path / "config.json").write_text(json.dumps(config, indent=1))
