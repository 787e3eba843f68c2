"""A training batch of variable-length sequences (`PPOBatch`) and its split into micro-batches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridengine import checks

_FIELDS = ("response_mask", "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs", "old_values", "returns")
RESERVED_FIELDS = ("mask", "seq_index", "valid", "input_ids", "targets", "num_tokens", "num_sequences",
                   "global_tokens", "global_sequences")
"""Names `HybridEngine.train_step` gives its loss beside the batch's fields (an extra field may not take them)."""


@dataclass(kw_only=True, slots=True)
class PPOBatch:
    """Variable-length sequences (prompt + response) and per-target-token training data.

    `input_ids[b]` has T_b >= 2 tokens; every other field is aligned with the *targets*
    `input_ids[b][1:]` (length T_b - 1): position t is the prediction of token t + 1. Fields are
    stored as 1-D tensors (ids int64, the rest fp32) and moved to the device one micro-batch at a
    time; CPU tensors or lists are the cheap input.
    """

    input_ids: list[torch.Tensor]
    response_mask: list[torch.Tensor] | None = None
    """1 where the target token is trained on (response tokens); None: log_probs only."""
    old_logprobs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    rollout_logprobs: list[torch.Tensor] | None = None
    """The sampler's log-probs of the target tokens (what the rollout drew them with); the rollout
    correction (`PPOConfig.rollout_correction`) weighs old_logprobs against them."""
    old_values: list[torch.Tensor] | None = None
    """Critic: the values at rollout time (for value clipping)."""
    returns: list[torch.Tensor] | None = None
    """Critic: the regression targets (e.g. from `gae`)."""
    extra: dict[str, list[torch.Tensor]] | None = None
    """Further per-target-token tensors for a custom loss (`HybridEngine.train_step`): name -> one 1-D
    tensor per sequence of len(input_ids[b]) - 1 entries, float (stored fp32, finite everywhere), integer
    (int64) or bool. A loss reads them as `fields[name]`, padded to [B, T] like every field; a name may
    not be one of the built-in fields'."""
    groups: list[int] | None = None
    """A group id per sequence: the sequences of one group are consecutive and always share a micro-batch
    (a micro-batch never splits a sequence, nor a group), for losses over several sequences, e.g. the
    chosen/rejected pairs of DPO. None: each sequence is its own group."""

    def __post_init__(self):
        op = "PPOBatch"
        _check_sequences(f"{op}.", self.input_ids)
        ids = []
        for b, t in enumerate(self.input_ids):
            t = _as_tensor(op, f"input_ids[{b}]", t)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{op}.input_ids[{b}] must hold integer token ids, got {t.dtype}")
            if t.dim() > 1:  # flattening would join its rows into one sequence
                raise ValueError(f"{op}.input_ids[{b}] must be one sequence (a 1-D tensor or list of token ids), "
                                 f"got shape {tuple(t.shape)}")
            t = t.to(torch.long).reshape(-1)
            if t.numel() < 2:
                raise ValueError(f"{op}.input_ids[{b}] has {t.numel()} tokens; at least 2 are needed")
            ids.append(t)
        self.input_ids = ids
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{op}.{name} must be a list of per-sequence tensors or None, got "
                                 f"{checks.describe(value)}")
            rows = []
            for b, v in enumerate(value):
                v = _as_tensor(op, f"{name}[{b}]", v)
                if v.is_complex():
                    raise ValueError(f"{op}.{name}[{b}] must hold real numbers, got {v.dtype}")
                rows.append(v.to(torch.float32).reshape(-1))
            setattr(self, name, rows)
        if self.extra is not None:
            if not isinstance(self.extra, dict):
                raise ValueError(f"{op}.extra must be a dict of name -> list of per-sequence tensors, got "
                                 f"{checks.describe(self.extra)}")
            extra = {}
            for name, value in self.extra.items():
                if not isinstance(value, (list, tuple)):
                    raise ValueError(f"{op}.extra[{name!r}] must be a list of per-sequence tensors, got "
                                     f"{checks.describe(value)}")
                rows = []
                for b, v in enumerate(value):
                    v = _as_tensor(op, f"extra[{name!r}][{b}]", v)
                    if v.is_complex():
                        raise ValueError(f"{op}.extra[{name!r}][{b}] must hold real numbers, got {v.dtype}")
                    dtype = torch.float32 if v.is_floating_point() else torch.bool if v.dtype == torch.bool \
                        else torch.int64
                    rows.append(v.to(dtype).reshape(-1) if v.dim() <= 1 else v)  # a 2-D one is rejected below
                extra[name] = rows
            self.extra = extra
        if self.groups is not None:
            if isinstance(self.groups, torch.Tensor):
                self.groups = self.groups.tolist()
            if not isinstance(self.groups, (list, tuple)):
                raise ValueError(f"{op}.groups must be a list of one group id per sequence, got "
                                 f"{checks.describe(self.groups)}")
            self.groups = list(self.groups)
        self.validate()

    def validate(self, vocab_size: int | None = None, *, op: str = "PPOBatch") -> None:
        """Check the batch as it is now (its tensors may have been changed in place since construction):
        every `input_ids[b]` is a 1-D integer tensor of at least 2 ids, in [0, vocab_size) when given;
        every field has one entry per target token; `response_mask` holds only 0 and 1; every float
        field is finite everywhere, masked positions included (a NaN there still reaches the loss and
        the gradient: 0 * NaN = NaN). Raises ValueError naming the field and its first bad entry.

        One reduction per field over the concatenated sequences (and one host sync); the bad entry is
        searched for only on failure. The trainer calls it before a step's first collective."""
        where = "PPOBatch." if op == "PPOBatch" else f"{op}: batch."
        ids = self.input_ids
        _check_sequences(where, ids)
        for b, t in enumerate(ids):
            if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex()
                    or t.dtype == torch.bool):
                raise ValueError(f"{where}input_ids[{b}] must be a 1-D integer tensor of token ids, got "
                                 f"{checks.describe(t)}")
            if t.numel() < 2:
                raise ValueError(f"{where}input_ids[{b}] has {t.numel()} tokens; at least 2 are needed")
        lengths = [int(t.numel()) for t in ids]
        if vocab_size is not None:
            checks.number(op, "vocab_size", vocab_size, low=1, integer=True)
            flat = torch.cat(ids)
            low, high = torch.stack(torch.aminmax(flat)).tolist()
            if low < 0 or high >= vocab_size:
                b, t, value = _first(flat, (flat < 0) | (flat >= vocab_size), lengths, 0)
                raise ValueError(f"{where}input_ids[{b}][{t}] is token id {value}, outside the vocabulary "
                                 f"[0, {vocab_size})")
        for name in _FIELDS:
            rows = getattr(self, name)
            if rows is None:
                continue
            if not isinstance(rows, (list, tuple)):
                raise ValueError(f"{where}{name} must be a list of per-sequence tensors or None, got "
                                 f"{checks.describe(rows)}")
            if len(rows) != len(ids):
                raise ValueError(f"{where}{name} has {len(rows)} sequences, input_ids has {len(ids)}")
            for b, (v, n) in enumerate(zip(rows, lengths)):
                if not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.is_floating_point():
                    raise ValueError(f"{where}{name}[{b}] must be a 1-D float tensor, got {checks.describe(v)}")
                if v.numel() != n - 1:
                    raise ValueError(f"{where}{name}[{b}] has {v.numel()} entries; expected len(input_ids[{b}]) - 1 "
                                     f"= {n - 1} (one per target token)")
            flat = torch.cat(rows)
            if name == "response_mask":
                bad = (flat != 0) & (flat != 1)  # NaN too
                if bad.any():
                    b, t, value = _first(flat, bad, lengths, 1)
                    raise ValueError(f"{where}response_mask must hold only 0 and 1; response_mask[{b}][{t}] is "
                                     f"{value}")
                continue
            low, high = torch.stack(torch.aminmax(flat)).tolist()  # a NaN propagates to both
            if not (math.isfinite(low) and math.isfinite(high)):
                b, t, value = _first(flat, ~torch.isfinite(flat), lengths, 1)
                raise ValueError(f"{where}{name}[{b}][{t}] is {value}; every entry must be finite, masked "
                                 "positions included")
        self._validate_extra(where, lengths)
        self._validate_groups(where, len(ids))

    def _validate_extra(self, where: str, lengths: list[int]) -> None:
        if self.extra is None:
            return
        if not isinstance(self.extra, dict):
            raise ValueError(f"{where}extra must be a dict of name -> list of per-sequence tensors, got "
                             f"{checks.describe(self.extra)}")
        for name, rows in self.extra.items():
            label = f"extra[{name!r}]"
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"{where}extra has the key {name!r}; names must be identifiers")
            if name in _FIELDS or name in RESERVED_FIELDS:
                raise ValueError(f"{where}{label} clashes with a built-in field of the same name; rename it")
            if not isinstance(rows, (list, tuple)):
                raise ValueError(f"{where}{label} must be a list of per-sequence tensors, got {checks.describe(rows)}")
            if len(rows) != len(lengths):
                raise ValueError(f"{where}{label} has {len(rows)} sequences, input_ids has {len(lengths)}")
            kinds = set()
            for b, (v, n) in enumerate(zip(rows, lengths)):
                if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.is_complex():
                    raise ValueError(f"{where}{label}[{b}] must be a 1-D tensor (one entry per target token), got "
                                     f"{checks.describe(v)}")
                if v.numel() != n - 1:
                    raise ValueError(f"{where}{label}[{b}] has {v.numel()} entries; expected len(input_ids[{b}]) - 1 "
                                     f"= {n - 1} (one per target token)")
                kinds.add(v.dtype)
            if len(kinds) > 1:
                raise ValueError(f"{where}{label} mixes dtypes {sorted(map(str, kinds))}; one dtype per field")
            flat = torch.cat(list(rows))
            if flat.is_floating_point() and flat.numel():
                low, high = torch.stack(torch.aminmax(flat.float())).tolist()
                if not (math.isfinite(low) and math.isfinite(high)):
                    b, t, value = _first(flat, ~torch.isfinite(flat), lengths, 1)
                    raise ValueError(f"{where}{label}[{b}][{t}] is {value}; every entry must be finite, masked "
                                     "positions included")

    def _validate_groups(self, where: str, num: int) -> None:
        groups = self.groups
        if groups is None:
            return
        if not isinstance(groups, (list, tuple)) or len(groups) != num:
            raise ValueError(f"{where}groups must hold one group id per sequence ({num}), got "
                             f"{checks.describe(groups)}")
        seen = set()
        for b, g in enumerate(groups):
            if isinstance(g, bool) or not isinstance(g, int):
                raise ValueError(f"{where}groups[{b}] must be an int group id, got {g!r}")
            if b and g != groups[b - 1]:
                if g in seen:
                    raise ValueError(f"{where}groups[{b}] = {g} returns to a group seen before: the sequences of "
                                     "one group must be consecutive")
                seen.add(groups[b - 1])

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.input_ids]

    def padded(self, name: str, rows: list[int], width: int, device) -> torch.Tensor:
        """Field `name` (a built-in field, or a key of `extra`) of sequences `rows` as [len(rows), width]
        (zero padding; an extra field keeps its dtype)."""
        values = self.extra[name] if name not in _FIELDS else getattr(self, name)
        dtype = torch.float32 if name in _FIELDS else values[0].dtype
        out = torch.zeros(len(rows), width, dtype=dtype)
        for i, b in enumerate(rows):
            v = values[b]
            out[i, :v.numel()] = v
        return out.to(device)


