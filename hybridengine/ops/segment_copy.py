"""The fused resharding copy: dst[d:d+n] = src[s:s+n] for every row (s, d, n) of a segment table.

Three layers, as for every op: `segment_copy_ref` (plain torch, the reference), the C++/CUDA op
`torch.ops.hybridengine.segment_copy` (CPU: validates the table then memcpy per row; CUDA: one
launch for all rows, 16-byte vectors where aligned), and `segment_copy`, which checks its arguments
and hands them to `launch_segment_copy`, which picks one (callers that built the arguments
themselves call it directly).

Device tables come from `prepare_table`, which validates once on the host (bounds, overlapping
destinations) and splits long rows so one launch spreads over the whole GPU.
"""

from __future__ import annotations

import torch

from hybridengine.checks import describe
from hybridengine.ops._ext import extension_has, warn_once

MAX_SEGMENT_BYTES = 32 * 1024
"""Rows longer than this are split: one CUDA warp per row, so a 4 GiB copy runs as 128k warps."""


def _check_args(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"segment_copy: {name} must be a contiguous 1-D tensor, got {describe(t)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"segment_copy: dtype mismatch, src is {src.dtype} and dst is {dst.dtype}")
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"segment_copy: table must be an int64 tensor [S, 3], got {describe(table)}")
    if src.device != dst.device or table.device != src.device:
        raise ValueError(f"segment_copy: src ({src.device}), dst ({dst.device}) and table ({table.device}) "
                         "must be on one device")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"segment_copy: table must be int64 [S, 3] (src, dst, numel) rows, got "
                         f"{table.dtype} {tuple(table.shape)}")


def validate_table(table: torch.Tensor, src_numel: int, dst_numel: int) -> None:
    """Raise ValueError unless every row is in bounds and no two destinations overlap."""
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"table must be int64 [S, 3] (src, dst, numel) rows, got {table.dtype} {tuple(table.shape)}")
    if table.numel() == 0:
        return
    t = table.cpu()
    s, d, n = t.unbind(1)
    bad = (s < 0) | (d < 0) | (n < 0)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"table row {i} = {t[i].tolist()} has a negative entry")
    for name, start, limit in (("src", s, src_numel), ("dst", d, dst_numel)):
        over = start + n > limit
        if over.any():
            i = int(over.nonzero()[0])
            raise ValueError(f"table row {i} = {t[i].tolist()} is out of range for {name} "
                             f"({name} has {limit} elements)")
    live = (n > 0).nonzero().squeeze(1)
    order = live[torch.argsort(d[live], stable=True)]
    ends, starts = (d + n)[order[:-1]], d[order[1:]]
    clash = ends > starts
    if clash.any():
        k = int(clash.nonzero()[0])
        a, b = int(order[k]), int(order[k + 1])
        raise ValueError(f"table rows {a} and {b} write overlapping destinations "
                         f"{t[a].tolist()} and {t[b].tolist()}")


def split_rows(table: torch.Tensor, max_numel: int) -> torch.Tensor:
    """Split every row longer than max_numel into consecutive rows of at most max_numel."""
    if max_numel < 1:
        raise ValueError(f"max_numel must be >= 1, got {max_numel}")
    if table.numel() == 0:
        return table.reshape(0, 3)
    s, d, n = table.unbind(1)
    pieces = torch.clamp((n + max_numel - 1) // max_numel, min=1)
    row = torch.repeat_interleave(torch.arange(len(table)), pieces)
    first = torch.cumsum(pieces, 0) - pieces
    k = torch.arange(len(row)) - first[row]
    off = k * max_numel
    return torch.stack([s[row] + off, d[row] + off, torch.clamp(n[row] - off, max=max_numel)], 1).contiguous()


def prepare_table(table: torch.Tensor, element_size: int, *, src_numel: int, dst_numel: int,
                  device: torch.device | str = "cpu", max_bytes: int = MAX_SEGMENT_BYTES) -> torch.Tensor:
    """Validate a host table once, split long rows (16-byte multiples), and move it to `device`."""
    validate_table(table, src_numel, dst_numel)
    if max_bytes % 16 or max_bytes < 16:
        raise ValueError(f"max_bytes must be a positive multiple of 16, got {max_bytes}")
    return split_rows(table.cpu(), max(1, max_bytes // element_size)).to(device)


def segment_copy_ref(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """Plain-torch reference: one slice assignment per row."""
    _check_args(src, dst, table)
    validate_table(table, src.numel(), dst.numel())
    for s, d, n in table.tolist():
        dst[d:d + n] = src[s:s + n]


def segment_copy(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, *, max_blocks: int = 0) -> None:
    """dst[d:d+n] = src[s:s+n] for every row of table, in place, with the fastest available op.

    `max_blocks` > 0 bounds the CUDA grid (blocks stride over the rows), so a copy running beside an
    NCCL collective leaves SMs to it; 0 (default): one block per 8 rows. No effect on CPU."""
    _check_args(src, dst, table)
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0:
        raise ValueError(f"segment_copy: max_blocks must be an int >= 0 (0: no bound), got {max_blocks!r}")
    launch_segment_copy(src, dst, table, max_blocks)


def launch_segment_copy(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, max_blocks: int = 0) -> None:
    """`segment_copy` for callers that built the arguments themselves (the sharded buffer's pack and
    unpack, several per training step, with tables from `prepare_table`): asserts instead of checks."""
    assert src.dim() == 1 and dst.dim() == 1 and src.dtype == dst.dtype and src.device == dst.device == table.device
    if extension_has("segment_copy", src.device.type):
        torch.ops.hybridengine.segment_copy(src, dst, table, max_blocks)
        return
    warn_once(f"segment_copy: no {src.device.type} implementation in hybridengine._C; running the torch reference")
    segment_copy_ref(src, dst, table)
