"""Linear layers of the decode step: out = x @ weight^T (+ bias) for few rows, with a split-K Triton kernel.

Three layers, as for the other ops: `decode_linear_ref` (plain torch, fp32 math rounded once),
`decode_linear_triton` (the kernel in `hybridengine.kernels.linear`, CUDA or the interpreter) and
`decode_linear`, which takes the kernel on CUDA for x of at most DECODE_LINEAR_MAX_ROWS rows and
`F.linear` otherwise. `decode_linear_plan` picks the launch: the K split that brings the programs to
about DECODE_LINEAR_WAVES x the SM count, so a small weight is read by every SM (see the kernel's
docstring for how the splits are merged in the same launch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DECODE_LINEAR_MAX_ROWS = 256
"""Rows (decode batch) up to which `decode_linear` takes the Triton kernel on CUDA."""
DECODE_LINEAR_WAVES = 2
"""The K split fills up to this many programs per SM."""
DECODE_LINEAR_MIN_K = 256
"""Each split covers at least this many of K (two 128-wide steps): a split costs a partial tile's
store and load."""
DECODE_LINEAR_MAX_SPLIT = 16

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
_counters: dict[torch.device, torch.Tensor] = {}


def decode_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias in fp32 (exact products of 16-bit inputs), rounded once to x's dtype."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _check(x, weight, bias, out) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"decode_linear: x must be a 2-D [rows, in_features] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"decode_linear: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"decode_linear: x must have unit stride in its last dim, got strides {x.stride()}")
    m, k = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"decode_linear: weight must be [out_features, {k}], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    n = weight.shape[0]
    if weight.dtype != x.dtype or weight.device != x.device or not weight.is_contiguous():
        raise ValueError(f"decode_linear: weight must be a contiguous {x.dtype} tensor on {x.device}, got "
                         f"{weight.dtype} on {weight.device}{'' if weight.is_contiguous() else ', not contiguous'}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device or not bias.is_contiguous()):
        raise ValueError(f"decode_linear: bias must be None or a contiguous [{n}] {x.dtype} tensor on {x.device}, got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"decode_linear: out must be a [{m}, {n}] {x.dtype} tensor on {x.device}, got "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
        if out.stride(-1) != 1:
            raise ValueError(f"decode_linear: out must have unit stride in its last dim, got strides {out.stride()}")
        for name, t in (("x", x), ("weight", weight)):
            if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                raise ValueError(f"decode_linear: out must not share memory with {name} (other programs still read it)")
    return m, n, k


def decode_linear_plan(m: int, n: int, k: int, num_sms: int) -> dict:
    """Launch config for [m, k] @ [n, k]^T: 64 or 128-row tiles, 64-column tiles, 128-wide K steps, and
    the largest power-of-two K split (<= DECODE_LINEAR_MAX_SPLIT) that keeps programs <= WAVES x SMs and
    each split >= DECODE_LINEAR_MIN_K of K."""
    block_m = 64 if m <= 64 else 128
    block_n = 64
    tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
    split = 1
    while (split * 2 <= DECODE_LINEAR_MAX_SPLIT and tiles * split * 2 <= DECODE_LINEAR_WAVES * num_sms
           and k // (split * 2) >= DECODE_LINEAR_MIN_K):
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=4)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 counter per output tile, kept per device: the kernel leaves them at zero."""
    have = _counters.get(device)
    if have is None or have.numel() < tiles:
        have = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _counters[device] = have
    return have


def decode_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`decode_linear` with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); `config` overrides
    keys of `decode_linear_plan` (the bench's sweep uses it)."""
    from hybridengine.kernels.linear import decode_linear_kernel

    m, n, k = _check(x, weight, bias, out)
    cfg = decode_linear_plan(m, n, k, _num_sms(x.device))
    unknown = set(config or {}) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"decode_linear: config keys must be among {sorted(_CONFIG_KEYS)}, got {sorted(unknown)}")
    cfg.update(config or {})
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if not isinstance(cfg[key], int) or cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"decode_linear: config {key} must be a power of two >= 16, got {cfg[key]!r}")
    if not isinstance(cfg["SPLIT_K"], int) or not 1 <= cfg["SPLIT_K"] <= 64:
        raise ValueError(f"decode_linear: config SPLIT_K must be an int in [1, 64], got {cfg['SPLIT_K']!r}")
    if x.device.type != "cuda":
        cfg["num_stages"] = 1
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    split = cfg.pop("SPLIT_K")
    # each split a whole number of K steps; a split count past ceil(K / BLOCK_K) would leave splits empty
    k_per_split = math.ceil(math.ceil(k / split) / block_k) * block_k
    split = math.ceil(k / k_per_split)
    grid = (math.ceil(n / block_n), math.ceil(m / block_m), split)
    m_pad, n_pad = grid[1] * block_m, grid[0] * block_n
    if split > 1:
        part = torch.empty(split, m_pad, n_pad, dtype=torch.float32, device=x.device)
        count = _tile_counters(x.device, grid[0] * grid[1])
    else:
        part = count = out  # unused (SPLIT_K is a constexpr)
    decode_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, part, count,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split, m_pad, n_pad,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32, **cfg,
    )
    return out


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, one rounding.

    CUDA with M <= DECODE_LINEAR_MAX_ROWS: the split-K Triton kernel; otherwise `F.linear` (cuBLAS),
    whose results can differ from the kernel's in the last bit (another fp32 summation order)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= DECODE_LINEAR_MAX_ROWS:
        return decode_linear_triton(x, weight, bias, out=out)
    if out is None:
        return F.linear(x, weight, bias)
    _check(x, weight, bias, out)
    return torch.addmm(bias, x, weight.t(), out=out) if bias is not None else torch.mm(x, weight.t(), out=out)
