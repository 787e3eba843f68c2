"""Weights in and out of a `ShardedBuffer` in transformers naming (the engine's parameter names are HF's).

- `unit_tensors(sharded, u, names)`: parameters of unit u, all-gathered from the ranks and unpacked
  to natural layout, as separate tensors. `HybridEngine.state_dict` yields them unit by unit,
  so at most one unit is gathered at a time; `checkpoint.full_state_dict` collects them all.
- `check_weights(items, ...)`: a whole set of named tensors checked against the layout before anything
  is written (names, shapes, floating dtypes, finite values in the buffer's dtype, duplicates, a tied
  LM head equal to its embedding):
  the list of `(parameter name, tensor)` writes; `check_same_writes`: every rank writes the same names.
- `write_weights_(sharded, writes, ...)`: the writes into this rank's part of the buffer, with no
  collective (every rank holds the same full tensors): the training shard of every unit they touch,
  and in the generation state the whole TP slice of it (the generation view). Parameters not written
  keep their bits, also where they share a unit with written ones. Returns, per touched unit, the
  mask of the shard's elements that were written, which `refresh_masters_` uses to set the
  optimizer's fp32 masters of those elements to the new weights (else the next step would write the
  rounded old master back).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from hybridengine import checks
from hybridengine.model.family import family_of
from hybridengine.model.loading import check_hf_piece, check_hf_tensor, check_tied_head
from hybridengine.sharding.switch import ShardedBuffer


def tied_names(model_type: str) -> tuple[str, str]:
    """(LM head, embedding) parameter names of the model family: with tied embeddings the head is the embedding."""
    family = family_of(model_type)
    return family.lm_head_name, family.embed_name


def unit_tensors(sharded: ShardedBuffer, u: int, names: list[str], *, device: torch.device | str | None = None,
                 keep: bool = True) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters `names` of unit u (natural layout, each its own contiguous tensor
    on `device`, default the buffer's). The gather is collective: every rank of the group calls it for
    the same u; `keep=False` takes part in the gather and returns nothing (no copies made)."""
    natural = sharded.gather_unit(u)
    if not keep:
        return []
    device = sharded.device if device is None else torch.device(device)
    with torch.no_grad():
        # a copy each: the gathered buffer may be G itself (N = tg = 1), which training overwrites
        return [(n, sharded.natural_view(natural, n).to(device, copy=True)) for n in names]


def unit_names(layout, order: Mapping[str, int] | None = None) -> list[list[str]]:
    """Per unit, its parameter names sorted by `order` (name -> rank; default the layout's order)."""
    out = []
    for unit in layout.units:
        names = [s.name for s in unit.params]
        out.append(sorted(names, key=lambda n: order.get(n, len(order))) if order is not None else names)
    return out


def check_weights(weights, layout, *, tied: bool, model_type: str, dtype: torch.dtype, strict: bool = True,
                  op: str = "load_weights", config=None) -> list[tuple[str, torch.Tensor]]:
    """`weights` (a mapping or an iterable of (name, tensor) pairs, which this materialises) checked as a
    whole: the (parameter name, tensor) writes, in the layout's order. A ValueError names the first bad
    item: not a (str, tensor) pair, a name given twice, a name that is not a parameter (`strict`; else it
    is skipped), a shape other than the parameter's, a dtype that is not floating, a NaN or inf, or a value
    that becomes inf in `dtype` (a conversion and one host sync per tensor); for tied embeddings
    (`tied`) `lm_head.weight` writes the embedding, and must equal `model.embed_tokens.weight` in `dtype`
    (the buffer's) when both are given. With the model's `config`, a checkpoint tensor that is part of a
    parameter (the family's `hf_piece`: `mlp.experts.<e>.gate_proj.weight`, ...) is placed in it; a stacked
    parameter is written whole, so its pieces must cover it (every expert's gate, up and down)."""
    if isinstance(weights, Mapping):
        weights = weights.items()
    elif isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, Iterable):
        raise ValueError(f"{op}: weights must be a mapping or an iterable of (name, tensor) pairs, got "
                         f"{checks.describe(weights)}")
    shapes = {s.name: s.shape for s in layout.specs}
    where = f"the weights given to {op}"
    given: dict[str, torch.Tensor] = {}
    hf_piece = family_of(model_type).hf_piece
    stacked: dict[str, torch.Tensor] = {}  # parameter -> its value assembled from checkpoint pieces
    filled: dict[str, int] = {}
    piece_names: set[str] = set()
    for i, item in enumerate(weights):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"{op}: item {i} of weights must be a (str, torch.Tensor) pair, got "
                             f"{checks.describe(item)}")
        name, tensor = item
        if name in given or name in piece_names:
            raise ValueError(f"{op}: tensor {name!r} appears twice in weights")
        piece = None if config is None else hf_piece(name, config)
        if piece is not None:
            if piece[0] not in shapes and not strict:
                continue
            if piece[0] in shapes and piece[0] not in stacked:
                stacked[piece[0]] = torch.zeros(shapes[piece[0]], dtype=dtype, device=tensor.device)
            target, view = check_hf_piece(name, tensor, where, piece, stacked, model_type)
            _check_finite(op, name, tensor, dtype)
            view.copy_(tensor)
            filled[target] = filled.get(target, 0) + view.numel()
            piece_names.add(name)
            continue
        if check_hf_tensor(name, tensor, where, shapes, tied=tied, model_type=model_type, strict=strict) is None:
            continue
        if tensor.is_meta:
            raise ValueError(f"{op}: tensor {name!r} is on the meta device (it has no values)")
        _check_finite(op, name, tensor, dtype)
        given[name] = tensor
    for target, value in stacked.items():
        if target in given:
            raise ValueError(f"{op}: tensor {target!r} is given whole and in per-expert pieces")
        if filled[target] != value.numel():
            raise ValueError(f"{op}: the per-expert tensors of {target!r} cover {filled[target]} of its "
                             f"{value.numel()} elements; a stacked parameter is written whole: give every expert's "
                             "gate, up and down weights")
        given[target] = value
    tied_head, embed = tied_names(model_type)
    if tied and tied_head in given:
        head = given.pop(tied_head)
        if embed in given:
            check_tied_head(head, given[embed].to(dtype), where)
        else:
            given[embed] = head  # the tied head is the embedding (as in transformers)
    return [(s.name, given[s.name]) for s in layout.specs if s.name in given]


