"""One view over weights stored back to back, so that one GEMM computes several projections."""

from __future__ import annotations

import torch


def stacked_rows(*weights: torch.Tensor) -> torch.Tensor | None:
    """One [sum of rows, cols] view over 2-D weights (or one [sum] view over 1-D biases) stored back
    to back: the flat buffer keeps a layer's q/k/v weights, its q/k/v biases and its gate/up weights
    adjacent (see layout.param_specs), so one GEMM computes them; None where they are not adjacent,
    contiguous, of one dtype and width."""
    first = weights[0]
    for w in weights:
        if (w.dim() != first.dim() or w.dim() not in (1, 2) or not w.is_contiguous() or w.dtype != first.dtype
                or w.device != first.device or w.shape[1:] != first.shape[1:]):
            return None
    for a, b in zip(weights, weights[1:]):
        if (a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                or a.data_ptr() + a.numel() * a.element_size() != b.data_ptr()):
            return None
    rows = sum(w.shape[0] for w in weights)
    if first.dim() == 1:
        return first.as_strided((rows,), (1,))
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))
