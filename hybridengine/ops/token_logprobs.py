"""`token_logprobs`: per-token log-probs (and entropies) of the target tokens straight from the last hidden states
and the LM head, never materialising the [B, T, V] logits.

For rollout log-prob recompute and reference-model log-probs. Three layers: the plain-torch reference
(`token_logprobs_ref`: full logits in fp32), the fused path (`lm_head.head_pass`: cuBLAS chunk GEMMs and the
row kernels, in an `autograd.Function`) and the public op, which validates and picks one: the kernels on CUDA,
the reference elsewhere. The forward costs 2*M*H*V flops; a gradient recomputes each chunk in the backward
(6*M*H*V more).
"""

from __future__ import annotations

import torch

from hybridengine.ops.lm_head import (check_head, check_temperature, check_values, grad_buffers, gradient_bytes,
                                      head_pass, logprobs_ref, needs_grad, use_kernels)


def token_logprobs_ref(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False, exact=False):
    """Plain-torch `token_logprobs`: full logits in fp32."""
    check_head("token_logprobs_ref", hidden, weight, bias, targets)
    check_temperature(temperature)
    check_values("token_logprobs_ref", targets, weight.shape[0], None, None)
    logp, entropy = logprobs_ref(hidden, weight, targets, bias, temperature, exact)
    return (logp, entropy) if return_entropy else logp


class _FusedTokenLogprobs(torch.autograd.Function):
    """Forward: stats only (2*M*H*V). Backward: recomputes each chunk and applies the row gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, needs, chunk_rows, block_v, exact):
        B, T, H = hidden.shape
        _, logp, entropy = head_pass(hidden, weight, bias, targets.reshape(-1), None, temperature=temperature,
                                     chunk_rows=chunk_rows, block_v=block_v, exact=exact)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.args = (temperature, needs, chunk_rows, block_v, exact)
        return logp.view(B, T), entropy.view(B, T)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, needs, chunk_rows, block_v, exact = ctx.args
        B, T, H = hidden.shape
        zeros = torch.zeros(B * T, dtype=torch.float32, device=hidden.device)
        g_logp = zeros if grad_logp is None else grad_logp.reshape(-1).float()
        g_ent = zeros if grad_entropy is None else grad_entropy.reshape(-1).float()
        grad_h, grad_w, grad_b = grad_buffers(hidden, weight, bias, needs, None)
        head_pass(hidden, weight, bias, targets.reshape(-1), None, temperature=temperature,
                  coefs=lambda s, e, *_: (g_logp[s:e], g_ent[s:e]), grad_hidden=grad_h, grad_weight=grad_w,
                  grad_bias=grad_b, chunk_rows=chunk_rows, block_v=block_v,
                  grad_bytes=gradient_bytes(hidden, weight, needs), exact=exact)
        if grad_h is not None:
            grad_h = grad_h.view(B, T, H)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _token_logprobs_fused(hidden, weight, targets, *, bias, temperature, exact=False, chunk_rows=None, block_v=None):
    targets = targets.long()
    needs = needs_grad(hidden, weight, bias)
    if any(needs):
        return _FusedTokenLogprobs.apply(hidden, weight, bias, targets, temperature, needs, chunk_rows, block_v,
                                         exact)
    B, T, H = hidden.shape
    _, logp, entropy = head_pass(hidden, weight, bias, targets.reshape(-1), None, temperature=temperature,
                                 chunk_rows=chunk_rows, block_v=block_v, exact=exact)
    return logp.view(B, T), entropy.view(B, T)


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False, exact=False):
    """log_softmax((hidden @ weight.T + bias) / temperature)[targets], fp32 [B, T], without the logits.

    With return_entropy, also the entropy of each token's distribution: (logp, entropy). For
    rollout log-prob recompute and reference-model log-probs; differentiable (the backward
    recomputes the logits chunk by chunk). exact=True: `logp[b, t]` is bitwise
    `chosen_logprobs(linear_exact(hidden[b, t][None], weight, bias), targets[b, t][None], 1 / temperature)`
    whatever the batch, its padding and the chunking (see `hybridengine.ops.lm_head`).
    """
    check_head("token_logprobs", hidden, weight, bias, targets)
    check_temperature(temperature)
    check_values("token_logprobs", targets, weight.shape[0], None, None)
    if use_kernels("token_logprobs", hidden):
        logp, entropy = _token_logprobs_fused(hidden, weight, targets, bias=bias, temperature=temperature, exact=exact)
    else:
        logp, entropy = logprobs_ref(hidden, weight, targets, bias, temperature, exact)
    return (logp, entropy) if return_entropy else logp
