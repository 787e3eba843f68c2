"""`masked_logprobs`: per-token (logp, entropy) of the target tokens where a mask is set, straight from the last
hidden states and the LM head, for losses written in plain torch on them (`HybridEngine.train_step`, the losses
of `hybridengine.train.losses`).

Three layers: the plain-torch reference (`_masked_logprobs_ref`: full logits), the fused path
(`lm_head.head_pass` forward keeping its last logits chunk, `lm_head.head_grad_pass` backward, in an
`autograd.Function`) and the public op, which validates and picks one: the kernels on CUDA, the reference
elsewhere.
"""

from __future__ import annotations

import torch

from hybridengine.ops.lm_head import (check_head, check_temperature, check_values, computed_rows, grad_buffers,
                                      gradient_bytes, head_grad_pass, head_pass, logprobs_ref, needs_grad,
                                      rows_per_chunk, scatter_rows, use_kernels)
from hybridengine.ops.policy_loss import bool_mask


class _FusedMaskedLogprobs(torch.autograd.Function):
    """Forward: stats of the masked-in rows (2*M*H*V), keeping the last chunk's logits. Backward: dL/dlogits
    from dL/dlogp and dL/dentropy chunk by chunk, recomputing every chunk but the kept one (4*M*H*V, plus
    2*M*H*V for each recomputed chunk: none when the rows fit in one chunk)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, temperature, needs, chunk_rows, block_v, exact):
        B, T, H = hidden.shape
        targets = targets.reshape(-1).long()
        num = B * T if rows is None else rows.numel()
        chunk = chunk_rows or rows_per_chunk(num, weight.shape[0], hidden.element_size(),
                                             gradient_bytes(hidden, weight, needs))
        kept = {} if any(needs) else None
        lse, logp, entropy = head_pass(hidden, weight, bias, targets, rows, temperature=temperature,
                                       chunk_rows=chunk, block_v=block_v, exact=exact, keep=kept)
        ctx.save_for_backward(hidden, weight, bias, targets, rows, lse, entropy)
        ctx.kept, ctx.args = kept, (temperature, needs, chunk, block_v, exact)
        return scatter_rows(logp, rows, B, T), scatter_rows(entropy, rows, B, T)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, rows, lse, entropy = ctx.saved_tensors
        temperature, needs, chunk, block_v, exact = ctx.args
        if ctx.kept is None:
            raise RuntimeError("masked_logprobs: a second backward through one call (retain_graph=True) is not "
                               "supported: the kept logits chunk is consumed by the first")
        kept, ctx.kept = ctx.kept, None
        B, T, H = hidden.shape

        def per_row(g):  # [B, T] -> fp32 per computed row
            if g is None:
                return torch.zeros_like(lse)
            g = g.reshape(-1).float()
            return g if rows is None else g.index_select(0, rows)

        grad_h, grad_w, grad_b = grad_buffers(hidden, weight, bias, needs, rows)
        if lse.numel():
            head_grad_pass(hidden, weight, bias, targets, rows, lse, entropy, per_row(grad_logp),
                           per_row(grad_entropy), temperature=temperature, chunk=chunk, kept=kept,
                           grad_hidden=grad_h, grad_weight=grad_w, grad_bias=grad_b, block_v=block_v, exact=exact)
        if grad_h is not None:
            grad_h = grad_h.view(B, T, H)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, *([None] * 7)


def _masked_logprobs_fused(hidden, weight, targets, mask_bool, num_tokens, *, bias, temperature, exact=False,
                           chunk_rows=None, block_v=None):
    """The Triton path of `masked_logprobs` (inputs already validated)."""
    rows, needs = computed_rows(mask_bool, num_tokens), needs_grad(hidden, weight, bias)
    return _FusedMaskedLogprobs.apply(hidden, weight, bias, targets, rows, temperature, needs, chunk_rows, block_v,
                                      exact)


def _masked_logprobs_ref(hidden, weight, targets, mask_bool, bias, temperature, exact=False):
    """Plain torch: `ppo_loss_ref`'s log-probs (full logits, masked-out targets read as 0), then 0 where
    the mask is 0 (no gradient flows there)."""
    safe_targets = torch.where(mask_bool, targets, torch.zeros_like(targets))
    logp, entropy = logprobs_ref(hidden, weight, safe_targets, bias, temperature, exact)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(mask_bool, logp, zero), torch.where(mask_bool, entropy, zero)


def masked_logprobs(hidden, weight, targets, mask, *, bias=None, temperature=1.0, exact=False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logp, entropy), fp32 [B, T], of the target tokens where mask is 1, for a loss written in
    plain torch on them (`HybridEngine.train_step`); 0 where mask is 0 (never computed, no gradient).

    hidden [B, T, H], weight [V, H], bias [V] or None, targets [B, T] int (any value where mask is 0),
    mask [B, T] 0/1. `logp = log_softmax((hidden @ weight.T + bias) / temperature)[targets]` and the
    entropy of that distribution, exactly as `ppo_loss` computes them (`exact=True`: the bits of
    `token_logprobs(exact=True)` and of the sampler). Differentiable: any dL/dlogp and dL/dentropy flow
    back to hidden, weight and bias through d logp / d logits = onehot - softmax and d entropy / d logits
    = -softmax * (log softmax + entropy), both divided by the temperature.

    On CUDA the fused path runs: the forward computes the stats chunk by chunk (one [C, V] logits chunk at
    a time) and keeps the last chunk; the backward turns each chunk into dL/dlogits and the hidden, weight
    and bias gradients, recomputing every chunk but the kept one. When the masked-in tokens fit in one
    chunk (up to ~3.5k tokens at V = 152k bf16) the op costs what `ppo_loss` does (6*M*H*V flops); past
    that, 2*M*H*V more for the recomputed chunks. Peak memory is `ppo_loss`'s: one chunk plus the
    gradients. Elsewhere the plain-torch reference (full logits) runs.
    """
    op = "masked_logprobs"
    check_head(op, hidden, weight, bias, targets)
    check_temperature(temperature)
    mask_bool = bool_mask(op, mask, targets.shape, hidden.device, strict=False)
    num_tokens = check_values(op, targets, weight.shape[0], mask, mask_bool)
    if use_kernels(op, hidden):
        return _masked_logprobs_fused(hidden, weight, targets, mask_bool, num_tokens, bias=bias,
                                      temperature=temperature, exact=exact)
    return _masked_logprobs_ref(hidden, weight, targets, mask_bool, bias, temperature, exact)
