"""Perplexity on held-out token rows: exp(mean next-token negative log-likelihood)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


@torch.no_grad()
def nll_per_row(model: nn.Module, rows: Tensor, batch_size: int = 4) -> Tensor:
    """rows [n, seq] -> mean next-token NLL of each row [n] (float64), for paired comparisons."""
    device = next(model.parameters()).device
    out = []
    for chunk in rows.split(batch_size):
        chunk = chunk.to(device)
        logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].float()  # [b, seq-1, vocab]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
        out.append(nll.mean(dim=1).double().cpu())
    return torch.cat(out)


def perplexity(model: nn.Module, rows: Tensor, batch_size: int = 4) -> float:
    return math.exp(nll_per_row(model, rows, batch_size).mean().item())
