"""Distribution metrics on held-out text: both models' perplexity and the per-token KL(baseline || quantized).

KL and top-1 agreement compare the full next-token distributions at every position, so they notice damage
long before accuracy on a task moves: the most sensitive signal, and cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class Distribution:
    tokens: int
    ppl_baseline: float
    ppl_quantized: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    top1_agreement: float
    kl_per_token: Tensor  # [tokens] float32, for the KL histogram
    nll_baseline_rows: Tensor  # [rows] mean NLL per row, for paired comparisons
    nll_quantized_rows: Tensor

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_quantized / self.ppl_baseline

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens, "ppl_baseline": self.ppl_baseline, "ppl_quantized": self.ppl_quantized,
            "ppl_ratio": self.ppl_ratio, "kl_mean": self.kl_mean, "kl_median": self.kl_median, "kl_p99": self.kl_p99,
            "top1_agreement": self.top1_agreement,
        }


@torch.no_grad()
def token_stats(base_logits: Tensor, quant_logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits [b, seq, vocab] predicting targets [b, seq] -> per-token KL, top-1 match, NLL of each model."""
    lb = torch.log_softmax(base_logits.float(), dim=-1)
    lq = torch.log_softmax(quant_logits.float(), dim=-1)
    kl = (lb.exp() * (lb - lq)).sum(dim=-1).clamp(min=0)  # [b, seq]
    agree = lb.argmax(dim=-1) == lq.argmax(dim=-1)
    nll_b = -lb.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    nll_q = -lq.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return kl, agree, nll_b, nll_q


@torch.no_grad()
def distribution(baseline, quantized, rows: Tensor, on_row=None) -> Distribution:
    """`baseline`/`quantized` expose `logits(ids [b, seq]) -> [b, seq, vocab]`; rows [n, seq] token ids."""
    kls, agrees, nb, nq = [], [], [], []
    for row in rows.split(1):
        inputs, targets = row[:, :-1], row[:, 1:]
        kl, agree, nll_b, nll_q = token_stats(baseline.logits(inputs), quantized.logits(inputs), targets)
        kls.append(kl.flatten())
        agrees.append(agree.flatten())
        nb.append(nll_b.mean(dim=1))
        nq.append(nll_q.mean(dim=1))
        if on_row:
            on_row()
    kl = torch.cat(kls)
    nb, nq = torch.cat(nb).double(), torch.cat(nq).double()
    return Distribution(
        tokens=kl.numel(),
        ppl_baseline=math.exp(nb.mean().item()),
        ppl_quantized=math.exp(nq.mean().item()),
        kl_mean=kl.mean().item(),
        kl_median=kl.median().item(),
        kl_p99=torch.quantile(kl.double(), 0.99).item(),
        top1_agreement=torch.cat(agrees).float().mean().item(),
        kl_per_token=kl,
        nll_baseline_rows=nb,
        nll_quantized_rows=nq,
    )
