"""Strided copies by 2-D runs: for each run (s, d, w, h, sp, dp), h rows of w elements,
dst[d + i*dp : d + i*dp + w] = src[s + i*sp : s + i*sp + w].

The same copies as a segment table (`segment_copy`), grouped so that each group is one
`cudaMemcpy2DAsync`: on CUDA the driver runs them on the copy engines (DMA), so an unpack issued this
way leaves the SMs to a concurrent NCCL collective. A row-parallel weight's slice, thousands of
table rows, is one run; a column-parallel slice is one run of one row.

Three layers, as for every op: `copy_2d_ref` (plain torch), the C++/CUDA op
`torch.ops.hybridengine.copy_2d` (runs on the host in both cases: the CPU op memcpys, the CUDA op
issues one async copy per run on the current stream), and `copy_2d`, which picks one.
"""

from __future__ import annotations

import torch

from hybridengine.ops._ext import extension_has, warn_once
from hybridengine.ops.segment_copy import check_src_dst, validate_table

RUN_FIELDS = ("src", "dst", "width", "height", "src_pitch", "dst_pitch")


def runs_from_table(table: torch.Tensor) -> torch.Tensor:
    """2-D runs doing what a segment table does: consecutive rows of equal length whose source and
    destination advance by constant steps (each at least the length) merge into one run.

    Rows are taken in table order; a table that `validate_table` accepts gives runs that write the same
    disjoint destinations. Returns an int64 CPU tensor [R, 6]."""
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"table must be int64 [S, 3] (src, dst, numel) rows, got {table.dtype} {tuple(table.shape)}")
    runs: list[list[int]] = []
    for s, d, n in table.tolist():
        if n == 0:
            continue
        if runs:
            r = runs[-1]
            if r[2] == n:
                if r[3] == 1 and s - r[0] >= n and d - r[1] >= n:  # the second row sets the pitches
                    r[3], r[4], r[5] = 2, s - r[0], d - r[1]
                    continue
                if r[3] > 1 and s == r[0] + r[3] * r[4] and d == r[1] + r[3] * r[5]:
                    r[3] += 1
                    continue
        runs.append([s, d, n, 1, n, n])
    return torch.tensor(runs, dtype=torch.int64).reshape(-1, len(RUN_FIELDS))


def table_from_runs(runs: torch.Tensor) -> torch.Tensor:
    """The segment table of a set of runs, one row per copied row (for validation and tests)."""
    rows = [(s + i * sp, d + i * dp, w) for s, d, w, h, sp, dp in runs.tolist() for i in range(h) if w]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def _check_args(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor) -> None:
    check_src_dst("copy_2d", src, dst)
    if src.device != dst.device:
        raise ValueError(f"copy_2d: device mismatch, src is on {src.device} and dst on {dst.device}")
    if runs.device.type != "cpu" or runs.dtype != torch.int64 or runs.dim() != 2 or runs.shape[1] != len(RUN_FIELDS):
        raise ValueError(f"copy_2d: runs must be an int64 CPU tensor [R, 6] of {RUN_FIELDS} rows, got "
                         f"{runs.dtype} {tuple(runs.shape)} on {runs.device}")


def check_runs(runs: torch.Tensor, src_numel: int, dst_numel: int) -> None:
    """Raise ValueError naming the first run that is negative, has a pitch below its width, or reaches
    past src or dst (what the C++ op checks too; checked here first, so bad runs never reach it)."""
    if runs.numel() == 0:
        return
    s, d, w, h, sp, dp = runs.unbind(1)
    live = (w > 0) & (h > 0)
    last = torch.clamp(h - 1, min=0)
    for what, bad in (("has a negative offset or size", (s < 0) | (d < 0) | (w < 0) | (h < 0)),
                      ("has pitches smaller than its width", live & (h > 1) & ((sp < w) | (dp < w))),
                      (f"reads past src ({src_numel} elements)", live & (s + last * sp + w > src_numel)),
                      (f"writes past dst ({dst_numel} elements)", live & (d + last * dp + w > dst_numel))):
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"copy_2d: run {i} {what}: {runs[i].tolist()}")


def prepare_runs(table: torch.Tensor, *, src_numel: int, dst_numel: int) -> torch.Tensor:
    """Validate a host segment table once (bounds, overlapping destinations) and group it into runs."""
    validate_table(table, src_numel, dst_numel)
    return runs_from_table(table.cpu())


def copy_2d_ref(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor) -> None:
    """Plain-torch reference: one strided view assignment per run."""
    _check_args(src, dst, runs)
    check_runs(runs, src.numel(), dst.numel())
    validate_table(table_from_runs(runs), src.numel(), dst.numel())
    for s, d, w, h, sp, dp in runs.tolist():
        if w and h:
            dst.as_strided((h, w), (dp, 1), d).copy_(src.as_strided((h, w), (sp, 1), s))


def copy_2d(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor) -> None:
    """The runs' copies in place, with the fastest available op (CUDA: one cudaMemcpy2DAsync per run
    on the current stream). Every run is bounds-checked before anything is copied."""
    _check_args(src, dst, runs)
    check_runs(runs, src.numel(), dst.numel())
    if extension_has("copy_2d", src.device.type):
        torch.ops.hybridengine.copy_2d(src, dst, runs)
        return
    warn_once(f"copy_2d: no {src.device.type} implementation in hybridengine._C; running the torch reference")
    copy_2d_ref(src, dst, runs)
