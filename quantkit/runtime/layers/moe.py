"""A top-k routed mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral).

The router scores every expert for each token; each token goes to its top-k experts, weighted by their softmax
probabilities (renormalised over the k where the family does). Tokens are grouped by expert, so each expert that any
token chose runs one gate/up GEMM and one down GEMM on its tokens, on the same packed int4/int8 kernels as a dense
layer. Experts are visited in ascending order and summed in that order, as HF transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from quantkit.runtime.layers.linear import Linear


@dataclass(frozen=True, slots=True)
class Routing:
    top_k: int
    normalise: bool  # the k chosen probabilities rescaled to sum to 1 (Mixtral, Qwen3-MoE's norm_topk_prob)


class SparseMLP(nn.Module):
    def __init__(self, router: Linear, experts: list[tuple[Linear, Linear]], routing: Routing,
                 act: Callable[[Tensor], Tensor], shared: tuple[Linear, Linear, Linear] | None = None):
        """`experts`: (gate_up, down) per expert, gate rows first; `act(gate_up) -> [T, inter]`; `shared`: Qwen2-MoE's
        always-on expert (gate_up, down, its [1, hidden] sigmoid gate)."""
        super().__init__()
        self.router, self.routing, self.act = router, routing, act
        self.experts = nn.ModuleList(nn.ModuleList(pair) for pair in experts)
        self.shared = None if shared is None else nn.ModuleList(shared)

    def route(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h [T, hidden] -> (weights [T, k] in h's dtype, chosen expert ids [T, k])."""
        probs = torch.softmax(self.router(h).float(), dim=-1)  # [T, experts]
        weights, chosen = torch.topk(probs, self.routing.top_k, dim=-1)
        if self.routing.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), chosen

    def forward(self, h: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        weights, chosen = self.route(h)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():  # ascending
            token, slot = (chosen == e).nonzero(as_tuple=True)  # a token picks an expert at most once
            gate_up, down = self.experts[e]
            y = down(self.act(gate_up(h[token]))) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared is not None:
            gate_up, down, gate = self.shared
            out = out + torch.sigmoid(gate(h)) * down(self.act(gate_up(h)))
        return out
