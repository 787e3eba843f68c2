"""The chunked LM-head pass behind the log-prob ops and the fused PPO loss: per-token log-probs and entropies
(and their gradients) straight from the last hidden states and the LM head, never materialising the logits.

`head_pass` runs one pass over the head, chunk by chunk. Per chunk of `C` tokens (`h` [C, H], `W` [V, H]):

    x = h @ W.T (+ b)                    cuBLAS, 2*C*H*V flops, x in the input dtype [C, V]
    lse, logp, entropy = logit_stats(x)  Triton, one read of x
    g_logp, g_ent = coefs(logp, entropy) the caller's dL/dlogp and dL/dentropy per token, O(C)
    x <- dloss/dx                        Triton, in place, one read + one write of x
    grad_h[chunk] = x @ W                cuBLAS, 2*C*H*V
    grad_W += x.T @ h                    cuBLAS, 2*C*H*V (beta = 1: reads and writes grad_W once)

Forward + backward is 6*M*H*V flops (the floor) and 6 bytes per logit of elementwise traffic in bf16; the
statistics alone (no `coefs`) are the first 2*M*H*V. `head_grad_pass` is the backward of a statistics-only
pass, from saved (lse, entropy). Memory beyond the inputs: one [C, V] logits chunk, grad_W (weight's dtype),
grad_h, and O(M) fp32 vectors; C (`rows_per_chunk`) is sized so that all of it stays within
LOSS_MEMORY_BYTES (2 GiB) where the gradients leave room. Only the selected rows (`rows`: the masked-in
tokens) are computed.

Precision: the chunk logits are rounded to the input dtype by the GEMM exactly as in naive torch
(`(hidden @ weight.T).float()`), and everything after that is fp32. grad_W is accumulated in the
weight's dtype across chunks (one rounding per chunk; an fp32 accumulator would cost 2 GiB more
at V = 152k, H = 3584).

Exact log-probs (`exact=True`): the rollout's sampler and the trainer report the same bits for the
same hidden states. The chunk logits come from the batch-invariant `linear_exact` (a row's bits do
not depend on the other rows), and each row's log-prob from `chosen_logprobs`' own code: the
`logit_stats` kernel with a per-row inverse temperature on the kernel path, `scaled_log_softmax`
(`(x.float() * inv_t).log_softmax(-1)`) on the torch path; the temperature is applied as `x * inv_t` with
`inv_t = 1 / T` rounded to fp32, as the sampler does. A token's log-prob is then independent of the batch,
its padding and the chunking. Gradients keep the default path's math (cuBLAS on CUDA).

Also here: the checks of the head's inputs (`check_head`, `check_temperature`, `check_values`), the
plain-torch reference on full logits (`logprobs_ref`) and the choice of path (`use_kernels`). The Triton
kernels are `hybridengine.kernels.ppo_loss`'s.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridengine import checks
from hybridengine.ops import _launch
from hybridengine.ops._ext import warn_once

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

LOGITS_CHUNK_BYTES = 2**30
"""Upper bound on the one [C, V] logits chunk: C <= 3530 tokens at V = 152064 bf16. Past ~2k rows a
larger chunk buys little (bench ppo_loss, the chunk sweep)."""
LOSS_MEMORY_BYTES = 2 * 2**30
"""Target for the op's peak extra memory: the gradients it returns (grad_hidden [M, H], grad_weight
[V, H], fp32 grad_bias) plus the logits chunk. The chunk gets what the gradients leave, between
MIN_CHUNK_ROWS rows and LOGITS_CHUNK_BYTES: at H = 3584, V = 152064 bf16 the gradients are 1.07 GiB
at M = 8k (chunk capped at 1 GiB), 1.23 GiB at 32k (chunk ~0.76 GiB) and 1.89 GiB at 128k (chunk
~0.1 GiB = 384 rows). Where the gradients alone exceed the target, the chunk stays at MIN_CHUNK_ROWS."""
MIN_CHUNK_ROWS = 256
"""Below this the grad_weight read-modify-write of each chunk's beta = 1 GEMM (2 x V x H x 2 bytes)
outweighs its 2 x C x H x V flops."""
WORKSPACE_BYTES_PER_ROW = 64
"""The O(M) fp32 vectors (stats, weights, PPO coefficients) reserved out of LOSS_MEMORY_BYTES per row."""
CHUNK_ALIGN = 128
"""Chunk rows are a multiple of this (GEMM tile height) except for the last."""


# --------------------------------------------------------------------------------------------
# checks


def check_temperature(temperature: float) -> None:
    """temperature is a finite number > 0."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def check_head(op: str, hidden, weight, bias, targets) -> None:
    """hidden [B, T, H] float, weight [V, H] and bias [V] of hidden's dtype, targets [B, T] int; one device."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"{op}: hidden must be a float [B, T, H] tensor, got {checks.describe(hidden)}")
    if hidden.dtype not in (*KERNEL_DTYPES, torch.float64):
        raise ValueError(f"{op}: hidden must be bf16, fp16, fp32 or fp64, got {hidden.dtype}")
    B, T, H = hidden.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != H or weight.shape[0] < 1:
        raise ValueError(f"{op}: weight must be [V, H] with H = {H} (hidden's last dim), got {checks.describe(weight)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{op}: weight is on {weight.device}, hidden on {hidden.device}")
    V = weight.shape[0]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (V,):
            raise ValueError(f"{op}: bias must be [V] = [{V}] or None, got {checks.describe(bias)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"{op}: bias must be {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")
    if not isinstance(targets, torch.Tensor) or targets.shape != (B, T):
        raise ValueError(f"{op}: targets must be [B, T] = [{B}, {T}], got {checks.describe(targets)}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{op}: targets must be an integer tensor, got {targets.dtype}")
    if targets.device != hidden.device:
        raise ValueError(f"{op}: targets are on {targets.device}, hidden on {hidden.device}")


def check_values(op: str, targets: torch.Tensor, vocab: int, mask: torch.Tensor | None,
                 mask_bool: torch.Tensor | None) -> int:
    """Targets in [0, V) where the mask is set, mask entries 0/1; returns the number of masked-in
    tokens. One host sync for all checks."""
    bad_target = (targets < 0) | (targets >= vocab)
    checks = []
    if mask_bool is not None:
        bad_target &= mask_bool
        bad_mask = torch.zeros((), dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool else \
            ((mask != 0) & (mask != 1)).any()
        checks = [bad_mask, mask_bool.sum()]
    flags = torch.stack([bad_target.any().long(), *[c.long() for c in checks]]).tolist()
    if flags[0]:
        where = "where mask is set " if mask_bool is not None else ""
        raise ValueError(f"{op}: targets must lie in [0, {vocab}) {where}(the vocabulary is weight.shape[0])")
    if mask_bool is None:
        return targets.numel()
    if flags[1]:
        raise ValueError(f"{op}: mask must hold only 0 and 1")
    return flags[2]


# --------------------------------------------------------------------------------------------
# the reference and the exact path's row formula


def logprobs_ref(hidden, weight, targets, bias, temperature, exact=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive: the full [B, T, V] logits in the input dtype, then fp32 (fp64 for fp64 inputs).
    exact: the logits of `linear_exact` and `chosen_logprobs`' torch code (fp32, `* inv_t`)."""
    if exact:
        B, T, H = hidden.shape
        logits = _linear_exact(hidden.reshape(B * T, H), weight, bias)
        log_probs = scaled_log_softmax(logits, inv_temperature_rows(1.0 / temperature, B * T, logits.device))
        logp = log_probs.gather(-1, targets.reshape(B * T, 1).long()).view(B, T)
        return logp, -(log_probs.exp() * log_probs).sum(-1).view(B, T)
    logits = F.linear(hidden, weight, bias)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


