"""A training batch of variable-length sequences (`PPOBatch`) and its split into micro-batches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridengine import checks

_FIELDS = ("response_mask", "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs", "old_values", "returns")


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

    def __post_init__(self):
        op = "PPOBatch"
        if not isinstance(self.input_ids, (list, tuple)) or not self.input_ids:
            raise ValueError(f"{op}.input_ids must hold at least one sequence, got {checks.describe(self.input_ids)}")
        ids = []
        for b, t in enumerate(self.input_ids):
            t = _as_tensor(op, f"input_ids[{b}]", t)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{op}.input_ids[{b}] must hold integer token ids, got {t.dtype}")
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
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"{where}input_ids must hold at least one sequence, got {checks.describe(ids)}")
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

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.input_ids]

    def padded(self, name: str, rows: list[int], width: int, device) -> torch.Tensor:
        """Field `name` of sequences `rows` as [len(rows), width] (zero padding)."""
        out = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, b in enumerate(rows):
            v = getattr(self, name)[b]
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


def _as_tensor(op: str, name: str, x) -> torch.Tensor:
    """x (a tensor or a list of numbers) as a tensor."""
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{op}.{name} must be a tensor or a list of numbers, got {checks.describe(x)}") from None


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequences of at most max_tokens tokens (a longer sequence goes alone)."""
    groups, current, tokens = [], [], 0
    for b, n in enumerate(lengths):
        if current and tokens + n > max_tokens:
            groups.append(current)
            current, tokens = [], 0
        current.append(b)
        tokens += n
    groups.append(current)
    return groups


def plan_micro_batches(lengths: list[int], max_tokens: int, group) -> list[list[int]]:
    """Micro-batches, the same number on every rank (each one gathers and reduce-scatters every unit,
    so ranks must agree): a rank with fewer splits its largest groups, then pads with empty ones
    (an empty micro-batch runs a masked dummy sequence that contributes nothing)."""
    groups = micro_batches(lengths, max_tokens)
    if group is None or dist.get_world_size(group) == 1:
        return groups
    count = torch.tensor([len(groups)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    target = int(count.item())
    while len(groups) < target:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups.append([])
            continue
        big = max(splittable, key=lambda g: sum(lengths[b] for b in g))
        i = groups.index(big)
        groups[i:i + 1] = [big[:len(big) // 2], big[len(big) // 2:]]
    return groups
