"""The MoE load-balancing loss of one micro-batch, as transformers computes it (`load_balancing_loss_func`,
Switch Transformer eqs. 4-6), added to the training loss with `ModelConfig.router_aux_loss_coef`.

    aux = E * sum_e f_e * P_e

f_e: the share of the top-k assignments that go to expert e, P_e: the mean router probability of e, both pooled
over every MoE layer and token of the forward (transformers' `total_rows` counts layers x tokens). f comes from
the top-k choices and carries no gradient, so once the forward has run, aux is linear in each layer's
probabilities: aux = sum_l E / (L N) * f . softmax(logits_l).sum(tokens). The trainer adds each layer's term to
that layer's backward (where its router logits exist with autograd, recomputed under activation checkpointing).
Probabilities are taken in fp32.
"""

from __future__ import annotations

import torch


class LoadBalance:
    """The load-balancing loss of one forward, from its MoE layers' (router logits, chosen experts)."""

    def __init__(self, routing: dict[int, tuple[torch.Tensor, torch.Tensor]], num_experts: int):
        logits = [lg for lg, _ in routing.values()]
        rows = sum(lg.shape[0] for lg in logits)  # layers x tokens
        counts = sum(torch.bincount(ex.reshape(-1), minlength=num_experts).float() for _, ex in routing.values())
        self.fraction = counts / rows
        """f: top-k assignments per expert over layers x tokens [E] (sums to k)."""
        self.scale = num_experts / rows
        with torch.no_grad():
            self.value = float(sum(self.layer_term(lg) for lg in logits))
            """aux of the forward (a host float: a metric)."""

    def layer_term(self, router_logits: torch.Tensor) -> torch.Tensor:
        """One layer's share of aux, differentiable in its router logits [N, E]."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        return self.scale * (probs.sum(0) * self.fraction).sum()