def _linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Imported on first use: it loads Triton kernels, which must come after TRITON_INTERPRET is set.
    from hybridengine.ops.exact_linear import linear_exact

    return linear_exact(x, weight, bias)


def inv_temperature_rows(inv_temperature, rows: int, device) -> torch.Tensor:
    """inv_temperature (a float, rounded once to fp32, or an fp32 [rows] tensor) as an fp32 [rows] tensor."""
    if isinstance(inv_temperature, torch.Tensor):
        return inv_temperature
    return torch.full((rows,), inv_temperature, dtype=torch.float32, device=device)


def scaled_log_softmax(logits: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits * inv_t) per row in fp32: `chosen_logprobs`' torch path (row-invariant:
    CPU and CUDA softmax reduce each row on its own)."""
    return (logits.float() * inv_t[:, None]).log_softmax(-1)


# --------------------------------------------------------------------------------------------
# the chunked pass


def rows_per_chunk(num_rows: int, vocab: int, element_size: int, grad_bytes: int = 0) -> int:
    """Rows per chunk: the largest multiple of CHUNK_ALIGN whose [C, V] chunk fits both
    LOGITS_CHUNK_BYTES and what `grad_bytes` (the gradients the call returns) leave of
    LOSS_MEMORY_BYTES, at least MIN_CHUNK_ROWS; then evened out over the chunks so the last is not
    a sliver (M = 8192 at V = 152k bf16: 2816 + 2816 + 2560, not 3456 + 3456 + 1280)."""
    row_bytes = vocab * element_size
    left = LOSS_MEMORY_BYTES - grad_bytes - WORKSPACE_BYTES_PER_ROW * num_rows
    budget = min(LOGITS_CHUNK_BYTES, max(left, MIN_CHUNK_ROWS * row_bytes))
    cap = max(CHUNK_ALIGN, budget // row_bytes // CHUNK_ALIGN * CHUNK_ALIGN)
    if num_rows <= cap:
        return max(num_rows, 1)
    per_chunk = -(-num_rows // -(-num_rows // cap))
    return min(cap, -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN)


def gradient_bytes(hidden: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool, bool]) -> int:
    """Bytes of the gradients a fused call allocates: grad_hidden [B * T, H], grad_weight, fp32 grad_bias."""
    need_h, need_w, need_b = needs
    return (need_h * hidden.shape[0] * hidden.shape[1] * hidden.shape[2] * hidden.element_size()
            + need_w * weight.numel() * weight.element_size() + need_b * weight.shape[0] * 4)


def load_kernels():
    from hybridengine.kernels import ppo_loss as kernels  # Triton imported on first use, after TRITON_INTERPRET is set

    return kernels


def _token_rows(hidden: torch.Tensor) -> torch.Tensor | None:
    """hidden [B, T, H] as [B * T, H] rows without a copy, or None where its strides do not allow it (each
    chunk is then gathered from the 3-D tensor)."""
    B, T, H = hidden.shape
    try:
        return hidden.view(B * T, H)
    except RuntimeError:
        return None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out <- h @ weight.T (+ bias): one chunk's logits in the input dtype (cuBLAS)."""
    if bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)
    return out


