"""AWQ (Lin et al., 2023): protect the input channels that carry large activations by scaling them up
before quantization, and fold the inverse scale into the op that produces those activations.

For a mapping prev -> [balance linears] (e.g. input_layernorm -> q/k/v), per input channel
s = mean|x|^a / mean|w|^(1-a), with `a` chosen on a grid to minimise the output error of the quantized
balance linears; then prev's output is divided by s and the balance weights' columns multiplied by s.
The float model is unchanged; the quantized one loses less. A clipping search then shrinks each group's
range where that lowers the output error. Pure functions over tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantkit.config import Scheme
from quantkit.quant.qparams import (
    QuantizedWeight,
    dequantize,
    grouped,
    minmax_qparams,
    quantize,
)


# AutoAWQ leaves q/k unclipped: attention scores are too sensitive to a shrunken range.
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


def fake_quant(w: Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> Tensor:
    scale, zp = minmax_qparams(w, scheme, scale_dtype)
    return dequantize(quantize(w, scale, zp, scheme), scale, zp)


def candidate_scales(x_mean: Tensor, w_mean: Tensor, alpha: float) -> Tensor:
    """Per input channel [in]; normalised so max*min = 1 to keep magnitudes centred."""
    s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(weights: list[Tensor], group_size: int | None) -> Tensor:
    """Mean over output rows of |w| normalised by its group's absmax: [in]."""
    w = torch.cat(weights, dim=0).float()
    g = grouped(w, group_size).abs()
    g = g / (g.amax(dim=-1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(dim=0)


@torch.no_grad()
def search_scale(x: Tensor, weights: list[Tensor], scheme: Scheme, scale_dtype: torch.dtype, grid: int = 20) -> tuple[Tensor, float]:
    """x [n, in] inputs of the balance linears, weights [out_i, in] -> (best scales [in], best alpha)."""
    x = x.float()
    w = torch.cat(weights, dim=0).float()  # rows are independent: one matmul for all balance linears
    reference = x @ w.t()
    x_mean, w_mean = x.abs().mean(dim=0), weight_mean(weights, scheme.group_size)
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for i in range(grid):
        alpha = i / grid
        s = candidate_scales(x_mean, w_mean, alpha)
        wq = fake_quant(w * s, scheme, scale_dtype) / s
        loss = (x @ wq.t() - reference).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def search_clip(w: Tensor, x: Tensor, scheme: Scheme, scale_dtype: torch.dtype, steps: int = 10, max_shrink: float = 0.5) -> Tensor:
    """Per-group range shrink ratio [out, groups] in (max_shrink, 1] minimising that group's output error."""
    wg = grouped(w.float(), scheme.group_size)  # [out, G, g]
    xg = x.float().reshape(x.shape[0], wg.shape[1], wg.shape[2]).transpose(0, 1)  # [G, n, g]
    reference = torch.bmm(xg, wg.permute(1, 2, 0))  # [G, n, out]: each group's share of the output
    best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
    best_ratio = torch.ones(wg.shape[:2], device=w.device)
    for i in range(steps):
        ratio = 1 - i * (1 - max_shrink) / steps
        wq = rtn_clipped(w, torch.full(wg.shape[:2], ratio, device=w.device), scheme, scale_dtype).dequantize(torch.float32)
        err = (torch.bmm(xg, grouped(wq, scheme.group_size).permute(1, 2, 0)) - reference).pow(2).mean(dim=1).t()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio


def rtn_clipped(w: Tensor, ratio: Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    """RTN with each group's [min, max] range scaled by ratio [out, groups]; ratio 1 is plain RTN."""
    g = grouped(w.float(), scheme.group_size)
    lo = (g.amin(dim=-1) * ratio).unsqueeze(-1)
    hi = (g.amax(dim=-1) * ratio).unsqueeze(-1)
    clamped = torch.minimum(torch.maximum(g, lo), hi).reshape(w.shape)
    scale, zp = minmax_qparams(clamped, scheme, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zp, scheme), scale, zp, scheme)