def _first(flat: torch.Tensor, bad: torch.Tensor, lengths: list[int], shift: int) -> tuple[int, int, object]:
    """(sequence, position, value) of the first True of `bad` over the concatenated rows of a field
    whose row b has lengths[b] - shift entries."""
    i = int(bad.nonzero()[0, 0])
    value = flat[i].item()
    for b, n in enumerate(lengths):
        if i < n - shift:
            return b, i, value
        i -= n - shift
    raise AssertionError("index past the batch")


def _check_sequences(where: str, ids) -> None:
    """input_ids is a non-empty list of sequences; a 2-D tensor is not (its rows share one length: padding would
    be trained on as tokens)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{where}input_ids must be a list of at least one sequence (each a 1-D tensor or list of "
                         f"token ids), got {checks.describe(ids)}")


def _as_tensor(op: str, name: str, x) -> torch.Tensor:
    """x (a tensor or a list of numbers) as a tensor."""
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{op}.{name} must be a tensor or a list of numbers, got {checks.describe(x)}") from None


def micro_batches(lengths: list[int], max_tokens: int, groups: list[int] | None = None) -> list[list[int]]:
    """Consecutive groups of whole sequences of at most max_tokens tokens (a longer sequence, or group of
    `groups`, goes alone); a sequence is never split, nor a group."""
    out, current, tokens = [], [], 0
    for unit in _units_of(list(range(len(lengths))), groups):
        n = sum(lengths[b] for b in unit)
        if current and tokens + n > max_tokens:
            out.append(current)
            current, tokens = [], 0
        current.extend(unit)
        tokens += n
    out.append(current)
    return out


def plan_micro_batches(lengths: list[int], max_tokens: int, group, groups: list[int] | None = None
                       ) -> list[list[int]]:
    """Micro-batches, the same number on every rank (each one gathers and reduce-scatters every unit,
    so ranks must agree): a rank with fewer splits its largest micro-batches between whole sequences
    (or whole groups of `groups`), then pads with empty ones (an empty micro-batch runs a masked dummy
    sequence that contributes nothing)."""
    out = micro_batches(lengths, max_tokens, groups)
    if group is None or dist.get_world_size(group) == 1:
        return out
    count = torch.tensor([len(out)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    target = int(count.item())
    while len(out) < target:
        units = {id(m): _units_of(m, groups) for m in out}
        splittable = [m for m in out if len(units[id(m)]) > 1]
        if not splittable:
            out.append([])
            continue
        big = max(splittable, key=lambda m: sum(lengths[b] for b in m))
        i = out.index(big)
        parts = units[id(big)]
        half = [b for unit in parts[:len(parts) // 2] for b in unit]
        out[i:i + 1] = [half, big[len(half):]]
    return out


def _units_of(rows: list[int], groups: list[int] | None) -> list[list[int]]:
    """The runs of `rows` (consecutive sequence indices) that stay together."""
    if groups is None:
        return [[b] for b in rows]
    units = []
    for b in rows:
        if units and groups[b] == groups[units[-1][-1]]:
            units[-1].append(b)
        else:
            units.append([b])
    return units