def _chunk_inputs(hidden: torch.Tensor, flat: torch.Tensor | None, targets: torch.Tensor, rows: torch.Tensor | None,
                  T: int, start: int, end: int):
    """Chunk [start, end) of the selected token rows: (their indices or None when every row is taken, hidden
    rows [n, H], targets [n]); hidden is [B, T, H] unless `flat` [N, H] is given."""
    index = None if rows is None else rows[start:end]
    if flat is None:
        token = torch.arange(start, end, device=hidden.device) if index is None else index
        h = hidden[token // T, token % T]
    else:
        h = flat[start:end] if index is None else flat.index_select(0, index)
    t = targets[start:end] if index is None else targets.index_select(0, index)
    return index, h, t


def _head_grads_(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor | None, start: int,
                 end: int, grad_hidden, grad_weight, grad_bias) -> None:
    """One chunk's LM-head gradients from its logit gradients x [rows, V] and hidden rows h: grad_hidden's rows
    (start:end, or `index` where the chunk's rows are scattered), grad_weight and grad_bias accumulated."""
    if grad_hidden is not None:
        if index is None:
            torch.mm(x, weight, out=grad_hidden[start:end])
        else:
            grad_hidden.index_copy_(0, index, x @ weight)
    if grad_weight is not None:
        grad_weight.addmm_(x.t(), h)
    if grad_bias is not None:
        grad_bias += x.sum(0, dtype=torch.float32)


def head_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              rows: torch.Tensor | None, *, temperature: float, coefs=None, grad_hidden=None, grad_weight=None,
              grad_bias=None, chunk_rows: int | None = None, block_v: int | None = None, grad_bytes: int = 0,
              exact: bool = False, keep: dict | None = None):
    """One pass over the LM head, chunk by chunk, never holding more than one [C, V] logits chunk.

    hidden [B, T, H] (any strides: a [:, -T:] slice of the prompt+response states is read chunk by
    chunk, never copied whole), targets [B * T] int64; `rows` (1-D int64 into the B * T tokens) selects
    the rows to compute, None = all. Returns fp32 (lse, logp, entropy), one entry per selected row.
    With `coefs(start, end, logp, entropy) -> (dL/dlogp, dL/dentropy)` for the chunk's selected rows,
    also turns each chunk into dL/dlogits and accumulates it into grad_hidden [B * T, H] (rows not
    selected are left alone), grad_weight [V, H] and grad_bias (fp32 [V]), whichever are given.
    exact: each chunk's logits from `linear_exact` and its stats from the per-row-temperature kernel,
    the code of `chosen_logprobs` (the gradients are the same either way). `keep` (a dict, without
    `coefs`): receives the last chunk's logits (`logits`, its first row `start`, the chunk `buffer`) for a
    backward that does not recompute them (`head_grad_pass`).
    """
    kernels = load_kernels()
    B, T, H = hidden.shape
    flat = _token_rows(hidden)
    num = B * T if rows is None else rows.numel()
    vocab = weight.shape[0]
    device = hidden.device
    stats = tuple(torch.empty(num, dtype=torch.float32, device=device) for _ in range(3))
    if num == 0:
        return stats
    chunk = chunk_rows or rows_per_chunk(num, vocab, hidden.element_size(), grad_bytes)
    inv_t = 1.0 / temperature
    if exact:  # linear_exact allocates each chunk's logits itself
        buffer, inv_t_rows = None, inv_temperature_rows(inv_t, min(chunk, num), device)
    else:
        buffer = torch.empty(min(chunk, num), vocab, dtype=hidden.dtype, device=device)
    for start in range(0, num, chunk):
        end = min(start + chunk, num)
        index, h, t = _chunk_inputs(hidden, flat, targets, rows, T, start, end)
        lse, logp, ent = (s[start:end] for s in stats)
        if exact:
            x = None  # the previous chunk's logits go before the next are allocated
            x = _linear_exact(h, weight, bias)
            kernels.logit_stats(x, t, inv_temperature=inv_t_rows[:end - start], out=(lse, logp, ent), block_v=block_v)
        else:
            x = _chunk_logits(h, weight, bias, buffer[:end - start])
            kernels.logit_stats(x, t, inv_temperature=inv_t, out=(lse, logp, ent), block_v=block_v)
        if coefs is None:
            if keep is not None and end == num:
                keep.update(logits=x, start=start, buffer=buffer)
            continue
        g_logp, g_ent = coefs(start, end, logp, ent)
        kernels.logit_grad_(x, t, lse, ent, g_logp.contiguous(), g_ent.contiguous(), inv_temperature=inv_t,
                            block_v=block_v)
        _head_grads_(x, h, weight, index, start, end, grad_hidden, grad_weight, grad_bias)
    return stats