def _check_finite(op: str, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Every value of `tensor` is finite, also once rounded to `dtype` (what the buffer will hold: an fp32
    1e6 is inf in fp16). A NaN weight spreads to every logit of the next forward."""
    stored = tensor.to(dtype)
    if bool(torch.isfinite(stored).all()):
        return
    bad = ~torch.isfinite(tensor)
    where = tuple(int(i) for i in (bad if bad.any() else ~torch.isfinite(stored)).nonzero()[0])
    value = tensor[where].item()
    overflow = "" if bad.any() else f", which is inf in the engine's {dtype}"
    raise ValueError(f"{op}: tensor {name!r} holds {value} at index {where}{overflow}; every weight must be finite")


@torch.no_grad()
def write_weights_(sharded: ShardedBuffer, writes: list[tuple[str, torch.Tensor]], *,
                   generation: bool) -> dict[int, torch.Tensor | None]:
    """Write checked `writes` (every rank passes the same) into this rank's training shard of each unit
    they touch, and with `generation` into the rank's whole TP slice of it (the generation view, which
    holds the shard). Returns {unit index: bool mask over the rank's shard of the elements written, or
    None when the whole unit was written}."""
    layout, dtype, device = sharded.layout, sharded.gen.data.dtype, sharded.device
    unit_of = {s.name: layout.unit_index[s.unit] for s in layout.specs}
    by_unit: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in writes:
        by_unit.setdefault(unit_of[name], []).append((name, tensor))
    masks: dict[int, torch.Tensor | None] = {}
    for u, items in by_unit.items():
        unit = layout.units[u]
        natural = torch.zeros(unit.natural_numel, dtype=dtype, device=device)
        for name, tensor in items:
            layout.natural_view(natural, name).copy_(tensor)
        packed = sharded.pack_unit(u, natural)
        if generation:
            start = sharded.tp_rank * unit.slice_numel
            dst, src = sharded.gen.unit_slice(u), packed[start:start + unit.slice_numel]
        else:
            start = unit.shard_range(sharded.rank)[0]
            dst, src = sharded.shard_views()[u], packed[start:start + unit.shard_numel]
        if len(items) == len(unit.params):  # the whole unit: padding stays zero in `packed`
            dst.copy_(src)
            masks[u] = None
            continue
        marks = torch.zeros(unit.natural_numel, dtype=dtype, device=device)
        for name, _ in items:
            layout.natural_view(marks, name).fill_(1)
        mask = sharded.pack_unit(u, marks)[start:start + dst.numel()] != 0
        dst.copy_(torch.where(mask, src, dst))
        own = unit.shard_range(sharded.rank)[0] - start  # the shard inside dst (0 in the training state)
        masks[u] = mask[own:own + unit.shard_numel]
    sharded.clear_prefetch()  # a unit gathered ahead would hold the old weights
    return masks


@torch.no_grad()
def refresh_masters_(optimizer, masks: dict[int, torch.Tensor | None]) -> None:
    """Make the optimizer's master weights of the written elements (`write_weights_`'s masks) equal to the
    new weights: an fp32 master becomes the weight's value, a split master's low half zero. Moments and
    the step count stay."""
    if optimizer.offload is not None:
        optimizer.offload.join()  # written wherever the state is now (device or host memory)
    for u, mask in masks.items():
        if optimizer.master is not None:
            master = optimizer.master[u]
            new = optimizer.params[u].to(master.device).float()
            master.copy_(new if mask is None else torch.where(mask.to(master.device), new, master))
        elif optimizer.master_lo is not None:  # the param is the split master's high half already
            lo = optimizer.master_lo[u]
            if mask is None:
                lo.zero_()
            else:
                lo.masked_fill_(mask.to(lo.device), 0)


def check_same_writes(writes: list[tuple[str, torch.Tensor]], group, op: str = "load_weights") -> None:
    """Every rank of `group` (None: alone) writes the same parameters: a ValueError on every rank naming
    the ranks whose names differ from rank 0's (the values are not compared)."""
    if group is None:
        return
    names = [n for n, _ in writes]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, names, group=group)
    differ = [r for r, other in enumerate(everyone) if other != everyone[0]]
    if differ:
        raise ValueError(f"{op}: ranks {differ} pass other parameters than rank 0 (rank 0: {len(everyone[0])}, "
                         f"rank {differ[0]}: {len(everyone[differ[0]])}); every rank must pass the same weights")