def head_grad_pass(hidden, weight, bias, targets, rows, lse, entropy, g_logp, g_ent, *, temperature, chunk,
                   kept, grad_hidden, grad_weight, grad_bias, block_v=None, exact=False) -> None:
    """The backward of a `head_pass` run with `keep`: per chunk of the same rows, dL/dlogits from the saved
    fp32 (lse, entropy) and the per-row dL/dlogp, dL/dentropy, into grad_hidden / grad_weight / grad_bias.
    The kept last chunk goes first (no GEMM for it); its storage then holds the recomputed chunks, so the
    pass never holds more than one [C, V] chunk."""
    kernels = load_kernels()
    B, T, H = hidden.shape
    flat = _token_rows(hidden)
    num = B * T if rows is None else rows.numel()
    device = hidden.device
    inv_t = 1.0 / temperature
    starts = list(range(0, num, chunk))
    last = kept.get("start") if kept else None
    if last in starts:  # the kept chunk first, then the others in order
        starts.remove(last)
        starts.insert(0, last)
    buffer = None
    for start in starts:
        end = min(start + chunk, num)
        index, h, t = _chunk_inputs(hidden, flat, targets, rows, T, start, end)
        if start == last:
            x = kept.pop("logits")
            buffer = kept.pop("buffer", None)  # the forward's chunk storage holds the recomputed chunks
        elif exact:
            x = None  # the previous chunk's logits go before the next are allocated
            x = _linear_exact(h, weight, bias)
        else:
            if buffer is None:
                buffer = torch.empty(min(chunk, num), weight.shape[0], dtype=hidden.dtype, device=device)
            x = _chunk_logits(h, weight, bias, buffer[:end - start])
        kernels.logit_grad_(x, t, lse[start:end], entropy[start:end], g_logp[start:end].contiguous(),
                            g_ent[start:end].contiguous(), inv_temperature=inv_t, block_v=block_v)
        _head_grads_(x, h, weight, index, start, end, grad_hidden, grad_weight, grad_bias)


def grad_buffers(hidden, weight, bias, needs, rows):
    """Gradient buffers: grad_hidden [B * T, H] (contiguous whatever hidden's strides), grad_weight, fp32 grad_bias."""
    need_h, need_w, need_b = needs
    grad_h = None
    if need_h:  # rows that are not computed keep a zero gradient
        shape = (hidden.shape[0] * hidden.shape[1], hidden.shape[2])
        new = torch.empty if rows is None else torch.zeros
        grad_h = new(shape, dtype=hidden.dtype, device=hidden.device)
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
    return grad_h, grad_w, grad_b


def scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """Per-row values back to [B, T]; rows that were not computed are 0 (and masked out)."""
    if rows is None:
        return values.view(B, T)
    return torch.zeros(B * T, dtype=values.dtype, device=values.device).index_copy_(0, rows, values).view(B, T)


# --------------------------------------------------------------------------------------------
# the choice of path


def use_kernels(op: str, hidden: torch.Tensor) -> bool:
    """The Triton path where `_launch.use_kernel` says so (CUDA; tests patch it to run the kernels under the
    interpreter, as `chosen_logprobs` does) for bf16/fp16/fp32; the reference otherwise (warned once)."""
    if not _launch.use_kernel(hidden):
        return False
    if hidden.dtype not in KERNEL_DTYPES:
        warn_once(f"{op}: no fused kernel for {hidden.dtype}; running the torch reference, which "
                  f"materialises the full [B, T, V] logits")
        return False
    try:
        load_kernels()
    except Exception as e:  # noqa: BLE001 - any import failure means: no kernels here
        warn_once(f"{op}: the Triton kernels do not import ({type(e).__name__}: {e}); running the torch "
                  f"reference, which materialises the full [B, T, V] logits")
        return False
    return True


def needs_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) a fused call computes a gradient for."""
    grad_on = torch.is_grad_enabled()
    return tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))


def computed_rows(mask_bool: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
    """The masked-in token rows (1-D int64 into the B * T tokens) a fused call computes; None: all of them."""
    return None if num_tokens == mask_bool.numel() else mask_bool.reshape(-1).nonzero().squeeze(1)
